/* Linear layers on a GGUF's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, Q4_K, Q5_K, Q6_K): y = x W^T,
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
 *   Q6_K, Q4_0, Q5_0, Q8_0, MXFP4  a = dx * d;  acc = acc + a * isum  (isum holds the -32 / -8 / -16 / -12
 *                                  offset)
 *   Q4_1, Q5_1  a = dx * d;  acc = acc + a * isum;  m = dx * min;  acc = acc + m * sum(q of the block)
 *
 * where isum = sum_j scale_j * (q_w . q_x over sub-block j) and msum = sum_j min_j * sum_x(j) for the
 * K-quants' 6-bit sub-block scales and mins, and acc starts at 0 (then y = acc, or acc + bias).
 * MXFP4 (gpt-oss's experts: 32 E2M1 codes and an E8M0 exponent e) fits the legacy form: its doubled
 * values kvalues[code] (-12..12) are held as w = kvalues[code] + 12 (0..24) with offset 12, and d =
 * 2^(e - 128) (ggml's GGML_E8M0_TO_FP32_HALF, subnormal for e = 0, 1: exact in float), so that a = dx *
 * d is exact short of underflow and the integers are llama.cpp's MXFP4 x Q8_0 sums. The
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
 * 67, 7 rows 179 -> 102. The legacy types (Q4_0 .. Q8_0, MXFP4) run repacked the same way ("the legacy types
 * repacked" below; SmolLM2's Q4_1 file, one row: 66-72 -> 23-25 ms a token). Where the CPU has AVX-512 VNNI
 * or AVX-VNNI, the same kernels add products with vpdpbusd ("with VNNI" below). In a build without those
 * instructions every type stays in the file's layout, through the portable integer loops: within a group each weight block is
 * unpacked once into small integers (u8, 0..63) and used for every row; one row goes channel by
 * channel instead, each channel's row of blocks read in order with a prefetch PREFETCH_BYTES ahead:
 * one sequential stream per thread, which the hardware prefetchers follow (8 rows of a group read
 * block by block are 8 short streams). The activations are quantized row by row on the pool (a
 * prefill chunk's 512 rows; with AVX-512, 16 values a vector by the scalar code's very operations).
 *
 * Calls of AMX_MIN_ROWS (20) rows or more (prefill chunks, long verify passes) run on AMX-INT8 tiles
 * where the CPU has them (Xeon 4th generation on) and Linux grants the tile state ("AMX-INT8: many
 * rows on tiles" below; block_gemm_amx() says whether it runs, block_gemm_amx_calls() counts the
 * calls): each sub-block's scale folded into the weights (v = (w - offset) * sc, |v| <= 4096) and
 * split into a low and a high byte, two tile products (tdpbsud, tdpbssd) give isum = 256 * S_h +
 * S_l, the very integer of the other paths, and the chains are chain_lanes' on 16 lanes: the same
 * bits (tests/kernels/test_block_gemm_amx.py: against the VNNI and the portable builds, every type).
 * Measured on the 2-core Sapphire Rapids VM (other work shared its cores: absolute figures drift by
 * half, so each call was timed against a build without the tiles in the same process, alternately),
 * the coder's linears at 512 rows, one thread's CPU time, VNNI -> tiles: q/k/v 2048 x 1536 (Q4_K,
 * Q4_K, Q6_K) 15.8 -> 6.6 ms (204 -> 487 GOP/s), o 1536 x 1536 Q4_K 11.0 -> 3.1 (219 -> 778),
 * gate/up 17920 x 1536 Q4_K 147 -> 59 (192 -> 475), down 1536 x 8960 Q4_K 72 -> 24 (196 -> 582),
 * Q6_K 90 -> 22 (156 -> 638): a layer's linears 245 -> 93 ms (2.6x; two threads, wall clock:
 * 269 -> 119 ms). 16 rows a tie, 24 rows 1.1-1.6x, 32 rows 1.4-2x. What is left at 512 rows is
 * mostly the 16-lane chains (one step of float operations per output and block, which the tiles
 * cannot take; without them the tiles ran a gate call in about a third of its time), then the
 * quantization of K = 8960 and the chains' round trip through the outputs between K chunks.
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
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14,
       T_MXFP4 = 39 };
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

/* MXFP4's doubled E2M1 values (0, 1, 2, 3, 4, 6, 8, 12, then the same negated) plus 12, by 4-bit code:
 * the weight integers w (0..24), unsigned as vpmaddubsw's weights are. */
static const uint8_t mxfp4_w[16] __attribute__((aligned(16))) = {12, 13, 14, 15, 16, 18, 20, 24,
                                                                 12, 11, 10, 9, 8, 6, 4, 0};

/* An E8M0 exponent as MXFP4's block scale 2^(e - 128), built from its bits as ggml does (e = 0, 1 the
 * subnormals 2^-128, 2^-127): exact, no float operation. */
static inline float e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* A legacy block's scale d: float16, or MXFP4's E8M0 byte. */
static inline float legacy_scale(int type, const uint8_t *blk) {
    return type == T_MXFP4 ? e8m0_half(blk[0]) : f16_at(blk);
}

/* Which block sizes a type has: values per block, bytes per block; 0 for a type not handled here. */
int block_gemm_block(int type, int64_t *values, int64_t *bytes) {
    switch (type) {
    case T_Q4_0: *values = 32, *bytes = 18; return 1;
    case T_Q4_1: *values = 32, *bytes = 20; return 1;
    case T_Q5_0: *values = 32, *bytes = 22; return 1;
    case T_Q5_1: *values = 32, *bytes = 24; return 1;
    case T_Q8_0: *values = 32, *bytes = 34; return 1;
    case T_MXFP4: *values = 32, *bytes = 17; return 1;
    case T_Q4_K: *values = 256, *bytes = 144; return 1;
    case T_Q5_K: *values = 256, *bytes = 176; return 1;
    case T_Q6_K: *values = 256, *bytes = 210; return 1;
    default: return 0;
    }
}

int block_gemm_avx2(void) { return BG_AVX2; }

static inline int is_k(int type) { return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K; }

/* ---- activations ----------------------------------------------------------------------------- */

#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(BLOCK_GEMM_FORCE_PORTABLE)
#define BG_QUANTIZE512 1
#else
#define BG_QUANTIZE512 0
#endif

/* One row's blocks of `size` values: q = rint(x * (127 / amax)), d = amax / 127 (0 for an all-zero
 * block), and the sums of q per 16 values (sum16). The same bits on every path: with AVX-512, 16
 * values a vector by the same IEEE operations (|x| and the maximum are exact, and max(|x|, amax)
 * keeps amax where |x| is NaN, as the scalar comparison does; x * id one rounding; vrndscaleps to
 * nearest even is rintf in the default rounding mode; the clamp and the conversion of small integers
 * are exact), a prefill chunk's 512 rows in a fraction of the scalar loops' time; else scalar C. */
static void quantize_blocks(const float *x, int64_t k, int64_t size, int8_t *q, float *d, int16_t *sum16) {
#if BG_QUANTIZE512
    const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF); /* (an integer and: vandps is AVX-512DQ) */
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (int64_t b = 0; b < k / size; b++) {
        const float *v = x + b * size;
        __m512 top = _mm512_setzero_ps();
        for (int64_t i = 0; i < size; i += 16)
            top = _mm512_max_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(v + i), magnitude)), top);
        float amax = _mm512_reduce_max_ps(top);
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        __m512 scale = _mm512_set1_ps(id);
        for (int64_t i = 0; i < size; i += 16) {
            __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(v + i), scale),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m512i n = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
            _mm_storeu_si128((__m128i *)(q + b * size + i), _mm512_cvtepi32_epi8(n));
            sum16[(b * size + i) / 16] = (int16_t)_mm512_reduce_add_epi32(n);
        }
    }
#else
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
#endif
}

/* A row's activations in one block size: int8 values [k], scales [k / size], sums per 16 [k / 16]. */
struct acts {
    const int8_t *q;
    const float *d;
    const int16_t *s16;
};

/* ---- unpacking a block of 8 channels ----------------------------------------------------------- */

/* A weight block of GROUP channels unpacked: w[c][i] the unsigned weight integers (u8; for Q8_0 the
 * signed values, for MXFP4 kvalues + 12), sc[c][j] the sub-block scales, mn[c][j] the mins (K-quants),
 * and the float scales. */
struct unpacked {
    uint8_t w[GROUP][QK] __attribute__((aligned(32)));
    int16_t sc[GROUP][MAX_SUB];
    int16_t mn[GROUP][MAX_SUB];
    float d[GROUP], dm[GROUP];
    int subs, sub_len, offset; /* sub-blocks, their length, the constant subtracted from w (0, 8, 12, 16, 32) */
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
/* The weight integers of Q4_0 / Q4_1 / MXFP4 with AVX2 (the same bytes unpack_one's loops write; MXFP4's
 * codes through a vpshufb table): 1 for a type it unpacked, 0 for one left to the loops (the K-quants run
 * repacked, `x8`, or in the loops). */
static int unpack_ints_avx2(int type, const uint8_t *blk, uint8_t *w) {
    switch (type) {
    case T_Q4_0:
    case T_Q4_1:
    case T_MXFP4: {
        __m128i v = _mm_loadu_si128((const __m128i *)(blk + (type == T_Q4_0 ? 2 : type == T_MXFP4 ? 1 : 4)));
        __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0F));
        __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
        if (type == T_MXFP4) {
            const __m128i table = _mm_load_si128((const __m128i *)mxfp4_w);
            lo = _mm_shuffle_epi8(table, lo), hi = _mm_shuffle_epi8(table, hi);
        }
        _mm_store_si128((__m128i *)w, lo);
        _mm_store_si128((__m128i *)(w + 16), hi);
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
        u->d[c] = legacy_scale(type, blk), u->dm[c] = type == T_Q4_1 ? f16_at(blk + 2) : 0.0f;
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
    case T_MXFP4:
        for (int i = 0; i < 16; i++) w[i] = mxfp4_w[blk[1 + i] & 0xF], w[i + 16] = mxfp4_w[blk[1 + i] >> 4];
        u->d[c] = e8m0_half(blk[0]);
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
    u->offset = type == T_Q6_K ? 32 : (type == T_Q4_0 ? 8 : (type == T_Q5_0 ? 16 : (type == T_MXFP4 ? 12 : 0)));
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
/* Rows advanced together: their int16 and int32 sums stay (mostly) in registers. With AVX-512 the
 * compiler has 32 vector registers for the 256-bit code, without it 16: on the EPYC AVX2 (Zen 3) 4 rows
 * a step against 6 took passes of 8 rows 149 -> 133 ms and of 16 rows 276 -> 267 (one process,
 * alternating builds; 5 rows alike, 3 slower). */
#ifndef X8_ROWS
#if defined(__AVX512VL__)
#define X8_ROWS 6
#else
#define X8_ROWS 4
#endif
#endif
#ifndef X8_HINT
#define X8_HINT _MM_HINT_T0
#endif
#ifndef X8_AHEAD
#define X8_AHEAD 1024 /* bytes ahead of the block being read that the repacked kernels ask for */
#endif
/* Ask for the bytes X8_AHEAD past block `blk` of `bytes` (a whole block's lines, one prefetch each), at
 * the start of every block: a task's groups are one run of memory, so this is the stream the kernel
 * reads next. The hardware prefetchers alone left a one-row pass well short of the bus on the EPYC AVX2
 * (2 cores of a Zen 3: the coder's layers and head at ~19 and ~16 GB/s of a 39 GB/s read); with the
 * prefetch, the same process alternating the two builds, the coder's passes of 1 / 4 / 8 rows took
 * 55.6 -> 44.0, 99.6 -> 80.5 and 156.3 -> 143.7 ms. 512 bytes and 1 KB measured alike; 2 KB, 4 KB, 8 KB
 * or the hint into L2 (T1) no better. (Unrolled: a loop around the prefetches cost a tenth of a
 * one-row block's instructions. Past a weight's last block the addresses may be unmapped: an x86
 * prefetch never faults, it is dropped.) */
#define X8_PREFETCH(blk, bytes)                                                                               \
    do {                                                                                                      \
        if (X8_AHEAD > 0)                                                                                     \
            _Pragma("GCC unroll 32") for (int line_ = 0; line_ < (bytes); line_ += 64)                        \
                _mm_prefetch((const char *)(blk) + X8_AHEAD + line_, X8_HINT);                                \
    } while (0)
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
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1 || type == T_Q8_0 || type == T_MXFP4;
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
    if (type == T_MXFP4) { /* the exponents, then the file's 4-bit codes (not u's w: 5 bits) reordered */
        uint8_t *qs = dst + GROUP;
        for (int c = 0; c < channels; c++) {
            dst[c] = src[c][0];
            for (int v = 0; v < 4; v++) memcpy(qs + 32 * v + 4 * c, src[c] + 1 + 4 * v, 4);
        }
        return;
    }
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

/* The 8 channels' float scales d of a repacked legacy block: its float16 d[8], or MXFP4's exponents
 * e[8] as 2^(e - 128) built from their bits (e8m0_half on 8 lanes: e < 2 the subnormals). */
static inline __m256 x8_scales(int type, const uint8_t *blk) {
    if (type != T_MXFP4) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
    __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)blk));
    __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(subnormal, normal, _mm256_cmpgt_epi32(e, _mm256_set1_epi32(1))));
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
        X8_PREFETCH(blk, five ? Q5X8_BYTES : Q4X8_BYTES);
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
        X8_PREFETCH(blk, Q6X8_BYTES);
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

/* Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and MXFP4 are repacked at load as the K-quants are: a block of 8 channels holds,
 * in each 32-bit lane of weight vector t (0..7), values 4t .. 4t + 3 of one channel. vpmaddubsw against a row's
 * 4 activations 4t .. 4t + 3 broadcast to every lane leaves each channel's partial dot product in its lane (the
 * activations in their own order, read once for 8 channels), and the float chains advance 8 channels at a time:
 * a one-row decode step reads one sequential stream per group instead of unpacking one channel's 32-value block
 * at a time (SmolLM2's Q4_1 file: ~3x). The integers are the file layout's: isum = w . q - offset * sum(q) (pair
 * sums added in int16 only where they cannot overflow: Q4 8 of 2 * 15 * 127 <= 30480, Q5 4 of 2 * 31 * 127,
 * MXFP4 4 of 2 * 24 * 127, Q8_0 one of 2 * 128 * 127 as |w| * (q sgn w)), second = sum(q) for Q4_1 / Q5_1, and
 * each lane's chain is chain_one's.
 *
 * A block of 8 channels is 8 file blocks' bytes: d[8] (float16), for Q4_1 / Q5_1 m[8] (float16), then for
 * Q4 / Q5 qs[4 vectors][8 channels][4 bytes], byte i of a channel's lane in vector v holding value 4v + i
 * in its low nibble and value 16 + 4v + i in its high one, and for Q5 qh[8][4], bit t of byte i the fifth
 * bit of value 4t + i; for Q8_0 qs[8 vectors][8][4], value 4t + i as int8. MXFP4 (136 bytes = 8 * 17):
 * e[8], then qs as Q4's, the file's 4-bit codes: the repacked form reads the bytes llama.cpp reads, and
 * a vpshufb table gives w = kvalues[code] + 12 in the inner loop (5 bits: 4 of them stored, a fifth of
 * the stream more, for one shuffle a weight vector). */
static inline __attribute__((always_inline)) void legacy_x8_rows(const int n, const int type, const uint8_t *group,
                                                                 int64_t nb, const struct acts *a, __m256 *y) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), zero = _mm256_setzero_si256();
    const int with_min = type == T_Q4_1 || type == T_Q5_1, five = type == T_Q5_0 || type == T_Q5_1;
    const int mx = type == T_MXFP4, offset = type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : mx ? 12 : 0;
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)mxfp4_w));
    const int64_t bytes = x8_bytes(type);
    for (int r = 0; r < n; r++) y[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = group + b * bytes, *qs = blk + (mx ? GROUP : with_min ? 32 : 16);
        X8_PREFETCH(blk, bytes);
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
                if (mx) w = _mm256_shuffle_epi8(table, w);
                for (int r = 0; r < n; r++) /* (VNNI: int32 sums) */
                    part[r] = add_products(part[r], w, broadcast4(a[r].q + b * Q32 + 4 * t));
                if (!BG_VNNI && (five || mx) && t == 3)
                    for (int r = 0; r < n; r++) {
                        isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(part[r], ones));
                        part[r] = zero;
                    }
            }
            for (int r = 0; r < n; r++) isum[r] = BG_VNNI ? part[r] : _mm256_add_epi32(isum[r], _mm256_madd_epi16(part[r], ones));
        }
        __m256 d = x8_scales(type, blk);
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
    int per_segment_rows;       /* block_linear_rows: segment s reads row s alone, into output row 0 */
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
     : type == T_Q5_1 ? legacy_x8_rows(N, T_Q5_1, group, nb, a, y)                                            \
     : type == T_MXFP4 ? legacy_x8_rows(N, T_MXFP4, group, nb, a, y) : legacy_x8_rows(N, T_Q8_0, group, nb, a, y))
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

/* ---- AMX-INT8: many rows on tiles ---------------------------------------------------------------- */

/* Calls of AMX_MIN_ROWS rows or more (a prefill chunk, a long verify pass) run on AMX-INT8 tiles where
 * the CPU has them and Linux grants the tile state (arch_prctl ARCH_REQ_XCOMP_PERM, as int8_gemm.c
 * asks): tdpbssd / tdpbsud add 16 x 16 x 64 products of signed activations (A) and signed / unsigned
 * weight bytes (B) into int32, exactly (no saturation), ~10x vpdpbusd's multiply-adds per cycle. The
 * integers and chains are the ones above, so the bits are the VNNI and portable paths' (tested).
 *
 * A tile product sums its whole 64-value step, so it cannot scale sub-blocks of 16 or 32 on its own.
 * The weights of a panel of 16 channels are therefore unpacked once per call (per K chunk, below) from
 * the repacked x8 blocks into tiles of v = (w - offset) * sc, the sub-block's scale folded into each
 * weight (exact integers: Q4_K 0..945, Q5_K 0..1953, Q6_K (-32..31) * (-128..127), |v| <= 4096),
 * split as v = 256 * h + l with l = v & 255 (u8, tdpbsud) and h = v >> 8 (s8, -16..16, tdpbssd).
 * Two tile products over the block's 256 values give
 *     isum = sum_i v_i q_i = 256 * S_h + S_l      (integer identity, no rounding anywhere)
 * with |S_l| <= 256 * 255 * 127 < 2^23, |S_h| <= 256 * 16 * 127 < 2^20 and |isum| <= 256 * 4096 * 127
 * < 2^27: all within int32, so isum is the very integer the VNNI lanes and the portable loops form
 * (Q6_K's offset included: they subtract 32 * sum_j sc_j * sum(q over j), the same sum regrouped).
 * Q4_K / Q5_K's msum (mins <= 63 times sub-block sums of q, |.| <= 4064, 8 of them) is vpdpwssd on
 * the int16 pairs the VNNI path reads. Twice the multiply-adds of the raw weights, but the tiles'
 * output per block is the isum the chain wants: no per-sub-block scaling of int32 tiles.
 * The legacy types (one scale per 32 values) take tiles of 32 values (w - offset as s8, tdpbssd:
 * Q4_0 -8..7, Q5_0 -16..15, Q4_1 / Q5_1 0..31, MXFP4 -12..12, Q8_0 as is; |isum| <= 32 * 128 * 127),
 * one C tile a block, and then each chain step is chain_lanes' on 16 lanes: the same IEEE operations in
 * the same order (this file is compiled with -ffp-contract=off: no fused multiply-add).
 *
 * Order: a call's K is cut into chunks whose activations (rows x chunk, int8) stay in L2 (the call's
 * outputs hold the chains' accumulators between chunks, which run in order: a chain's block order is
 * unchanged); per chunk, a pool task is a panel of 16 channels (two x8 groups): its weight tiles are
 * unpacked into a thread-local buffer (L2), then block by block (the block's tiles stay in L1) over
 * the rows 32 at a time (C tiles 0..3: rows 0..15 l, h, rows 16..31 l, h; A tiles 4, 5; B 6 (l), 7
 * (h)). The tiles of one step are issued 4 K steps apart, 8 rows of the previous step's sums chained
 * on AVX-512 after each (the vector work between the tiles' multiplies), then stored. The
 * accumulators of a panel's rows live in the buffer; the chunk's last block writes them to the
 * outputs with streaming stores (a whole 64-byte line: no read for ownership; the outputs of a
 * chunk, e.g. 512 x 8960 floats, exceed L2, and reading them in cost a third of a gate call). The
 * activations are quantized straight into the tiles' layout (amx_tile_row: one sequential stream
 * per panel, which the prefetchers follow; strided rows of the row-major q stalled the tile loads),
 * their rows padded to a multiple of 32 with zeros (rows past m are computed and never stored). */
#if BG_VNNI && !defined(BLOCK_GEMM_NO_AMX) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && \
    defined(__AVX512BW__) && defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__linux__)
#define BG_AMX 1
#include "amx_tiles.h"
#else
#define BG_AMX 0
#endif
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 20 /* fewer rows run on the VNNI kernels (measured: 16 rows a tie, 24 faster) */
#endif
#ifndef AMX_LAG
#define AMX_LAG 1 /* a step's sums are chained during the next step's tiles (a lag of 2 or 3: no faster) */
#endif
#ifndef AMX_CHUNK_BYTES
#define AMX_CHUNK_BYTES (1 << 20) /* activations (rows x K chunk) a chunk keeps in L2 */
#endif

static int64_t amx_calls; /* calls that ran on the tiles (block_gemm_amx_calls: the tests' witness) */

#if BG_AMX
/* K-quants: every tile 16 x 64 bytes. Legacy: A tiles (4, 5) 16 rows x 32 values, B tiles 8 rows
 * (32 values / 4) x 64 bytes, C tiles 16 x 16 int32. */
static void amx_configure(int legacy) {
    amx_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.bytes_per_row[t] = legacy && (t == 4 || t == 5) ? 32 : 64;
        config.rows[t] = legacy && t >= 6 ? 8 : 16;
    }
    _tile_loadconfig(&config);
}

/* A panel block's unpacked form. K-quants: l tiles [4 steps][16 rows][64], h tiles [4][16][64], the
 * 16 channels' d and dmin (float), the mins as int16 pairs [4 pairs][16 channels][2]. Legacy: one B
 * tile [8][64] (s8), d, m. */
#define AK_L 0
#define AK_H 4096
#define AK_D 8192
#define AK_DM (AK_D + 64)
#define AK_MN (AK_D + 128)
#define AK_BYTES (AK_MN + 256)
#define AL_D 512
#define AL_DM (AL_D + 64)
#define AL_BYTES (AL_D + 128)

/* v (32 int16, the scaled weights of one 32-byte half row) split into its low bytes (l) and the low
 * bytes of v >> 8 (h), each the half row of its tile. */
static inline void amx_split(__m512i v, uint8_t *l, uint8_t *h) {
    _mm256_store_si256((__m256i *)l, _mm512_cvtepi16_epi8(v));
    _mm256_store_si256((__m256i *)h, _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
}

/* Each channel's sub-block `half` scale (a pair's [8 channels][2] bytes as int16 in s16) on the 4
 * int16 of its 32-bit lane: word e takes word 2 * (e / 4) + half. */
static inline __m512i amx_lane_scales(__m256i s16, int half) {
    static const int16_t index[2][32] __attribute__((aligned(64))) = {
        {0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6, 8, 8, 8, 8, 10, 10, 10, 10, 12, 12, 12, 12, 14, 14, 14, 14},
        {1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7, 9, 9, 9, 9, 11, 11, 11, 11, 13, 13, 13, 13, 15, 15, 15, 15}};
    return _mm512_permutexvar_epi16(_mm512_load_si512((const void *)index[half]), _mm512_castsi256_si512(s16));
}

/* One x8 K-quant block (8 channels) into half `side` (bytes 32 * side ..) of the panel block `o`. */
static void amx_unpack_k(int type, const uint8_t *blk, int side, uint8_t *o) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    if (type == T_Q6_K_X8) {
        const __m512i offset = _mm512_set1_epi16(32);
        for (int p = 0; p < 8; p++) { /* pair p: values 32p .. 32p + 31, B rows 8p .. 8p + 7 */
            const uint8_t *ql = blk + 144 + 128 * p, *qh = blk + 1168 + 64 * p;
            __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 16 + 16 * p)));
            __m512i sc[2] = {amx_lane_scales(s16, 0), amx_lane_scales(s16, 1)};
            __m256i top[2] = {_mm256_loadu_si256((const __m256i *)qh), _mm256_loadu_si256((const __m256i *)(qh + 32))};
            for (int t = 0; t < 4; t++) {
                __m256i packed = _mm256_loadu_si256((const __m256i *)(ql + 32 * t));
                for (int half = 0; half < 2; half++) { /* group 4 * half + t: sub-block 2p + half */
                    __m256i w = _mm256_or_si256(_mm256_and_si256(half ? _mm256_srli_epi16(packed, 4) : packed, low4),
                                                q6_top(top[half], t));
                    __m512i v = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_cvtepu8_epi16(w), offset), sc[half]);
                    int row = 8 * p + 4 * half + t;
                    amx_split(v, o + AK_L + 64 * row + 32 * side, o + AK_H + 64 * row + 32 * side);
                }
            }
        }
        _mm256_store_ps((float *)(o + AK_D) + 8 * side, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk)));
        return;
    }
    const int five = type == T_Q5_K_X8;
    for (int p = 0; p < 4; p++) { /* pair p: values 64p .. 64p + 63, the tile of step p */
        const uint8_t *qs = blk + 160 + 256 * p;
        __m256i s16 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * p)));
        __m512i sc[2] = {amx_lane_scales(s16, 0), amx_lane_scales(s16, 1)};
        __m256i fifths[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        if (five)
            for (int half = 0; half < 2; half++)
                fifths[half] = _mm256_loadu_si256((const __m256i *)(blk + Q4X8_BYTES + 64 * p + 32 * half));
        for (int v = 0; v < 8; v++) {
            __m256i packed = _mm256_loadu_si256((const __m256i *)(qs + 32 * v));
            for (int half = 0; half < 2; half++) { /* sub-block 2p + half, values 4v .. 4v + 3: row 8 half + v */
                __m256i w = _mm256_and_si256(half ? _mm256_srli_epi16(packed, 4) : packed, low4);
                if (five) w = _mm256_or_si256(w, q5_fifth(fifths[half], v));
                __m512i prod = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(w), sc[half]);
                int row = 16 * p + 8 * half + v;
                amx_split(prod, o + AK_L + 64 * row + 32 * side, o + AK_H + 64 * row + 32 * side);
            }
        }
        _mm256_store_si256((__m256i *)(o + AK_MN + 64 * p + 32 * side),
                           _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 96 + 16 * p))));
    }
    _mm256_store_ps((float *)(o + AK_D) + 8 * side, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk)));
    _mm256_store_ps((float *)(o + AK_DM) + 8 * side, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))));
}

/* One x8 legacy block (8 channels, 32 values) into half `side` of the panel block `o`: B row t holds
 * values 4t .. 4t + 3 as w - offset (s8; MXFP4's kvalues straight from a signed table, the same
 * integers). */
static void amx_unpack_legacy(int type, const uint8_t *blk, int side, uint8_t *o) {
    const int with_min = type == T_Q4_1 || type == T_Q5_1, five = type == T_Q5_0 || type == T_Q5_1;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i offset = _mm256_set1_epi8((char)(type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : 0));
    static const int8_t mxfp4_values[16] __attribute__((aligned(16))) = {0, 1, 2, 3, 4, 6, 8, 12,
                                                                         0, -1, -2, -3, -4, -6, -8, -12};
    const __m256i values = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)mxfp4_values));
    const uint8_t *qs = blk + (type == T_MXFP4 ? GROUP : with_min ? 32 : 16);
    __m256i fifths = five ? _mm256_loadu_si256((const __m256i *)(qs + 128)) : _mm256_setzero_si256();
    for (int t = 0; t < 8; t++) {
        __m256i w;
        if (type == T_Q8_0) {
            w = _mm256_loadu_si256((const __m256i *)(qs + 32 * t));
        } else {
            __m256i packed = _mm256_loadu_si256((const __m256i *)(qs + 32 * (t & 3)));
            w = _mm256_and_si256(t < 4 ? packed : _mm256_srli_epi16(packed, 4), low4);
            if (five) w = _mm256_or_si256(w, q5_fifth(fifths, t));
            w = type == T_MXFP4 ? _mm256_shuffle_epi8(values, w) : _mm256_sub_epi8(w, offset);
        }
        _mm256_store_si256((__m256i *)(o + 64 * t + 32 * side), w);
    }
    __m256 d = x8_scales(type, blk);
    _mm256_store_ps((float *)(o + AL_D) + 8 * side, d);
    _mm256_store_ps((float *)(o + AL_DM) + 8 * side,
                    with_min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))) : d);
}

/* One call on the tiles: the main job, the chunk of blocks being run, the panels. */
struct amx_job {
    const struct job *job;
    int64_t k0, kc;            /* the chunk: values k0 .. k0 + kc */
    const int64_t *panel_start; /* first global panel of each segment */
    const int8_t *t32, *t256;  /* the rows' activations in tiles (amx_tile_row), rows padded to 32 */
    /* what the chains read per row, block-major ([block][padded rows]: a step's 32 rows side by side,
     * where the rows' own arrays put each row's values a row apart, a cache line or more each) */
    const float *dx32, *dx256;  /* activation scales */
    const int32_t *pairs, *qsum; /* Q4_K / Q5_K: the rows' 4 pair sums; Q4_1 / Q5_1: sum(q) per block */
    int64_t padded;
};

/* A thread's buffer for a panel's unpacked blocks (kept: the pool's threads live on). */
static __thread uint8_t *amx_buffer;
static __thread size_t amx_capacity;

static uint8_t *amx_scratch(size_t bytes) {
    if (bytes > amx_capacity) {
        free(amx_buffer);
        amx_capacity = (bytes + 4095) / 4096 * 4096;
        amx_buffer = aligned_alloc(4096, amx_capacity);
        if (!amx_buffer) abort();
    }
    return amx_buffer;
}

/* One chain step (one block) of rows [r0, r0 + rows) of a panel, rows <= 16 of one C tile pair:
 * its sums `s` (and, for the K-quants, `sh`: isum = 256 * sh + s) into the rows' 16 accumulators
 * (acc, [row][16]), chain_lanes' operations on 16 lanes. */
struct amx_chain {
    int with_min;
    const float *d, *dm;
    const int16_t *mins; /* Q4_K / Q5_K: [4 pairs][16][2] of the block, else NULL */
    const float *dx;      /* the block's activation scales, row r's at dx[r] */
    const int32_t *pairs; /* Q4_K / Q5_K: the block's pair sums, row r's at pairs[4 r ..] */
    const int32_t *qsum;  /* Q4_1 / Q5_1: the block's sums of q, row r's at qsum[r] */
    float *out; /* the chunk's last block: the chains go to out (row r at out + r * ldo, + bias) */
    int64_t ldo;
    __mmask16 mask;
    const float *bias; /* the call's last block: the panel's biases, or NULL */
    int final;
};

static inline __attribute__((always_inline)) void amx_chain_rows(const struct amx_chain *c, int64_t r0,
                                                                 int rows, const int32_t *s, const int32_t *sh,
                                                                 float *acc) {
    const __m512 d = _mm512_load_ps(c->d), dm = _mm512_load_ps(c->dm);
    __m512i mins[4];
    if (c->mins)
        for (int p = 0; p < 4; p++) mins[p] = _mm512_load_si512((const void *)(c->mins + 32 * p));
    for (int i = 0; i < rows; i++) {
        int64_t r = r0 + i;
        __m512i isum = _mm512_load_si512((const void *)(s + 16 * i));
        if (sh) isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((const void *)(sh + 16 * i)), 8), isum);
        __m512 x = _mm512_set1_ps(c->dx[r]);
        __m512 sum = _mm512_add_ps(_mm512_load_ps(acc + 16 * i), _mm512_mul_ps(_mm512_mul_ps(x, d), _mm512_cvtepi32_ps(isum)));
        if (c->mins) { /* Q4_K / Q5_K: - (dx * dmin) * msum */
            const int32_t *pairs = c->pairs + 4 * r;
            __m512i msum = _mm512_setzero_si512();
            for (int p = 0; p < 4; p++) msum = _mm512_dpwssd_epi32(msum, mins[p], _mm512_set1_epi32(pairs[p]));
            sum = _mm512_sub_ps(sum, _mm512_mul_ps(_mm512_mul_ps(x, dm), _mm512_cvtepi32_ps(msum)));
        } else if (c->with_min) { /* Q4_1 / Q5_1: + (dx * m) * sum(q) */
            __m512i qsum = _mm512_set1_epi32(c->qsum[r]);
            sum = _mm512_add_ps(sum, _mm512_mul_ps(_mm512_mul_ps(x, dm), _mm512_cvtepi32_ps(qsum)));
        }
        if (!c->final) {
            _mm512_store_ps(acc + 16 * i, sum);
            continue;
        }
        if (c->bias) sum = _mm512_add_ps(sum, _mm512_load_ps(c->bias));
        float *y = c->out + r * c->ldo;
        if (c->mask == 0xFFFF && !((uintptr_t)y & 63))
            _mm512_stream_ps(y, sum); /* a whole line: no read for ownership (the outputs exceed L2) */
        else
            _mm512_mask_storeu_ps(y, c->mask, sum);
    }
}

/* The tiles of K step s (of 4) of a K-quant block (unpacked at o), rows r0 .. r0 + 31 of the
 * activations at aq (two A tiles when `two`): C 0, 1 (rows 0..15: l, h), 2, 3 (rows 16..31). */
#define AMX_K_STEP(s, two)                                                                                    \
    do {                                                                                                      \
        _tile_loadd(4, aq + 1024 * (s), 64);                                                                  \
        _tile_loadd(6, o + AK_L + 1024 * (s), 64);                                                            \
        _tile_loadd(7, o + AK_H + 1024 * (s), 64);                                                            \
        _tile_dpbsud(0, 4, 6);                                                                                \
        _tile_dpbssd(1, 4, 7);                                                                                \
        if (two) {                                                                                            \
            _tile_loadd(5, aq + 4096 + 1024 * (s), 64);                                                       \
            _tile_dpbsud(2, 5, 6);                                                                            \
            _tile_dpbssd(3, 5, 7);                                                                            \
        }                                                                                                     \
    } while (0)

/* Panel t (global) of the chunk: unpack its blocks, then every (block, 32 rows) step. */
static void amx_task(void *context, int64_t t) {
    const struct amx_job *aj = context;
    const struct job *job = aj->job;
    int seg = 0;
    while (seg + 1 < job->nseg && t >= aj->panel_start[seg + 1]) seg++;
    int64_t panel = t - aj->panel_start[seg], k = job->k, m = job->m;
    int type = job->types[seg], base = x8_base(type), legacy = is_legacy(base);
    int64_t values = x8_values(type), nb = k / values, b0 = aj->k0 / values, nbc = aj->kc / values;
    int64_t groups = (job->ns[seg] + GROUP - 1) / GROUP, first = panel * 16, col = job->starts[seg] + first;
    int channels = (int)(job->ns[seg] - first < 16 ? job->ns[seg] - first : 16);
    int64_t bytes = x8_bytes(type), unpacked = legacy ? AL_BYTES : AK_BYTES;
    int64_t pairs = (m + 31) / 32, steps = nbc * pairs;
    uint8_t *buf = amx_scratch((size_t)(nbc * unpacked + (AMX_LAG + 1) * 1024 * 4 + pairs * 32 * 64));
    int32_t *sums = (int32_t *)(buf + nbc * unpacked); /* AMX_LAG + 1 sets of 4 C tiles [16][16] */
    float *acc = (float *)(buf + nbc * unpacked + (AMX_LAG + 1) * 1024 * 4); /* [rows][16] accumulators */
    for (int side = 0; side < 2; side++) {
        int64_t g = 2 * panel + side;
        for (int64_t b = 0; b < nbc; b++) {
            uint8_t *o = buf + b * unpacked;
            if (g >= groups) { /* a panel of one group: zero weights and scales, never stored */
                for (int64_t row = 0; row < (legacy ? 8 : 128); row++) memset(o + 64 * row + 32 * side, 0, 32);
                memset(o + (legacy ? AL_D : AK_D) + 32 * side, 0, 32);
                memset(o + (legacy ? AL_DM : AK_DM) + 32 * side, 0, 32);
                if (!legacy)
                    for (int p = 0; p < 4; p++) memset(o + AK_MN + 64 * p + 32 * side, 0, 32);
                continue;
            }
            const uint8_t *blk = job->data[seg] + (g * nb + b0 + b) * bytes;
            if (legacy) amx_unpack_legacy(base, blk, side, o);
            else amx_unpack_k(type, blk, side, o);
        }
    }
    const __mmask16 mask = (__mmask16)((1u << channels) - 1u);
    float *out = job->out + col;
    for (int64_t r = 0; r < m; r++) /* the chains so far: 0, or where the last chunk left them */
        _mm512_store_ps(acc + 16 * r, b0 == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, out + r * job->ldo));
    int last = b0 + nbc == nb;
    float bias[16] __attribute__((aligned(64)));
    memset(bias, 0, sizeof bias);
    if (last && job->bias) memcpy(bias, job->bias + col, sizeof(float) * (size_t)channels);
    struct amx_chain chain = {base == T_Q4_1 || base == T_Q5_1, NULL, NULL, NULL, NULL, NULL, NULL,
                              out, job->ldo, mask, last && job->bias ? bias : NULL, 0};
    const int8_t *q = legacy ? aj->t32 : aj->t256;
    const int64_t row_tiles = pairs * 2;
    amx_configure(legacy);
    /* step i: block b0 + i / pairs, rows 32 * (i % pairs) ..; step i - 1's sums are chained, 8 rows
     * after each of step i's 4 tile steps (the vector work in between the tiles' multiplies) */
    for (int64_t i = 0; i < steps + AMX_LAG; i++) {
        int64_t r0 = 32 * (i % pairs), pb = (i - AMX_LAG) / pairs, pr0 = 32 * ((i - AMX_LAG) % pairs);
        int two = m - r0 > 16, prows = i >= AMX_LAG ? (m - pr0 < 32 ? (int)(m - pr0) : 32) : 0;
        const uint8_t *o = buf + (i / pairs) * unpacked, *po = buf + pb * unpacked;
        const int8_t *aq = q + ((b0 + i / pairs) * row_tiles + r0 / 16) * (legacy ? 512 : 4096);
        int32_t *ps = sums + ((i - AMX_LAG) % (AMX_LAG + 1)) * 1024;
        if (i >= AMX_LAG) {
            chain.d = (const float *)(po + (legacy ? AL_D : AK_D)), chain.dm = (const float *)(po + (legacy ? AL_DM : AK_DM));
            chain.mins = base == T_Q4_K || base == T_Q5_K ? (const int16_t *)(po + AK_MN) : NULL;
            chain.final = pb == nbc - 1; /* (the chunk's last block: straight into out) */
            chain.dx = (legacy ? aj->dx32 : aj->dx256) + (b0 + pb) * aj->padded;
            chain.pairs = aj->pairs ? aj->pairs + (b0 + pb) * aj->padded * 4 : NULL;
            chain.qsum = aj->qsum ? aj->qsum + (b0 + pb) * aj->padded : NULL;
        }
        if (legacy) {
            if (i < steps) {
                _tile_zero(0);
                _tile_loadd(6, o, 64);
                _tile_loadd(4, aq, 32);
                _tile_dpbssd(0, 4, 6);
                if (two) {
                    _tile_zero(2);
                    _tile_loadd(5, aq + 512, 32);
                    _tile_dpbssd(2, 5, 6);
                }
            }
            if (i >= AMX_LAG) {
                amx_chain_rows(&chain, pr0, prows < 16 ? prows : 16, ps, NULL, acc + 16 * pr0);
                if (prows > 16) amx_chain_rows(&chain, pr0 + 16, prows - 16, ps + 512, NULL, acc + 16 * (pr0 + 16));
            }
        } else {
            if (i < steps) {
                _tile_zero(0);
                _tile_zero(1);
                if (two) {
                    _tile_zero(2);
                    _tile_zero(3);
                }
            }
            for (int s = 0; s < 4; s++) {
                if (i < steps) {
                    if (two) AMX_K_STEP(s, 1); else AMX_K_STEP(s, 0);
                }
                int lo = 8 * s, hi = 8 * s + 8 < prows ? 8 * s + 8 : prows; /* rows lo .. hi of step i - 1 */
                if (lo < hi) {
                    int tile = lo / 16, at = lo % 16;
                    amx_chain_rows(&chain, pr0 + lo, hi - lo, ps + 512 * tile + 16 * at,
                                   ps + 512 * tile + 256 + 16 * at, acc + 16 * (pr0 + lo));
                }
            }
        }
        if (i < steps) {
            int32_t *s = sums + (i % (AMX_LAG + 1)) * 1024;
            _tile_stored(0, s, 64);
            if (!legacy) _tile_stored(1, s + 256, 64);
            if (two) {
                _tile_stored(2, s + 512, 64);
                if (!legacy) _tile_stored(3, s + 768, 64);
            }
        }
    }
    _tile_release();
    _mm_sfence(); /* the streamed outputs ordered before the pool hands the call back */
}

/* Row r of a call's activations q (k values) into the tiles' layout t, where the tiles of block b
 * (values `size`: 256, or 32 for the legacy types) lie in order of row tile (16 rows), then K step
 * (64 values; the legacy types' one of 32), each tile's 16 rows of 64 (32) bytes: a panel's steps read
 * them block by block, row tile after row tile, one sequential stream. row_tiles: the padded rows / 16. */
static void amx_tile_row(const int8_t *q, int64_t k, int64_t r, int64_t size, int64_t row_tiles, int8_t *t) {
    int64_t step = size == QK ? 64 : 32, tile = 16 * step, per = size / step;
    for (int64_t b = 0; b < k / size; b++)
        for (int64_t s = 0; s < per; s++)
            memcpy(t + ((b * row_tiles + r / 16) * per + s) * tile + (r % 16) * step, q + b * size + s * step, (size_t)step);
}

/* Whether a call runs on the tiles: enough rows, every segment repacked, the tiles granted. */
static int amx_runs(int64_t m, int nseg, const int *types) {
    if (m < AMX_MIN_ROWS) return 0;
    for (int s = 0; s < nseg; s++)
        if (!is_x8(types[s])) return 0;
    return amx_usable();
}

/* The call on the tiles: K in chunks (in order), each chunk's panels on the pool. */
static void amx_run(const struct job *job, const int8_t *t32, const int8_t *t256, int threads) {
    int64_t *panel_start = malloc(sizeof(int64_t) * (size_t)(job->nseg + 1)), panels = 0;
    if (!panel_start) abort();
    int64_t unit = Q32;
    for (int s = 0; s < job->nseg; s++) {
        panel_start[s] = panels;
        panels += (job->ns[s] + 15) / 16;
        if (is_k(x8_base(job->types[s]))) unit = QK;
    }
    int64_t padded = (job->m + 31) / 32 * 32, units = job->k / unit, m = job->m, k = job->k;
    int legacy = 0, mins = 0, with_min = 0;
    for (int s = 0; s < job->nseg; s++) {
        int base = x8_base(job->types[s]);
        legacy |= is_legacy(base), mins |= base == T_Q4_K || base == T_Q5_K, with_min |= base == T_Q4_1 || base == T_Q5_1;
    }
    int64_t n32 = legacy ? k / Q32 * padded : 0, n256 = unit == QK ? k / QK * padded : 0;
    float *dx = calloc((size_t)(n32 + n256 + 1), sizeof(float));
    int32_t *pairs = mins ? calloc((size_t)(4 * n256), sizeof(int32_t)) : NULL;
    int32_t *qsum = with_min ? calloc((size_t)n32, sizeof(int32_t)) : NULL;
    if (!dx || (mins && !pairs) || (with_min && !qsum)) abort();
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < n32 / padded; b++) {
            dx[b * padded + r] = job->a32[r].d[b];
            if (qsum) qsum[b * padded + r] = job->a32[r].s16[2 * b] + job->a32[r].s16[2 * b + 1];
        }
        for (int64_t b = 0; b < n256 / padded; b++) {
            dx[n32 + b * padded + r] = job->a256[r].d[b];
            if (pairs) memcpy(pairs + (b * padded + r) * 4, job->x4[r].pairs + 4 * b, 4 * sizeof(int32_t));
        }
    }
    int64_t per = AMX_CHUNK_BYTES / (padded * unit) > 0 ? AMX_CHUNK_BYTES / (padded * unit) : 1;
    int64_t chunks = (units + per - 1) / per;
    per = (units + chunks - 1) / chunks; /* chunks of (nearly) equal size */
    for (int64_t u = 0; u < units; u += per) {
        struct amx_job aj = {job, u * unit, (units - u < per ? units - u : per) * unit, panel_start, t32, t256,
                             dx, dx + n32, pairs, qsum, padded};
        pool_for(threads, panels, amx_task, &aj);
    }
    free(panel_start), free(dx), free(pairs), free(qsum);
    __atomic_fetch_add(&amx_calls, 1, __ATOMIC_RELAXED);
}
#endif

/* 1 where this build has the AMX path and this process may use the tiles (a call of AMX_MIN_ROWS rows
 * or more of repacked weights runs there), else 0. */
int block_gemm_amx(void) {
#if BG_AMX
    return amx_usable();
#else
    return 0;
#endif
}

/* How many calls ran on the tiles so far (in this process). */
int64_t block_gemm_amx_calls(void) { return __atomic_load_n(&amx_calls, __ATOMIC_RELAXED); }

/* The fewest rows a call runs on the tiles with. */
int block_gemm_amx_min_rows(void) { return AMX_MIN_ROWS; }

static void run_group(const struct job *job, int seg, int64_t g, float *acc, struct unpacked *u) {
    if (job->per_segment_rows) { /* the one-row call of row `seg` on this segment's weights */
        struct job one = *job;
        one.m = 1, one.per_segment_rows = 0, one.a32 = job->a32 + seg, one.a256 = job->a256 + seg;
        if (job->x4) one.x4 = job->x4 + seg;
        if (job->x6) one.x6 = job->x6 + seg;
        run_group(&one, seg, g, acc, u);
        return;
    }
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
    int8_t *t32, *t256; /* the activations in the tiles' layout (AMX), or NULL */
    int64_t row_tiles;
};

static void quantize_task(void *context, int64_t r) {
    const struct quantize_job *job = context;
    const struct acts *a32 = &job->a[r], *a256 = &job->a[job->m + r];
#if BG_AMX
    if (job->t32 || job->t256) { /* on the tiles: q only in the tiles' layout (through a row's buffer) */
        int8_t *row = (int8_t *)amx_scratch((size_t)job->k);
        if (job->need32) {
            quantize_blocks(job->x + r * job->ldx, job->k, 32, row, (float *)a32->d, (int16_t *)a32->s16);
            amx_tile_row(row, job->k, r, Q32, job->row_tiles, job->t32);
        }
        if (job->need256) {
            quantize_blocks(job->x + r * job->ldx, job->k, 256, row, (float *)a256->d, (int16_t *)a256->s16);
            amx_tile_row(row, job->k, r, QK, job->row_tiles, job->t256);
            if (job->need_x4) x8_order(row, a256->s16, job->k, 32, NULL, (int32_t *)job->xa[r].pairs);
            if (job->need_x6) x8_order(row, a256->s16, job->k, 16, NULL, (int32_t *)job->xa[job->m + r].pairs);
        }
        return;
    }
#endif
    if (job->need32) quantize_blocks(job->x + r * job->ldx, job->k, 32, (int8_t *)a32->q, (float *)a32->d, (int16_t *)a32->s16);
    if (!job->need256) return;
    quantize_blocks(job->x + r * job->ldx, job->k, 256, (int8_t *)a256->q, (float *)a256->d, (int16_t *)a256->s16);
    if (job->need_x4) x8_order(a256->q, a256->s16, job->k, 32, (int8_t *)job->xa[r].q, (int32_t *)job->xa[r].pairs);
    if (job->need_x6)
        x8_order(a256->q, a256->s16, job->k, 16, (int8_t *)job->xa[job->m + r].q, (int32_t *)job->xa[job->m + r].pairs);
}

static int linear_call(const float *x, int64_t m, int64_t k, int64_t ldx, int nseg, const uint8_t *const *data,
                       const int *types, const int64_t *ns, const float *bias, float *out, int64_t ldo, int threads,
                       int per_segment_rows) {
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
#if BG_AMX
    int amx = !per_segment_rows && amx_runs(m, nseg, types);
#else
    int amx = 0;
#endif
    int8_t *q = malloc(amx ? 1 : (size_t)(m * k * 2) + 1); /* (on the tiles: their layout alone, below) */
    float *d = malloc(sizeof(float) * (size_t)(m * (k / 32 + k / 256) + 1));
    int16_t *s16 = malloc(sizeof(int16_t) * (size_t)(m * (k / 16) * 2 + 1));
    struct acts *a = malloc(sizeof(struct acts) * (size_t)(2 * m));
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(2 * nseg + 1));
    if (!q || !d || !s16 || !a || !starts) {
        free(q), free(d), free(s16), free(a), free(starts);
        return -2;
    }
    /* on the tiles: the activations in their layout too, the rows padded to 32 (with zeros: the padding
     * rows' sums are computed and never stored) */
    int64_t padded = (m + 31) / 32 * 32;
    int8_t *tiled = amx ? aligned_alloc(64, (size_t)(padded * k * 2)) : NULL;
    if (amx && !tiled) {
        free(q), free(d), free(s16), free(a), free(starts);
        return -2;
    }
    int8_t *t32 = amx && need32 ? tiled : NULL, *t256 = amx && need256 ? tiled + padded * k : NULL;
    /* the repacked types' order of the same q (and their pair sums) */
    int need_x8 = need_x4 || need_x6;
    int reorder = need_x8 && !BG_VNNI; /* (VNNI reads q in its own order: no reordered copy) */
    int8_t *xq = reorder ? malloc((size_t)(2 * m * k)) : NULL;
    int32_t *xp = need_x8 ? malloc(sizeof(int32_t) * (size_t)(m * (k / 64 + k / 32))) : NULL;
    struct x8acts *xa = need_x8 ? malloc(sizeof(struct x8acts) * (size_t)(2 * m)) : NULL;
    if (need_x8 && ((reorder && !xq) || !xp || !xa)) {
        free(q), free(d), free(s16), free(a), free(starts), free(xq), free(xp), free(xa), free(tiled);
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
    struct quantize_job quantize = {x, k, ldx, m, need32, need256, need_x4, need_x6, a, xa, t32, t256, padded / 16};
    pool_for(m >= 8 ? threads : 1, m, quantize_task, &quantize); /* a few rows: not worth a hand-off */
#if BG_AMX
    if (amx && padded > m) {
        int8_t *zeros = calloc((size_t)k, 1);
        if (!zeros) abort();
        for (int64_t r = m; r < padded; r++) {
            if (t32) amx_tile_row(zeros, k, r, Q32, padded / 16, t32);
            if (t256) amx_tile_row(zeros, k, r, QK, padded / 16, t256);
        }
        free(zeros);
    }
#endif
    int64_t *group_start = starts + nseg, col = 0, groups = 0;
    for (int s = 0; s < nseg; s++) {
        starts[s] = col, group_start[s] = groups;
        col += ns[s], groups += (ns[s] + GROUP - 1) / GROUP;
    }
    int64_t per_task = groups / (threads * 8) > 0 ? groups / (threads * 8) : 1;
    struct job job = {m, k, a, a + m, xa, xa ? xa + m : NULL, nseg, data, types, ns, starts, bias, out, ldo,
                      per_task, groups, group_start, per_segment_rows};
#if BG_AMX
    if (amx) amx_run(&job, t32, t256, threads);
    else
#endif
        pool_for(threads, (groups + per_task - 1) / per_task, run_task, &job);
    free(q), free(d), free(s16), free(a), free(starts), free(xq), free(xp), free(xa), free(tiled);
    return 0;
}

int block_linear(const float *x, int64_t m, int64_t k, int64_t ldx, int nseg, const uint8_t *const *data,
                 const int *types, const int64_t *ns, const float *bias, float *out, int64_t ldo, int threads) {
    return linear_call(x, m, k, ldx, nseg, data, types, ns, bias, out, ldo, threads, 0);
}

/* Segment s times row s of x (m == nseg rows), the outputs side by side in one row of `out`: a MoE
 * decode row's k down projections, each expert's weights on its own input, in one call. Every output
 * is the one-row call's (the same quantized row, integers and chain: run_group runs the m == 1 path
 * on row s). Returns block_linear's codes, -1 also where m != nseg. */
int block_linear_rows(const float *x, int64_t m, int64_t k, int64_t ldx, int nseg, const uint8_t *const *data,
                      const int *types, const int64_t *ns, const float *bias, float *out, int threads) {
    if (m != nseg) return -1;
    return linear_call(x, m, k, ldx, nseg, data, types, ns, bias, out, 0, threads, 1);
}
