/* Linear layers on a GGUF's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): y = x W^T,
 * exact by construction, reading the weights in the bytes the file holds them.
 *
 * Activations are quantized per row and per block as llama.cpp does: for the K-quants per block of
 * 256 (an int8 q = rint(x * 127 / amax), a float scale dx = amax / 127, and the sums of q per 16,
 * llama.cpp's Q8_K), for the others per block of 32 (the same with the sum per 32, llama.cpp's
 * Q8_0 / Q8_1). q is in [-127, 127].
 *
 * Each output y[r][c] is then, per weight block b in order along K, an integer dot product of the
 * block's weight integers with the row's q (exact in int32 whatever the vector width or order:
 * |pair sums| <= 2 * 63 * 127 < 2^15 in vpmaddubsw, and a block's total < 2^27), combined with
 * the block's float scales by a fixed chain of IEEE operations (no fused multiply-add):
 *
 *   Q4_K, Q5_K  a = dx * d;  acc = acc + a * isum;  m = dx * dmin;  acc = acc - m * msum
 *   Q6_K, Q4_0, Q5_0, Q8_0   a = dx * d;  acc = acc + a * isum     (isum holds the -32 / -8 / -16 offset)
 *   Q4_1, Q5_1  a = dx * d;  acc = acc + a * isum;  m = dx * min;  acc = acc + m * sum(q of the block)
 *
 * where isum = sum_j scale_j * (q_w . q_x over sub-block j) and msum = sum_j min_j * sum_x(j) for the
 * K-quants' 6-bit sub-block scales and mins, and acc starts at 0 (then y = acc, or acc + bias). The
 * chain of output c reads only c's weights and row r's activations, so a row's bits never depend on
 * the other rows of a pass, the thread that ran it, or the path: the AVX2 code computes 8 outputs'
 * chains in the 8 lanes of a vector, lane by lane the same operations as the portable C, whose
 * integers it gives exactly (tests/kernels/test_block_gemm.py compares the two paths bit for bit).
 *
 * Work is split by groups of 8 output channels (one pool task covers several). With AVX2 (and F16C),
 * the K-quants (Q4_K and Q6_K: a Q4_K_M file's linears; Q5_K) run repacked 8 channels to a block, one
 * channel to a 32-bit lane (block_gemm_pack, once at load; see "the K-quants repacked" below): about half the
 * instructions, the activations read once for 8 channels, one sequential stream per group and
 * X8_ROWS rows at a time; on the coder's linears (2 cores, same bits) 1 row 68 -> 46 ms, 4 rows 135 ->
 * 67, 7 rows 179 -> 102. The legacy types (Q4_0 .. Q8_0) run repacked the same way ("the legacy types
 * repacked" below; SmolLM2's Q4_1 file, one row: 66-72 -> 23-25 ms a token). Where the CPU has AVX-512 VNNI
 * or AVX-VNNI, the same kernels add products with vpdpbusd ("with VNNI" below). In a build without those
 * instructions every type stays in the file's layout, through the portable integer loops: within a group each weight block is
 * unpacked once into small integers (u8, 0..63) and used for every row; one row goes channel by
 * channel instead, each channel's row of blocks read in order with a prefetch PREFETCH_BYTES ahead:
 * one sequential stream per thread, which the hardware prefetchers follow (8 rows of a group read
 * block by block are 8 short streams). The activations are quantized row by row on the pool (a
 * prefill chunk's 512 rows).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "layer_kernels.h"
#include "pool.h"

#if defined(BLOCK_GEMM_FORCE_PORTABLE) || !defined(__AVX2__)
#define BG_AVX2 0
#else
#define BG_AVX2 1
#endif
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* ggml's type ids (gguf.constants.GGMLQuantizationType) */
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };
#define GROUP 8   /* output channels a task's chains advance together */
#define QK 256    /* K-quant super-block */
#define Q32 32    /* legacy block */
#define MAX_SUB 16

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) {
                mant <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__) && !defined(BLOCK_GEMM_FORCE_PORTABLE)
    return _cvtsh_ss(h); /* the same exact conversion in one instruction */
#else
    return half_to_float(h);
#endif
}

/* Which block sizes a type has: values per block, bytes per block; 0 for a type not handled here. */
int block_gemm_block(int type, int64_t *values, int64_t *bytes) {
    switch (type) {
    case T_Q4_0: *values = 32, *bytes = 18; return 1;
    case T_Q4_1: *values = 32, *bytes = 20; return 1;
    case T_Q5_0: *values = 32, *bytes = 22; return 1;
    case T_Q5_1: *values = 32, *bytes = 24; return 1;
    case T_Q8_0: *values = 32, *bytes = 34; return 1;
    case T_Q4_K: *values = 256, *bytes = 144; return 1;
    case T_Q5_K: *values = 256, *bytes = 176; return 1;
    case T_Q6_K: *values = 256, *bytes = 210; return 1;
    default: return 0;
    }
}

int block_gemm_avx2(void) { return BG_AVX2; }

static inline int is_k(int type) { return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K; }

/* ---- activations ----------------------------------------------------------------------------- */

/* One row's blocks of `size` values: q = rint(x * (127 / amax)), d = amax / 127 (0 for an all-zero
 * block), and the sums of q per 16 values (sum16). Scalar C on every path: the same bits. */
static void quantize_blocks(const float *x, int64_t k, int64_t size, int8_t *q, float *d, int16_t *sum16) {
    for (int64_t b = 0; b < k / size; b++) {
        const float *v = x + b * size;
        float amax = 0.0f;
        for (int64_t i = 0; i < size; i++) {
            float a = fabsf(v[i]);
            amax = a > amax ? a : amax;
        }
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        for (int64_t i = 0; i < size; i++) {
            float r = rintf(v[i] * id);
            r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
            q[b * size + i] = (int8_t)r;
        }
        for (int64_t s = 0; s < size / 16; s++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) sum += q[b * size + s * 16 + i];
            sum16[b * size / 16 + s] = (int16_t)sum;
        }
    }
}

/* A row's activations in one block size: int8 values [k], scales [k / size], sums per 16 [k / 16]. */
struct acts {
    const int8_t *q;
    const float *d;
    const int16_t *s16;
};

/* ---- unpacking a block of 8 channels ----------------------------------------------------------- */

/* A weight block of GROUP channels unpacked: w[c][i] the unsigned weight integers (u8; for Q8_0 the
 * signed values), sc[c][j] the sub-block scales, mn[c][j] the mins (K-quants), and the float scales. */
struct unpacked {
    uint8_t w[GROUP][QK] __attribute__((aligned(32)));
    int16_t sc[GROUP][MAX_SUB];
    int16_t mn[GROUP][MAX_SUB];
    float d[GROUP], dm[GROUP];
    int subs, sub_len, offset; /* sub-blocks, their length, the constant subtracted from w (0, 8, 16, 32) */
};

static void k4_scale_min(int j, const uint8_t *s, int16_t *sc, int16_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

#if BG_AVX2
/* The weight integers of Q4_0 / Q4_1 with AVX2 (the same bytes unpack_one's loops write): 1 for a
 * type it unpacked, 0 for one left to the loops (the K-quants run repacked, `x8`, or in the loops). */
static int unpack_ints_avx2(int type, const uint8_t *blk, uint8_t *w) {
    switch (type) {
    case T_Q4_0:
    case T_Q4_1: {
        __m128i v = _mm_loadu_si128((const __m128i *)(blk + (type == T_Q4_0 ? 2 : 4)));
        _mm_store_si128((__m128i *)w, _mm_and_si128(v, _mm_set1_epi8(0x0F)));
        _mm_store_si128((__m128i *)(w + 16), _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F)));
        return 1;
    }
    default:
        return 0;
    }
}
#endif

static void unpack_portable(int type, const uint8_t *blk, struct unpacked *u, int c);

static void unpack_one(int type, const uint8_t *blk, struct unpacked *u, int c) {
#if BG_AVX2
    uint8_t *w = u->w[c];
    if (unpack_ints_avx2(type, blk, w)) { /* the scales as the loops set them */
        u->d[c] = f16_at(blk), u->dm[c] = type == T_Q4_1 ? f16_at(blk + 2) : 0.0f;
        return;
    }
#endif
    unpack_portable(type, blk, u, c);
}

/* unpack_one's loops: every type's integers into u->w[c], the K-quants' scales into u->sc / u->mn. */
static void unpack_portable(int type, const uint8_t *blk, struct unpacked *u, int c) {
    uint8_t *w = u->w[c];
    switch (type) {
    case T_Q4_0:
    case T_Q4_1: {
        const uint8_t *qs = blk + (type == T_Q4_0 ? 2 : 4);
        for (int i = 0; i < 16; i++) w[i] = qs[i] & 0xF, w[i + 16] = qs[i] >> 4;
        u->d[c] = f16_at(blk);
        u->dm[c] = type == T_Q4_1 ? f16_at(blk + 2) : 0.0f;
        break;
    }
    case T_Q5_0:
    case T_Q5_1: {
        int base = type == T_Q5_0 ? 2 : 4;
        uint32_t qh;
        memcpy(&qh, blk + base, 4);
        const uint8_t *qs = blk + base + 4;
        for (int i = 0; i < 16; i++) {
            w[i] = (uint8_t)((qs[i] & 0xF) | (((qh >> i) & 1) << 4));
            w[i + 16] = (uint8_t)((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
        }
        u->d[c] = f16_at(blk);
        u->dm[c] = type == T_Q5_1 ? f16_at(blk + 2) : 0.0f;
        break;
    }
    case T_Q8_0:
        memcpy(w, blk + 2, 32);
        u->d[c] = f16_at(blk);
        u->dm[c] = 0.0f;
        break;
    case T_Q4_K:
    case T_Q5_K: {
        const uint8_t *scales = blk + 4, *qh = blk + 16, *qs = blk + (type == T_Q4_K ? 16 : 48);
        for (int t = 0; t < 4; t++) {
            for (int l = 0; l < 32; l++) {
                uint8_t lo = qs[32 * t + l] & 0xF, hi = qs[32 * t + l] >> 4;
                if (type == T_Q5_K) {
                    lo |= ((qh[l] >> (2 * t)) & 1) << 4;
                    hi |= ((qh[l] >> (2 * t + 1)) & 1) << 4;
                }
                w[64 * t + l] = lo, w[64 * t + 32 + l] = hi;
            }
        }
        for (int j = 0; j < 8; j++) k4_scale_min(j, scales, &u->sc[c][j], &u->mn[c][j]);
        u->d[c] = f16_at(blk);
        u->dm[c] = f16_at(blk + 2);
        break;
    }
    case T_Q6_K: {
        const uint8_t *ql = blk, *qh = blk + 128;
        const int8_t *scales = (const int8_t *)(blk + 192);
        for (int h = 0; h < 2; h++) {
            const uint8_t *l8 = ql + 64 * h, *h8 = qh + 32 * h;
            uint8_t *o = w + 128 * h;
            for (int l = 0; l < 32; l++) {
                o[l] = (uint8_t)((l8[l] & 0xF) | ((h8[l] & 3) << 4));
                o[l + 32] = (uint8_t)((l8[l + 32] & 0xF) | (((h8[l] >> 2) & 3) << 4));
                o[l + 64] = (uint8_t)((l8[l] >> 4) | (((h8[l] >> 4) & 3) << 4));
                o[l + 96] = (uint8_t)((l8[l + 32] >> 4) | (((h8[l] >> 6) & 3) << 4));
            }
        }
        for (int j = 0; j < 16; j++) u->sc[c][j] = scales[j];
        u->d[c] = f16_at(blk + 208);
        u->dm[c] = 0.0f;
        break;
    }
    }
}

/* The sub-blocks of a type's block: how many, their length, the constant subtracted from w. */
static void block_shape(int type, struct unpacked *u) {
    u->subs = type == T_Q6_K ? 16 : (type == T_Q4_K || type == T_Q5_K ? 8 : 1);
    u->sub_len = type == T_Q6_K ? 16 : 32;
    u->offset = type == T_Q6_K ? 32 : (type == T_Q4_0 ? 8 : (type == T_Q5_0 ? 16 : 0));
}

static void unpack(int type, const uint8_t *first, int64_t row_bytes, int64_t blk_bytes, int64_t b, int channels,
                   struct unpacked *u) {
    block_shape(type, u);
    for (int c = 0; c < GROUP; c++) {
        if (c < channels) {
            unpack_one(type, first + c * row_bytes + b * blk_bytes, u, c);
        } else { /* a short group's missing channels: zeros, never stored */
            memset(u->w[c], 0, sizeof u->w[c]);
            memset(u->sc[c], 0, sizeof u->sc[c]);
            memset(u->mn[c], 0, sizeof u->mn[c]);
            u->d[c] = u->dm[c] = 0.0f;
        }
    }
}

/* ---- the integers of one block: isum (scales and offset applied) and the second term ----------- */

/* Portable: isum[c] = sum_j sc_j * sum_i (w - offset) q over sub-block j (sc = 1 for legacy types),
 * second[c] = msum (K-quants' mins) or the block's sum of q (Q4_1 / Q5_1). */
static inline void channel_ints_portable(int type, const struct unpacked *u, int c, const int8_t *q,
                                         int32_t *isum, int32_t *second) {
    int32_t total = 0, mins = 0;
    for (int j = 0; j < u->subs; j++) {
        int32_t dot = 0, qsum = 0;
        const uint8_t *w = u->w[c] + j * u->sub_len;
        const int8_t *x = q + j * u->sub_len;
        /* Q8_0's weights read through an int8_t pointer, never as (int8_t) casts of the u8 bytes: GCC
         * 12.2 vectorizes a dot product of cast bytes with AVX-VNNI's vpdpbusd as if they were
         * unsigned (wrong sums for negative weights; seen with -march=native on a Xeon with AVX-512
         * VNNI, checked in a stand-alone program). */
        if (type == T_Q8_0) {
            const int8_t *signed_w = (const int8_t *)w;
            for (int i = 0; i < u->sub_len; i++) dot += signed_w[i] * x[i];
        } else
            for (int i = 0; i < u->sub_len; i++) dot += w[i] * x[i];
        for (int i = 0; i < u->sub_len; i++) qsum += x[i];
        dot -= u->offset * qsum;
        total += (is_k(type) ? u->sc[c][j] : 1) * dot;
        if (type == T_Q4_K || type == T_Q5_K) mins += u->mn[c][j] * qsum;
        else if (type == T_Q4_1 || type == T_Q5_1) mins += qsum;
    }
    *isum = total, *second = mins;
}

static inline void block_ints_portable(int type, const struct unpacked *u, const int8_t *q, const int16_t *s16,
                                       int32_t *isum, int32_t *second) {
    for (int c = 0; c < GROUP; c++) channel_ints_portable(type, u, c, q, isum + c, second + c);
    (void)s16;
}

#if BG_AVX2
/* Lane c: the sum of v[c]'s eight int32 (exact, any order). */
static inline __m256i sums_of_8(const __m256i *v) {
    __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* A legacy block (Q4_0 .. Q8_0, 32 values) of one channel against one row's x: 8 lanes of pair
 * sums (u8 weights, s8 activations: pair sums <= 2 * 63 * 127, never saturating; Q8_0 as
 * |w| * (x sgn w)) whose total is the raw dot product. */
static inline __m256i legacy_lanes(int type, __m256i w, __m256i x) {
    __m256i p = type == T_Q8_0 ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
                               : _mm256_maddubs_epi16(w, x);
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

/* The same integers as block_ints_portable for a legacy type, 8 channels in the 8 lanes of isum /
 * second. */
static void block_ints_avx2(int type, const struct unpacked *u, const int8_t *q, const int16_t *s16,
                            __m256i *isum, __m256i *second) {
    __m256i acc[GROUP], x = _mm256_loadu_si256((const __m256i *)q);
    for (int c = 0; c < GROUP; c++) acc[c] = legacy_lanes(type, _mm256_load_si256((const __m256i *)u->w[c]), x);
    /* one sub-block of 32: the offset and the second term are the block's sum of q, any channel */
    int32_t qsum = s16[0] + s16[1];
    *isum = _mm256_sub_epi32(sums_of_8(acc), _mm256_set1_epi32(u->offset * qsum));
    *second = _mm256_set1_epi32(type == T_Q4_1 || type == T_Q5_1 ? qsum : 0);
}

/* The lanes' sum (exact, any order). */
static inline int32_t sum_lanes(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

/* block_ints_avx2's integers for channel c alone (the one-row path of the legacy types). */
static inline void channel_ints_avx2(int type, const struct unpacked *u, int c, const int8_t *q, const int16_t *s16,
                                     int32_t *isum, int32_t *second) {
    __m256i x = _mm256_loadu_si256((const __m256i *)q), w = _mm256_load_si256((const __m256i *)u->w[c]);
    int32_t qsum = s16[0] + s16[1];
    *isum = sum_lanes(legacy_lanes(type, w, x)) - u->offset * qsum;
    *second = type == T_Q4_1 || type == T_Q5_1 ? qsum : 0;
}

/* 8 outputs' chains (acc, one per lane) advanced by one block of a row (dx its activation scale, d / dm
 * the 8 channels' float scales): lane by lane the portable chain_one. */
static inline __m256 chain_lanes(int type, __m256 d, __m256 dm, float dx, __m256i isum, __m256i second,
                                 __m256 acc) {
    __m256 x = _mm256_set1_ps(dx);
    __m256 a = _mm256_mul_ps(x, d);
    __m256 s = _mm256_add_ps(acc, _mm256_mul_ps(a, _mm256_cvtepi32_ps(isum)));
    if (type == T_Q4_K || type == T_Q5_K || type == T_Q4_1 || type == T_Q5_1) {
        __m256 t = _mm256_mul_ps(_mm256_mul_ps(x, dm), _mm256_cvtepi32_ps(second));
        s = (type == T_Q4_K || type == T_Q5_K) ? _mm256_sub_ps(s, t) : _mm256_add_ps(s, t);
    }
    return s;
}

static inline void chain_avx2(int type, const struct unpacked *u, float dx, __m256i isum, __m256i second,
                              float *acc) {
    _mm256_storeu_ps(acc, chain_lanes(type, _mm256_loadu_ps(u->d), _mm256_loadu_ps(u->dm), dx, isum, second,
                                      _mm256_loadu_ps(acc)));
}
#endif

/* ---- the float chain ------------------------------------------------------------------------------ */

/* One output's chain advanced by one block (d, dm: the block's float scales, dx: the row's
 * activation scale): the same operations, in the same order, on every path (the AVX2 lanes of
 * chain_avx2 are 8 channels' chains). */
static inline float chain_one(int type, float d, float dm, float dx, int32_t isum, int32_t second, float acc) {
    float a = dx * d;
    float s = acc + a * (float)isum;
    if (type == T_Q4_K || type == T_Q5_K) {
        float m = dx * dm;
        s = s - m * (float)second;
    } else if (type == T_Q4_1 || type == T_Q5_1) {
        float m = dx * dm;
        s = s + m * (float)second;
    }
    return s;
}

/* acc[c] advanced by one block of row r, for the group's 8 channels. */
static inline void chain(int type, const struct unpacked *u, float dx, const int32_t *isum, const int32_t *second,
                         float *acc) {
    for (int c = 0; c < GROUP; c++) acc[c] = chain_one(type, u->d[c], u->dm[c], dx, isum[c], second[c], acc[c]);
}

/* ---- the K-quants repacked: 8 channels to a block, one channel to a lane (AVX2) --------------------- */

/* The K-quants (Q4_K and Q6_K, the types of a Q4_K_M file's linears, and Q5_K) are repacked once at
 * load (block_gemm_pack) so
 * that a block of 8 channels holds, in each 32-bit lane of a vector, 4 weights of one channel: 2 of
 * sub-block j and 2 of sub-block j + 1 (j even). vpmaddubsw against 4 activations broadcast to every
 * lane then leaves each channel's sub-block j and j + 1 partial sums side by side in its lane, and one
 * vpmaddwd against the lane's two scales adds them scaled: the channels' integers come out in the 8
 * lanes directly (no horizontal sums, no per-channel scale shuffles), the activations are read once
 * for 8 channels and the float chains advance 8 channels at a time. Roughly half the instructions of
 * a block read in the file's layout, and one sequential stream per group.
 *
 * The integers are the same: isum = sum_j sc_j * (w . q over sub-block j) and msum = sum_j mn_j *
 * sum(q over j), summed in int16 only where they cannot overflow (Q4_K: 8 pair sums of |15 * 127 * 2|
 * <= 30480; Q5_K: 4 of 31 * 127 * 2; Q6_K: 2 of |63 * 127 * 2| <= 32004) and in int32 after, and each lane's chain is
 * chain_one's. So the outputs are the bits of the file's layout on any path (tested against the
 * portable build).
 *
 * Q4_K x8 (1184 bytes = 8 * 144 + 32): d[8], dmin[8] (float16); sc[4 pairs][8 channels][2], mn[same]
 * (u8, the 6-bit scales and mins of sub-blocks 2p, 2p + 1); qs[4 pairs][8 vectors][8 channels][4
 * bytes]: byte i of a channel's lane in vector v holds group v in its low nibble and group v + 8 in its
 * high one, where group t, byte i is value 2t + (i & 1) of sub-block 2p + (i >> 1).
 * Q5_K x8 (1440 bytes = 8 * 176 + 32): Q4_K x8 of the low 4 bits, then qh[4 pairs][2 halves][8][4]:
 * bit v of a byte, the fifth bit of the same byte of group v + 8 * half.
 * Q6_K x8 (1680 bytes = 8 * 210): d[8] (float16); sc[8 pairs][8][2] (int8); ql[8 pairs][4 vectors][8][4]
 * (low 4 bits: groups v and v + 4 in the low and high nibble, groups of sub-blocks of 16 as above);
 * qh[8 pairs][2 vectors][8][4] (the top 2 bits: group 4h + u at bits 2u, 2u + 1 of vector h).
 *
 * With VNNI (AVX-512 VNNI on 256-bit vectors, or AVX-VNNI: a build for a CPU that has it), vpdpbusd adds a
 * lane's 4 products u8 x s8 into its int32 in one instruction (vpmaddubsw, then an add, without it), but
 * all 4 must share a scale: the K-quants' groups hold 4 values of one sub-block instead (group t of pair
 * p: values 4t' + i of sub-block 2p + t / (sub / 4), t' = t mod sub / 4; the same bytes, scales and
 * mins otherwise, so the low nibbles of a Q4_K pair are sub-block 2p and the high ones 2p + 1), the
 * activations are read in their own order, and each sub-block's int32 sums are multiplied by its scale
 * (vpmulld) and added. The legacy types' lanes already hold 4 values of one block. The integers are
 * the same sums of the same products, so the outputs are the same bits as without VNNI and as the
 * portable C (a test builds the library without VNNI and compares; the repacked order is the
 * library's own: each library repacks the weights it multiplies). */
#define X8 100 /* a repacked type's id: its ggml id + X8 */
enum { T_Q4_K_X8 = T_Q4_K + X8, T_Q5_K_X8 = T_Q5_K + X8, T_Q6_K_X8 = T_Q6_K + X8 };
#define Q4X8_BYTES 1184
#define Q5X8_BYTES 1440
#define Q6X8_BYTES 1680
#ifndef X8_ROWS
#define X8_ROWS 6 /* rows advanced together: their int16 and int32 sums stay (mostly) in registers */
#endif
#if BG_AVX2 && defined(__F16C__)
#define BG_X8 1
#else
#define BG_X8 0
#endif
/* vpdpbusd (AVX-512 VNNI on 256-bit vectors, or AVX-VNNI): see "with VNNI" below. */
#if BG_X8 && !defined(BLOCK_GEMM_NO_VNNI) && \
    ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
#define BG_VNNI 1
#else
#define BG_VNNI 0
#endif
/* 1 where a VNNI row's sums run in two chains (vpdpbusd's latency, with few rows in flight), else 0. */
#define VNNI_SPLIT(n) (BG_VNNI && (n) <= 3 ? 1 : 0)

static inline int is_legacy(int type) {
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1 || type == T_Q8_0;
}

/* The type a repacked id repacks (a file type: itself). */
static inline int x8_base(int type) { return type > X8 ? type - X8 : type; }

static inline int is_x8(int type) { return type > X8 && (is_k(type - X8) || is_legacy(type - X8)); }

/* Bytes of a repacked block of 8 channels (a repacked type or the type it repacks): 8 file blocks' bytes,
 * plus 32 for Q4_K / Q5_K (their 6-bit scales and mins as bytes). */
static inline int64_t x8_bytes(int type) {
    int64_t values = 1, bytes = 1;
    type = x8_base(type);
    block_gemm_block(type, &values, &bytes);
    return type == T_Q4_K ? Q4X8_BYTES : type == T_Q5_K ? Q5X8_BYTES : 8 * bytes;
}

/* Values along K of one block of a repacked (or file) type: 256 for the K-quants, 32 for the others. */
static inline int64_t x8_values(int type) { return is_k(x8_base(type)) ? QK : Q32; }

/* The repacked id of a type this build runs repacked (0: it runs in the file's layout). */
int block_gemm_packed_type(int type) {
    return BG_X8 && (is_k(type) || is_legacy(type)) ? type + X8 : 0;
}

/* Bytes of the repacked form of an [n, k] weight of `type` (0 where block_gemm_packed_type is 0 or k
 * is not a whole number of blocks): ceil(n / 8) groups of k / values blocks, a short group zero-padded. */
int64_t block_gemm_packed_bytes(int type, int64_t n, int64_t k) {
    if (!block_gemm_packed_type(type) || k % x8_values(type)) return 0;
    return (n + GROUP - 1) / GROUP * (k / x8_values(type)) * x8_bytes(type);
}

/* Weight integer of channel c, pair p (sub-blocks of `sub` values), group t, byte i (see above; with
 * VNNI, group t of a pair is values 4t' + i of one sub-block, t' = t mod sub / 4: "with VNNI" below). */
static inline uint8_t x8_weight(const struct unpacked *u, int c, int sub, int p, int t, int i) {
    if (BG_VNNI) return u->w[c][sub * (2 * p + t / (sub / 4)) + 4 * (t % (sub / 4)) + i];
    return u->w[c][sub * (2 * p + (i >> 1)) + 2 * t + (i & 1)];
}

int block_gemm_vnni(void) { return BG_VNNI; }

/* A legacy block of 8 channels (see "the legacy types repacked" below). */
static void pack_legacy_block(int type, const struct unpacked *u, const uint8_t *const *src, int channels,
                              uint8_t *dst) {
    int with_min = type == T_Q4_1 || type == T_Q5_1, five = type == T_Q5_0 || type == T_Q5_1;
    for (int c = 0; c < channels; c++) { /* the float16 scales' (and mins') bytes as the file has them */
        memcpy(dst + 2 * c, src[c], 2);
        if (with_min) memcpy(dst + 16 + 2 * c, src[c] + 2, 2);
    }
    uint8_t *qs = dst + (with_min ? 32 : 16);
    for (int c = 0; c < GROUP; c++)
        for (int i = 0; i < 4; i++) {
            const uint8_t *w = u->w[c];
            if (type == T_Q8_0) {
                for (int t = 0; t < 8; t++) qs[32 * t + 4 * c + i] = w[4 * t + i];
                continue;
            }
            for (int v = 0; v < 4; v++) qs[32 * v + 4 * c + i] = (uint8_t)((w[4 * v + i] & 0xF) | (w[16 + 4 * v + i] & 0xF) << 4);
            if (five) {
                uint8_t bits = 0;
                for (int t = 0; t < 8; t++) bits |= (uint8_t)(((w[4 * t + i] >> 4) & 1) << t);
                qs[128 + 4 * c + i] = bits;
            }
        }
}

static void pack_group_block(int type, const uint8_t *const *src, int channels, uint8_t *dst) {
    struct unpacked u;
    memset(&u, 0, sizeof u);
    for (int c = 0; c < channels; c++) unpack_portable(type, src[c], &u, c);
    if (is_legacy(type)) {
        pack_legacy_block(type, &u, src, channels, dst);
        return;
    }
    int q4 = type == T_Q4_K || type == T_Q5_K; /* Q5_K: Q4_K's layout, plus its fifth bits after it */
    for (int c = 0; c < channels; c++) /* the float16 scales' bytes as the file has them */
        memcpy(dst + 2 * c, src[c] + (q4 ? 0 : 208), 2), q4 ? (void)memcpy(dst + 16 + 2 * c, src[c] + 2, 2) : (void)0;
    uint8_t *scales = dst + (q4 ? 32 : 16), *qs = dst + (q4 ? 160 : 144);
    int pairs = q4 ? 4 : 8, sub = q4 ? 32 : 16;
    for (int p = 0; p < pairs; p++)
        for (int c = 0; c < GROUP; c++)
            for (int h = 0; h < 2; h++) {
                scales[16 * p + 2 * c + h] = (uint8_t)u.sc[c][2 * p + h];
                if (q4) dst[96 + 16 * p + 2 * c + h] = (uint8_t)u.mn[c][2 * p + h];
            }
    for (int p = 0; p < pairs; p++)
        for (int c = 0; c < GROUP; c++)
            for (int i = 0; i < 4; i++) {
                if (q4) {
                    for (int v = 0; v < 8; v++)
                        qs[256 * p + 32 * v + 4 * c + i] = (uint8_t)((x8_weight(&u, c, sub, p, v, i) & 0xF) |
                                                                     (x8_weight(&u, c, sub, p, v + 8, i) & 0xF) << 4);
                    for (int h = 0; h < 2 && type == T_Q5_K; h++) {
                        uint8_t fifth = 0;
                        for (int v = 0; v < 8; v++) fifth |= (uint8_t)((x8_weight(&u, c, sub, p, v + 8 * h, i) >> 4) << v);
                        dst[Q4X8_BYTES + 64 * p + 32 * h + 4 * c + i] = fifth;
                    }
                    continue;
                }
                for (int v = 0; v < 4; v++)
                    qs[128 * p + 32 * v + 4 * c + i] = (uint8_t)((x8_weight(&u, c, sub, p, v, i) & 0xF) |
                                                                 (x8_weight(&u, c, sub, p, v + 4, i) & 0xF) << 4);
                for (int h = 0; h < 2; h++) {
                    uint8_t top = 0;
                    for (int t = 0; t < 4; t++) top |= (uint8_t)((x8_weight(&u, c, sub, p, 4 * h + t, i) >> 4) << (2 * t));
                    dst[1168 + 64 * p + 32 * h + 4 * c + i] = top;
                }
            }
}

struct pack_job {
    int type;
    const uint8_t *src;
    int64_t n, nb, row_bytes, bytes, packed;
    uint8_t *dst;
};

static void pack_task(void *context, int64_t g) {
    const struct pack_job *job = context;
    int channels = (int)(job->n - g * GROUP < GROUP ? job->n - g * GROUP : GROUP);
    for (int64_t b = 0; b < job->nb; b++) {
        const uint8_t *blocks[GROUP];
        for (int c = 0; c < channels; c++) blocks[c] = job->src + (g * GROUP + c) * job->row_bytes + b * job->bytes;
        uint8_t *out = job->dst + (g * job->nb + b) * job->packed;
        memset(out, 0, (size_t)job->packed);
        pack_group_block(job->type, blocks, channels, out);
    }
}

/* Repack an [n, k] weight of `type` (rows of the file's blocks) into dst (block_gemm_packed_bytes
 * of it), a group of 8 channels per pool task. 0, or -1 for a type or shape it does not repack. */
int block_gemm_pack(int type, const uint8_t *src, int64_t n, int64_t k, uint8_t *dst, int threads) {
    int64_t values = 1, bytes = 1;
    if (!block_gemm_packed_bytes(type, n, k) || !block_gemm_block(type, &values, &bytes)) return -1;
    struct pack_job job = {type, src, n, k / values, k / values * bytes, bytes, x8_bytes(type), dst};
    pool_for(threads, (n + GROUP - 1) / GROUP, pack_task, &job);
    return 0;
}

/* A row's activations as the repacked lanes read them: q in group order (per pair of sub-blocks of
 * `sub` values, group t = values 2t, 2t + 1 of the first, then of the second) and each pair's two
 * sums of q as one int32 (low half: the first sub-block), for vpmaddwd with the mins / scales. */
struct x8acts {
    const int8_t *q;
    const int32_t *pairs;
    const float *d;
};

static void x8_order(const int8_t *q, const int16_t *s16, int64_t k, int sub, int8_t *out, int32_t *pairs) {
    for (int64_t base = 0; base < k; base += 2 * sub) {
        for (int t = 0; t < sub / 2 && !BG_VNNI; t++) /* (VNNI reads q in its own order: out unused) */
            for (int i = 0; i < 4; i++) out[base + 4 * t + i] = q[base + sub * (i >> 1) + 2 * t + (i & 1)];
        int16_t sums[2];
        for (int h = 0; h < 2; h++) {
            const int16_t *s = s16 + (base + sub * h) / 16;
            sums[h] = (int16_t)(sub == 32 ? s[0] + s[1] : s[0]);
        }
        *pairs++ = (int32_t)((uint32_t)(uint16_t)sums[0] | (uint32_t)(uint16_t)sums[1] << 16);
    }
}

#if BG_X8
static inline __m256i broadcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* The fifth bit of weight vector v (0..7) of a Q5_K half (bit v of each byte of `bits`) at bit 4. */
static inline __m256i q5_fifth(__m256i bits, int v) {
    __m256i moved = v <= 4 ? _mm256_slli_epi16(bits, 4 - v) : _mm256_srli_epi16(bits, v - 4);
    return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
}

/* With VNNI: acc + the sums of each lane's 4 products u8 x s8 (vpdpbusd: exact in int32, no saturation
 * step); without it, acc + vpmaddubsw's pair sums in int16 (the callers keep them below 2^15). */
static inline __m256i add_products(__m256i acc, __m256i u, __m256i s) {
#if BG_VNNI && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif BG_VNNI
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s));
#endif
}

/* A pair's sub-block scale (int16 pairs per lane, the first sub-block low) for sub-block `half`, as
 * int32 lanes (VNNI's per-sub-block sums are scaled with vpmulld). */
static inline __m256i half_scale(__m256i pairs16, int half, int is_signed) {
    if (half) return is_signed ? _mm256_srai_epi32(pairs16, 16) : _mm256_srli_epi32(pairs16, 16);
    return is_signed ? _mm256_srai_epi32(_mm256_slli_epi32(pairs16, 16), 16)
                     : _mm256_and_si256(pairs16, _mm256_set1_epi32(0xFFFF));
}

/* n (<= X8_ROWS) rows of a repacked Q4_K (Q5_K when `five`) group over its nb blocks: y[r], the 8
 * channels' outputs. Q5_K's pair sums reach 2 * 31 * 127: four of them per int16 before vpmaddwd. */
static inline __attribute__((always_inline)) void q45x8_rows(const int n, const int five, const uint8_t *group,
                                                             int64_t nb, const struct x8acts *a, __m256 *y) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int r = 0; r < n; r++) y[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = group + b * (five ? Q5X8_BYTES : Q4X8_BYTES);
        __m256i isum[X8_ROWS], msum[X8_ROWS];
        for (int r = 0; r < n; r++) isum[r] = msum[r] = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            const uint8_t *qs = blk + 160 + 256 * p;
            __m256i scales = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * p)));
            for (int half = 0; half < 2; half++) { /* groups 0..7 (low nibbles), then 8..15 */
                __m256i part[2][X8_ROWS], fifths = five ? _mm256_loadu_si256((const __m256i *)(blk + Q4X8_BYTES +
                                                                                               64 * p + 32 * half))
                                                        : _mm256_setzero_si256();
                for (int r = 0; r < n; r++) part[0][r] = part[1][r] = _mm256_setzero_si256();
                for (int v = 0; v < 8; v++) {
                    __m256i packed = _mm256_loadu_si256((const __m256i *)(qs + 32 * v));
                    __m256i w = _mm256_and_si256(half ? _mm256_srli_epi16(packed, 4) : packed, low4);
                    if (five) w = _mm256_or_si256(w, q5_fifth(fifths, v));
                    for (int r = 0; r < n; r++) /* (VNNI: a row's sums in two chains when few rows run) */
                        part[v & VNNI_SPLIT(n)][r] = add_products(part[v & VNNI_SPLIT(n)][r], w,
                                                                  broadcast4(a[r].q + b * QK + 64 * p + 32 * half + 4 * v));
                    if (!BG_VNNI && five && v == 3)
                        for (int r = 0; r < n; r++) {
                            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(part[0][r], scales));
                            part[0][r] = _mm256_setzero_si256();
                        }
                }
                if (BG_VNNI) { /* one sub-block's sums: times its scale */
                    __m256i scale = half_scale(scales, half, 0);
                    for (int r = 0; r < n; r++)
                        isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(
                                                       VNNI_SPLIT(n) ? _mm256_add_epi32(part[0][r], part[1][r]) : part[0][r], scale));
                } else {
                    for (int r = 0; r < n; r++) isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(part[0][r], scales));
                }
            }
            __m256i mins = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 96 + 16 * p)));
            for (int r = 0; r < n; r++)
                msum[r] = _mm256_add_epi32(msum[r], _mm256_madd_epi16(mins, _mm256_set1_epi32(a[r].pairs[4 * b + p])));
        }
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        for (int r = 0; r < n; r++) /* Q5_K's chain is Q4_K's */
            y[r] = chain_lanes(T_Q4_K, d, dm, a[r].d[b], isum[r], msum[r], y[r]);
    }
}

/* The top two bits of group 4h + t (h the vector) moved to bits 4, 5 of each byte. */
static inline __m256i q6_top(__m256i h, int t) {
    const __m256i bits45 = _mm256_set1_epi8(0x30);
    __m256i moved = t == 0 ? _mm256_slli_epi16(h, 4) : t == 1 ? _mm256_slli_epi16(h, 2) : t == 2 ? h
                                                                                                : _mm256_srli_epi16(h, 2);
    return _mm256_and_si256(moved, bits45);
}

/* n (<= X8_ROWS) rows of a repacked Q6_K group over its nb blocks. */
static inline __attribute__((always_inline)) void q6x8_rows(const int n, const uint8_t *group, int64_t nb,
                                                            const struct x8acts *a, __m256 *y) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    for (int r = 0; r < n; r++) y[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = group + b * Q6X8_BYTES;
        __m256i isum[X8_ROWS], offset[X8_ROWS];
        for (int r = 0; r < n; r++) isum[r] = offset[r] = zero;
        for (int p = 0; p < 8; p++) {
            const uint8_t *ql = blk + 144 + 128 * p, *qh = blk + 1168 + 64 * p;
            const int8_t *q[X8_ROWS];
            for (int r = 0; r < n; r++) q[r] = a[r].q + b * QK + 32 * p;
            __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 16 + 16 * p)));
            for (int half = 0; half < 2; half++) { /* groups 0..3 (low nibbles, qh vector 0), then 4..7 */
                __m256i top = _mm256_loadu_si256((const __m256i *)(qh + 32 * half)), w[4];
                for (int t = 0; t < 4; t++) {
                    __m256i packed = _mm256_loadu_si256((const __m256i *)(ql + 32 * t));
                    w[t] = _mm256_or_si256(_mm256_and_si256(half ? _mm256_srli_epi16(packed, 4) : packed, low4),
                                           q6_top(top, t));
                }
                if (BG_VNNI) { /* sub-block 2p + half: its sums times its scale */
                    __m256i scale = half_scale(scales, half, 1);
                    for (int r = 0; r < n; r++) {
                        const int8_t *x = q[r] + 16 * half;
                        __m256i even = add_products(zero, w[0], broadcast4(x)), odd = add_products(zero, w[1], broadcast4(x + 4));
                        even = add_products(even, w[2], broadcast4(x + 8)), odd = add_products(odd, w[3], broadcast4(x + 12));
                        isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(_mm256_add_epi32(even, odd), scale));
                    }
                    continue;
                }
                for (int r = 0; r < n; r++) /* two groups' pair sums per int16 (<= 32004) */
                    for (int t = 0; t < 4; t += 2) {
                        const int8_t *x = q[r] + 16 * half + 4 * t;
                        __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(w[t], broadcast4(x)),
                                                        _mm256_maddubs_epi16(w[t + 1], broadcast4(x + 4)));
                        isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(pair, scales));
                    }
            }
            for (int r = 0; r < n; r++) /* 32 * sum_j sc_j * (sum of q over sub-block j), taken off below */
                offset[r] = _mm256_add_epi32(offset[r], _mm256_madd_epi16(scales, _mm256_set1_epi32(a[r].pairs[8 * b + p])));
        }
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        for (int r = 0; r < n; r++)
            y[r] = chain_lanes(T_Q6_K, d, d, a[r].d[b], _mm256_sub_epi32(isum[r], _mm256_slli_epi32(offset[r], 5)), zero,
                               y[r]);
    }
}

/* ---- the legacy types repacked: 8 channels to a block of 32 values, one channel to a lane (AVX2) ------ */

/* Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 are repacked at load as the K-quants are: a block of 8 channels holds,
 * in each 32-bit lane of weight vector t (0..7), values 4t .. 4t + 3 of one channel. vpmaddubsw against a
 * row's 4 activations 4t .. 4t + 3 broadcast to every lane leaves each channel's partial dot product in its
 * lane (the activations in their own order, read once for 8 channels), and the float chains advance 8
 * channels at a time: a one-row decode step reads one sequential stream per group instead of unpacking
 * one channel's 32-value block at a time (SmolLM2's Q4_1 file: ~3x). The integers are the file layout's:
 * isum = w . q - offset * sum(q) (pair sums added in int16 only where they cannot overflow: Q4 8 of
 * 2 * 15 * 127 <= 30480, Q5 4 of 2 * 31 * 127, Q8_0 one of 2 * 128 * 127 as |w| * (q sgn w)), second =
 * sum(q) for Q4_1 / Q5_1, and each lane's chain is chain_one's.
 *
 * A block of 8 channels is 8 file blocks' bytes: d[8] (float16), for Q4_1 / Q5_1 m[8] (float16), then for
 * Q4 / Q5 qs[4 vectors][8 channels][4 bytes], byte i of a channel's lane in vector v holding value 4v + i
 * in its low nibble and value 16 + 4v + i in its high one, and for Q5 qh[8][4], bit t of byte i the fifth
 * bit of value 4t + i; for Q8_0 qs[8 vectors][8][4], value 4t + i as int8. */
static inline __attribute__((always_inline)) void legacy_x8_rows(const int n, const int type, const uint8_t *group,
                                                                 int64_t nb, const struct acts *a, __m256 *y) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), zero = _mm256_setzero_si256();
    const int with_min = type == T_Q4_1 || type == T_Q5_1, five = type == T_Q5_0 || type == T_Q5_1;
    const int offset = type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : 0;
    const int64_t bytes = x8_bytes(type);
    for (int r = 0; r < n; r++) y[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = group + b * bytes, *qs = blk + (with_min ? 32 : 16);
        __m256i isum[X8_ROWS], part[X8_ROWS];
        for (int r = 0; r < n; r++) isum[r] = part[r] = zero;
        if (type == T_Q8_0) {
            for (int t = 0; t < 8; t++) {
                __m256i w = _mm256_loadu_si256((const __m256i *)(qs + 32 * t)), size = _mm256_sign_epi8(w, w);
                for (int r = 0; r < n; r++) {
                    __m256i x = _mm256_sign_epi8(broadcast4(a[r].q + b * Q32 + 4 * t), w);
                    isum[r] = BG_VNNI ? add_products(isum[r], size, x)
                                      : _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(size, x), ones));
                }
            }
        } else {
            __m256i fifths = five ? _mm256_loadu_si256((const __m256i *)(qs + 128)) : zero;
            for (int t = 0; t < 8; t++) {
                __m256i packed = _mm256_loadu_si256((const __m256i *)(qs + 32 * (t & 3)));
                __m256i w = _mm256_and_si256(t < 4 ? packed : _mm256_srli_epi16(packed, 4), low4);
                if (five) w = _mm256_or_si256(w, q5_fifth(fifths, t));
                for (int r = 0; r < n; r++) /* (VNNI: int32 sums) */
                    part[r] = add_products(part[r], w, broadcast4(a[r].q + b * Q32 + 4 * t));
                if (!BG_VNNI && five && t == 3)
                    for (int r = 0; r < n; r++) {
                        isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(part[r], ones));
                        part[r] = zero;
                    }
            }
            for (int r = 0; r < n; r++) isum[r] = BG_VNNI ? part[r] : _mm256_add_epi32(isum[r], _mm256_madd_epi16(part[r], ones));
        }
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256 dm = with_min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))) : d;
        for (int r = 0; r < n; r++) {
            int32_t qsum = a[r].s16[2 * b] + a[r].s16[2 * b + 1];
            __m256i ints = _mm256_sub_epi32(isum[r], _mm256_set1_epi32(offset * qsum));
            y[r] = chain_lanes(type, d, dm, a[r].d[b], ints, _mm256_set1_epi32(with_min ? qsum : 0), y[r]);
        }
    }
}
#endif

/* ---- one call: several weight segments side by side, every row ------------------------------------ */

struct job {
    int64_t m, k;
    const struct acts *a32, *a256; /* per row */
    const struct x8acts *x4, *x6;  /* per row, in the repacked Q4_K / Q6_K order (NULL where none runs) */
    int nseg;
    const uint8_t *const *data;
    const int *types;
    const int64_t *ns, *starts; /* each segment's channels and first output column */
    const float *bias;
    float *out;
    int64_t ldo, groups_per_task, total_groups;
    const int64_t *group_start; /* first global group of each segment */
};

/* How far ahead of the block being read the one-row path asks for weights (bytes). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 256
#endif

#if BG_X8
/* n rows (1 .. X8_ROWS) of a repacked group, n a constant in each case so the row loops unroll. */
#define X8_ROWS_SWITCH(n, CALL)                                                                               \
    switch (n) {                                                                                              \
    case 1: CALL(1); break;                                                                                   \
    case 2: CALL(2); break;                                                                                   \
    case 3: CALL(3); break;                                                                                   \
    case 4: CALL(4 < X8_ROWS ? 4 : X8_ROWS); break;                                                           \
    case 5: CALL(5 < X8_ROWS ? 5 : X8_ROWS); break;                                                           \
    case 6: CALL(6 < X8_ROWS ? 6 : X8_ROWS); break;                                                           \
    case 7: CALL(7 < X8_ROWS ? 7 : X8_ROWS); break;                                                           \
    default: CALL(X8_ROWS);                                                                                   \
    }

static void x8_rows(int type, int n, const uint8_t *group, int64_t nb, const struct x8acts *a, __m256 *y) {
#define K_ROWS(N)                                                                                             \
    (type == T_Q4_K_X8 ? q45x8_rows(N, 0, group, nb, a, y)                                                    \
                       : type == T_Q5_K_X8 ? q45x8_rows(N, 1, group, nb, a, y) : q6x8_rows(N, group, nb, a, y))
    X8_ROWS_SWITCH(n, K_ROWS)
#undef K_ROWS
}

static void legacy_rows(int type, int n, const uint8_t *group, int64_t nb, const struct acts *a, __m256 *y) {
#define LEGACY_ROWS(N)                                                                                        \
    (type == T_Q4_0 ? legacy_x8_rows(N, T_Q4_0, group, nb, a, y)                                              \
     : type == T_Q4_1 ? legacy_x8_rows(N, T_Q4_1, group, nb, a, y)                                            \
     : type == T_Q5_0 ? legacy_x8_rows(N, T_Q5_0, group, nb, a, y)                                            \
     : type == T_Q5_1 ? legacy_x8_rows(N, T_Q5_1, group, nb, a, y) : legacy_x8_rows(N, T_Q8_0, group, nb, a, y))
    X8_ROWS_SWITCH(n, LEGACY_ROWS)
#undef LEGACY_ROWS
}

/* Group g of a repacked segment, every row, X8_ROWS at a time (each group's blocks are one stream). */
static void x8_group(const struct job *job, int seg, int64_t g) {
    int type = job->types[seg], base = x8_base(type);
    int64_t nb = job->k / x8_values(type), first = g * GROUP, col = job->starts[seg] + first;
    int channels = (int)(job->ns[seg] - first < GROUP ? job->ns[seg] - first : GROUP);
    const uint8_t *group = job->data[seg] + g * nb * x8_bytes(type);
    const struct x8acts *a = type == T_Q6_K_X8 ? job->x6 : job->x4; /* Q4_K, Q5_K: sub-blocks of 32 */
    for (int64_t r0 = 0; r0 < job->m; r0 += X8_ROWS) {
        int n = job->m - r0 < X8_ROWS ? (int)(job->m - r0) : X8_ROWS;
        __m256 y[X8_ROWS];
        float lanes[GROUP];
        if (is_legacy(base)) legacy_rows(base, n, group, nb, job->a32 + r0, y);
        else x8_rows(type, n, group, nb, a + r0, y);
        for (int r = 0; r < n; r++) {
            float *out = job->out + (r0 + r) * job->ldo + col;
            if (channels == GROUP) { /* (a whole group: one store, not a copy through `lanes`) */
                _mm256_storeu_ps(out, job->bias ? _mm256_add_ps(y[r], _mm256_loadu_ps(job->bias + col)) : y[r]);
                continue;
            }
            _mm256_storeu_ps(lanes, y[r]);
            for (int c = 0; c < channels; c++) out[c] = job->bias ? lanes[c] + job->bias[col + c] : lanes[c];
        }
    }
}
#endif

static void run_group(const struct job *job, int seg, int64_t g, float *acc, struct unpacked *u) {
    int type = job->types[seg];
#if BG_X8
    if (is_x8(type)) {
        x8_group(job, seg, g);
        return;
    }
#endif
    int64_t values = 1, bytes = 1;
    block_gemm_block(type, &values, &bytes);
    int64_t nb = job->k / values, row_bytes = nb * bytes, first = g * GROUP;
    int channels = (int)(job->ns[seg] - first < GROUP ? job->ns[seg] - first : GROUP);
    const uint8_t *w = job->data[seg] + first * row_bytes;
    const struct acts *a = is_k(type) ? job->a256 : job->a32;
    if (job->m == 1) { /* one row: channel after channel, each row of blocks read in order */
        int64_t col = job->starts[seg] + first;
        block_shape(type, u);
        for (int c = 0; c < channels; c++) {
            const uint8_t *row = w + c * row_bytes;
            float y = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = row + b * bytes;
                int32_t isum, second;
#if BG_AVX2
                _mm_prefetch((const char *)blk + PREFETCH_BYTES, _MM_HINT_T0);
#endif
                unpack_one(type, blk, u, 0);
#if BG_AVX2
                if (!is_k(type))
                    channel_ints_avx2(type, u, 0, a[0].q + b * values, a[0].s16 + b * values / 16, &isum, &second);
                else
#endif
                    channel_ints_portable(type, u, 0, a[0].q + b * values, &isum, &second);
                y = chain_one(type, u->d[0], u->dm[0], a[0].d[b], isum, second, y);
            }
            job->out[col + c] = job->bias ? y + job->bias[col + c] : y;
        }
        return;
    }
    memset(acc, 0, sizeof(float) * GROUP * job->m);
#if BG_AVX2
    /* The group's rows are one run of memory, read block by block across its 8 rows: ask for the
     * next group's run now (a decode step streams every weight from DRAM once). */
    if (first + GROUP < job->ns[seg]) {
        const char *next = (const char *)(w + GROUP * row_bytes);
        int64_t next_rows = job->ns[seg] - first - GROUP < GROUP ? job->ns[seg] - first - GROUP : GROUP;
        for (int64_t off = 0; off < next_rows * row_bytes; off += 64) _mm_prefetch(next + off, _MM_HINT_T1);
    }
#endif
    for (int64_t b = 0; b < nb; b++) {
        unpack(type, w, row_bytes, bytes, b, channels, u);
        for (int64_t r = 0; r < job->m; r++) {
            const int8_t *q = a[r].q + b * values;
            const int16_t *s16 = a[r].s16 + b * values / 16;
#if BG_AVX2
            if (!is_k(type)) {
                __m256i isum, second;
                block_ints_avx2(type, u, q, s16, &isum, &second);
                chain_avx2(type, u, a[r].d[b], isum, second, acc + r * GROUP);
                continue;
            }
#endif
            int32_t isum[GROUP], second[GROUP];
            block_ints_portable(type, u, q, s16, isum, second);
            chain(type, u, a[r].d[b], isum, second, acc + r * GROUP);
        }
    }
    int64_t col = job->starts[seg] + first;
    for (int64_t r = 0; r < job->m; r++) {
        for (int c = 0; c < channels; c++) {
            float y = acc[r * GROUP + c];
            job->out[r * job->ldo + col + c] = job->bias ? y + job->bias[col + c] : y;
        }
    }
}

static void run_task(void *context, int64_t t) {
    const struct job *job = context;
    struct unpacked *u = aligned_alloc(32, (sizeof(struct unpacked) + 31) / 32 * 32);
    float *acc = malloc(sizeof(float) * GROUP * (size_t)job->m);
    if (!u || !acc) abort();
    for (int64_t g = t * job->groups_per_task; g < (t + 1) * job->groups_per_task && g < job->total_groups; g++) {
        int seg = 0;
        while (seg + 1 < job->nseg && g >= job->group_start[seg + 1]) seg++;
        run_group(job, seg, g - job->group_start[seg], acc, u);
    }
    free(u);
    free(acc);
}

/* y [m][ldo] = x [m][k] (row stride ldx) times the weights of `nseg` segments (each ns[s] channels of
 * ggml type types[s], rows of k values, data[s] their blocks), side by side in y's columns, plus
 * bias (or NULL). Returns 0, or -1 for a type or shape not handled (k not a whole number of blocks),
 * -2 without memory. Compiled with BLOCK_GEMM_FORCE_PORTABLE, the portable integers and chains run
 * (the tests build that library too and compare the two bit for bit). */
/* Row r's activations in every form the call's segments read, one pool task per row. */
struct quantize_job {
    const float *x;
    int64_t k, ldx, m;
    int need32, need256, need_x4, need_x6;
    const struct acts *a;
    const struct x8acts *xa;
};

static void quantize_task(void *context, int64_t r) {
    const struct quantize_job *job = context;
    const struct acts *a32 = &job->a[r], *a256 = &job->a[job->m + r];
    if (job->need32) quantize_blocks(job->x + r * job->ldx, job->k, 32, (int8_t *)a32->q, (float *)a32->d, (int16_t *)a32->s16);
    if (!job->need256) return;
    quantize_blocks(job->x + r * job->ldx, job->k, 256, (int8_t *)a256->q, (float *)a256->d, (int16_t *)a256->s16);
    if (job->need_x4) x8_order(a256->q, a256->s16, job->k, 32, (int8_t *)job->xa[r].q, (int32_t *)job->xa[r].pairs);
    if (job->need_x6)
        x8_order(a256->q, a256->s16, job->k, 16, (int8_t *)job->xa[job->m + r].q, (int32_t *)job->xa[job->m + r].pairs);
}

int block_linear(const float *x, int64_t m, int64_t k, int64_t ldx, int nseg, const uint8_t *const *data,
                 const int *types, const int64_t *ns, const float *bias, float *out, int64_t ldo, int threads) {
    int need32 = 0, need256 = 0, need_x4 = 0, need_x6 = 0;
    for (int s = 0; s < nseg; s++) {
        int64_t values = 1, bytes = 1;
        if (is_x8(types[s])) {
            if (!BG_X8 || k % x8_values(types[s])) return -1;
            if (is_legacy(x8_base(types[s]))) {
                need32 = 1;
                continue;
            }
            need256 = 1, need_x4 |= types[s] != T_Q6_K_X8, need_x6 |= types[s] == T_Q6_K_X8;
            continue;
        }
        if (!block_gemm_block(types[s], &values, &bytes) || k % values) return -1;
        if (is_k(types[s])) need256 = 1;
        else need32 = 1;
    }
    int8_t *q = malloc((size_t)(m * k * 2) + 1);
    float *d = malloc(sizeof(float) * (size_t)(m * (k / 32 + k / 256) + 1));
    int16_t *s16 = malloc(sizeof(int16_t) * (size_t)(m * (k / 16) * 2 + 1));
    struct acts *a = malloc(sizeof(struct acts) * (size_t)(2 * m));
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(2 * nseg + 1));
    if (!q || !d || !s16 || !a || !starts) {
        free(q), free(d), free(s16), free(a), free(starts);
        return -2;
    }
    /* the repacked types' order of the same q (and their pair sums) */
    int need_x8 = need_x4 || need_x6;
    int reorder = need_x8 && !BG_VNNI; /* (VNNI reads q in its own order: no reordered copy) */
    int8_t *xq = reorder ? malloc((size_t)(2 * m * k)) : NULL;
    int32_t *xp = need_x8 ? malloc(sizeof(int32_t) * (size_t)(m * (k / 64 + k / 32))) : NULL;
    struct x8acts *xa = need_x8 ? malloc(sizeof(struct x8acts) * (size_t)(2 * m)) : NULL;
    if (need_x8 && ((reorder && !xq) || !xp || !xa)) {
        free(q), free(d), free(s16), free(a), free(starts), free(xq), free(xp), free(xa);
        return -2;
    }
    for (int64_t r = 0; r < m; r++) {
        a[r] = (struct acts){q + r * k, d + r * (k / 32), s16 + r * (k / 16)};
        a[m + r] = (struct acts){q + m * k + r * k, d + m * (k / 32) + r * (k / 256), s16 + m * (k / 16) + r * (k / 16)};
        if (need_x8) {
            xa[r] = (struct x8acts){reorder ? xq + r * k : a[m + r].q, xp + r * (k / 64), a[m + r].d};
            xa[m + r] = (struct x8acts){reorder ? xq + (m + r) * k : a[m + r].q, xp + m * (k / 64) + r * (k / 32),
                                        a[m + r].d};
        }
    }
    struct quantize_job quantize = {x, k, ldx, m, need32, need256, need_x4, need_x6, a, xa};
    pool_for(m >= 8 ? threads : 1, m, quantize_task, &quantize); /* a few rows: not worth a hand-off */
    int64_t *group_start = starts + nseg, col = 0, groups = 0;
    for (int s = 0; s < nseg; s++) {
        starts[s] = col, group_start[s] = groups;
        col += ns[s], groups += (ns[s] + GROUP - 1) / GROUP;
    }
    int64_t per_task = groups / (threads * 8) > 0 ? groups / (threads * 8) : 1;
    struct job job = {m, k, a, a + m, xa, xa ? xa + m : NULL, nseg, data, types, ns, starts, bias, out, ldo,
                      per_task, groups, group_start};
    pool_for(threads, (groups + per_task - 1) / per_task, run_task, &job);
    free(q), free(d), free(s16), free(a), free(starts), free(xq), free(xp), free(xa);
    return 0;
}
