/* Decode and verify attention for every lane of a shared pass in one call (the torch backend on CPU).
 *
 * Row-exact by construction: a row's output is computed by the same instructions in the same order
 * whatever other rows share the call. Its scores, softmax and weighted sum touch only its own
 * query, its own keys (positions low..p of its lane's cache) and buffers indexed from its first
 * key; sums run over fixed 16-wide vector lanes and then a fixed tree, and every value is one IEEE
 * operation per element (-ffp-contract=off, no -ffast-math: the compiler fuses and reassociates
 * nothing; the one fused multiply-add is explicit, `madd`), so neither the number of rows, the other lanes, the thread count nor which
 * thread runs a task can change a bit. The exponential is our own (Cephes' polynomial), not
 * libm's, so its vector and scalar forms cannot differ.
 *
 * What the call saves over one torch attention call per row: a lane's keys and values are read
 * once for all of its rows and all the query heads that share them (the loops run key by key,
 * queries inside), and one call covers all lanes and heads of a layer, split over threads by
 * (lane, kv head).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define W 16
#define CHUNKS 16 /* vectors of one row's weighted sum kept in registers at a time (d <= 256 at once) */
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline vf splat(float x) { return (vf){0} + x; }

/* a * b + c for the dot products and weighted sums: one fused multiply-add (a single rounding)
 * where the CPU has it, else a multiply and an add; either way every call site always runs the
 * same one, so it changes which bits a row gets on a machine, never whether rows agree. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define FUSED 1
static inline vf madd(vf a, vf b, vf c) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#elif defined(__FMA__) && defined(__AVX__)
#include <immintrin.h>
#define FUSED 1
static inline vf madd(vf a, vf b, vf c) {
    __m256 x[2], y[2], z[2];
    memcpy(x, &a, sizeof a);
    memcpy(y, &b, sizeof b);
    memcpy(z, &c, sizeof c);
    z[0] = _mm256_fmadd_ps(x[0], y[0], z[0]);
    z[1] = _mm256_fmadd_ps(x[1], y[1], z[1]);
    memcpy(&c, z, sizeof c);
    return c;
}
#else
#define FUSED 0
static inline vf madd(vf a, vf b, vf c) { return a * b + c; }
#endif

/* Whether `madd` is fused here (part of the kernel's name in snapshot keys: other bits). */
int lane_attention_fused(void) { return FUSED; }

/* The 16 lanes of v summed as a fixed tree: (0+8, 1+9, ...), then halves again. */
static inline float hsum(vf v) {
    float a[W];
    store(a, v);
    for (int width = W / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) a[i] = a[i] + a[i + width];
    return a[0];
}

#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)

/* Sixteen dot products at once: acc[j] holds key j's 16 partial sums (lane c: the chunks' element
 * c); the result's lane j is their sum, as the same tree for every key (c + 8, then + 4, + 2, + 1). */
static inline vf sum_lanes(const vf acc[W]) {
    vf t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = SHUFFLE(acc[2 * i], acc[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SHUFFLE(acc[2 * i], acc[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        u[i] = SHUFFLE(t[2 * i], t[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               SHUFFLE(t[2 * i], t[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        w[i] = SHUFFLE(u[2 * i], u[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               SHUFFLE(u[2 * i], u[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUFFLE(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUFFLE(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* q . k for the 16 keys at `keys[j]`, each over d elements: 16-wide partial sums over whole chunks,
 * their tree sum, then the tail (d % 16 elements) in order. Stored in dots[0..15]. */
static inline __attribute__((always_inline)) void block_dots(const float *q, const float *const keys[W], int64_t d, float dots[W]) {
    vf acc[W];
    int64_t whole = d - d % W;
    for (int j = 0; j < W; j++) {
        vf a = {0};
        if (whole) a = load(q) * load(keys[j]);
        for (int64_t c = W; c < whole; c += W) a = madd(load(q + c), load(keys[j] + c), a);
        acc[j] = a;
    }
    store(dots, sum_lanes(acc));
    for (int j = 0; j < W; j++)
        for (int64_t c = whole; c < d; c++) dots[j] = dots[j] + q[c] * keys[j][c];
}

/* exp(x) for x <= 0 (Cephes expf: x = n ln2 + r, a degree-5 polynomial in r, times 2^n); 0 below -87. */
static inline vf vexp(vf x) {
    const vi keep = x >= splat(-87.0f);
    x = (vf)(((vi)x & keep) | ((vi)splat(-87.0f) & ~keep));
    vf fx = x * splat(1.44269504088896341f) + splat(0.5f);
    vi n = __builtin_convertvector(fx, vi);
    vf nf = __builtin_convertvector(n, vf);
    vi above = nf > fx; /* truncation rounded up (negative fx): floor is one less */
    n = n + above;
    nf = __builtin_convertvector(n, vf);
    vf r = x - nf * splat(0.693359375f);
    r = r - nf * splat(-2.12194440e-4f);
    vf z = r * r;
    vf y = splat(1.9875691500e-4f);
    y = y * r + splat(1.3981999507e-3f);
    y = y * r + splat(8.3334519073e-3f);
    y = y * r + splat(4.1665795894e-2f);
    y = y * r + splat(1.6666665459e-1f);
    y = y * r + splat(5.0000001201e-1f);
    y = y * z + r + splat(1.0f);
    vi bits = (n + 127) << 23;
    return (vf)((vi)(y * (vf)bits) & keep);
}

/* One query row against keys 0..count-1 of `scores` (already q.k * scale, padded with -inf to a
 * whole chunk): exponentials in place, returns their sum. */
static float softmax_numerators(float *scores, int64_t count) {
    vf high = splat(-INFINITY); /* the row's largest score (a max: any order gives the same bits) */
    for (int64_t j = 0; j < count; j += W) {
        vf s = load(scores + j);
        high = (vf)(((vi)s & (s > high)) | ((vi)high & ~(s > high)));
    }
    float lanes[W], top = -INFINITY;
    store(lanes, high);
    for (int j = 0; j < W; j++) top = lanes[j] > top ? lanes[j] : top;
    vf acc = {0};
    vf shift = splat(top);
    for (int64_t j = 0; j < count; j += W) {
        vf e = vexp(load(scores + j) - shift);
        store(scores + j, e);
        acc = acc + e;
    }
    return hsum(acc);
}

static inline int64_t lowest_key(int64_t position, int64_t window) {
    return window > 0 && position - window + 1 > 0 ? position - window + 1 : 0;
}

/* One (lane, kv head) task: the `group` query heads that read kv head over rows 0..rows-1 at
 * positions start.., keys / values [capacity, d]. Query r is row r / group, head r % group (at
 * q + row * q_stride + head * d). Keys go by blocks of 16, read once for all queries; a query's
 * scores sit at offsets from its own first key, so its softmax never depends on the others. */
static inline __attribute__((always_inline)) void attend_lane_group(
    const float *q, int64_t q_stride, int64_t group, float *out, const float *keys, const float *values,
    int64_t rows, int64_t start, int64_t d, float scale, int64_t window, const float *zeros) {
    int64_t queries = rows * group, first = lowest_key(start, window), last = start + rows - 1;
    int64_t span = ((last - first + 1 + W - 1) / W) * W; /* a query's scores, padded to whole chunks */
    float *scores = malloc(sizeof(float) * (size_t)(span * queries));
    float *acc = calloc((size_t)(queries * d), sizeof(float));
    float *sums = malloc(sizeof(float) * (size_t)queries);
    if (!scores || !acc || !sums) abort();
    for (int64_t i = 0; i < queries * span; i++) scores[i] = -INFINITY;
    int64_t whole = d - d % W;
    for (int64_t j0 = first; j0 <= last; j0 += W) {
        const float *block[W];
        for (int j = 0; j < W; j++) block[j] = j0 + j <= last ? keys + (j0 + j) * d : zeros;
        for (int64_t r = 0; r < queries; r++) {
            int64_t p = start + r / group, low = lowest_key(p, window);
            if (j0 > p || j0 + W <= low) continue;
            float dots[W];
            block_dots(q + (r / group) * q_stride + (r % group) * d, block, d, dots);
            for (int j = 0; j < W; j++)
                if (j0 + j >= low && j0 + j <= p) scores[r * span + (j0 + j - low)] = dots[j] * scale;
        }
    }
    for (int64_t r = 0; r < queries; r++) {
        int64_t p = start + r / group;
        sums[r] = softmax_numerators(scores + r * span, p - lowest_key(p, window) + 1);
    }
    for (int64_t j0 = first; j0 <= last; j0 += W) { /* a block of values, read once for all queries */
        for (int64_t r = 0; r < queries; r++) {
            int64_t p = start + r / group, low = lowest_key(p, window);
            int64_t from = j0 > low ? j0 : low, to = j0 + W - 1 < p ? j0 + W - 1 : p;
            const float *e = scores + r * span - low;
            float *a = acc + r * d;
            for (int64_t c0 = 0; c0 < whole; c0 += CHUNKS * W) { /* per element: keys in ascending order */
                int64_t chunks = (whole - c0) / W < CHUNKS ? (whole - c0) / W : CHUNKS;
                vf part[CHUNKS];
                for (int64_t c = 0; c < chunks; c++) part[c] = load(a + c0 + c * W);
                for (int64_t j = from; j <= to; j++) {
                    vf weight = splat(e[j]);
                    const float *v = values + j * d + c0;
                    for (int64_t c = 0; c < chunks; c++) part[c] = madd(weight, load(v + c * W), part[c]);
                }
                for (int64_t c = 0; c < chunks; c++) store(a + c0 + c * W, part[c]);
            }
            for (int64_t c = whole; c < d; c++)
                for (int64_t j = from; j <= to; j++) a[c] = a[c] + e[j] * values[j * d + c];
        }
    }
    for (int64_t r = 0; r < queries; r++) {
        float *o = out + (r / group) * q_stride + (r % group) * d;
        for (int64_t c = 0; c < d; c++) o[c] = acc[r * d + c] / sums[r];
    }
    free(scores);
    free(acc);
    free(sums);
}

/* attend_lane_group compiled for the common head sizes as constants (the query's chunks stay in
 * registers, loops unroll); the same source order of operations, so the same bits as the generic one. */
static void attend_task(const float *q, int64_t q_stride, int64_t group, float *out, const float *keys,
                        const float *values, int64_t rows, int64_t start, int64_t d, float scale, int64_t window,
                        const float *zeros) {
    switch (d) {
    case 64: attend_lane_group(q, q_stride, group, out, keys, values, rows, start, 64, scale, window, zeros); break;
    case 128: attend_lane_group(q, q_stride, group, out, keys, values, rows, start, 128, scale, window, zeros); break;
    case 256: attend_lane_group(q, q_stride, group, out, keys, values, rows, start, 256, scale, window, zeros); break;
    default: attend_lane_group(q, q_stride, group, out, keys, values, rows, start, d, scale, window, zeros);
    }
}

/* q, out [m, heads, d] float32: the pass's rows, lane after lane. Lane l holds rows
 * begin[l]..begin[l]+rows[l] at positions start[l].., and its cache's keys / values
 * [kv_heads, capacity[l], d] at the addresses keys[l] / values[l]. Head h reads kv head
 * h / (heads / kv_heads). window > 0: a row at position p sees keys max(0, p-window+1)..p. */
void lane_attention(const float *q, float *out, int64_t heads, int64_t kv_heads, int64_t d, int64_t lanes,
                    const int64_t *begin, const int64_t *rows, const int64_t *start, const int64_t *capacity,
                    const int64_t *keys, const int64_t *values, float scale, int64_t window, int threads) {
    int64_t group = heads / kv_heads, tasks = lanes * kv_heads;
    float *zeros = calloc((size_t)d, sizeof(float)); /* the keys past a lane's last, in its final block */
    if (!zeros) abort();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t t = 0; t < tasks; t++) {
        int64_t l = t / kv_heads, kv = t % kv_heads, offset = kv * capacity[l] * d;
        int64_t first = (begin[l] * heads + kv * group) * d; /* row begin[l], head kv * group */
        attend_task(q + first, heads * d, group, out + first, (const float *)(intptr_t)keys[l] + offset,
                    (const float *)(intptr_t)values[l] + offset, rows[l], start[l], d, scale, window, zeros);
    }
    free(zeros);
}
