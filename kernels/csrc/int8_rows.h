/* The per-row arithmetic of the int8 linear layers (csrc/int8_rows.c), shared by the fused
 * linear of csrc/int8_gemm.c, so that both compute the very same IEEE operations. */
#ifndef AGENTFOLD_INT8_ROWS_H
#define AGENTFOLD_INT8_ROWS_H

#include <stdint.h>

#define HALF 256
#define ACT_LEVELS (127 * HALF)
/* A row's 16-bit integers keep 8 significant bits per block of EXP_BLOCK: q = mantissa * 2^e with
 * |mantissa| <= MANTISSA_LEVELS and e in 0..8, the block's smallest e that holds its largest |q|.
 * They are still 16-bit integers (so every path's exact sums hold), but each block is also one
 * int8 row times a power of two: what int8_gemm.c's block kernel multiplies, one pass instead of
 * the two halves'. */
#define EXP_BLOCK 64
#define MANTISSA_LEVELS 127
#define CHUNK_UNIT 16 /* the block kernel's sums: unit * (blocks with e >= 4) + (blocks with e < 4) */

/* One row's scale, and its 16-bit integers as int8 halves hi, lo (q = 256 hi + lo); with
 * mantissas and exps (else NULL), each block's int8 mantissas and exponent (hi, lo then may be NULL). */
float quantize_one(const float *row, int64_t k, int8_t *hi, int8_t *lo, int8_t *mantissas, uint8_t *exps);

/* Columns from..to-1 of one row: y = float(unit * hi + lo) * row_scale * weight_scale (+ bias). */
void combine_span(const int32_t *hi, const int32_t *lo, int64_t unit, int64_t from, int64_t to, float row_scale,
                  const float *weight_scales, const float *bias, float *y);

#endif
