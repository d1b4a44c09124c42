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
 * once for all of its rows and all the query heads that share them (the scores run block of keys
 * by block, queries inside; the weighted sums value row by row, queries inside), and one call
 * covers all lanes and heads of a layer, split over threads by (lane, kv head) tasks of the
 * kernels' pool (pool.h).
 *
 * The cache holds float32 or float16 (IEEE binary16) keys and values. A float16 block of 16 keys
 * is widened as the scores load it, once per sweep of up to QUERIES (8, or 4 without AVX-512)
 * queries (the model's caches keep their keys in such blocks; key rows are widened and transposed
 * into one first), and a value row as it is read for a sub-group of queries: widening is exact, so
 * the arithmetic after it is the float32 kernel's, on the values the cache holds. The call can
 * also store the pass's own new keys and values into each lane's cache first (rounded to nearest
 * even when the cache is float16, as torch's conversion does), inside the task that then reads
 * them: one call per layer for every lane, with no per-lane work left to the caller.
 *
 * Long prefill chunks (`lane_attention_prefill`, lanes the caller names by their row count) run on
 * the AMX-BF16 tiles instead where the CPU has them: at the end of this file, with why each row
 * is still its own and why only the prefill plan may choose it.
 *
 * Attention sinks (gpt-oss, `lane_attention_sinks`): a logit per query head that is one more term of
 * every softmax and adds no value. On the vectors it joins the query's largest score and its
 * numerator is added to the sum once, after the fixed tree (`attend_queries`); on the tiles it is the
 * online softmax's starting state (`matrix_group`). Either way a fixed point of the query's own
 * chain, from its own head's logit: rows stay their own. Without sinks (NULL) no operation is added.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "layer_kernels.h"
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

/* AVX2 with FMA and F16C but no AVX-512: the hot loops (scores, their scaling, masking and maxima,
 * the softmax's exponentials and sums, weighted sums) keep each 16-lane vector as two AVX registers
 * themselves (`HALVES`). GCC compiles the generic 16-lane type there through the stack (every
 * operand stored and reloaded: ~5x slower attention over 2K keys on a 2-core AMD EPYC; the softmax
 * in generic vectors was still half of a 512-row prefill chunk's attention over 3.5K keys); the
 * lanes' operations and their order are the same, so are the bits. */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && \
    !defined(LANE_ATTENTION_NO_HALVES) /* the tests build it without them too, and compare the bits */
#define HALVES 1
#else
#define HALVES 0
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

/* Whether the hot loops run on register halves here (`HALVES`: the same bits either way). */
int lane_attention_halves(void) { return HALVES; }

#if HALVES
/* Elements at..at+7 of a float32 or float16 (`half`: widened, exact) array, as one AVX register. */
static inline __m256 eight_at(const void *base, int64_t half, int64_t at) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + at)))
                : _mm256_loadu_ps((const float *)base + at);
}
#endif

/* Whether `madd` is fused here (part of the kernel's name in snapshot keys: other bits). */
int lane_attention_fused(void) { return FUSED; }

/* The scores go by blocks of 16 keys at absolute positions 16b..16b+15, one key per vector lane:
 * a block holds k[c][t] = key 16b + t's element c (the model's caches keep their keys so,
 * `blocked`, and the scores read it in place; a cache of key rows is transposed into one first),
 * and every query of the task runs d fused multiply-adds over it, lane t holding its dot
 * product with key 16b + t. Per query and key that is the chain dot = fma(k[c], q[c], dot) for
 * c = 0..d-1 from +0, times the scale: nothing a lane computes depends on the other lanes, the
 * other queries or how many there are. Keys outside the query's own (its window's start to its
 * position) get -inf, so they add exact zeros to the sums that follow (a sum that starts at +0
 * and adds only zeros and positive terms is unchanged by a zero; it can never be -0).
 *
 * The softmax: the largest score (a maximum: the same in any order), each numerator
 * exp(score - largest) in the key's lane, and their sum as 16 running sums, lane t over the keys
 * 16b + t in ascending b, then a fixed tree over the 16 lanes. Lanes are tied to absolute key
 * positions, so a query's sum has the same terms in the same order whatever block its task
 * starts from (blocks outside its keys add only zeros).
 *
 * (Until VERSION 5 a task's queries sat in the vector lanes and each key was broadcast to them:
 * 64 multiply-adds per key for a task of 3 queries, most lanes idle. Keys in lanes cost 4 per key
 * and query, and the widening 4 per key (a transposition of key rows 20), shared by the task's
 * queries. Until 2026-12 the widened blocks were stored to a buffer and read back by groups of 4
 * queries; widening them in the scores' own loads, for 8 queries at once, gives the same bits and
 * cut the attention of 8 lanes x 2 rows over 900 keys by a third on a 2-core AMD EPYC.) */

/* exp(x) for x <= 0 (Cephes expf: x = n ln2 + r, a degree-5 polynomial in r, times 2^n); 0 below
 * -87 and for -inf and NaN. Lane-wise operations only. */
static inline vf vexp16(vf x) {
    const vf floor_ = (vf){0} - 87.0f;
    const vi keep = x >= floor_;
    x = (vf)(((vi)x & keep) | ((vi)floor_ & ~keep));
    vf fx = x * ((vf){0} + 1.44269504088896341f) + ((vf){0} + 0.5f);
    vi n = __builtin_convertvector(fx, vi);
    vf nf = __builtin_convertvector(n, vf);
    vi above = nf > fx; /* truncation rounded up (negative fx): floor is one less */
    n = n + above;
    nf = __builtin_convertvector(n, vf);
    vf r = x - nf * ((vf){0} + 0.693359375f);
    r = r - nf * ((vf){0} - 2.12194440e-4f);
    vf z = r * r;
    vf y = (vf){0} + 1.9875691500e-4f;
    y = y * r + ((vf){0} + 1.3981999507e-3f);
    y = y * r + ((vf){0} + 8.3334519073e-3f);
    y = y * r + ((vf){0} + 4.1665795894e-2f);
    y = y * r + ((vf){0} + 1.6666665459e-1f);
    y = y * r + ((vf){0} + 5.0000001201e-1f);
    y = y * z + r + ((vf){0} + 1.0f);
    vi bits = (n + 127) << 23;
    return (vf)((vi)(y * (vf)bits) & keep);
}

/* Lane-wise larger of a and b, b where they tie or a is NaN (a maximum in any order). */
static inline vf vmax(vf a, vf b) { return (vf)(((vi)a & (a > b)) | ((vi)b & ~(a > b))); }

/* The 16 lanes' sum by a fixed tree (pairs of lanes i, i + 8, then i, i + 4, ...). */
static inline float tree_sum(vf v) {
    float x[W];
    memcpy(x, &v, sizeof x);
    for (int width = W / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) x[i] = x[i] + x[i + width];
    return x[0];
}

static inline float lane_max(vf v) {
    float top = -INFINITY;
    for (int i = 0; i < W; i++) top = v[i] > top ? v[i] : top;
    return top;
}

static inline int64_t lowest_key(int64_t position, int64_t window) {
    return window > 0 && position - window + 1 > 0 ? position - window + 1 : 0;
}

/* Row `index` of a float32 or float16 cache whose rows are d elements. */
static inline void *cache_row(void *base, int64_t half, int64_t index, int64_t d) {
    return (char *)base + (size_t)(index * d) * (half ? sizeof(uint16_t) : sizeof(float));
}

/* One position's d new key elements into a float32 or float16 cache: row `position` of [capacity][d],
 * or (`blocked`) lane position % 16 of block position / 16's [d][16]. */
static inline void store_key(const float *from, int64_t half, int64_t blocked, int64_t position, int64_t d, void *keys) {
    if (!blocked) {
        narrow(from, half, d, cache_row(keys, half, position, d));
        return;
    }
    int64_t at = (position - position % 16) * d + position % 16; /* element (position, 0) */
    for (int64_t c = 0; c < d; c++) {
        if (half) ((uint16_t *)keys)[at + c * 16] = float_to_half(from[c]);
        else ((float *)keys)[at + c * 16] = from[c];
    }
}

/* Ask for the cache rows of the block of 16 starting at `from` (up to `last`) PREFETCH_BLOCKS blocks
 * ahead of their use, into L2: the blocks are streamed from memory once per task (keys in the
 * scores, values in the weighted sums), and the work on one block hides the next ones' latency.
 * Into L2, not L1: a block's 32 lines asked into L1 at once held up the loads behind them. And the
 * values are fetched in the weighted sums' own pass, not while the keys stream (until 2026-12 they
 * were, into L2, and the keys into L1): 8 lanes x 2 rows over 900 keys ~17% less time on a 2-core
 * Zen 4, 8 x 4 rows ~15%, one lane and prefill chunks the same. (Speed only.) */
#define PREFETCH_BLOCKS 4
static inline void fetch_ahead(const void *base, int64_t half, int64_t from, int64_t last, int64_t d) {
    if (from > last) return;
    int64_t count = last - from + 1 < W ? last - from + 1 : W;
    const char *p = cache_row((void *)base, half, from, d), *end = cache_row((void *)base, half, from + count, d);
    for (; p < end; p += 64) __builtin_prefetch(p, 0, 2);
}


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
static void accumulate_range(float *a, const float *weights, int64_t first, const void *values, int64_t half,
                             int64_t from, int64_t to, int64_t d) {
    if (from > to) return;
    int64_t whole = d - d % W;
#if HALVES
    for (int64_t c0 = 0; c0 < whole; c0 += 4 * W) { /* the same, each vector as two AVX registers */
        int64_t parts = (whole - c0) / W < 4 ? 2 * ((whole - c0) / W) : 8;
        __m256 part[8];
        for (int64_t c = 0; c < parts; c++) part[c] = _mm256_loadu_ps(a + c0 + c * 8);
        for (int64_t j = from; j <= to; j++) {
            __m256 weight = _mm256_broadcast_ss(weights + (j - first));
            for (int64_t c = 0; c < parts; c++)
                part[c] = _mm256_fmadd_ps(weight, eight_at(values, half, j * d + c0 + 8 * c), part[c]);
        }
        for (int64_t c = 0; c < parts; c++) _mm256_storeu_ps(a + c0 + c * 8, part[c]);
    }
#else
    for (int64_t c0 = 0; c0 < whole; c0 += 4 * W) { /* 4 chunks at once: 4 chains in flight */
        int64_t chunks = (whole - c0) / W < 4 ? (whole - c0) / W : 4;
        vf part[4];
        for (int64_t c = 0; c < chunks; c++) part[c] = load(a + c0 + c * W);
        for (int64_t j = from; j <= to; j++) {
            vf weight = splat(weights[j - first]);
            for (int64_t c = 0; c < chunks; c++) part[c] = madd(weight, value_chunk(values, half, j, d, c0 + c * W), part[c]);
        }
        for (int64_t c = 0; c < chunks; c++) store(a + c0 + c * W, part[c]);
    }
#endif
    for (int64_t c = whole; c < d; c++)
        for (int64_t j = from; j <= to; j++) a[c] = a[c] + weights[j - first] * value_at(values, half, j, d, c);
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
#if HALVES
/* shared_halves' loop over CH whole chunks (elements c0 .. c0 + CH * W - 1) of n queries, with n, the
 * chunk count and the cache's type constants, in a function of its own: with a chunk count known
 * only at run time GCC kept the 2 x 4 sums on the stack, a store and a reload on every chain's
 * multiply-add (most of a 512-row prefill chunk's attention at 12K keys). The same fused chains. */
static inline __attribute__((always_inline)) void shared_chunks(const int n, const int kh, float *acc,
                                                                const float *const *weights, const void *values,
                                                                int64_t from, int64_t to, int64_t d, int64_t c0) {
    /* named registers, not arrays: GCC kept arrays of these sums in memory as well, a store each */
    float *a = acc + c0, *b = acc + d + c0;
    const float *wa = weights[0], *wb = n > 1 ? weights[1] : weights[0];
    __m256 a0 = _mm256_loadu_ps(a), a1 = _mm256_loadu_ps(a + 8), a2 = _mm256_loadu_ps(a + 16), a3 = _mm256_loadu_ps(a + 24);
    __m256 b0 = a0, b1 = a1, b2 = a2, b3 = a3;
    if (n > 1) b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8), b2 = _mm256_loadu_ps(b + 16), b3 = _mm256_loadu_ps(b + 24);
    for (int64_t j0 = from; j0 <= to; j0 += W) {
        fetch_ahead(values, kh, j0 + PREFETCH_BLOCKS * W, to, d);
        int64_t j1 = j0 + W - 1 < to ? j0 + W - 1 : to;
        for (int64_t j = j0; j <= j1; j++) {
            int64_t at = j * d + c0;
            __m256 x0 = eight_at(values, kh, at), x1 = eight_at(values, kh, at + 8);
            __m256 x2 = eight_at(values, kh, at + 16), x3 = eight_at(values, kh, at + 24);
            __m256 weight = _mm256_broadcast_ss(wa + (j - from));
            a0 = _mm256_fmadd_ps(weight, x0, a0), a1 = _mm256_fmadd_ps(weight, x1, a1);
            a2 = _mm256_fmadd_ps(weight, x2, a2), a3 = _mm256_fmadd_ps(weight, x3, a3);
            if (n > 1) {
                weight = _mm256_broadcast_ss(wb + (j - from));
                b0 = _mm256_fmadd_ps(weight, x0, b0), b1 = _mm256_fmadd_ps(weight, x1, b1);
                b2 = _mm256_fmadd_ps(weight, x2, b2), b3 = _mm256_fmadd_ps(weight, x3, b3);
            }
        }
    }
    _mm256_storeu_ps(a, a0), _mm256_storeu_ps(a + 8, a1), _mm256_storeu_ps(a + 16, a2), _mm256_storeu_ps(a + 24, a3);
    if (n > 1)
        _mm256_storeu_ps(b, b0), _mm256_storeu_ps(b + 8, b1), _mm256_storeu_ps(b + 16, b2), _mm256_storeu_ps(b + 24, b3);
}

#define SHARED_CHUNKS(N, KH)                                                                                  \
    static __attribute__((noinline)) void shared_chunks_##N##KH(float *acc, const float *const *weights,       \
                                                                const void *values, int64_t from, int64_t to, \
                                                                int64_t d, int64_t c0) {                      \
        shared_chunks(N, KH, acc, weights, values, from, to, d, c0);                                          \
    }
SHARED_CHUNKS(1, 0) SHARED_CHUNKS(1, 1) SHARED_CHUNKS(2, 0) SHARED_CHUNKS(2, 1)
#undef SHARED_CHUNKS
typedef void (*chunks_summer)(float *, const float *const *, const void *, int64_t, int64_t, int64_t, int64_t);
static const chunks_summer sum_chunks[2][2] = {{shared_chunks_10, shared_chunks_11},
                                               {shared_chunks_20, shared_chunks_21}};

/* accumulate_shared_n's whole chunks with each vector as two AVX registers (`HALVES`): the same
 * fused chains, lane by lane, in the same order. */
static inline __attribute__((always_inline)) void shared_halves(
    const int64_t n, float *acc, const float *const *weights_of, int64_t first, const void *values, int64_t half,
    int64_t from, int64_t to, int64_t d, int64_t whole) {
    for (int64_t c0 = 0; c0 < whole; c0 += CH * W) {
        int64_t chunks = (whole - c0) / W < CH ? (whole - c0) / W : CH;
        if (chunks == CH && SUB == 2 && CH == 2) { /* (shared_chunks names its 2 x 4 sums) */
            const float *weights[SUB];
            for (int64_t i = 0; i < n; i++) weights[i] = weights_of[i] + (from - first);
            sum_chunks[n - 1][half != 0](acc, weights, values, from, to, d, c0);
            continue;
        }
        __m256 part[SUB][2 * CH];
        const float *w[SUB];
        for (int64_t i = 0; i < n; i++) {
            w[i] = weights_of[i] + (from - first);
            for (int64_t c = 0; c < 2 * chunks; c++) part[i][c] = _mm256_loadu_ps(acc + i * d + c0 + c * 8);
        }
        for (int64_t j = from; j <= to; j++) {
            if (((j - from) & (W - 1)) == 0) fetch_ahead(values, half, j + PREFETCH_BLOCKS * W, to, d);
            __m256 x[2 * CH];
            for (int64_t c = 0; c < 2 * chunks; c++) x[c] = eight_at(values, half, j * d + c0 + 8 * c);
            for (int64_t i = 0; i < n; i++) {
                __m256 weight = _mm256_broadcast_ss(w[i]);
                w[i]++;
                for (int64_t c = 0; c < 2 * chunks; c++) part[i][c] = _mm256_fmadd_ps(weight, x[c], part[i][c]);
            }
        }
        for (int64_t i = 0; i < n; i++)
            for (int64_t c = 0; c < 2 * chunks; c++) _mm256_storeu_ps(acc + i * d + c0 + c * 8, part[i][c]);
    }
}
#endif

static inline __attribute__((always_inline)) void accumulate_shared_n(
    const int64_t n, float *acc, const float *const *weights_of, int64_t first, const void *values, int64_t half,
    int64_t from, int64_t to, int64_t d) {
    int64_t whole = d - d % W;
#if HALVES
    shared_halves(n, acc, weights_of, first, values, half, from, to, d, whole);
#else
    for (int64_t c0 = 0; c0 < whole; c0 += CH * W) {
        int64_t chunks = (whole - c0) / W < CH ? (whole - c0) / W : CH;
        vf part[SUB][CH];
        const float *w[SUB];
        for (int64_t i = 0; i < n; i++) {
            w[i] = weights_of[i] + (from - first);
            for (int64_t c = 0; c < chunks; c++) part[i][c] = load(acc + i * d + c0 + c * W);
        }
        for (int64_t j = from; j <= to; j++) {
            if (((j - from) & (W - 1)) == 0) fetch_ahead(values, half, j + PREFETCH_BLOCKS * W, to, d);
            vf x[CH];
            for (int64_t c = 0; c < chunks; c++) x[c] = value_chunk(values, half, j, d, c0 + c * W);
            for (int64_t i = 0; i < n; i++) {
                vf weight = splat(*w[i]);
                w[i]++;
                for (int64_t c = 0; c < chunks; c++) part[i][c] = madd(weight, x[c], part[i][c]);
            }
        }
        for (int64_t i = 0; i < n; i++)
            for (int64_t c = 0; c < chunks; c++) store(acc + i * d + c0 + c * W, part[i][c]);
    }
#endif
    for (int64_t i = 0; i < n; i++)
        for (int64_t c = whole; c < d; c++)
            for (int64_t j = from; j <= to; j++)
                acc[i * d + c] = acc[i * d + c] + weights_of[i][j - first] * value_at(values, half, j, d, c);
}

static inline __attribute__((always_inline)) void accumulate_shared(
    int64_t n, float *acc, const float *const *weights_of, int64_t first, const void *values, int64_t half,
    int64_t from, int64_t to, int64_t d) {
#define SHARED(N) accumulate_shared_n(N, acc, weights_of, first, values, half, from, to, d)
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

/* Keys j0..j0+count-1 (j0 a multiple of 16) of a float32 or float16 cache of key rows ([capacity][d])
 * widened and transposed into kt [d][16] (key j0 + t in lane t; lanes past count zero). A blocked
 * cache needs none of this: its blocks already lie so, and the scores read them in place
 * (`key_lanes`). Data movement only: exact, by any method. */
static inline void transpose_keys(const void *keys, int64_t half, int64_t j0, int64_t count, int64_t d, float *kt) {
#if defined(__AVX512F__)
    if (d % W == 0) {
        for (int64_t c0 = 0; c0 < d; c0 += W) {
            __m512 r[W], t[W];
            for (int i = 0; i < W; i++) {
                if (i >= count) {
                    r[i] = _mm512_setzero_ps();
                } else if (half) {
                    r[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)keys + (j0 + i) * d + c0)));
                } else {
                    r[i] = _mm512_loadu_ps((const float *)keys + (j0 + i) * d + c0);
                }
            }
            /* rows i -> columns: pairs of rows interleaved, then pairs of pairs (each 128-bit lane
             * then holds one column of 4 rows), then the 128-bit lanes gathered 4 x 4 */
            for (int i = 0; i < W; i += 2) {
                t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
                t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
            }
            for (int g = 0; g < 4; g++) { /* r[4g + k]: lane L holds column 4L + k of rows 4g..4g+3 */
                __m512d lo0 = _mm512_castps_pd(t[4 * g]), lo1 = _mm512_castps_pd(t[4 * g + 2]);
                __m512d hi0 = _mm512_castps_pd(t[4 * g + 1]), hi1 = _mm512_castps_pd(t[4 * g + 3]);
                r[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo0, lo1));
                r[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo0, lo1));
                r[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(hi0, hi1));
                r[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(hi0, hi1));
            }
            for (int k = 0; k < 4; k++) {
                __m512 u0 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x44), u1 = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xEE);
                __m512 u2 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x44);
                __m512 u3 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xEE);
                _mm512_storeu_ps(kt + (c0 + k) * W, _mm512_shuffle_f32x4(u0, u2, 0x88));
                _mm512_storeu_ps(kt + (c0 + 4 + k) * W, _mm512_shuffle_f32x4(u0, u2, 0xDD));
                _mm512_storeu_ps(kt + (c0 + 8 + k) * W, _mm512_shuffle_f32x4(u1, u3, 0x88));
                _mm512_storeu_ps(kt + (c0 + 12 + k) * W, _mm512_shuffle_f32x4(u1, u3, 0xDD));
            }
        }
        return;
    }
#endif
    for (int64_t c = 0; c < d; c++)
        for (int64_t i = 0; i < W; i++) kt[c * W + i] = i < count ? value_at(keys, half, j0 + i, d, c) : 0.0f;
}

/* Element c of a block of 16 keys ([d][16]: key t's element c in lane t), float16 (`kh`: widened
 * as it is loaded, exact) or float32: a blocked cache's block read in place, or a staged one. */
static inline __attribute__((always_inline)) vf key_lanes(const void *block, const int kh, int64_t c) {
    return value_chunk(block, kh, c, W, 0); /* row c of a [d][16] block, as value rows are read */
}

/* Queries per sweep of the scores over a pair of blocks: each block element is loaded (and
 * widened) once for all of them, their 2 x QUERIES sums in registers (AVX-512: 32 of them). */
#if defined(__AVX512F__)
#define QUERIES 8
#elif HALVES /* 2 x 2 sums of two registers (8), two blocks' elements (4) */
#define QUERIES 2
#else
#define QUERIES 4
#endif

/* n (<= QUERIES) queries' scores over one or two blocks of keys (k0, and k1 when `two`; float16
 * when `kh`): s[i][b] the lanes' dot products with query i (rows at qv + i * d). With 2n
 * independent chains the FMA pipes stay busy. n, two and kh are constants at every call site. */
#if HALVES
/* block_scores' chains with each vector as two AVX registers (`HALVES`), in a function of its own:
 * inlined into attend_task's large body, GCC kept the 2 x 4 sums on the stack (a store and a reload
 * on every multiply-add's chain: half the prefill time at 4K keys). The same fused chains, lane by
 * lane, in the same order; lanes[i][x] the 8 lanes x of query i (x: block 0 low, high, block 1 ...). */
static inline __attribute__((always_inline)) void scores_halves(const int n, const int two, const int kh,
                                                                const float *qv, int64_t d, const void *k0,
                                                                const void *k1, float lanes[QUERIES][4][8]) {
    __m256 sum[QUERIES][4];
    for (int i = 0; i < n; i++) sum[i][0] = sum[i][1] = sum[i][2] = sum[i][3] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c++) {
        __m256 key[4];
        for (int h = 0; h <= two; h++) {
            const void *block = h ? k1 : k0;
            for (int part = 0; part < 2; part++) key[2 * h + part] = eight_at(block, kh, c * W + 8 * part);
        }
        for (int i = 0; i < n; i++) {
            __m256 q = _mm256_broadcast_ss(qv + i * d + c);
            for (int x = 0; x < 2 + 2 * two; x++) sum[i][x] = _mm256_fmadd_ps(key[x], q, sum[i][x]);
        }
    }
    for (int i = 0; i < n; i++)
        for (int x = 0; x < 2 + 2 * two; x++) _mm256_storeu_ps(lanes[i][x], sum[i][x]);
}

#define SCORES_HALVES(N, TWO, KH)                                                                              \
    static __attribute__((noinline)) void scores_halves_##N##TWO##KH(const float *qv, int64_t d, const void *k0, \
                                                                      const void *k1, float lanes[QUERIES][4][8]) { \
        scores_halves(N, TWO, KH, qv, d, k0, k1, lanes);                                                       \
    }
SCORES_HALVES(1, 0, 0) SCORES_HALVES(1, 0, 1) SCORES_HALVES(1, 1, 0) SCORES_HALVES(1, 1, 1)
SCORES_HALVES(2, 0, 0) SCORES_HALVES(2, 0, 1) SCORES_HALVES(2, 1, 0) SCORES_HALVES(2, 1, 1)
#undef SCORES_HALVES
typedef void (*halves_scorer)(const float *, int64_t, const void *, const void *, float[QUERIES][4][8]);
static const halves_scorer score_halves[2][2][2] = {
    {{scores_halves_100, scores_halves_101}, {scores_halves_110, scores_halves_111}},
    {{scores_halves_200, scores_halves_201}, {scores_halves_210, scores_halves_211}}};

/* 8 lanes of a query's scores (keys key0..key0 + 7) as attend_queries' generic loop makes them:
 * times the scale, -inf outside low..high, stored to the row, and the running maximum of those
 * lanes (top8: 8 of the query's 16) taken as vmax does (the score where it is larger, else top). */
static inline void scores_to_row(const float *sums, int64_t key0, int32_t low, int32_t high, float scale, float *row,
                                 float *top8) {
    __m256i key = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int32_t)key0));
    __m256i outside = _mm256_or_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(low), key),
                                      _mm256_cmpgt_epi32(key, _mm256_set1_epi32(high)));
    __m256 score = _mm256_mul_ps(_mm256_loadu_ps(sums), _mm256_set1_ps(scale));
    score = _mm256_blendv_ps(score, _mm256_set1_ps(-INFINITY), _mm256_castsi256_ps(outside));
    _mm256_storeu_ps(row, score);
    __m256 top = _mm256_loadu_ps(top8);
    _mm256_storeu_ps(top8, _mm256_blendv_ps(top, score, _mm256_cmp_ps(score, top, _CMP_GT_OQ)));
}

/* vexp16 on 8 lanes: the same operations in the same order (no fused multiply-add), the same bits. */
static inline __m256 vexp8(__m256 x) {
    const __m256 floor_ = _mm256_set1_ps(-87.0f);
    __m256 keep = _mm256_cmp_ps(x, floor_, _CMP_GE_OQ);
    x = _mm256_blendv_ps(floor_, x, keep);
    __m256 fx = _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f));
    __m256i n = _mm256_cvttps_epi32(fx);
    __m256 nf = _mm256_cvtepi32_ps(n);
    n = _mm256_add_epi32(n, _mm256_castps_si256(_mm256_cmp_ps(nf, fx, _CMP_GT_OQ))); /* floor: one less */
    nf = _mm256_cvtepi32_ps(n);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(nf, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(nf, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 z = _mm256_mul_ps(r, r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, z), r), _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(bits)), keep);
}
#endif

static inline __attribute__((always_inline)) void block_scores(const int n, const int two, const int kh, const float *qv,
                                                               int64_t d, const void *k0, const void *k1,
                                                               vf s[QUERIES][2]) {
    for (int i = 0; i < QUERIES; i++) s[i][0] = s[i][1] = (vf){0};
    for (int64_t c = 0; c < d; c++) {
        vf key0 = key_lanes(k0, kh, c), key1 = two ? key_lanes(k1, kh, c) : (vf){0};
        for (int i = 0; i < n; i++) {
            vf q = splat(qv[i * d + c]);
            s[i][0] = madd(key0, q, s[i][0]);
            if (two) s[i][1] = madd(key1, q, s[i][1]);
        }
    }
}

/* Value rows the weighted sums of every query of a task go through before the next ones: 64 rows of
 * d = 128 are 16 KB (float16), so each tile is read from memory once and then from L1 by all the
 * task's queries, where one sweep over all the shared keys per sub-group of SUB queries streamed
 * the whole lane's values (3 MB at 12K keys) from L3 for every pair of queries of a prefill chunk.
 * Each sum still runs key by key in ascending order (its partial sums wait in `acc` between
 * tiles, as float32): the tiles change no bit. */
#define SHARED_KEYS 64

/* Queries r0..r1-1 of a task (see attend_lane_group): their scores over every block of keys the
 * task's rows see (each block read once per sweep of QUERIES of them), softmax, weighted
 * sums and outputs. A query's arithmetic is its own: which queries share a call changes no bit.
 *
 * `sinks` (NULL: none), the task's `group` query heads' sink logits (gpt-oss: one more term of each
 * softmax, with no value): query r's sink s = sinks[r % group] joins the largest score,
 * largest = max(the lanes' largest, s), and after the fixed tree over the 16 lanes' sums its
 * numerator exp(s - largest) (vexp16's lane 0, the same bits on every build) is added once:
 * sum = tree + exp(s - largest). Both depend on the query's own head and scores alone. Without sinks
 * not one operation is added (the bits of the kernel before sinks); a sink of -inf gives those bits
 * too (its numerator is +0, and tree + 0 is tree: the sum is positive). */
static inline __attribute__((always_inline)) void attend_queries(
    const float *q, int64_t q_stride, int64_t group, float *out, void *keys, void *values, int64_t half,
    int64_t blocked, int64_t rows, int64_t start, int64_t d, float scale, int64_t window, const float *sinks,
    int64_t r0, int64_t r1, float *e) {
    int64_t queries = r1 - r0, first = lowest_key(start, window), last = start + rows - 1;
    int64_t base = first - first % W, blocks = (last - base) / W + 1, span = blocks * W; /* aligned to 16 */
    float *qv = malloc(sizeof(float) * (size_t)(queries * d));   /* the queries, one after the other */
    float *kt = blocked ? NULL : malloc(sizeof(float) * (size_t)(2 * d * W)); /* two blocks of key rows, transposed */
    vf *top = aligned_alloc(sizeof(vf), sizeof(vf) * (size_t)queries); /* each query's largest score per lane */
    vi *low = aligned_alloc(sizeof(vi), sizeof(vi) * (size_t)queries), *high = aligned_alloc(sizeof(vi), sizeof(vi) * (size_t)queries);
    float *sums = malloc(sizeof(float) * (size_t)queries);
    float *acc = calloc((size_t)(queries * d), sizeof(float));
    if (!qv || (!blocked && !kt) || !top || !low || !high || !sums || !acc) abort();
    for (int64_t i = 0; i < queries; i++) {
        int64_t r = r0 + i, p = start + r / group;
        memcpy(qv + i * d, q + (r / group) * q_stride + (r % group) * d, sizeof(float) * (size_t)d);
        top[i] = (vf){0} - INFINITY;
        low[i] = (vi){0} + (int32_t)lowest_key(p, window);
        high[i] = (vi){0} + (int32_t)p;
    }
#if !HALVES
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#endif
    const int kh = blocked && half; /* the blocks the scores read: the cache's own (float16), or float32 */
    for (int64_t b = 0; b < blocks; b += 2) { /* two blocks of keys at a time, each read once per sweep */
        int64_t j0 = base + b * W, two = b + 1 < blocks;
        const void *block[2];
        for (int64_t h = 0; h <= two; h++) {
            int64_t from = j0 + h * W, count = last - from + 1 < W ? last - from + 1 : W;
            fetch_ahead(keys, half, from + PREFETCH_BLOCKS * W, last, d);
            if (blocked) { /* block from / 16 lies where row `from` would (lanes past count: keys not seen, masked) */
                block[h] = cache_row(keys, half, from, d);
            } else {
                transpose_keys(keys, half, from, count, d, kt + h * d * W);
                block[h] = kt + h * d * W;
            }
        }
        for (int64_t i0 = 0; i0 < queries; i0 += QUERIES) {
            int64_t n = queries - i0 < QUERIES ? queries - i0 : QUERIES;
#if HALVES
            float lanes[QUERIES][4][8] __attribute__((aligned(32)));
            score_halves[n - 1][two][kh](qv + i0 * d, d, block[0], block[1], lanes);
            for (int64_t i = 0; i < n; i++)
                for (int64_t x = 0; x < 2 + 2 * two; x++)
                    scores_to_row(lanes[i][x], j0 + 8 * x, low[i0 + i][0], high[i0 + i][0], scale,
                                  e + (i0 + i) * span + b * W + 8 * x, (float *)&top[i0 + i] + 8 * (x & 1));
#else
            vf s[QUERIES][2];
#define SCORES(N)                                                                                         \
    case N:                                                                                               \
        if (kh) two ? block_scores(N, 1, 1, qv + i0 * d, d, block[0], block[1], s)                      \
                    : block_scores(N, 0, 1, qv + i0 * d, d, block[0], block[0], s);                      \
        else two ? block_scores(N, 1, 0, qv + i0 * d, d, block[0], block[1], s)                         \
                 : block_scores(N, 0, 0, qv + i0 * d, d, block[0], block[0], s);                         \
        break;
            switch (n) {
                SCORES(1)
#if QUERIES > 2
                SCORES(2)
#endif
#if QUERIES > 3
                SCORES(3)
#endif
#if QUERIES > 4
                SCORES(4) SCORES(5) SCORES(6) SCORES(7)
#endif
            default:
                SCORES(QUERIES)
            }
#undef SCORES
            for (int64_t i = 0; i < n; i++)
                for (int64_t h = 0; h <= two; h++) {
                    vi key = lane + (int32_t)(j0 + h * W);
                    vi seen = (key >= low[i0 + i]) & (key <= high[i0 + i]);
                    vf score = s[i][h] * splat(scale);
                    score = (vf)(((vi)score & seen) | ((vi)((vf){0} - INFINITY) & ~seen));
                    store(e + (i0 + i) * span + (b + h) * W, score);
                    top[i0 + i] = vmax(score, top[i0 + i]);
                }
#endif
        }
    }
    for (int64_t i = 0; i < queries; i++) {
        float *row = e + i * span, top_score = lane_max(top[i]), sink = sinks ? sinks[(r0 + i) % group] : 0.0f;
        if (sinks && sink > top_score) top_score = sink;
#if HALVES /* vexp16's lanes 0..7 and 8..15 as two AVX registers, each lane's sum in the same order */
        __m256 largest = _mm256_set1_ps(top_score), part[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t j = 0; j < span; j += W)
            for (int h = 0; h < 2; h++) {
                __m256 x = vexp8(_mm256_sub_ps(_mm256_loadu_ps(row + j + 8 * h), largest));
                _mm256_storeu_ps(row + j + 8 * h, x);
                part[h] = _mm256_add_ps(part[h], x);
            }
        float lanes[W];
        _mm256_storeu_ps(lanes, part[0]);
        _mm256_storeu_ps(lanes + 8, part[1]);
        sums[i] = tree_sum(load(lanes));
#else
        vf largest = splat(top_score), part = (vf){0};
        for (int64_t j = 0; j < span; j += W) {
            vf x = vexp16(load(row + j) - largest);
            store(row + j, x);
            part = part + x;
        }
        sums[i] = tree_sum(part);
#endif
        if (sinks) sums[i] = sums[i] + vexp16(splat(sink - top_score))[0]; /* the sink's term, last */
    }
    /* The weighted sums, per query and element over its keys in ascending order, in three
     * ranges: its own keys below the ones every query of the task sees, those shared keys (all of
     * the context before the task's rows: most of a decode pass's work, by sub-groups of queries
     * whose sums stay in registers while each value row is read once), then its own keys after
     * them. (Each element's operations run key by key whichever range a key falls in: the ranges
     * change no bit.) */
    int64_t shared_low = lowest_key(last, window), shared_high = start; /* every row sees these */
    if (shared_low > shared_high) shared_low = shared_high + 1;
    const float *weights_of[SUB];
    for (int64_t i = 0; i < queries; i++) {
        int64_t p = start + (r0 + i) / group, lowest = lowest_key(p, window);
        accumulate_range(acc + i * d, e + i * span, base, values, half, lowest,
                         shared_low - 1 < p ? shared_low - 1 : p, d);
    }
    for (int64_t j0 = shared_low; j0 <= shared_high; j0 += SHARED_KEYS) { /* a tile of value rows, from L1 */
        int64_t j1 = j0 + SHARED_KEYS - 1 < shared_high ? j0 + SHARED_KEYS - 1 : shared_high;
        for (int64_t i0 = 0; i0 < queries; i0 += SUB) {
            int64_t n = queries - i0 < SUB ? queries - i0 : SUB;
            for (int64_t i = 0; i < n; i++) weights_of[i] = e + (i0 + i) * span;
            accumulate_shared(n, acc + i0 * d, weights_of, base, values, half, j0, j1, d);
        }
    }
    for (int64_t i = 0; i < queries; i++) {
        int64_t p = start + (r0 + i) / group, lowest = lowest_key(p, window);
        accumulate_range(acc + i * d, e + i * span, base, values, half,
                         shared_high + 1 > lowest ? shared_high + 1 : lowest, p, d);
    }
    for (int64_t i = 0; i < queries; i++) {
        int64_t r = r0 + i;
        float *o = out + (r / group) * q_stride + (r % group) * d;
        for (int64_t c = 0; c < d; c++) o[c] = acc[i * d + c] / sums[i];
    }
    free(qv);
    free(kt);
    free(top);
    free(low);
    free(high);
    free(sums);
    free(acc);
}

/* The scores a task keeps at once: queries go by groups of this many floats' worth of scores
 * (queries x keys), so a prefill chunk of 512 rows over 32K keys takes a few MB, not 200. A
 * group re-reads the keys the task's other groups read (from cache). (Speed only.) */
#define SCORE_FLOATS (1 << 20)

/* One (lane, kv head) task: the `group` query heads that read kv head over rows 0..rows-1 at
 * positions start.., keys / values [capacity, d] (float32, or float16 when `half`). Query r is row
 * r / group, head r % group (at q + row * q_stride + head * d). `new_keys` / `new_values` (row
 * strides k_stride / v_stride), when given, are the rows' own keys and values, stored at positions
 * start.. first. The queries go by groups (attend_queries); in each, a block of keys is read
 * once per sweep of QUERIES queries, and the weighted sums go by sub-groups of queries
 * (accumulate_shared), each value row read once for a sub-group. */
static inline __attribute__((always_inline)) void attend_lane_group(
    const float *q, int64_t q_stride, int64_t group, float *out, void *keys, void *values, int64_t half,
    int64_t blocked, int64_t rows, int64_t start, int64_t d, float scale, int64_t window, const float *sinks,
    const float *new_keys, int64_t k_stride, const float *new_values, int64_t v_stride) {
    if (new_keys)
        for (int64_t r = 0; r < rows; r++) {
            store_key(new_keys + r * k_stride, half, blocked, start + r, d, keys);
            narrow(new_values + r * v_stride, half, d, cache_row(values, half, start + r, d));
        }
    int64_t queries = rows * group, first = lowest_key(start, window), last = start + rows - 1;
    int64_t span = ((last - (first - first % W)) / W + 1) * W;
    int64_t step = SCORE_FLOATS / span / 4 * 4;
    step = step < 4 ? 4 : step;
    step = step > queries ? queries : step;
    float *e = malloc(sizeof(float) * (size_t)(span * step)); /* scores, then numerators: [query][key - base] */
    if (!e) abort();
    for (int64_t r0 = 0; r0 < queries; r0 += step)
        attend_queries(q, q_stride, group, out, keys, values, half, blocked, rows, start, d, scale, window, sinks, r0,
                       r0 + step < queries ? r0 + step : queries, e);
    free(e);
}

/* attend_lane_group compiled for the common head sizes as constants (loops unroll); the same
 * source order of operations, so the same bits as the generic one. */
#define ATTEND(D) attend_lane_group(q, q_stride, group, out, keys, values, half, blocked, rows, start, D, scale, window, \
                                    sinks, new_keys, k_stride, new_values, v_stride)
static void attend_task(const float *q, int64_t q_stride, int64_t group, float *out, void *keys, void *values,
                        int64_t half, int64_t blocked, int64_t rows, int64_t start, int64_t d, float scale, int64_t window,
                        const float *sinks, const float *new_keys, int64_t k_stride, const float *new_values,
                        int64_t v_stride) {
    switch (d) {
    case 64: ATTEND(64); break;
    case 128: ATTEND(128); break;
    case 256: ATTEND(256); break;
    default: ATTEND(d);
    }
}

/* ---- Prefill chunks on the matrix tiles (AMX-BF16) ----
 *
 * A lane of a prefill chunk with many rows (`matrix_rows`, set by the caller only for prompt chunks
 * cut at the prefill plan's boundaries) attends on the tiles where the CPU has AMX-BF16 and the
 * process may use them: the scores Q K^T and the weighted sums P V as tile products (tdpbf16ps:
 * products of bfloat16 pairs summed into float32), the softmax on vectors (`matrix_exp`: vexp16's
 * polynomial in fused multiply-adds), keys by blocks of MK with a running maximum and sum per query
 * (the online softmax). Decode and verify rows, short chunks and every lane of a call without
 * `matrix_rows` keep the vector path above.
 * (512 rows of the coder's heads over 4K-12K keys on a 2-core Sapphire Rapids: ~2.5x less CPU time
 * than the vector path; about half of it is the tile products, most of the rest the softmax's
 * exponentials, which the tile products hold up rather than overlap.)
 *
 * Accuracy: each float32 operand x goes to the tiles as x = hi + lo, hi = x rounded to 8
 * significant bits and lo = bf16(x - hi) (`split`; a float16 cache's values split exactly), and
 * the scores as q_lo k_hi + q_hi k_hi + q_hi k_lo + q_lo k_lo, the weighted sums as
 * p_lo v_hi + p_hi v_hi + p_hi v_lo (TILE_PRODUCTS), each summed in float32. Against float64 on
 * the coder's own queries and float16 caches (512 rows over 2K keys, layers 0, 1, 13, 27) the
 * outputs' RMS error is 0.6-4x the vector path's (relative to the outputs' RMS: 2e-6 .. 7e-6),
 * their largest 0.7-7x (relative to the largest output: at most 5e-5); without the scores'
 * lo x lo term the RMS error was 6-10x the vector path's on layers 0, 1 and 13 (sharp
 * attention), while the sums' lo x lo term would cut it by ~5% for 1/7 more tile work. The
 * splits leave a floor of ~2^-18 whatever the context (over a few hundred keys the vector path is
 * ~10x closer); either way far below what storing the next layer's keys and values in float16
 * rounds (2^-11).
 *
 * Exactness: a query's output still depends on its own query, keys and values alone. A tile
 * product computes each output element from its own A row and B column (the other rows of a tile
 * change none of its bits); the blocks of keys lie at absolute multiples of MK; a query takes part
 * in a block's softmax update only where it sees one of the block's keys (others leave its
 * maximum, sum and output untouched), and the keys of a block it does not see get weight exactly
 * 0, whose products add exact zeros to its float32 sums (which start at +0, so never -0); value
 * rows past the lane's last written key are zeros, not whatever the cache holds there (0 x NaN).
 * So which rows share a tile, where the chunk starts, the other lanes, the thread count and which
 * thread runs a task change no bit. (One caveat: a value that is not finite (an inf in a float16
 * cache) reaches the rows of its tiles before its position as 0 x inf; the row at its position,
 * and every later one, is not finite either way.) The bits differ from the vector path's, so
 * which path a row takes must be fixed by the plan: see kernels/torch_cpu.py, MATRIX_MIN_ROWS. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && \
    defined(__AMX_BF16__) && defined(__linux__) && !defined(LANE_ATTENTION_NO_MATRIX)
#define MATRIX 1
#include "amx_tiles.h"
#else
#define MATRIX 0
#endif

struct attention_job {
    const float *q;
    float *out;
    int64_t heads, kv_heads, d;
    const int64_t *begin, *rows, *start, *capacity, *keys, *values;
    float scale;
    int64_t window, half;
    const float *new_keys, *new_values;
    int64_t k_stride, v_stride, blocked;
    int64_t matrix_rows; /* lanes with at least this many rows go to the tiles (0: none) */
    const float *sinks;  /* [heads] each query head's sink logit (gpt-oss), or NULL: none */
};

static inline int on_matrix(const struct attention_job *job, int64_t l) {
    return job->matrix_rows > 0 && job->rows[l] >= job->matrix_rows;
}

/* A task's lane l, kv head kv: its query rows, output rows, caches and new rows. */
struct lane_view {
    const float *q, *new_keys, *new_values;
    float *out;
    void *keys, *values;
};

static struct lane_view view_of(const struct attention_job *job, int64_t l, int64_t kv) {
    int64_t heads = job->heads, d = job->d, group = heads / job->kv_heads, half = job->half;
    int64_t offset = kv * job->capacity[l], first = (job->begin[l] * heads + kv * group) * d; /* row begin[l], head kv * group */
    struct lane_view v = {job->q + first,
                          job->new_keys ? job->new_keys + job->begin[l] * job->k_stride + kv * d : NULL,
                          job->new_values ? job->new_values + job->begin[l] * job->v_stride + kv * d : NULL,
                          job->out + first, cache_row((void *)(intptr_t)job->keys[l], half, offset, d),
                          cache_row((void *)(intptr_t)job->values[l], half, offset, d)};
    return v;
}

/* Task t: lane t / kv_heads, kv head t % kv_heads. A lane bound for the tiles only stores its new
 * keys and values here (the tile tasks read them after this pass). */
static void attention_task(void *context, int64_t t) {
    const struct attention_job *job = context;
    int64_t kv_heads = job->kv_heads, d = job->d, l = t / kv_heads, kv = t % kv_heads;
    struct lane_view v = view_of(job, l, kv);
    if (on_matrix(job, l)) {
        if (v.new_keys)
            for (int64_t r = 0; r < job->rows[l]; r++) {
                store_key(v.new_keys + r * job->k_stride, job->half, job->blocked, job->start[l] + r, d, v.keys);
                narrow(v.new_values + r * job->v_stride, job->half, d, cache_row(v.values, job->half, job->start[l] + r, d));
            }
        return;
    }
    attend_task(v.q, job->heads * d, job->heads / kv_heads, v.out, v.keys, v.values, job->half, job->blocked,
                job->rows[l], job->start[l], d, job->scale, job->window,
                job->sinks ? job->sinks + kv * (job->heads / kv_heads) : NULL, v.new_keys, job->k_stride,
                v.new_values, job->v_stride);
}

#if MATRIX
#define MQ 512      /* queries per tile task (32 tiles of 16; at 256 each block's keys and values were
                       converted twice as often, ~5% slower at 12K) */
#define MK 128      /* keys per block of the online softmax (8 tiles of 16, 4 steps of 32) */
#define MAX_D 256   /* head sizes the tiles take: multiples of 32 up to this */

static int64_t matrix_rows_run; /* rows attended on the tiles since the library loaded (atomic) */

/* Tiles (amx_configure_16x64): C 0..3, A 4, 5, B 6, 7. */

/* x0 (16 floats) then x1 as 32 bfloat16: hi, x rounded to 8 significant bits (Veltkamp's split:
 * c = (2^16 + 1) x, hi = c - (c - x), each an IEEE operation), and lo = bf16(x - hi), x - hi exact
 * in float32 and at most 2^-9 of x, rounded to nearest even. A float16 value (11 significant bits)
 * splits exactly; a float32 one keeps ~18 of its 24 bits. hi's low 16 bits are zeros: its bf16 is
 * its upper half. (c overflows past |x| = 2^111: queries, cached values and weights are far below.) */
static inline void split(__m512 x0, __m512 x1, __m512i *hi, __m512i *lo) {
    const __m512 sigma = _mm512_set1_ps(65537.0f);
    const __m512i upper = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
                                           31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    __m512 c0 = _mm512_mul_ps(sigma, x0), c1 = _mm512_mul_ps(sigma, x1);
    __m512 h0 = _mm512_sub_ps(c0, _mm512_sub_ps(c0, x0)), h1 = _mm512_sub_ps(c1, _mm512_sub_ps(c1, x1));
    *hi = _mm512_permutex2var_epi16(_mm512_castps_si512(h0), upper, _mm512_castps_si512(h1));
    *lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(x1, h1), _mm512_sub_ps(x0, h0));
}

/* split, then pairs interleaved: element 2t from x0's lane t, 2t + 1 from x1's (a B tile's row). */
static inline void split_pairs(__m512 x0, __m512 x1, __m512i *hi, __m512i *lo) {
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    split(x0, x1, hi, lo);
    *hi = _mm512_permutexvar_epi16(pairs, *hi);
    *lo = _mm512_permutexvar_epi16(pairs, *lo);
}

/* Per task: queries as A tiles, a block's keys and values as B tiles, scores, weights, outputs. */
struct matrix_buffers {
    uint16_t *q_hi, *q_lo;   /* [MQ][d] */
    uint32_t *k_hi, *k_lo;   /* [MK / 16][d / 32] tiles of [16 element pairs][16 keys] */
    uint32_t *v_hi, *v_lo;   /* [MK / 32][d / 16] tiles of [16 key pairs][16 elements] */
    float *s;                /* [MQ][MK] scores */
    uint16_t *p_hi, *p_lo;   /* [MQ][MK] weights */
    float *o, *c, *staging;  /* [MQ][d] outputs; 4 C tiles; a block of key rows transposed */
    float *top, *sum, *alpha;
    uint8_t *live;
};

/* Each thread's buffers (~1.3 MB at d 128), kept between calls (a prefill runs this every layer)
 * and freed when the thread ends. */
static __thread char *matrix_memory;
static __thread size_t matrix_memory_size;
static pthread_key_t matrix_memory_key;
static pthread_once_t matrix_memory_once = PTHREAD_ONCE_INIT;
static void matrix_memory_make_key(void) { pthread_key_create(&matrix_memory_key, free); }

static int matrix_buffers_for(int64_t d, struct matrix_buffers *b) {
    size_t sizes[] = {2 * MQ * d, 2 * MQ * d, 4 * MK * d, 4 * MK * d, 4 * MK * d, 4 * MK * d, 4 * MQ * MK,
                      2 * MQ * MK, 2 * MQ * MK, 4 * MQ * d, 4 * 4 * 256, 4 * 16 * d, 4 * MQ, 4 * MQ, 4 * MQ, MQ};
    size_t total = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) total += (sizes[i] + 63) / 64 * 64;
    if (total > matrix_memory_size) {
        pthread_once(&matrix_memory_once, matrix_memory_make_key);
        free(matrix_memory);
        matrix_memory = aligned_alloc(64, total);
        matrix_memory_size = matrix_memory ? total : 0;
        pthread_setspecific(matrix_memory_key, matrix_memory); /* (the thread's end frees it) */
        if (!matrix_memory) return 0;
    }
    void **slots[] = {(void **)&b->q_hi, (void **)&b->q_lo, (void **)&b->k_hi, (void **)&b->k_lo, (void **)&b->v_hi,
                      (void **)&b->v_lo, (void **)&b->s, (void **)&b->p_hi, (void **)&b->p_lo, (void **)&b->o,
                      (void **)&b->c, (void **)&b->staging, (void **)&b->top, (void **)&b->sum, (void **)&b->alpha,
                      (void **)&b->live};
    char *at = matrix_memory;
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        *slots[i] = at;
        at += (sizes[i] + 63) / 64 * 64;
    }
    return 1;
}

/* Keys j..j+15 (j a multiple of 16, count of them written) as B tiles of the scores, one per k step
 * s (elements 32s..32s+31): row r, lane t holds key j + t's elements 32s + 2r and 32s + 2r + 1. */
static void matrix_keys(const void *keys, int64_t half, int64_t blocked, int64_t j, int64_t count, int64_t d,
                        float *staging, uint32_t *hi, uint32_t *lo) {
    const void *block = staging;
    int kh = 0;
    if (blocked) {
        block = cache_row((void *)keys, half, j, d);
        kh = half != 0;
    } else {
        transpose_keys(keys, half, j, count, d, staging);
    }
    for (int64_t c = 0; c < d; c += 2) {
        __m512i h, l;
        split_pairs((__m512)key_lanes(block, kh, c), (__m512)key_lanes(block, kh, c + 1), &h, &l);
        int64_t at = (c / 32) * 256 + (c % 32) / 2 * 16;
        _mm512_store_si512(hi + at, h);
        _mm512_store_si512(lo + at, l);
    }
}

/* Value rows j..j+31 as B tiles of the weighted sums, one per 16 elements: row r, lane c holds rows
 * j + 2r and j + 2r + 1's element c. Rows past `last` (not written) are zeros. */
static void matrix_values(const void *values, int64_t half, int64_t j, int64_t last, int64_t d, uint32_t *hi,
                          uint32_t *lo) {
    for (int64_t r = 0; r < 16; r++)
        for (int64_t c = 0; c < d; c += 16) {
            int64_t a = j + 2 * r;
            __m512 x0 = a <= last ? (__m512)value_chunk(values, half, a, d, c) : _mm512_setzero_ps();
            __m512 x1 = a + 1 <= last ? (__m512)value_chunk(values, half, a + 1, d, c) : _mm512_setzero_ps();
            __m512i h, l;
            split_pairs(x0, x1, &h, &l);
            _mm512_store_si512(hi + (c / 16) * 256 + r * 16, h);
            _mm512_store_si512(lo + (c / 16) * 256 + r * 16, l);
        }
}

/* c(0..3) += the products of A tiles a0, a1 (hi, lo at stride sa) and B tiles b0, b1 (hi, lo,
 * rows 64 bytes): lo x hi, hi x hi, hi x lo (and lo x lo where `four`), each element's float32 sum
 * in this order. */
#define TILE_PRODUCTS(four, a0_hi, a1_hi, a0_lo, a1_lo, sa, b0_hi, b1_hi, b0_lo, b1_lo) \
    do {                                                                               \
        _tile_loadd(6, b0_hi, 64);                                                     \
        _tile_loadd(7, b1_hi, 64);                                                     \
        _tile_loadd(4, a0_lo, sa);                                                     \
        _tile_loadd(5, a1_lo, sa);                                                     \
        _tile_dpbf16ps(0, 4, 6);                                                       \
        _tile_dpbf16ps(1, 4, 7);                                                       \
        _tile_dpbf16ps(2, 5, 6);                                                       \
        _tile_dpbf16ps(3, 5, 7);                                                       \
        _tile_loadd(4, a0_hi, sa);                                                     \
        _tile_loadd(5, a1_hi, sa);                                                     \
        _tile_dpbf16ps(0, 4, 6);                                                       \
        _tile_dpbf16ps(1, 4, 7);                                                       \
        _tile_dpbf16ps(2, 5, 6);                                                       \
        _tile_dpbf16ps(3, 5, 7);                                                       \
        _tile_loadd(6, b0_lo, 64);                                                     \
        _tile_loadd(7, b1_lo, 64);                                                     \
        _tile_dpbf16ps(0, 4, 6);                                                       \
        _tile_dpbf16ps(1, 4, 7);                                                       \
        _tile_dpbf16ps(2, 5, 6);                                                       \
        _tile_dpbf16ps(3, 5, 7);                                                       \
        if (four) {                                                                    \
            _tile_loadd(4, a0_lo, sa);                                                 \
            _tile_loadd(5, a1_lo, sa);                                                 \
            _tile_dpbf16ps(0, 4, 6);                                                   \
            _tile_dpbf16ps(1, 4, 7);                                                   \
            _tile_dpbf16ps(2, 5, 6);                                                   \
            _tile_dpbf16ps(3, 5, 7);                                                   \
        }                                                                              \
    } while (0)

/* What a task's units of work share while a block of keys j0..j0 + MK - 1 is on: the buffers, and
 * per query (i < n; padding rows past n) its position and lowest key. */
struct group_state {
    const struct matrix_buffers *b;
    const int64_t *position, *low;
    int64_t n, d, steps, j0;
};

/* Unit u of the scores of query tiles 2 pair, 2 pair + 1 (a pair of tiles, 32 queries): key tiles
 * 2 (u / steps) and the next (32 keys), k step u % steps; the first step clears the C tiles, the
 * last stores them. Key pairs no query of the pair sees are skipped (their scores are never read). */
static inline void scores_unit(const struct group_state *g, int64_t pair, int64_t u) {
    const struct matrix_buffers *b = g->b;
    int64_t first = 32 * pair, end = first + 32 < g->n ? first + 32 : g->n, d = g->d, steps = g->steps;
    int64_t t = u / steps, s = u % steps, j = g->j0 + 32 * t;
    if (j > g->position[end - 1] || j + 31 < g->low[first]) return;
    if (s == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    const uint16_t *ah = b->q_hi + first * d + 32 * s, *al = b->q_lo + first * d + 32 * s;
    const uint32_t *bh = b->k_hi + (2 * t * steps + s) * 256, *bl = b->k_lo + (2 * t * steps + s) * 256;
    TILE_PRODUCTS(1, ah, ah + 16 * d, al, al + 16 * d, 2 * d, bh, bh + steps * 256, bl, bl + steps * 256);
    if (s == steps - 1) {
        float *at = b->s + first * MK + 32 * t;
        _tile_stored(0, at, 4 * MK);
        _tile_stored(1, at + 16, 4 * MK);
        _tile_stored(2, at + 16 * MK, 4 * MK);
        _tile_stored(3, at + 16 * MK + 16, 4 * MK);
    }
}

/* Unit u of the weighted sums of a pair of query tiles: elements 32 (u / (MK / 32)) .. + 31 (two C
 * tiles per query tile), key step u % (MK / 32) (32 keys); the last step stores the C tiles and
 * folds them into each live query's outputs, o = o alpha + p v. Steps no query of the pair sees
 * add nothing (their weights are zeros) and are skipped. */
static inline void sums_unit(const struct group_state *g, int64_t pair, int64_t u) {
    const struct matrix_buffers *b = g->b;
    int64_t first = 32 * pair, end = first + 32 < g->n ? first + 32 : g->n, d = g->d;
    int64_t c = 32 * (u / (MK / 32)), t = u % (MK / 32), j = g->j0 + 32 * t;
    if (t == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    if (j <= g->position[end - 1] && j + 31 >= g->low[first]) {
        const uint16_t *ah = b->p_hi + first * MK + 32 * t, *al = b->p_lo + first * MK + 32 * t;
        const uint32_t *bh = b->v_hi + (t * (d / 16) + c / 16) * 256, *bl = b->v_lo + (t * (d / 16) + c / 16) * 256;
        TILE_PRODUCTS(0, ah, ah + 16 * MK, al, al + 16 * MK, 2 * MK, bh, bh + 256, bl, bl + 256);
    }
    if (t < MK / 32 - 1) return;
    _tile_stored(0, b->c, 64);
    _tile_stored(1, b->c + 256, 64);
    _tile_stored(2, b->c + 512, 64);
    _tile_stored(3, b->c + 768, 64);
    for (int64_t i = first; i < end; i++) {
        if (!b->live[i]) continue;
        int64_t r = i - first, tile = r < 16 ? 0 : 2; /* C tiles 0, 1: rows 0..15; 2, 3: 16..31 */
        float *o = b->o + i * d + c;
        vf alpha = splat(b->alpha[i]);
        store(o, madd(load(o), alpha, load(b->c + tile * 256 + (r % 16) * 16)));
        store(o + 16, madd(load(o + 16), alpha, load(b->c + (tile + 1) * 256 + (r % 16) * 16)));
    }
}

/* exp(x) for x <= 0 in the tiles' softmax (Cephes expf's reduction and polynomial, as vexp16, in fused
 * multiply-adds, 2^n by vscalefps: about half vexp16's operations; other bits than it, which this
 * path's rows never share): 0 below -87 and for -inf and NaN. Lane-wise, so a weight's bits depend
 * on its score alone. */
static inline __m512 matrix_exp(__m512 x) {
    const __m512 floor_ = _mm512_set1_ps(-87.0f);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, floor_, _CMP_GE_OQ);
    x = _mm512_max_ps(x, floor_); /* (NaN: the second operand) */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_scalef_ps(keep, y, n);
}

/* The softmax update of query i for the block (where it sees one of its keys; else not `live`, and
 * its running maximum, sum and outputs stay as they are): its scores (of the scaled query; -inf
 * where it does not see the key), the block's largest, the weights exp(score - largest) (matrix_exp)
 * as bf16 hi / lo, alpha = exp(old largest - new), sum = sum alpha + the weights' sum. */
static inline void softmax_row(const struct group_state *g, int64_t i) {
    const struct matrix_buffers *b = g->b;
    const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    int64_t j0 = g->j0, low = g->low[i], position = g->position[i];
    int64_t from = low > j0 ? low : j0, to = position < j0 + MK - 1 ? position : j0 + MK - 1;
    b->live[i] = from <= to;
    if (!b->live[i]) return;
    float *row = b->s + i * MK;
    __m512 top = _mm512_set1_ps(-INFINITY), part = _mm512_setzero_ps();
    if (from > j0 || to < j0 + MK - 1) { /* keys it does not see: -inf */
        for (int64_t h = 0; h < MK / W; h++) {
            vi key = lane + (int32_t)(j0 + h * W);
            vi seen = (key >= (int32_t)from) & (key <= (int32_t)to);
            vf score = load(row + h * W);
            score = (vf)(((vi)score & seen) | ((vi)((vf){0} - INFINITY) & ~seen));
            store(row + h * W, score);
            top = _mm512_max_ps(top, (__m512)score);
        }
    } else {
        for (int64_t h = 0; h < MK / W; h++) top = _mm512_max_ps(top, _mm512_load_ps(row + h * W));
    }
    /* (the reductions: fixed instruction sequences, so one order per row) */
    float block_top = _mm512_reduce_max_ps(top), largest = block_top > b->top[i] ? block_top : b->top[i];
    vf shift = splat(largest);
    for (int64_t h = 0; h < MK / W; h += 2) {
        __m512 e0 = matrix_exp(_mm512_sub_ps(_mm512_load_ps(row + h * W), (__m512)shift));
        __m512 e1 = matrix_exp(_mm512_sub_ps(_mm512_load_ps(row + h * W + W), (__m512)shift));
        part = _mm512_add_ps(part, e0);
        part = _mm512_add_ps(part, e1);
        __m512i hi, lo;
        split(e0, e1, &hi, &lo);
        _mm512_store_si512(b->p_hi + i * MK + h * W, hi);
        _mm512_store_si512(b->p_lo + i * MK + h * W, lo);
    }
    /* exp(old - new): 0 on the first block (-inf), exactly 1 where the largest is unchanged */
    float alpha = largest == b->top[i] ? 1.0f : _mm512_cvtss_f32(matrix_exp(_mm512_set1_ps(b->top[i] - largest)));
    b->alpha[i] = alpha;
    b->sum[i] = b->sum[i] * alpha + _mm512_reduce_add_ps(part);
    b->top[i] = largest;
}

/* Queries q0..q1-1 (< q0 + MQ) of lane l, kv head kv (query i: row i / group, head i % group). */
static void matrix_group(const struct attention_job *job, int64_t l, int64_t kv, int64_t q0, int64_t q1,
                         const struct matrix_buffers *b) {
    int64_t heads = job->heads, d = job->d, group = heads / job->kv_heads, half = job->half, window = job->window;
    int64_t start = job->start[l], last = start + job->rows[l] - 1, n = q1 - q0, tiles = (n + 31) / 32 * 2;
    int64_t steps = d / 32, q_stride = heads * d, pairs = tiles / 2;
    struct lane_view v = view_of(job, l, kv);
    int64_t position[MQ] = {0}, low[MQ] = {0};
    const __m512 scale = _mm512_set1_ps(job->scale);
    if (n <= 0) return;
    for (int64_t i = 0; i < tiles * 16; i++) {
        if (i < n) {
            int64_t r = q0 + i;
            const float *x = v.q + (r / group) * q_stride + (r % group) * d;
            position[i] = start + r / group;
            low[i] = lowest_key(position[i], window);
            for (int64_t c = 0; c < d; c += 32) { /* the scale applied to the query (one rounding) */
                __m512i h, lo;
                split(_mm512_mul_ps(_mm512_loadu_ps(x + c), scale), _mm512_mul_ps(_mm512_loadu_ps(x + c + 16), scale),
                      &h, &lo);
                _mm512_store_si512(b->q_hi + i * d + c, h);
                _mm512_store_si512(b->q_lo + i * d + c, lo);
            }
        } else { /* padding: zeros, never live */
            memset(b->q_hi + i * d, 0, sizeof(uint16_t) * (size_t)d);
            memset(b->q_lo + i * d, 0, sizeof(uint16_t) * (size_t)d);
        }
        /* a sink (gpt-oss) enters first, as a key of score s and value 0 would: largest s, sum
         * exp(s - s) = 1, outputs 0 (the first block it sees then rescales it by alpha as any). The
         * query's own head's logit: its row stays its own. (A sink of -inf: alpha exp(-inf) = +0 on
         * the first block, so sum 1 x 0 + ... is the bits without sinks.) */
        int has_sink = job->sinks && i < n;
        b->top[i] = has_sink ? job->sinks[kv * group + (q0 + i) % group] : -INFINITY;
        b->sum[i] = has_sink ? 1.0f : 0.0f;
    }
    memset(b->o, 0, sizeof(float) * (size_t)(n * d));
    struct group_state g = {b, position, low, n, d, steps, 0};
    /* Units of tile work per pair of query tiles (scores, then weighted sums) and the softmax rows
     * between them: pass p runs the scores of pair p, the softmax of pair p - 1's rows and the sums
     * of pair p - 2, a row after each unit, so that the vector work runs while the tiles compute
     * (~1.2x over the three phases one after the other on a 2-core Sapphire Rapids: the tile
     * products hold up the vector ports much of their time, so the overlap is partial). Each
     * unit and row is the same work in any case: the interleaving changes no bit. */
    int64_t score_units = (MK / 32) * steps, units = score_units + (MK / 32) * (d / 32);
    int64_t lowest = low[0], highest = position[n - 1]; /* positions ascend with the query index */
    for (int64_t j0 = lowest - lowest % MK; j0 <= highest; j0 += MK) {
        g.j0 = j0;
        for (int64_t t = 0; t < MK / 16 && j0 + 16 * t <= highest; t++) {
            int64_t j = j0 + 16 * t;
            matrix_keys(v.keys, half, job->blocked, j, last - j + 1 < 16 ? last - j + 1 : 16, d, b->staging,
                        b->k_hi + t * steps * 256, b->k_lo + t * steps * 256);
        }
        for (int64_t t = 0; t < MK / 32 && j0 + 32 * t <= highest; t++)
            matrix_values(v.values, half, j0 + 32 * t, last, d, b->v_hi + t * (d / 16) * 256,
                          b->v_lo + t * (d / 16) * 256);
        for (int64_t p = 0; p < pairs + 2; p++) {
            int64_t row = 32 * (p - 1), rows_end = row + 32 < n ? row + 32 : n, any = 0;
            if (p >= 2)
                for (int64_t i = 32 * (p - 2); i < 32 * (p - 1); i++) any |= i < n && b->live[i];
            for (int64_t u = 0; u < units; u++) {
                if (u < score_units) {
                    if (p < pairs) scores_unit(&g, p, u);
                } else if (any) {
                    sums_unit(&g, p - 2, u - score_units);
                }
                for (; p >= 1 && row < rows_end && row < 32 * (p - 1) + 32 * (u + 1) / units; row++)
                    softmax_row(&g, row);
            }
        }
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t r = q0 + i;
        float *o = v.out + (r / group) * q_stride + (r % group) * d;
        for (int64_t c = 0; c < d; c++) o[c] = b->o[i * d + c] / b->sum[i];
    }
}

struct matrix_job {
    const struct attention_job *job;
    const int64_t *tasks; /* per task: lane, kv head, first query */
};

static void matrix_task(void *context, int64_t t) {
    const struct matrix_job *mj = context;
    const struct attention_job *job = mj->job;
    int64_t l = mj->tasks[3 * t], kv = mj->tasks[3 * t + 1], q0 = mj->tasks[3 * t + 2];
    int64_t queries = job->rows[l] * (job->heads / job->kv_heads);
    struct matrix_buffers b;
    if (!matrix_buffers_for(job->d, &b)) abort();
    amx_configure_16x64();
    matrix_group(job, l, kv, q0, q0 + MQ < queries ? q0 + MQ : queries, &b);
    _tile_release();
}
#endif

/* Whether a call with matrix_rows > 0 may put lanes of head size d on the tiles here. */
static int matrix_ready(int64_t d) {
#if MATRIX
    return d % 32 == 0 && d <= MAX_D && amx_usable();
#else
    (void)d;
    return 0;
#endif
}

/* Whether prefill chunks can run on the tiles here (a CPU with AMX-BF16, a build for it, and the
 * kernel's permission): what `attention_kernel` names. */
int lane_attention_matrix(void) { return matrix_ready(32); }

/* Rows attended on the tiles since the library was loaded (tests: the path really ran). */
int64_t lane_attention_matrix_rows(void) {
#if MATRIX
    return __atomic_load_n(&matrix_rows_run, __ATOMIC_RELAXED);
#else
    return 0;
#endif
}

/* lane_attention_prefill with a sink logit per query head (`sinks` [heads], float32; NULL: none, the
 * bits of lane_attention_prefill): gpt-oss's attention, every path (vectors, tiles) taking them. */
void lane_attention_sinks(const float *q, float *out, int64_t heads, int64_t kv_heads, int64_t d, int64_t lanes,
                          const int64_t *begin, const int64_t *rows, const int64_t *start, const int64_t *capacity,
                          const int64_t *keys, const int64_t *values, float scale, int64_t window, int threads,
                          int64_t half, const float *new_keys, int64_t k_stride, const float *new_values,
                          int64_t v_stride, int64_t blocked, int64_t matrix_rows, const float *sinks) {
    struct attention_job job = {q, out, heads, kv_heads, d, begin, rows, start, capacity, keys, values, scale,
                                window, half, new_keys, new_values, k_stride, v_stride, blocked,
                                matrix_rows > 0 && matrix_ready(d) ? matrix_rows : 0, sinks};
    pool_for(threads, lanes * kv_heads, attention_task, &job); /* (stores the tile lanes' new rows first) */
#if MATRIX
    if (!job.matrix_rows) return;
    int64_t count = 0, group = heads / kv_heads;
    for (int64_t l = 0; l < lanes; l++)
        if (on_matrix(&job, l)) count += kv_heads * ((rows[l] * group + MQ - 1) / MQ);
    if (!count) return;
    int64_t *tasks = malloc(sizeof(int64_t) * 3 * (size_t)count), t = 0;
    if (!tasks) abort();
    for (int64_t l = 0; l < lanes; l++) {
        if (!on_matrix(&job, l)) continue;
        __atomic_fetch_add(&matrix_rows_run, rows[l], __ATOMIC_RELAXED);
        for (int64_t kv = 0; kv < kv_heads; kv++)
            for (int64_t q0 = 0; q0 < rows[l] * group; q0 += MQ, t++) {
                tasks[3 * t] = l;
                tasks[3 * t + 1] = kv;
                tasks[3 * t + 2] = q0;
            }
    }
    struct matrix_job mj = {&job, tasks};
    pool_for(threads, count, matrix_task, &mj);
    free(tasks);
#endif
}

/* lane_attention, with the lanes of at least `matrix_rows` rows (0: none) on the tiles where they
 * can run (`matrix_ready`), every other lane on the vectors. */
void lane_attention_prefill(const float *q, float *out, int64_t heads, int64_t kv_heads, int64_t d, int64_t lanes,
                            const int64_t *begin, const int64_t *rows, const int64_t *start, const int64_t *capacity,
                            const int64_t *keys, const int64_t *values, float scale, int64_t window, int threads,
                            int64_t half, const float *new_keys, int64_t k_stride, const float *new_values,
                            int64_t v_stride, int64_t blocked, int64_t matrix_rows) {
    lane_attention_sinks(q, out, heads, kv_heads, d, lanes, begin, rows, start, capacity, keys, values, scale, window,
                         threads, half, new_keys, k_stride, new_values, v_stride, blocked, matrix_rows, NULL);
}

void lane_attention(const float *q, float *out, int64_t heads, int64_t kv_heads, int64_t d, int64_t lanes,
                    const int64_t *begin, const int64_t *rows, const int64_t *start, const int64_t *capacity,
                    const int64_t *keys, const int64_t *values, float scale, int64_t window, int threads,
                    int64_t half, const float *new_keys, int64_t k_stride, const float *new_values,
                    int64_t v_stride, int64_t blocked) {
    lane_attention_prefill(q, out, heads, kv_heads, d, lanes, begin, rows, start, capacity, keys, values, scale,
                           window, threads, half, new_keys, k_stride, new_values, v_stride, blocked, 0);
}
