/* Per-row work around an int8 GEMM, in plain C: one call instead of a dozen torch ops.
 *
 * Every operation is a single IEEE operation per element in a fixed order (compiled with
 * -ffp-contract=off and without -ffast-math, so no fused multiply-adds or reassociation), and no
 * value depends on any other row: the same bits as kernels/int8_linear.py's torch fallback.
 */
#include <math.h>
#include <stdint.h>

#define HALF 256
#define ACT_LEVELS (127 * HALF)

/* x [m, k] float32 -> halves [2m, k] int8 (hi rows, then lo rows), scales [m]. */
void quantize_rows(const float *x, int64_t m, int64_t k, int8_t *halves, float *scales) {
    for (int64_t i = 0; i < m; i++) {
        const float *row = x + i * k;
        float amax = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            float a = fabsf(row[j]);
            amax = a > amax ? a : amax;
        }
        float scale = amax / (float)ACT_LEVELS;
        if (!(scale > 0.0f)) scale = 1.0f;
        scales[i] = scale;
        int8_t *hi = halves + i * k, *lo = halves + (m + i) * k;
        for (int64_t j = 0; j < k; j++) {
            float q = nearbyintf(row[j] / scale);
            q = q < -ACT_LEVELS ? -ACT_LEVELS : (q > ACT_LEVELS ? ACT_LEVELS : q);
            int32_t qi = (int32_t)q;
            int32_t h = (qi + HALF / 2) >> 8; /* floor division by 256 (arithmetic shift) */
            hi[j] = (int8_t)h;
            lo[j] = (int8_t)(qi - h * HALF);
        }
    }
}

/* sums [2m, n] int32 -> out [m, n] float32 = float(256 * hi + lo) * row_scale * weight_scale (+ bias). */
void combine(const int32_t *sums, int64_t m, int64_t n, const float *row_scales, const float *weight_scales,
             const float *bias, float *out) {
    for (int64_t i = 0; i < m; i++) {
        const int32_t *hi = sums + i * n, *lo = sums + (m + i) * n;
        float rs = row_scales[i];
        float *y = out + i * n;
        for (int64_t j = 0; j < n; j++) {
            float c = (float)((int64_t)hi[j] * HALF + (int64_t)lo[j]);
            float v = (c * rs) * weight_scales[j];
            y[j] = bias ? v + bias[j] : v;
        }
    }
}
