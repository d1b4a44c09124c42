/* The row-wise ops of a decoder layer (RMSNorm, SiLU / GELU-tanh times up, RoPE), one C call each
 * (the torch backend on CPU).
 *
 * Row-exact by construction: every output row is computed from its own input row (and the shared
 * weights / tables) by a fixed sequence of IEEE operations that does not depend on the other rows,
 * the row count, the thread count or where an element sits in its row:
 *
 * - reductions (rms_norm's sum of squares) run over 16-wide vector lanes, one row on one thread,
 *   then a fixed tree (hsum); the last partial chunk of a row is zero-padded to a whole vector, so
 *   there is no scalar tail with another order;
 * - elementwise transcendental ops (silu_mul, gelu_tanh_mul) apply one vector function to every
 *   16 elements, the last partial chunk of a row zero-padded into a vector: every element goes
 *   through the same instructions whatever its column. The exponential is our own (Cephes'
 *   polynomial, `one_plus_exp`), not libm's or Sleef's, so no vector / scalar pair can differ;
 * - rope is a multiply, a multiply and an add per element, the same bits in any form.
 *
 * Compiled with -ffp-contract=off and without -ffast-math (kernels/native.py): the compiler fuses
 * no multiply-adds, reassociates nothing and keeps divisions and square roots correctly rounded,
 * so each C operation below is one IEEE operation and the bits are the same on any CPU (no FMA is
 * used anywhere here, unlike lane_attention.c). Threads split rows (or, for the elementwise ops,
 * 16-aligned column blocks of rows): which thread computes an element changes nothing.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "layer_kernels.h"
#include "pool.h"
#include "vector16.h"

#define BLOCK 1024 /* columns per elementwise task (a multiple of W) */
/* Elements per thread (speed only: which thread computes a row or block changes no bit): a team
 * is at most `threads` strong, one thread per EXP_GRAIN elements of a transcendental op (a
 * fork / join costs about as much as exp over a few thousand floats), per MUL_GRAIN of the others. */
#ifndef EXP_GRAIN
#define EXP_GRAIN 2048
#endif
#ifndef MUL_GRAIN
#define MUL_GRAIN 16384
#endif

/* the first k < W elements at p, the other lanes 0 */
static inline vf load_part(const float *p, int64_t k) {
    float a[W] = {0};
    memcpy(a, p, sizeof(float) * (size_t)k);
    return load(a);
}

static inline void store_part(float *p, vf v, int64_t k) {
    float a[W];
    store(a, v);
    memcpy(p, a, sizeof(float) * (size_t)k);
}

/* mask ? a : b, lane by lane (mask lanes are all ones or all zeros) */
static inline vf select(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

static inline int team(int threads, int64_t tasks, int64_t elements, int64_t grain) {
    int64_t most = elements / grain < tasks ? elements / grain : tasks;
    return most < 1 ? 1 : (most < threads ? (int)most : threads);
}

/* The 16 lanes of v summed as a fixed tree: (0+8, 1+9, ...), then halves again (lane_attention.c's). */
static inline float hsum(vf v) {
    float a[W];
    store(a, v);
    for (int width = W / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) a[i] = a[i] + a[i + width];
    return a[0];
}

/* 1 + exp(t), the denominator of silu and gelu, with Cephes expf's reduction and polynomial:
 *   t = min(t, 89) (NaN becomes 89: +inf below, and the caller's numerator g carries the NaN),
 *   t = max(t, -86) (below, exp(t) < 2^-124 and 1 + exp(t) is 1 either way);
 *   k = t * log2(e) + 1.5 * 2^23, n = k - 1.5 * 2^23 (t log2(e) rounded to an integer, to nearest);
 *   r = (t - n * 0.693359375) - n * -2.12194440e-4 (both products exact);
 *   p = (((((c5 r + c4) r + c3) r + c2) r + c1) r + c0) * (r * r) + r + 1, left to right, with
 *       c5..c0 = 1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
 *       1.6666665459e-1, 5.0000001201e-1;
 *   exp(t) = (p * 2^(n-1)) * 2 (2^(n-1) from the bits of k, n in -124..128: both scalings exact;
 *       the last overflows to +inf from t ~ 88.72 on, where exp(t) exceeds FLT_MAX);
 *   result 1 + exp(t). exp(t) is within ~1 ulp of the true value. */
static inline vf one_plus_exp(vf t) {
    t = select(t < splat(89.0f), t, splat(89.0f)); /* NaN: 89 */
    t = select(t > splat(-86.0f), t, splat(-86.0f));
    const vf magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    vf k = t * splat(1.44269504088896341f) + magic;
    vf n = k - magic;
    vf r = t - n * splat(0.693359375f);
    r = r - n * splat(-2.12194440e-4f);
    vf z = r * r;
    vf y = splat(1.9875691500e-4f);
    y = y * r + splat(1.3981999507e-3f);
    y = y * r + splat(8.3334519073e-3f);
    y = y * r + splat(4.1665795894e-2f);
    y = y * r + splat(1.6666665459e-1f);
    y = y * r + splat(5.0000001201e-1f);
    y = y * z + r + splat(1.0f);
    vi half_scale = ((vi)k + (126 - (vi)magic)) << 23; /* 2^(n-1): n + 126 in the exponent field, n in -124..128 */
    return splat(1.0f) + (y * (vf)half_scale) * splat(2.0f);
}

/* silu(g) * u = (g / (1 + exp(-g))) * u */
static inline vf silu_mul_v(vf g, vf u) { return (g / one_plus_exp(-g)) * u; }

/* gelu_tanh(g) * u: 0.5 g (1 + tanh(t)), t = sqrt(2/pi) (g + 0.044715 g^3), is g / (1 + exp(-2t)).
 * Computed as (g / (1 + exp(a * -1.5957691216057308))) * u with a = g + 0.044715 * ((g * g) * g): the
 * exponent is exactly -2 times torch's tanh argument fl(fl(sqrt(2/pi)) * a) (a power of two apart), and
 * the form has no cancellation where tanh(t) is near -1 (gates below ~ -1), which 1 + tanh(t) has. */
static inline vf gelu_tanh_mul_v(vf g, vf u) {
    vf a = g + splat(0.044715f) * ((g * g) * g);
    return (g / one_plus_exp(a * splat(-1.5957691216057308f))) * u;
}

/* x [m, d] -> out [m, d]: per row, s = hsum(lanes l: sum over chunks c, in order, of x[16c+l]^2,
 * the last chunk zero-padded), r = 1 / sqrtf(s / d + eps), out = (x * r) * w with w = weight, or
 * (1 + weight) computed in float32 when add_one (Gemma's norm, as gemma3.GemmaRMSNorm's
 * 1.0 + weight.float()). torch's float32 expression x * rsqrt(mean(x^2) + eps) * w differs only in
 * the order of the sum (its rsqrt is 1 / sqrt too). */
struct norm_job {
    const float *x, *weight;
    int64_t d;
    float eps;
    int64_t add_one;
    float *out;
};

static void norm_row(void *context, int64_t i) {
    const struct norm_job *job = context;
    int64_t d = job->d, whole = d - d % W, tail = d - whole, add_one = job->add_one;
    const float *row = job->x + i * d, *weight = job->weight;
    float *o = job->out + i * d;
    vf acc = {0};
    for (int64_t c = 0; c < whole; c += W) {
        vf v = load(row + c);
        acc = acc + v * v;
    }
    if (tail) {
        vf v = load_part(row + whole, tail);
        acc = acc + v * v;
    }
    float mean = hsum(acc) / (float)d;
    float r = 1.0f / sqrtf(mean + job->eps);
    vf vr = splat(r), one = splat(add_one ? 1.0f : 0.0f);
    for (int64_t c = 0; c < whole; c += W) {
        vf w = add_one ? one + load(weight + c) : load(weight + c);
        store(o + c, (load(row + c) * vr) * w);
    }
    for (int64_t c = whole; c < d; c++) {
        float w = add_one ? 1.0f + weight[c] : weight[c];
        o[c] = (row[c] * r) * w;
    }
}

void rms_norm(const float *x, int64_t m, int64_t d, const float *weight, float eps, int64_t add_one, float *out,
              int threads) {
    struct norm_job job = {x, weight, d, eps, add_one, out};
    pool_for(team(threads, m, m * d, MUL_GRAIN), m, norm_row, &job);
}

/* out[i, j] = act(gate[i, j]) * up[i, j] for i < m, j < n; row i of gate / up at gate + i * stride,
 * up + i * stride; out [m, n] contiguous. */
struct gated_job {
    const float *gate, *up;
    int64_t n, stride, blocks;
    float *out;
    int kind;
};

static void gated_block(void *context, int64_t t) {
    const struct gated_job *job = context;
    int64_t n = job->n, i = t / job->blocks, from = (t % job->blocks) * BLOCK, to = from + BLOCK < n ? from + BLOCK : n;
    const float *g = job->gate + i * job->stride, *u = job->up + i * job->stride;
    float *o = job->out + i * n;
    int kind = job->kind;
    int64_t c = from;
    for (; c + W <= to; c += W) {
        vf gv = load(g + c), uv = load(u + c);
        store(o + c, kind ? gelu_tanh_mul_v(gv, uv) : silu_mul_v(gv, uv));
    }
    if (c < to) {
        vf gv = load_part(g + c, to - c), uv = load_part(u + c, to - c);
        store_part(o + c, kind ? gelu_tanh_mul_v(gv, uv) : silu_mul_v(gv, uv), to - c);
    }
}

static void gated(const float *gate, const float *up, int64_t m, int64_t n, int64_t stride, float *out, int threads,
                  int kind) {
    int64_t blocks = (n + BLOCK - 1) / BLOCK, tasks = m * blocks;
    struct gated_job job = {gate, up, n, stride, blocks, out, kind};
    pool_for(team(threads, tasks, m * n, EXP_GRAIN), tasks, gated_block, &job);
}

void silu_mul(const float *gate, const float *up, int64_t m, int64_t n, int64_t stride, float *out, int threads) {
    gated(gate, up, m, n, stride, out, threads, 0);
}

void gelu_tanh_mul(const float *gate, const float *up, int64_t m, int64_t n, int64_t stride, float *out,
                   int threads) {
    gated(gate, up, m, n, stride, out, threads, 1);
}

/* Hugging Face's half-split rotary embedding: x [m, heads, d] (row i at x + i * x_stride, its heads
 * d apart), row i at position positions[i] of the tables cos / sin [length, d] -> out [m, heads, d]
 * contiguous. out[j] = x[j] * cos[j] + (-x[j + d/2]) * sin[j] for j < d/2, and
 * x[j] * cos[j] + x[j - d/2] * sin[j] above: llama.Rope.forward's xf * cos + rotate_half(xf) * sin,
 * the same three IEEE operations per element, so the same bits. Returns 0, or -1 (and writes
 * nothing) when a position lies outside 0..length-1 or d is odd. */
struct rope_job {
    const float *x;
    int64_t heads, d, x_stride;
    const int64_t *positions;
    const float *cos, *sin;
    float *out;
};

static void rope_row(void *context, int64_t i) {
    const struct rope_job *job = context;
    int64_t heads = job->heads, d = job->d, half = d / 2, whole = half - half % W;
    const float *c = job->cos + job->positions[i] * d, *s = job->sin + job->positions[i] * d;
    for (int64_t h = 0; h < heads; h++) {
        const float *a = job->x + i * job->x_stride + h * d, *b = a + half;
        float *lo = job->out + (i * heads + h) * d, *hi = lo + half;
        for (int64_t j = 0; j < whole; j += W) {
            vf av = load(a + j), bv = load(b + j);
            store(lo + j, av * load(c + j) + (-bv) * load(s + j));
            store(hi + j, bv * load(c + half + j) + av * load(s + half + j));
        }
        for (int64_t j = whole; j < half; j++) {
            lo[j] = a[j] * c[j] + (-b[j]) * s[j];
            hi[j] = b[j] * c[half + j] + a[j] * s[half + j];
        }
    }
}

int rope(const float *x, int64_t m, int64_t heads, int64_t d, int64_t x_stride, const int64_t *positions,
         const float *cos, const float *sin, int64_t length, float *out, int threads) {
    if (d % 2) return -1;
    for (int64_t i = 0; i < m; i++)
        if (positions[i] < 0 || positions[i] >= length) return -1;
    struct rope_job job = {x, heads, d, x_stride, positions, cos, sin, out};
    pool_for(team(threads, m, m * heads * d, MUL_GRAIN), m, rope_row, &job);
    return 0;
}

/* A small float linear layer row by row: out[i, j] = (sum over t of x[i, t] * wt[t, j]) (+ bias[j]),
 * for a MoE router ([hidden, experts] transposed weights, a few MB at most): every output's sum runs
 * over t from 0 in order, one multiply and one add a step (no FMA: -ffp-contract=off), then the bias;
 * in 8-wide vectors of outputs, which changes nothing (each lane is its own chain). So a row's bits
 * are the one-row call's whatever the row count or thread, where a vendor GEMM picks kernels by the
 * row count (torch_cpu.aligned_mm calls it one row at a time for that: ~2,000 calls a 512-row chunk
 * on Qwen3-Coder-30B-A3B's 48 routers, 7% of its prefill).
 *
 * Order of the work (speed only): a task is up to TASK_ROWS rows, its outputs the running sums; t is
 * cut into chunks of CHUNK, and within a chunk 4 rows x 16 outputs at a time keep their sums in
 * registers while t runs through the chunk (each weight vector read once for 4 rows, the chunk's
 * weights read from L1 / L2 by every 4 rows of the task); a sum leaves a chunk where the next
 * takes it up, so every chain still runs t in order. */
typedef float v8 __attribute__((vector_size(32)));
#define TASK_ROWS 32
#define CHUNK 256

struct rows_job {
    const float *x, *wt, *bias;
    float *out;
    int64_t m, k, n;
};

static inline v8 load8(const float *p, int64_t count) {
    v8 v = {0};
    if (count == 8) memcpy(&v, p, sizeof v); /* (a constant size: one vector load) */
    else memcpy(&v, p, (size_t)count * sizeof(float));
    return v;
}

static inline void store8(float *p, v8 v, int64_t count) {
    if (count == 8) memcpy(p, &v, sizeof v);
    else memcpy(p, &v, (size_t)count * sizeof(float));
}

/* rows (<= 4) rows' 16 outputs from column j (cols of them) over t in [from, to). */
static inline void rows_slice(const struct rows_job *job, const float *x, float *out, int64_t rows, int64_t j,
                              int64_t from, int64_t to) {
    int64_t k = job->k, n = job->n, low = n - j < 8 ? n - j : 8, high = n - j - 8 < 0 ? 0 : (n - j - 8 < 8 ? n - j - 8 : 8);
    v8 acc[4][2] = {{{0}}};
    for (int64_t r = 0; r < rows; r++) {
        acc[r][0] = load8(out + r * n + j, low);
        if (high) acc[r][1] = load8(out + r * n + j + 8, high);
    }
    for (int64_t t = from; t < to; t++) {
        v8 w0 = load8(job->wt + t * n + j, low), w1 = high ? load8(job->wt + t * n + j + 8, high) : (v8){0};
        for (int64_t r = 0; r < rows; r++) {
            float xv = x[r * k + t];
            acc[r][0] = acc[r][0] + xv * w0;
            acc[r][1] = acc[r][1] + xv * w1;
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        store8(out + r * n + j, acc[r][0], low);
        if (high) store8(out + r * n + j + 8, acc[r][1], high);
    }
}

static void rows_task(void *context, int64_t task) {
    const struct rows_job *job = context;
    int64_t first = task * TASK_ROWS, rows = job->m - first < TASK_ROWS ? job->m - first : TASK_ROWS;
    int64_t k = job->k, n = job->n;
    float *out = job->out + first * n;
    memset(out, 0, (size_t)(rows * n) * sizeof(float));
    for (int64_t from = 0; from < k; from += CHUNK) {
        int64_t to = from + CHUNK < k ? from + CHUNK : k;
        for (int64_t j = 0; j < n; j += 16)
            for (int64_t r = 0; r < rows; r += 4)
                rows_slice(job, job->x + (first + r) * k, out + r * n, rows - r < 4 ? rows - r : 4, j, from, to);
    }
    if (job->bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < n; j++) out[r * n + j] = out[r * n + j] + job->bias[j];
}

void float_rows(const float *x, int64_t m, int64_t k, const float *wt, int64_t n, const float *bias, float *out,
                int threads) {
    struct rows_job job = {x, wt, bias, out, m, k, n};
    int64_t tasks = (m + TASK_ROWS - 1) / TASK_ROWS;
    pool_for(team(threads, tasks, m * k * n / 16, MUL_GRAIN), tasks, rows_task, &job);
}
