/* One decoder layer of a Llama-family model (Llama, SmolLM2, Qwen2) on a GGUF's blocks, in one call.
 *
 * Why: a decode or verify pass of a small model is mostly not arithmetic. SmolLM2-135M's one-row
 * pass on 2 cores took ~10 ms, of which the block kernels were ~4 ms: the rest was Python and torch
 * between ~10 C calls a layer (module calls, views, splits, empty tensors, ctypes argument
 * conversion). llama.cpp's whole token took ~9.4 ms. Here the layer's kernels run back to back
 * from C, each the very function the layer's torch modules call (rms_norm, block_linear, rope,
 * lane_attention, silu_mul; declared once in layer_kernels.h) with the same arguments, in the same
 * order, and the two residual adds are one IEEE addition an element, as torch's are. So every bit
 * of a row is the one the module path gives (tests/engine/test_decoder_layer.py compares them
 * across widths, lanes and threads): row-exact by construction, as each kernel is.
 *
 * The layer, as llama.DecoderLayer computes it (h: the rows of every lane of the pass):
 *   a = rms_norm(h) ; [q k v] = a Wqkv (+ bias) ; q, k = rope(q), rope(k)
 *   o = lane_attention(q, k, v) (storing k, v in each lane's cache) ; h' = h + o Wo
 *   a = rms_norm(h') ; [g u] = a Wgate_up ; out = h' + (silu(g) * u) Wdown
 * The scratch rows are allocated per call (a few hundred KB at decode widths).
 */
#include <stdint.h>
#include <stdlib.h>

#include "layer_kernels.h"

/* One block_linear's weights: a BlockLinear's segments, outputs side by side. */
struct block_gemm_args {
    const uint8_t *const *data;
    const int *types;
    const int64_t *ns;
    const float *bias; /* NULL: none */
    int64_t n;         /* the segments' outputs together */
    int64_t nseg;
};

/* What a layer keeps from one pass to the next (kernels/decoder_layer.py fills it). */
struct decoder_layer {
    const float *input_norm, *post_norm;
    float eps, scale;
    int64_t hidden, heads, kv_heads, head_dim, intermediate, window;
    struct block_gemm_args qkv, o, gate_up, down;
};

static int linear(const struct block_gemm_args *w, const float *x, int64_t m, int64_t k, float *out, int threads) {
    return block_linear(x, m, k, k, (int)w->nseg, w->data, w->types, w->ns, w->bias, out, w->n, threads);
}

static void add_rows(float *out, const float *x, const float *y, int64_t count) {
    for (int64_t i = 0; i < count; i++) out[i] = x[i] + y[i];
}

/* out [m, hidden]: the layer over h [m, hidden], the a pass's rows at `positions` (RoPE tables cos / sin
 * [length, head_dim]), each lane's rows (begin, rows, start) attending to its own cache
 * (capacity, keys, values: this layer's, as LaneTable holds them; half: float16 cache; blocked:
 * keys in blocks of 16 positions). 0, or -1 (a position outside the tables, a weight the block
 * kernels cannot run) or -2 (no memory): the caller raises. */
int decoder_layer(const struct decoder_layer *layer, const float *h, float *out, int64_t m, const int64_t *positions,
                  const float *cos, const float *sin, int64_t length, int64_t lanes, const int64_t *begin,
                  const int64_t *rows, const int64_t *start, const int64_t *capacity, const int64_t *keys,
                  const int64_t *values, int64_t half, int64_t blocked, int threads) {
    int64_t hidden = layer->hidden, d = layer->head_dim, heads = layer->heads, kv_heads = layer->kv_heads;
    int64_t q_size = heads * d, kv_size = kv_heads * d, qkv_size = layer->qkv.n, inter = layer->intermediate;
    if (qkv_size != q_size + 2 * kv_size || layer->o.n != hidden || layer->gate_up.n != 2 * inter ||
        layer->down.n != hidden)
        return -1;
    int64_t widest = qkv_size > 2 * inter ? qkv_size : 2 * inter;
    /* normed [m, hidden], wide (qkv or gate_up), q [m, q_size], k [m, kv_size], attended [m, q_size]
     * (then the gated rows [m, inter] over q and attended), projected [m, hidden] */
    int64_t gated_room = 2 * q_size > inter ? 2 * q_size : inter;
    float *scratch = malloc(sizeof(float) * (size_t)(m * (2 * hidden + widest + kv_size + gated_room)) + 1);
    if (!scratch) return -2;
    float *normed = scratch, *wide = normed + m * hidden, *k = wide + m * widest, *q = k + m * kv_size;
    float *attended = q + m * q_size, *gated = q, *projected = q + m * gated_room;
    int status = -1;

    rms_norm(h, m, hidden, layer->input_norm, layer->eps, 0, normed, threads);
    if ((status = linear(&layer->qkv, normed, m, hidden, wide, threads))) goto done;
    status = -1;
    if (rope(wide, m, heads, d, qkv_size, positions, cos, sin, length, q, threads)) goto done;
    if (rope(wide + q_size, m, kv_heads, d, qkv_size, positions, cos, sin, length, k, threads)) goto done;
    lane_attention(q, attended, heads, kv_heads, d, lanes, begin, rows, start, capacity, keys, values, layer->scale,
                   layer->window, threads, half, k, kv_size, wide + q_size + kv_size, qkv_size, blocked);
    if ((status = linear(&layer->o, attended, m, q_size, projected, threads))) goto done;
    add_rows(out, h, projected, m * hidden);

    rms_norm(out, m, hidden, layer->post_norm, layer->eps, 0, normed, threads);
    if ((status = linear(&layer->gate_up, normed, m, hidden, wide, threads))) goto done;
    silu_mul(wide, wide + inter, m, inter, 2 * inter, gated, threads);
    if ((status = linear(&layer->down, gated, m, inter, projected, threads))) goto done;
    add_rows(out, out, projected, m * hidden);
done:
    free(scratch);
    return status;
}
