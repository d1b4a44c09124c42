"""The C lane attention (csrc/lane_attention.c): every row of every lane of a shared pass has the
bits of that row run alone, whatever the other lanes, the pass width or the thread count.

Shapes: SmolLM2's (9 heads over 3 kv heads, d 64), Gemma 3 270M's windowed layers (d 256), and
odd ones (d 24 and 17: a scalar tail; lengths that start and end inside a 16-key block).
"""

from __future__ import annotations

import pytest
import torch

from agentfold.engine.torch.models import ops
from agentfold.kernels import native, torch_cpu

pytestmark = pytest.mark.skipif(torch_cpu.lane_library() is None, reason="no C compiler here")

# (heads, kv_heads, d, window, lanes as (context length, rows))
CASES = [
    (9, 3, 64, None, [(100, 6), (37, 1), (5, 16)]),
    (4, 2, 24, None, [(300, 7)]),
    (4, 4, 17, None, [(0, 5), (3, 2), (15, 1)]),
    (4, 1, 256, 512, [(700, 3), (20, 4)]),
    (8, 2, 32, 8, [(40, 9), (9, 3), (0, 2)]),
]


def _pass(heads: int, kv_heads: int, d: int, shape: list[tuple[int, int]], seed: int = 0):
    """Query rows for a pass and each lane's (begin, rows, start, keys, values) on its own cache."""
    generator = torch.Generator().manual_seed(seed)
    lanes, begin = [], 0
    for length, rows in shape:
        capacity = -(-(length + rows) // 256) * 256
        keys = torch.randn(kv_heads, capacity, d, generator=generator)
        values = torch.randn(kv_heads, capacity, d, generator=generator)
        lanes.append((begin, rows, length, keys, values))
        begin += rows
    return torch.randn(begin, heads, d, generator=generator), lanes


@pytest.mark.parametrize("heads,kv_heads,d,window,shape", CASES, ids=[f"d{c[2]}-{len(c[4])}lanes" for c in CASES])
def test_every_row_equals_its_one_row_call(heads, kv_heads, d, window, shape, threads):
    q, lanes = _pass(heads, kv_heads, d, shape)
    together = torch_cpu.lane_attention(q, lanes, 0.125, window)
    for begin, rows, start, keys, values in lanes:
        for i in range(rows):
            alone = torch_cpu.lane_attention(q[begin + i : begin + i + 1], [(0, 1, start + i, keys, values)],
                                             0.125, window)
            assert torch.equal(together[begin + i], alone[0]), (begin, i)


@pytest.mark.parametrize("heads,kv_heads,d,window,shape", CASES, ids=[f"d{c[2]}-{len(c[4])}lanes" for c in CASES])
def test_lane_attention_is_attention(heads, kv_heads, d, window, shape):
    """The same numbers as torch's attention per row, up to float32 rounding (its own exp and sums)."""
    q, lanes = _pass(heads, kv_heads, d, shape, seed=1)
    together = torch_cpu.lane_attention(q, lanes, 0.125, window)
    for begin, rows, start, keys, values in lanes:
        for i in range(rows):
            p = start + i
            low = 0 if window is None else max(0, p - window + 1)
            row = torch_cpu.attend_row(q[begin + i], keys[:, low : p + 1], values[:, low : p + 1], 0.125)
            assert torch.allclose(together[begin + i], row, atol=2e-6, rtol=1e-5), (begin, i)


def test_the_other_lanes_and_their_order_change_nothing(threads):
    q, lanes = _pass(9, 3, 64, [(500, 8), (64, 8), (1000, 8), (1, 8)], seed=2)
    full = torch_cpu.lane_attention(q, lanes, 0.125, None)
    order = [2, 0, 3, 1]
    moved, begin = [], 0
    for index in order:
        _, rows, start, keys, values = lanes[index]
        moved.append((begin, rows, start, keys, values))
        begin += rows
    q_moved = torch.cat([q[lanes[i][0] : lanes[i][0] + lanes[i][1]] for i in order])
    again = torch_cpu.lane_attention(q_moved, moved, 0.125, None)
    for (begin, rows, *_), index in zip(moved, order, strict=True):
        assert torch.equal(again[begin : begin + rows], full[lanes[index][0] : lanes[index][0] + rows])


def test_it_declines_what_it_does_not_cover():
    """Prefill chunks, passes past PER_ROW_LIMIT and other dtypes go to torch's attention (None)."""
    q, lanes = _pass(4, 2, 32, [(10, 4)])
    with torch_cpu.prefill_chunk():
        assert torch_cpu.lane_attention(q, lanes, 0.125, None) is None
    wide, wide_lanes = _pass(4, 2, 32, [(10, torch_cpu.PER_ROW_LIMIT + 1)])
    assert torch_cpu.lane_attention(wide, wide_lanes, 0.125, None) is None
    half = [(b, r, s, k.bfloat16(), v.bfloat16()) for b, r, s, k, v in lanes]
    assert torch_cpu.lane_attention(q.bfloat16(), half, 0.125, None) is None
    assert torch_cpu.attention_kernel().startswith("lane_attention.c")


def test_without_the_library_each_lane_runs_torch_attention(monkeypatch):
    """`ops.lane_attention` falls back to torch's attention lane by lane: the same numbers."""
    q, lanes = _pass(9, 3, 64, [(100, 6), (37, 3)], seed=3)
    native_out = ops.lane_attention(q, lanes, 0.125)
    monkeypatch.setattr(torch_cpu, "lane_library", lambda: None)
    torch_out = ops.lane_attention(q, lanes, 0.125)
    assert torch.allclose(native_out, torch_out, atol=2e-6, rtol=1e-5) and not torch.equal(native_out, torch_out)
    assert torch_cpu.attention_kernel() == "torch per row"


def test_the_library_builds_where_a_compiler_is(tmp_path):
    assert native.compiler() is not None
    assert native.build("lane_attention", ["-fopenmp"], folder=tmp_path) is not None


def test_a_strided_cache_gives_the_same_bits():
    """The kernel is chosen by the model and the pass, never by a cache's memory layout."""
    q, lanes = _pass(4, 2, 32, [(40, 3), (7, 2)], seed=4)
    strided = [(b, r, s, torch.cat([k, k], dim=2)[:, :, :32], torch.cat([v, v], dim=2)[:, :, :32])
               for b, r, s, k, v in lanes]
    assert not strided[0][3].is_contiguous()
    contiguous = torch_cpu.lane_attention(q, lanes, 0.125, None)
    assert torch.equal(torch_cpu.lane_attention(q, strided, 0.125, None), contiguous)
