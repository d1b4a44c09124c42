/* Per-row work around an int8 GEMM, in plain C: one call instead of a dozen torch ops.
 *
 * Every operation is a single IEEE operation per element in a fixed order (compiled with
 * -ffp-contract=off and without -ffast-math, so no fused multiply-adds or reassociation), and no
 * value depends on any other row: the same bits as kernels/int8_linear.py's torch fallback.
 */
#include <math.h>
#include <stdint.h>

#include "int8_rows.h"
#include "pool.h"
#include "vector16.h"


/* Elements per task of the kernels' pool (speed only: any split gives the same bits). */
#define GRAIN 16384

struct quantize_job {
    const float *x;
    int64_t m, k;
    int8_t *halves;
    float *scales;
};

/* One row: its scale (max |x| / ACT_LEVELS, 1 for a zero row) and its 16-bit integers as int8
 * halves hi, lo (q = 256 hi + lo), each EXP_BLOCK-wide block of them rounded to 8 significant bits
 * (see int8_rows.h); with `mantissas` and `exps` (both or neither), the blocks' int8 mantissas and
 * exponents too, and then hi and lo may be NULL (the block kernel reads only the blocks). Shared with int8_gemm.c's fused linear (int8_rows.h). */
float quantize_one(const float *row, int64_t k, int8_t *hi, int8_t *lo, int8_t *mantissas, uint8_t *exps) {
    /* The largest |x| (NaN never taken: x > amax is false). A maximum does not depend on the
     * order it is taken in, so 16 running maxima and then their maximum give the scalar loop's
     * value, without its chain of dependent compares (4 cycles each, most of a row's time). */
    vf top = (vf){0};
    int64_t j = 0;
    for (; j + W <= k; j += W) {
        vf a = (vf)((vi)load(row + j) & ((vi){0} + 0x7fffffff)); /* |x|: the sign bit cleared, as fabsf */
        top = (vf)(((vi)a & (a > top)) | ((vi)top & ~(a > top)));
    }
    float amax = 0.0f;
    for (int i = 0; i < W; i++) amax = top[i] > amax ? top[i] : amax;
    for (; j < k; j++) {
        float a = fabsf(row[j]);
        amax = a > amax ? a : amax;
    }
    float scale = amax / (float)ACT_LEVELS;
    if (!(scale > 0.0f)) scale = 1.0f;
    for (int64_t b0 = 0; b0 < k; b0 += EXP_BLOCK) {
        int64_t b1 = b0 + EXP_BLOCK < k ? b0 + EXP_BLOCK : k;
        int32_t q[EXP_BLOCK], biggest = 0;
        for (int64_t j = b0; j < b1; j++) {
            float v = nearbyintf(row[j] / scale);
            v = v < -ACT_LEVELS ? -ACT_LEVELS : (v > ACT_LEVELS ? ACT_LEVELS : v);
            int32_t qi = (int32_t)v, a = qi < 0 ? -qi : qi;
            q[j - b0] = qi;
            biggest = a > biggest ? a : biggest;
        }
        int e = 0;
        while (e < 8 && biggest > (MANTISSA_LEVELS << e)) e++;
        if (exps) exps[b0 / EXP_BLOCK] = (uint8_t)e;
        for (int64_t j = b0; j < b1; j++) {
            /* q / 2^e is exact in float (|q| < 2^15), rounded half to even as torch.round does */
            int32_t mantissa = (int32_t)nearbyintf((float)q[j - b0] / (float)(1 << e));
            if (hi) {
                int32_t qi = mantissa * (1 << e);
                int32_t h = (qi + HALF / 2) >> 8; /* floor division by 256 (arithmetic shift) */
                hi[j] = (int8_t)h;
                lo[j] = (int8_t)(qi - h * HALF);
            }
            if (mantissas) mantissas[j] = (int8_t)mantissa;
        }
    }
    return scale;
}

/* Columns from..to-1 of one row: y = float(unit * hi + lo) * row_scale * weight_scale (+ bias); unit
 * is HALF for sums of the halves, CHUNK_UNIT for the block kernel's two sums (int8_gemm.c): either
 * way the exact integer sum of the row's 16-bit integers times the weights, converted once. */
void combine_span(const int32_t *hi, const int32_t *lo, int64_t unit, int64_t from, int64_t to, float row_scale,
                  const float *weight_scales, const float *bias, float *y) {
    for (int64_t j = from; j < to; j++) {
        float c = (float)((int64_t)hi[j] * unit + (int64_t)lo[j]);
        float v = (c * row_scale) * weight_scales[j];
        y[j] = bias ? v + bias[j] : v;
    }
}

static void quantize_row(void *context, int64_t i) {
    const struct quantize_job *job = context;
    int64_t k = job->k;
    job->scales[i] = quantize_one(job->x + i * k, k, job->halves + i * k, job->halves + (job->m + i) * k, NULL, NULL);
}

/* x [m, k] float32 -> halves [2m, k] int8 (hi rows, then lo rows), scales [m]; a row per task. */
void quantize_rows(const float *x, int64_t m, int64_t k, int8_t *halves, float *scales, int threads) {
    struct quantize_job job = {x, m, k, halves, scales};
    int64_t most = m * k / GRAIN > 0 ? m * k / GRAIN : 1;
    pool_for(threads < most ? threads : (int)most, m, quantize_row, &job);
}

struct combine_job {
    const int32_t *sums;
    int64_t m, n, blocks;
    const float *row_scales, *weight_scales, *bias;
    float *out;
};

static void combine_block(void *context, int64_t t) {
    const struct combine_job *job = context;
    int64_t n = job->n, i = t / job->blocks, from = (t % job->blocks) * GRAIN, to = from + GRAIN < n ? from + GRAIN : n;
    combine_span(job->sums + i * n, job->sums + (job->m + i) * n, HALF, from, to, job->row_scales[i], job->weight_scales,
                 job->bias, job->out + i * n);
}

/* sums [2m, n] int32 -> out [m, n] float32 = float(256 * hi + lo) * row_scale * weight_scale (+ bias);
 * blocks of GRAIN columns of a row per task. */
void combine(const int32_t *sums, int64_t m, int64_t n, const float *row_scales, const float *weight_scales,
             const float *bias, float *out, int threads) {
    int64_t blocks = (n + GRAIN - 1) / GRAIN;
    struct combine_job job = {sums, m, n, blocks, row_scales, weight_scales, bias, out};
    pool_for(threads, m * blocks, combine_block, &job);
}
