/* The 16-lane float vector the row kernels compute with (GCC / Clang vector extensions: the
 * compiler maps it to AVX-512, two AVX registers or plain scalars, every lane one IEEE operation
 * either way), and its unaligned load, store and broadcast. Shared by rowwise.c and
 * lane_attention.c. */
#ifndef AGENTFOLD_VECTOR16_H
#define AGENTFOLD_VECTOR16_H

#include <stdint.h>
#include <string.h>

#define W 16
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* x in every lane: x - 0 is x exactly (-0 included), which the compiler emits as a plain broadcast
 * (0 + x would be an addition, slower, and +0 for -0) */
static inline vf splat(float x) { return x - (vf){0}; }

#endif
