"""The C lane attention (csrc/lane_attention.c): every row of every lane of a shared pass has the
bits of that row run alone, whatever the other lanes, the pass width or the thread count.

Shapes: SmolLM2's (9 heads over 3 kv heads, d 64), Gemma 3 270M's windowed layers (d 256), and
odd ones (d 24 and 17: a scalar tail; lengths that start and end inside a 16-key block).
"""

from __future__ import annotations

import pytest
import torch

from agentfold.engine.torch.models import ops
from agentfold.engine.torch.models.cache import LayerCache
from agentfold.engine.torch.models.llama import LayerLanes
from agentfold.kernels import native, torch_cpu

pytestmark = pytest.mark.skipif(not native.expected(), reason="no C compiler here (or AGENTFOLD_NATIVE=0)")

# (heads, kv_heads, d, window, lanes as (context length, rows))
CASES = [
    (9, 3, 64, None, [(100, 6), (37, 1), (5, 16)]),
    (4, 2, 24, None, [(300, 7)]),
    (4, 4, 17, None, [(0, 5), (3, 2), (15, 1)]),
    (4, 1, 256, 512, [(700, 3), (20, 4)]),
    (8, 2, 32, 8, [(40, 9), (9, 3), (0, 2)]),
]


def _pass(heads: int, kv_heads: int, d: int, shape: list[tuple[int, int]], seed: int = 0,
          dtype: torch.dtype = torch.float32):
    """Query rows for a pass and each lane's (begin, rows, start, keys, values) on its own cache."""
    generator = torch.Generator().manual_seed(seed)
    lanes, begin = [], 0
    for length, rows in shape:
        capacity = -(-(length + rows) // 256) * 256
        keys = torch.randn(kv_heads, capacity, d, generator=generator).to(dtype)
        values = torch.randn(kv_heads, capacity, d, generator=generator).to(dtype)
        lanes.append((begin, rows, length, keys, values))
        begin += rows
    return torch.randn(begin, heads, d, generator=generator), lanes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,d,window,shape", CASES, ids=[f"d{c[2]}-{len(c[4])}lanes" for c in CASES])
def test_every_row_equals_its_one_row_call(heads, kv_heads, d, window, shape, dtype, threads):
    q, lanes = _pass(heads, kv_heads, d, shape, dtype=dtype)
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


@pytest.mark.parametrize("prefill", [True, False], ids=["prefill-chunk", "wide-pass"])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("context", [500, 7000])
def test_prefill_chunks_and_wide_passes_are_row_exact_too(context, window, prefill, threads):
    """A wide pass (150 rows, past PER_ROW_LIMIT) and a prefill chunk short of the tiles'
    threshold (`MATRIX_MIN_ROWS` - 1 rows: every prompt piece that may share a pass is shorter
    still) run the same C call: each of their rows has its one-row call's bits, so their cache rows
    do not depend on where the prompt was cut. (Over 7,000 keys the kernel takes the chunk's queries
    in groups. Longer chunks on AMX tiles: tests/kernels/test_prefill_attention_amx.py.)"""
    rows = torch_cpu.MATRIX_MIN_ROWS - 1 if prefill else 150
    q, lanes = _pass(9, 3, 64, [(context, rows)], seed=3, dtype=torch.float16)
    if prefill:
        with torch_cpu.prefill_chunk():
            chunk = torch_cpu.lane_attention(q, lanes, 0.125, window)
    else:
        chunk = torch_cpu.lane_attention(q, lanes, 0.125, window)
    assert chunk is not None
    _, rows, start, keys, values = lanes[0]
    for i in (0, 1, 63, 64, 65, rows - 1):
        alone = torch_cpu.lane_attention(q[i : i + 1], [(0, 1, start + i, keys, values)], 0.125, window)
        assert torch.equal(chunk[i], alone[0]), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,d,window,shape", CASES, ids=[f"d{c[2]}-{len(c[4])}lanes" for c in CASES])
def test_blocked_keys_give_the_same_bits(heads, kv_heads, d, window, shape, dtype, threads):
    """Keys in LayerCache's blocks of 16 positions (the model's caches) are the same numbers as
    rows: every output has the bits of the row layout's."""
    q, lanes = _pass(heads, kv_heads, d, shape, seed=5, dtype=dtype)
    rows = torch_cpu.lane_attention(q, lanes, 0.125, window)
    assert torch.equal(torch_cpu.lane_attention(q, lanes, 0.125, window, blocked=True), rows)


def test_register_halves_give_the_generic_bits(generic_lane_library, monkeypatch):
    """On AVX2 the scores and weighted sums keep each 16-lane vector as two AVX registers
    (`HALVES`); built without them (the generic vectors), every output has the same bits."""
    generic = generic_lane_library
    for heads, kv_heads, d, window, shape in CASES:
        for dtype in (torch.float32, torch.float16):
            q, lanes = _pass(heads, kv_heads, d, shape, seed=9, dtype=dtype)
            for blocked in (False, True):
                fast = torch_cpu.lane_attention(q, lanes, 0.125, window, blocked=blocked)
                monkeypatch.setattr(torch_cpu, "lane_library", lambda: generic)
                slow = torch_cpu.lane_attention(q, lanes, 0.125, window, blocked=blocked)
                monkeypatch.undo()
                assert torch.equal(fast, slow), (d, shape, dtype, blocked)


def test_it_declines_what_it_does_not_cover():
    """Queries in another dtype than float32 (or caches the kernel does not read) go to torch's
    attention (None)."""
    q, lanes = _pass(4, 2, 32, [(10, 4)])
    half = [(b, r, s, k.bfloat16(), v.bfloat16()) for b, r, s, k, v in lanes]
    assert torch_cpu.lane_attention(q.bfloat16(), half, 0.125, None) is None
    assert torch_cpu.lane_attention(q, half, 0.125, None) is None
    assert torch_cpu.attention_kernel().startswith("lane_attention.c")


def _layer_lanes(heads: int, kv_heads: int, d: int, shape: list[tuple[int, int]], dtype: torch.dtype, seed: int,
                 blocked: bool = False):
    """A pass over LayerCaches holding random contexts: q and the rows' own k, v, the caches, the spans."""
    generator = torch.Generator().manual_seed(seed)
    caches, spans, begin = [], [], 0
    for length, rows in shape:
        cache = LayerCache(kv_heads, d, dtype, torch.device("cpu"), blocked)
        cache.write(0, *(torch.randn(kv_heads, length, d, generator=generator) for _ in range(2)))
        cache.reserve(length + rows)
        caches.append(cache)
        spans.append((begin, rows, length))
        begin += rows
    q, k, v = (torch.randn(begin, h, d, generator=generator) for h in (heads, kv_heads, kv_heads))
    return q, k, v, caches, spans


def _attend(q, k, v, caches, spans, scale=0.125, window=None):
    table = ops.lane_table(spans, [caches])
    positions = torch.cat([torch.arange(start, start + rows) for _, rows, start in spans])
    end = max(start + rows for _, rows, start in spans)
    return ops.attend_lanes(q, k, v, LayerLanes(spans, caches, positions, end, table, 0), scale, window)


@pytest.mark.parametrize("blocked", [False, True], ids=["rows", "blocked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_without_the_library_each_lane_runs_torch_attention(monkeypatch, dtype, blocked):
    """`ops.attend_lanes` falls back to storing each lane and torch's attention lane by lane: the
    same numbers, and the caches hold the same bits (the C kernel rounds to float16 as torch does,
    and stores blocked keys where LayerCache.write puts them)."""
    q, k, v, caches, spans = _layer_lanes(9, 3, 64, [(100, 6), (37, 3)], dtype, seed=3, blocked=blocked)
    native_out = _attend(q, k, v, caches, spans)
    stored = [cache.read(start + rows) for cache, (_, rows, start) in zip(caches, spans, strict=True)]
    q, k, v, caches, spans = _layer_lanes(9, 3, 64, [(100, 6), (37, 3)], dtype, seed=3, blocked=blocked)
    monkeypatch.setattr(torch_cpu, "lane_library", lambda: None)
    assert ops.lane_table(spans, [caches]) is None
    torch_out = _attend(q, k, v, caches, spans)
    assert torch.allclose(native_out, torch_out, atol=2e-6, rtol=1e-5) and not torch.equal(native_out, torch_out)
    for (keys, values), cache, (_, rows, start) in zip(stored, caches, spans, strict=True):
        assert [torch.equal(a, b) for a, b in zip((keys, values), cache.read(start + rows), strict=True)] == [True] * 2
    assert torch_cpu.attention_kernel() == "torch per row"


def test_float16_is_stored_as_torch_rounds_it():
    """The kernel's own float32 -> float16 narrowing (vector and scalar tail) gives torch's bits
    everywhere: normals, ties, subnormals, overflow to inf, signed zeros."""
    special = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, -70000.0, 2.0**-14, 2.0**-24, 2.0**-25,
                            1.5 * 2.0**-25, 3 * 2.0**-26, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, float("inf"), 1e-40])
    values = torch.cat([special, torch.randn(4093, generator=torch.Generator().manual_seed(5)) * 10.0 ** torch.randint(
        -9, 5, (4093,), generator=torch.Generator().manual_seed(6))])
    d = values.numel()  # one row of d elements: 16-wide vectors, then a tail
    cache = LayerCache(1, d, torch.float16, torch.device("cpu"))
    cache.reserve(1)
    q, rows = torch.zeros(1, 1, d), values.view(1, 1, d)
    table = ops.lane_table([(0, 1, 0)], [[cache]])
    table.attend(0, q, rows, rows, 1.0, None)
    keys, _ = cache.read(1)
    assert torch.equal(keys[0, 0].view(torch.int16), values.to(torch.float16).view(torch.int16))


def test_the_library_builds_where_a_compiler_is(tmp_path):
    assert native.compiler() is not None
    assert native.build(folder=tmp_path) is not None


def test_a_strided_cache_gives_the_same_bits():
    """The kernel is chosen by the model and the pass, never by a cache's memory layout."""
    q, lanes = _pass(4, 2, 32, [(40, 3), (7, 2)], seed=4)
    strided = [(b, r, s, torch.cat([k, k], dim=2)[:, :, :32], torch.cat([v, v], dim=2)[:, :, :32])
               for b, r, s, k, v in lanes]
    assert not strided[0][3].is_contiguous()
    contiguous = torch_cpu.lane_attention(q, lanes, 0.125, None)
    assert torch.equal(torch_cpu.lane_attention(q, strided, 0.125, None), contiguous)
