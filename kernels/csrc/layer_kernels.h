/* The kernels a decoder layer chains (csrc/decoder_layer.c), declared once: the files that define
 * them include this too, so a signature that drifts fails the build instead of a pass. */
#ifndef AGENTFOLD_LAYER_KERNELS_H
#define AGENTFOLD_LAYER_KERNELS_H

#include <stdint.h>

/* csrc/rowwise.c */
void rms_norm(const float *x, int64_t m, int64_t d, const float *weight, float eps, int64_t add_one, float *out,
              int threads);
void silu_mul(const float *gate, const float *up, int64_t m, int64_t n, int64_t stride, float *out, int threads);
int rope(const float *x, int64_t m, int64_t heads, int64_t d, int64_t x_stride, const int64_t *positions,
         const float *cos, const float *sin, int64_t length, float *out, int threads);

/* csrc/block_gemm.c */
int block_linear(const float *x, int64_t m, int64_t k, int64_t ldx, int nseg, const uint8_t *const *data,
                 const int *types, const int64_t *ns, const float *bias, float *out, int64_t ldo, int threads);

/* csrc/lane_attention.c */
void lane_attention(const float *q, float *out, int64_t heads, int64_t kv_heads, int64_t d, int64_t lanes,
                    const int64_t *begin, const int64_t *rows, const int64_t *start, const int64_t *capacity,
                    const int64_t *keys, const int64_t *values, float scale, int64_t window, int threads,
                    int64_t half, const float *new_keys, int64_t k_stride, const float *new_values,
                    int64_t v_stride, int64_t blocked);
/* lane_attention with the lanes of at least matrix_rows rows (0: none) on the matrix tiles where the
 * CPU has them (prefill chunks cut at the plan's boundaries only: kernels/torch_cpu.py) */
void lane_attention_prefill(const float *q, float *out, int64_t heads, int64_t kv_heads, int64_t d, int64_t lanes,
                            const int64_t *begin, const int64_t *rows, const int64_t *start, const int64_t *capacity,
                            const int64_t *keys, const int64_t *values, float scale, int64_t window, int threads,
                            int64_t half, const float *new_keys, int64_t k_stride, const float *new_values,
                            int64_t v_stride, int64_t blocked, int64_t matrix_rows);

#endif
