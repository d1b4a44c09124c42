"""Op by op: rows 1..32 of a multi-row call against one-row calls, bit for bit.

Elementwise ops, norms, RoPE, the row-exact attention and the int8 linear layers must hold at
every width. The BLAS's float matmul holds only up to a width that depends on its micro-kernel,
which is why the model's linear layers run on integer arithmetic.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from agentfold.kernels.attention import row_exact_sdpa
from agentfold.kernels.mlx_int8 import ExactLinear

WIDTHS = range(1, 33)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 576, 9, 3, 64  # SmolLM2-135M's shapes


def _rows_equal(batched: mx.array, singles: list[mx.array]) -> bool:
    return all(np.array_equal(np.array(batched[j]), np.array(singles[j][0])) for j in range(len(singles)))


@pytest.fixture(scope="module")
def x() -> mx.array:
    mx.random.seed(3)
    return mx.random.normal((32, HIDDEN))


def test_rms_norm_rows(x):
    weight = mx.random.normal((HIDDEN,))
    singles = [mx.fast.rms_norm(x[j : j + 1], weight, 1e-5) for j in range(32)]
    for width in WIDTHS:
        assert _rows_equal(mx.fast.rms_norm(x[:width], weight, 1e-5), singles[:width]), width


def test_swiglu_rows(x):
    gate, up = x, x[::-1]
    singles = [(mx.sigmoid(gate[j : j + 1]) * gate[j : j + 1]) * up[j : j + 1] for j in range(32)]
    for width in WIDTHS:
        assert _rows_equal((mx.sigmoid(gate[:width]) * gate[:width]) * up[:width], singles[:width]), width


def test_rope_rows():
    """Row j of a pass at offset o is rotated exactly like a one-row step at offset o + j."""
    mx.random.seed(4)
    q = mx.random.normal((1, HEADS, 32, HEAD_DIM))
    offset = 517
    singles = [mx.fast.rope(q[:, :, j : j + 1], HEAD_DIM, traditional=False, base=100000.0, scale=1.0,
                            offset=offset + j) for j in range(32)]
    for width in WIDTHS:
        batched = mx.fast.rope(q[:, :, :width], HEAD_DIM, traditional=False, base=100000.0, scale=1.0, offset=offset)
        for j in range(width):
            assert np.array_equal(np.array(batched[:, :, j]), np.array(singles[j][:, :, 0])), (width, j)


def test_embedding_rows():
    mx.random.seed(5)
    table = mx.random.normal((1000, HIDDEN))
    ids = mx.array(np.random.default_rng(0).integers(0, 1000, size=32))
    singles = [table[ids[j : j + 1]] for j in range(32)]
    for width in WIDTHS:
        assert _rows_equal(table[ids[:width]], singles[:width]), width


def test_row_exact_attention_rows():
    """Each row of the row-exact attention equals a one-row decode step over the same keys."""
    mx.random.seed(6)
    past = 300
    keys = mx.random.normal((1, KV_HEADS, past + 32, HEAD_DIM))
    values = mx.random.normal((1, KV_HEADS, past + 32, HEAD_DIM))
    queries = mx.random.normal((1, HEADS, 32, HEAD_DIM))
    scale = HEAD_DIM**-0.5
    sdpa = row_exact_sdpa(lambda *a, **k: mx.fast.scaled_dot_product_attention(*a, scale=k["scale"], mask=k["mask"]))
    singles = [mx.fast.scaled_dot_product_attention(queries[:, :, j : j + 1], keys[:, :, : past + j + 1],
                                                    values[:, :, : past + j + 1], scale=scale, mask=None)
               for j in range(32)]
    for width in WIDTHS:
        out = sdpa(queries[:, :, :width], keys[:, :, : past + width], values[:, :, : past + width],
                   cache=None, scale=scale, mask="causal")
        for j in range(width):
            assert np.array_equal(np.array(out[:, :, j]), np.array(singles[j][:, :, 0])), (width, j)


def _widest_exact(run, x: mx.array) -> int:
    singles = [run(x[j : j + 1]) for j in range(32)]
    widest = 0
    for width in WIDTHS:
        if not _rows_equal(run(x[:width]), singles[:width]):
            break
        widest = width
    return widest


def test_engine_never_verifies_wider_than_its_linear_layers_hold(x, smollm2_mlx_engine):
    """Every linear shape of the model holds at every width up to 32: int8 arithmetic, whatever the
    BLAS's float matmul does on this CPU (on an Intel Xeon its float32 matmul differs at 2 rows)."""
    mx.random.seed(7)
    vocab = smollm2_mlx_engine.backend.vocab_size
    assert smollm2_mlx_engine.backend.describe()["linear"].startswith("mlx_int8")
    shapes = [(HIDDEN, HIDDEN), (KV_HEADS * HEAD_DIM, HIDDEN), (1536, HIDDEN), (vocab, HIDDEN)]
    widest = min(_widest_exact(ExactLinear(mx.random.normal(shape)), x) for shape in shapes)
    down = ExactLinear(mx.random.normal((HIDDEN, 1536)))
    widest = min(widest, _widest_exact(down, mx.random.normal((32, 1536))))
    assert widest == 32
    assert smollm2_mlx_engine.exactness.max_width <= widest
    weight = mx.random.normal((1536, HIDDEN))
    float_widest = _widest_exact(lambda rows: rows @ weight.T, x)
    print(f"float32 BLAS matmul row-exact up to {float_widest} rows here (reported, not relied on)")
