/* The per-row arithmetic of the int8 linear layers (csrc/int8_rows.c), shared by the fused
 * linear of csrc/int8_gemm.c, so that both compute the very same IEEE operations. */
#ifndef AGENTFOLD_INT8_ROWS_H
#define AGENTFOLD_INT8_ROWS_H

#include <stdint.h>

#define HALF 256
#define ACT_LEVELS (127 * HALF)

/* One row's scale, and its 16-bit integers as int8 halves hi, lo (q = 256 hi + lo). */
float quantize_one(const float *row, int64_t k, int8_t *hi, int8_t *lo);

/* Columns from..to-1 of one row: y = float(256 * hi + lo) * row_scale * weight_scale (+ bias). */
void combine_span(const int32_t *hi, const int32_t *lo, int64_t from, int64_t to, float row_scale,
                  const float *weight_scales, const float *bias, float *y);

#endif
