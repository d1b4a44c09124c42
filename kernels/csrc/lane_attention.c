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
 * (lane, kv head) tasks of the kernels' pool (pool.h).
 *
 * The cache holds float32 or float16 (IEEE binary16) keys and values. A float16 block of 16 keys
 * is widened to float32 once per task, for all of its queries, and a value row as it is read for a
 * sub-group of queries: widening is exact, so the arithmetic after it is the float32 kernel's, on
 * the values the cache holds. The call can
 * also store the pass's own new keys and values into each lane's cache first (rounded to nearest
 * even when the cache is float16, as torch's conversion does), inside the task that then reads
 * them: one call per layer for every lane, with no per-lane work left to the caller.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "vector16.h"

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h> /* float16 conversions */
#endif


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

/* IEEE binary16 <-> float32. Widening is exact; narrowing rounds to nearest, ties to even (as
 * torch's and the CPU's own conversions do), so every path below stores the same bits. */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13); /* inf, nan */
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa) { /* subnormal: normalize */
        int shift = 0;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            shift++;
        }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((mantissa & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_half(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    uint32_t sign = (bits >> 16) & 0x8000, magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return (uint16_t)(sign | 0x7e00 | ((magnitude >> 13) & 0x3ff)); /* nan */
    if (magnitude >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds past the largest half: inf */
    if (magnitude < 0x38800000u) { /* below the smallest normal half: a subnormal (or zero) */
        if (magnitude < 0x33000000u) return (uint16_t)sign; /* under half the smallest subnormal */
        uint32_t mantissa = (magnitude & 0x7fffff) | 0x800000, shift = 126 - (magnitude >> 23);
        uint32_t kept = mantissa >> shift, rest = mantissa & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        kept += rest > halfway || (rest == halfway && (kept & 1));
        return (uint16_t)(sign | kept);
    }
    uint32_t kept = magnitude >> 13, rest = magnitude & 0x1fff;
    kept += rest > 0x1000 || (rest == 0x1000 && (kept & 1));
    return (uint16_t)(sign | (kept - (112u << 10)));
}

/* count elements of a float32 or float16 cache row, widened into `to` (exact). */
static inline void widen(const void *from, int64_t half, int64_t count, float *to) {
    if (!half) {
        memcpy(to, from, sizeof(float) * (size_t)count);
        return;
    }
    const uint16_t *h = from;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= count; i += 16) _mm512_storeu_ps(to + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
#elif defined(__F16C__)
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(to + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < count; i++) to[i] = half_to_float(h[i]);
}

/* count float32 values stored into a float32 or float16 cache row (float16: rounded to nearest even). */
static inline void narrow(const float *from, int64_t half, int64_t count, void *to) {
    if (!half) {
        memcpy(to, from, sizeof(float) * (size_t)count);
        return;
    }
    uint16_t *h = to;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= count; i += 16)
        _mm256_storeu_si256((__m256i *)(h + i), _mm512_cvtps_ph(_mm512_loadu_ps(from + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < count; i++) h[i] = float_to_half(from[i]);
}

/* Whether `madd` is fused here (part of the kernel's name in snapshot keys: other bits). */
int lane_attention_fused(void) { return FUSED; }

/* Scores, softmax and weighted sums go by "groups" of up to 16 (or, for a last group of at most
 * 8, 8) of a task's queries, one query per vector lane: the key-major half of the work (each
 * key's dot product with every query of the group, the softmax's max, exponentials and sum) is
 * plain lane-wise arithmetic, with no sum across lanes. A lane's operations use only its own
 * query, so neither the group's other queries, nor its width, nor which group a query falls in
 * can change a bit. Per query and key: dot = fma(k[c], q[c], dot) for c = 0..d-1 from +0, times
 * the scale; the keys outside the query's own (its window's start to its position) get -inf, so
 * they add exact zeros to the sums that follow (a sum that starts at +0 and adds only zeros and
 * positive or signed terms is unchanged by a zero; it can never be -0). */
#define G8 8
typedef float v8 __attribute__((vector_size(G8 * sizeof(float))));
typedef int32_t v8i __attribute__((vector_size(G8 * sizeof(int32_t))));

static inline v8 splat8(float x) { return x - (v8){0}; }

#if defined(__FMA__)
static inline v8 madd8(v8 a, v8 b, v8 c) { return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
#else
static inline v8 madd8(v8 a, v8 b, v8 c) { return a * b + c; }
#endif

/* exp(x) for x <= 0 (Cephes expf: x = n ln2 + r, a degree-5 polynomial in r, times 2^n); 0 below
 * -87 and for -inf and NaN. The same lane-wise operations for either width. */
#define DEFINE_VEXP(NAME, VT, VIT)                                                                        \
    static inline VT NAME(VT x) {                                                                         \
        const VT floor_ = (VT){0} - 87.0f;                                                                \
        const VIT keep = x >= floor_;                                                                     \
        x = (VT)(((VIT)x & keep) | ((VIT)floor_ & ~keep));                                                \
        VT fx = x * ((VT){0} + 1.44269504088896341f) + ((VT){0} + 0.5f);                                  \
        VIT n = __builtin_convertvector(fx, VIT);                                                         \
        VT nf = __builtin_convertvector(n, VT);                                                           \
        VIT above = nf > fx; /* truncation rounded up (negative fx): floor is one less */                 \
        n = n + above;                                                                                    \
        nf = __builtin_convertvector(n, VT);                                                              \
        VT r = x - nf * ((VT){0} + 0.693359375f);                                                         \
        r = r - nf * ((VT){0} - 2.12194440e-4f);                                                          \
        VT z = r * r;                                                                                     \
        VT y = (VT){0} + 1.9875691500e-4f;                                                                \
        y = y * r + ((VT){0} + 1.3981999507e-3f);                                                         \
        y = y * r + ((VT){0} + 8.3334519073e-3f);                                                         \
        y = y * r + ((VT){0} + 4.1665795894e-2f);                                                         \
        y = y * r + ((VT){0} + 1.6666665459e-1f);                                                         \
        y = y * r + ((VT){0} + 5.0000001201e-1f);                                                         \
        y = y * z + r + ((VT){0} + 1.0f);                                                                 \
        VIT bits = (n + 127) << 23;                                                                       \
        return (VT)((VIT)(y * (VT)bits) & keep);                                                          \
    }
DEFINE_VEXP(vexp16, vf, vi)
DEFINE_VEXP(vexp8, v8, v8i)

/* One group, V lanes wide: qt [d][V] the queries transposed (zeros past the last), low / high the
 * lanes' first and last keys (an empty range for padding lanes). `scores` writes keys j0..j0+count-1
 * (rows at rows[0..count-1], widened, d elements) into e [span][V] (key j at (j - first) * V);
 * `softmax` then turns e's span keys into numerators and writes the lanes' sums. KEYS keys at once
 * share the loads of qt and keep that many FMA chains in flight: 8 for the 8-wide group (two
 * 256-bit FMA pipes of 4 cycles' latency), 4 for the 16-wide one (measured on Zen 4: 8 made it 20%
 * slower, 4 made the 8-wide one 10% slower). Which keys share a step never changes a bit. */
#define DEFINE_GROUP(SCORES, SOFTMAX, VT, VIT, V, MADD, VEXP, SPLAT, KEYS)                                              \
    static void SCORES(const float *qt, const int32_t *low, const int32_t *high, int64_t d, float scale,    \
                       int64_t first, int64_t j0, int64_t count, const float *const *rows, float *e) {        \
        VIT lo, hi;                                                                                       \
        memcpy(&lo, low, sizeof lo);                                                                      \
        memcpy(&hi, high, sizeof hi);                                                                     \
        for (int64_t j = 0; j < count; j += KEYS) {                                                       \
            int64_t n = count - j < KEYS ? count - j : KEYS;                                              \
            VT acc[KEYS];                                                                                 \
            for (int t = 0; t < KEYS; t++) acc[t] = (VT){0};                                              \
            if (n == KEYS) {                                                                              \
                for (int64_t c = 0; c < d; c++) {                                                         \
                    VT column;                                                                            \
                    memcpy(&column, qt + c * V, sizeof column);                                           \
                    for (int t = 0; t < KEYS; t++) acc[t] = MADD(SPLAT(rows[j + t][c]), column, acc[t]);      \
                }                                                                                         \
            } else {                                                                                      \
                for (int t = 0; t < n; t++)                                                               \
                    for (int64_t c = 0; c < d; c++) {                                                     \
                        VT column;                                                                        \
                        memcpy(&column, qt + c * V, sizeof column);                                       \
                        acc[t] = MADD(SPLAT(rows[j + t][c]), column, acc[t]);                             \
                    }                                                                                     \
            }                                                                                             \
            for (int t = 0; t < n; t++) {                                                                 \
                VIT key = (VIT){0} + (int32_t)(j0 + j + t);                                               \
                VIT seen = (key >= lo) & (key <= hi);                                                     \
                VT score = acc[t] * SPLAT(scale);                                                         \
                score = (VT)(((VIT)score & seen) | ((VIT)((VT){0} - INFINITY) & ~seen));                  \
                memcpy(e + (j0 + j + t - first) * V, &score, sizeof score);                               \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
    static void SOFTMAX(float *e, int64_t span, float *sums) {                                            \
        VT top = (VT){0} - INFINITY; /* each lane's largest score (a max: any order, the same bits) */     \
        for (int64_t j = 0; j < span; j++) {                                                              \
            VT s;                                                                                         \
            memcpy(&s, e + j * V, sizeof s);                                                              \
            top = (VT)(((VIT)s & (s > top)) | ((VIT)top & ~(s > top)));                                   \
        }                                                                                                 \
        VT sum = (VT){0};                                                                                 \
        for (int64_t j = 0; j < span; j++) {                                                              \
            VT s;                                                                                         \
            memcpy(&s, e + j * V, sizeof s);                                                              \
            VT x = VEXP(s - top);                                                                         \
            memcpy(e + j * V, &x, sizeof x);                                                              \
            sum = sum + x;                                                                                \
        }                                                                                                 \
        memcpy(sums, &sum, sizeof sum);                                                                   \
    }
DEFINE_GROUP(scores16, softmax16, vf, vi, W, madd, vexp16, splat, 4)
DEFINE_GROUP(scores8, softmax8, v8, v8i, G8, madd8, vexp8, splat8, 8)

static inline int64_t lowest_key(int64_t position, int64_t window) {
    return window > 0 && position - window + 1 > 0 ? position - window + 1 : 0;
}

/* Row `index` of a float32 or float16 cache whose rows are d elements. */
static inline void *cache_row(void *base, int64_t half, int64_t index, int64_t d) {
    return (char *)base + (size_t)(index * d) * (half ? sizeof(uint16_t) : sizeof(float));
}

/* Ask for the cache rows of the block of 16 starting at `from` (up to `last`) ahead of their use:
 * the blocks are streamed from memory once per task, and the work on one block hides the next
 * ones' latency. `fetch_ahead`: PREFETCH_BLOCKS blocks ahead into L1; `fetch_far`: into L2, the
 * keys FAR blocks ahead and each value block as its key block is read, so the values' pass finds
 * them in L2 (25% less time at 8 lanes of 4 rows on Zen 4). (Speed only.) */
#define PREFETCH_BLOCKS 4
#define FAR 16
#define FETCH(NAME, ...)                                                                           \
    static inline void NAME(void *base, int64_t half, int64_t from, int64_t last, int64_t d) {     \
        if (from > last) return;                                                                   \
        int64_t count = last - from + 1 < W ? last - from + 1 : W;                                 \
        const char *p = cache_row(base, half, from, d), *end = cache_row(base, half, from + count, d); \
        for (; p < end; p += 64) __builtin_prefetch(p, ##__VA_ARGS__);                           \
    }
FETCH(fetch_ahead)
FETCH(fetch_far, 0, 2)


/* Query r's numerators in e (key j at (j - first) * its group's width) and that width. */
static inline const float *weight_row(const float *e, int64_t r, int64_t span) {
    int64_t lane = r % W;
    return e + (r - lane) * span + lane;
}
static inline int64_t weight_stride(int64_t r, int64_t queries) { return queries - (r - r % W) > G8 ? W : G8; }

/* Value row j's elements c..c+15, widened when the cache is float16 (exact). */
static inline vf value_chunk(const void *values, int64_t half, int64_t j, int64_t d, int64_t c) {
    if (!half) return load((const float *)values + j * d + c);
    const uint16_t *h = (const uint16_t *)values + j * d + c;
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
#elif defined(__F16C__)
    __m256 halves[2] = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)),
                        _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 8)))};
    vf widened;
    memcpy(&widened, halves, sizeof widened);
    return widened;
#else
    float widened[W];
    for (int i = 0; i < W; i++) widened[i] = half_to_float(h[i]);
    return load(widened);
#endif
}

static inline float value_at(const void *values, int64_t half, int64_t j, int64_t d, int64_t c) {
    return half ? half_to_float(((const uint16_t *)values)[j * d + c]) : ((const float *)values)[j * d + c];
}

/* a[c] += weight(j) * value(j)[c] for keys j = from..to in ascending order (one query). The
 * whole 16-wide chunks by `madd`, the rest of d (d % 16) by a product and a sum. */
static void accumulate_range(float *a, const float *weights, int64_t stride, int64_t first, const void *values,
                             int64_t half, int64_t from, int64_t to, int64_t d) {
    if (from > to) return;
    int64_t whole = d - d % W;
    for (int64_t c0 = 0; c0 < whole; c0 += 4 * W) { /* 4 chunks at once: 4 chains in flight */
        int64_t chunks = (whole - c0) / W < 4 ? (whole - c0) / W : 4;
        vf part[4];
        for (int64_t c = 0; c < chunks; c++) part[c] = load(a + c0 + c * W);
        for (int64_t j = from; j <= to; j++) {
            vf weight = splat(weights[(j - first) * stride]);
            for (int64_t c = 0; c < chunks; c++) part[c] = madd(weight, value_chunk(values, half, j, d, c0 + c * W), part[c]);
        }
        for (int64_t c = 0; c < chunks; c++) store(a + c0 + c * W, part[c]);
    }
    for (int64_t c = whole; c < d; c++)
        for (int64_t j = from; j <= to; j++) a[c] = a[c] + weights[(j - first) * stride] * value_at(values, half, j, d, c);
}

/* accumulate_range for n (<= SUB) consecutive queries over the same keys: CH chunks of their sums
 * in registers at a time while each value row's chunk is read once for all of them. Per query
 * and element the same operations in the same order as accumulate_range. */
#if defined(__AVX512F__) /* 32 vector registers: 6 x 4 sums, 4 value chunks */
#define SUB 6
#define CH 4
#else /* 16 registers of half the width: 2 x 2 sums (8), 2 value chunks (4) */
#define SUB 2
#define CH 2
#endif
static inline __attribute__((always_inline)) void accumulate_shared_n(
    const int64_t n, float *acc, const float *const *weights_of, const int64_t *stride_of, int64_t first,
    const void *values, int64_t half, int64_t from, int64_t to, int64_t d) {
    int64_t whole = d - d % W;
    for (int64_t c0 = 0; c0 < whole; c0 += CH * W) {
        int64_t chunks = (whole - c0) / W < CH ? (whole - c0) / W : CH;
        vf part[SUB][CH];
        const float *w[SUB];
        for (int64_t i = 0; i < n; i++) {
            w[i] = weights_of[i] + (from - first) * stride_of[i];
            for (int64_t c = 0; c < chunks; c++) part[i][c] = load(acc + i * d + c0 + c * W);
        }
        for (int64_t j = from; j <= to; j++) {
            if (((j - from) & (W - 1)) == 0) fetch_ahead((void *)values, half, j + PREFETCH_BLOCKS * W, to, d);
            vf x[CH];
            for (int64_t c = 0; c < chunks; c++) x[c] = value_chunk(values, half, j, d, c0 + c * W);
            for (int64_t i = 0; i < n; i++) {
                vf weight = splat(*w[i]);
                w[i] += stride_of[i];
                for (int64_t c = 0; c < chunks; c++) part[i][c] = madd(weight, x[c], part[i][c]);
            }
        }
        for (int64_t i = 0; i < n; i++)
            for (int64_t c = 0; c < chunks; c++) store(acc + i * d + c0 + c * W, part[i][c]);
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t c = whole; c < d; c++)
            for (int64_t j = from; j <= to; j++)
                acc[i * d + c] = acc[i * d + c] + weights_of[i][(j - first) * stride_of[i]] * value_at(values, half, j, d, c);
}

static inline __attribute__((always_inline)) void accumulate_shared(
    int64_t n, float *acc, const float *const *weights_of, const int64_t *stride_of, int64_t first,
    const void *values, int64_t half, int64_t from, int64_t to, int64_t d) {
#define SHARED(N) accumulate_shared_n(N, acc, weights_of, stride_of, first, values, half, from, to, d)
    switch (n < SUB ? n : SUB) {
    case 1: SHARED(1); break;
#if SUB > 2
    case 2: SHARED(2); break;
    case 3: SHARED(3); break;
    case 4: SHARED(4); break;
    case 5: SHARED(5); break;
#endif
    default: SHARED(SUB);
    }
#undef SHARED
}

/* One (lane, kv head) task: the `group` query heads that read kv head over rows 0..rows-1 at
 * positions start.., keys / values [capacity, d] (float32, or float16 when `half`). Query r is row
 * r / group, head r % group (at q + row * q_stride + head * d). `new_keys` / `new_values` (row
 * strides k_stride / v_stride), when given, are the rows' own keys and values, stored at positions
 * start.. first. The keys are widened once for the task; the queries go by groups (above); the
 * weighted sums go by sub-groups of queries (accumulate_shared), each value row read once for a
 * sub-group. */
static inline __attribute__((always_inline)) void attend_lane_group(
    const float *q, int64_t q_stride, int64_t group, float *out, void *keys, void *values, int64_t half,
    int64_t rows, int64_t start, int64_t d, float scale, int64_t window,
    const float *new_keys, int64_t k_stride, const float *new_values, int64_t v_stride) {
    if (new_keys)
        for (int64_t r = 0; r < rows; r++) {
            narrow(new_keys + r * k_stride, half, d, cache_row(keys, half, start + r, d));
            narrow(new_values + r * v_stride, half, d, cache_row(values, half, start + r, d));
        }
    int64_t queries = rows * group, first = lowest_key(start, window), last = start + rows - 1;
    int64_t span = last - first + 1, groups = (queries + W - 1) / W, rest = queries % W;
    int64_t lanes = (queries / W) * W + (rest > G8 ? W : rest ? G8 : 0); /* every group's lanes */
    float *e = malloc(sizeof(float) * (size_t)(span * lanes)); /* numerators, group after group */
    float *sums = malloc(sizeof(float) * (size_t)lanes);
    float *qt = malloc(sizeof(float) * (size_t)(d * lanes)); /* each group's queries, transposed */
    int32_t *bounds = malloc(sizeof(int32_t) * (size_t)(2 * lanes)); /* each lane's first and last key */
    float *acc = calloc((size_t)(queries * d), sizeof(float));
    float *wide = half ? malloc(sizeof(float) * (size_t)(W * d)) : NULL; /* one block, widened */
    if ((half && !wide) || !e || !sums || !qt || !bounds || !acc) abort();
    for (int64_t g = 0; g < groups; g++) {
        int64_t q0 = g * W, count = queries - q0 < W ? queries - q0 : W, v = count > G8 ? W : G8;
        for (int64_t i = 0; i < v; i++) {
            int64_t p = start + (q0 + i) / group;
            bounds[2 * q0 + i] = i < count ? (int32_t)lowest_key(p, window) : 1; /* padding lanes: no key */
            bounds[2 * q0 + v + i] = i < count ? (int32_t)p : 0;
            for (int64_t c = 0; c < d; c++)
                qt[q0 * d + c * v + i] = i < count ? q[((q0 + i) / group) * q_stride + ((q0 + i) % group) * d + c] : 0.0f;
        }
    }
    for (int64_t j0 = first; j0 <= last; j0 += W) { /* a block of keys, read (and widened) once for all queries */
        int64_t count = last - j0 + 1 < W ? last - j0 + 1 : W;
        const float *rows_of[W];
        fetch_ahead(keys, half, j0 + PREFETCH_BLOCKS * W, last, d);
        fetch_far(keys, half, j0 + FAR * W, last, d);
        fetch_far(values, half, j0, last, d);
        if (half) widen(cache_row(keys, half, j0, d), half, count * d, wide);
        for (int64_t j = 0; j < count; j++)
            rows_of[j] = half ? wide + j * d : (const float *)cache_row(keys, half, j0 + j, d);
        for (int64_t g = 0; g < groups; g++) {
            int64_t q0 = g * W, v = queries - q0 > G8 ? W : G8;
            if (v == W)
                scores16(qt + q0 * d, bounds + 2 * q0, bounds + 2 * q0 + v, d, scale, first, j0, count, rows_of,
                         e + q0 * span);
            else
                scores8(qt + q0 * d, bounds + 2 * q0, bounds + 2 * q0 + v, d, scale, first, j0, count, rows_of,
                        e + q0 * span);
        }
    }
    for (int64_t g = 0; g < groups; g++) {
        int64_t q0 = g * W;
        if (queries - q0 > G8) softmax16(e + q0 * span, span, sums + q0);
        else softmax8(e + q0 * span, span, sums + q0);
    }
    /* The weighted sums, per query and element over its keys in ascending order, in three
     * ranges: its own keys below the ones every query of the task sees, those shared keys (all of
     * the context before the pass's rows: most of the work, by sub-groups of queries whose sums
     * stay in registers while each value row is read once), then its own keys after them. */
    int64_t shared_low = lowest_key(last, window), shared_high = start; /* every row sees these */
    if (shared_low > shared_high) shared_low = shared_high + 1;
    const float *weights_of[SUB];
    int64_t stride_of[SUB];
    for (int64_t r = 0; r < queries; r++) {
        int64_t p = start + r / group, low = lowest_key(p, window);
        accumulate_range(acc + r * d, weight_row(e, r, span), weight_stride(r, queries), first, values, half,
                         low, shared_low - 1 < p ? shared_low - 1 : p, d);
    }
    if (shared_low <= shared_high)
        for (int64_t r0 = 0; r0 < queries; r0 += SUB) {
            int64_t n = queries - r0 < SUB ? queries - r0 : SUB;
            for (int64_t i = 0; i < n; i++) {
                weights_of[i] = weight_row(e, r0 + i, span);
                stride_of[i] = weight_stride(r0 + i, queries);
            }
            accumulate_shared(n, acc + r0 * d, weights_of, stride_of, first, values, half, shared_low, shared_high, d);
        }
    for (int64_t r = 0; r < queries; r++) {
        int64_t p = start + r / group, low = lowest_key(p, window);
        accumulate_range(acc + r * d, weight_row(e, r, span), weight_stride(r, queries), first, values, half,
                         shared_high + 1 > low ? shared_high + 1 : low, p, d);
    }
    for (int64_t r = 0; r < queries; r++) {
        float *o = out + (r / group) * q_stride + (r % group) * d;
        float total = sums[r]; /* lane r % 16 of its group: groups start at multiples of 16 */
        for (int64_t c = 0; c < d; c++) o[c] = acc[r * d + c] / total;
    }
    free(e);
    free(sums);
    free(qt);
    free(bounds);
    free(acc);
    free(wide);
}

/* attend_lane_group compiled for the common head sizes as constants (loops unroll); the same
 * source order of operations, so the same bits as the generic one. */
#define ATTEND(D) attend_lane_group(q, q_stride, group, out, keys, values, half, rows, start, D, scale, window, \
                                    new_keys, k_stride, new_values, v_stride)
static void attend_task(const float *q, int64_t q_stride, int64_t group, float *out, void *keys, void *values,
                        int64_t half, int64_t rows, int64_t start, int64_t d, float scale, int64_t window,
                        const float *new_keys, int64_t k_stride, const float *new_values, int64_t v_stride) {
    switch (d) {
    case 64: ATTEND(64); break;
    case 128: ATTEND(128); break;
    case 256: ATTEND(256); break;
    default: ATTEND(d);
    }
}

struct attention_job {
    const float *q;
    float *out;
    int64_t heads, kv_heads, d;
    const int64_t *begin, *rows, *start, *capacity, *keys, *values;
    float scale;
    int64_t window, half;
    const float *new_keys, *new_values;
    int64_t k_stride, v_stride;
};

/* Task t: lane t / kv_heads, kv head t % kv_heads. */
static void attention_task(void *context, int64_t t) {
    const struct attention_job *job = context;
    int64_t heads = job->heads, kv_heads = job->kv_heads, d = job->d, group = heads / kv_heads, half = job->half;
    int64_t l = t / kv_heads, kv = t % kv_heads, offset = kv * job->capacity[l];
    int64_t first = (job->begin[l] * heads + kv * group) * d; /* row begin[l], head kv * group */
    void *lane_keys = cache_row((void *)(intptr_t)job->keys[l], half, offset, d);
    void *lane_values = cache_row((void *)(intptr_t)job->values[l], half, offset, d);
    const float *new_keys = job->new_keys ? job->new_keys + job->begin[l] * job->k_stride + kv * d : NULL;
    const float *new_values = job->new_values ? job->new_values + job->begin[l] * job->v_stride + kv * d : NULL;
    attend_task(job->q + first, heads * d, group, job->out + first, lane_keys, lane_values, half, job->rows[l],
                job->start[l], d, job->scale, job->window, new_keys, job->k_stride, new_values,
                job->v_stride);
}

void lane_attention(const float *q, float *out, int64_t heads, int64_t kv_heads, int64_t d, int64_t lanes,
                    const int64_t *begin, const int64_t *rows, const int64_t *start, const int64_t *capacity,
                    const int64_t *keys, const int64_t *values, float scale, int64_t window, int threads,
                    int64_t half, const float *new_keys, int64_t k_stride, const float *new_values,
                    int64_t v_stride) {
    struct attention_job job = {q, out, heads, kv_heads, d, begin, rows, start, capacity, keys, values, scale,
                                window, half, new_keys, new_values, k_stride, v_stride};
    pool_for(threads, lanes * kv_heads, attention_task, &job);
}
