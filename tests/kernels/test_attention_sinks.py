"""Attention sinks (gpt-oss): every head's learned logit s_h takes part in each softmax and adds no value.

transformers' `eager_attention_forward` (models/gpt_oss) is the reference: scores q k^T * scale
(masked: causal, on sliding layers the last `window` keys), the sink's column appended, the row's
largest subtracted, softmax, the column dropped, times V. Every path takes them: the C lane
attention (csrc/lane_attention.c: decode / verify rows, prefill chunks, the AMX tiles where the CPU
has them) through `ops.attend_lanes`, and the torch paths (`ops.attention`, `windowed_attention`:
CUDA, or no compiler). Checked here: the numbers against the reference in float64; every row of a
pass (prefill chunk, verify pass, other lanes beside it, 1 or 2 threads) has the bits of the same
row run alone; `sinks=None` keeps the kernel's bits; the torch fallback agrees with the C path and
is row-exact for short passes; and what a sink costs a decode row over 4K keys (printed).
"""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from agentfold.engine.torch.models import ops
from agentfold.engine.torch.models.cache import LayerCache
from agentfold.engine.torch.models.llama import LayerLanes
from agentfold.kernels import native, torch_cpu
from tests.kernels.test_lane_attention import _pass

pytestmark = pytest.mark.skipif(not native.expected(), reason="no C compiler here (or AGENTFOLD_NATIVE=0)")

# (heads, kv_heads, d): gpt-oss's head shape over fewer heads, and an odd one (a scalar tail, group 2)
SHAPES = [(8, 2, 64), (6, 3, 24)]
# passes over one sequence as (start, rows, prefill): a prefill chunk, a verify pass, a decode row
PLANS = {"short": [(0, 37, True), (37, 5, False), (42, 1, False)],
         "long": [(0, 200, True), (200, 37, True), (237, 5, False), (242, 1, False)]}


def _sinks(heads: int, seed: int) -> torch.Tensor:
    """Sink logits around the scores' own size, one large enough to beat every score of its rows."""
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2.0
    sinks[1] = 8.0
    return sinks


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scale: float,
               window: int | None, sinks: torch.Tensor) -> torch.Tensor:
    """transformers' gpt-oss eager attention in float64: q [m, heads, d] at `positions` over keys,
    values [kv_heads, L, d] -> [m, heads, d]."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    heads, kv_heads = q.shape[1], keys.shape[0]
    module = SimpleNamespace(sinks=sinks.double(), num_key_value_groups=heads // kv_heads, training=False)
    key_index = torch.arange(keys.shape[1])
    distance = positions[:, None] - key_index[None, :]
    hidden = (distance < 0) | (distance >= window if window is not None else torch.zeros_like(distance, dtype=bool))
    mask = torch.zeros(hidden.shape, dtype=torch.float64).masked_fill(hidden, float("-inf"))[None, None]
    out, _ = eager_attention_forward(module, q.double().transpose(0, 1)[None], keys.double()[None],
                                     values.double()[None], mask, scale)
    return out[0]


def _sequence(heads: int, kv_heads: int, d: int, length: int, seed: int):
    """q [length, heads, d] and the rows' own k, v [length, kv_heads, d]."""
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(length, h, d, generator=generator) for h in (heads, kv_heads, kv_heads))


def _run(q, k, v, caches, spans, scale, window, prefill=False, **sinks):
    """ops.attend_lanes over LayerCaches (the model's path): each lane's rows stored, then attended
    (`sinks`: the keyword passed on, or none at all)."""
    assert q.shape[0] == k.shape[0] == v.shape[0] == sum(rows for _, rows, _ in spans)
    for cache, (_, rows, start) in zip(caches, spans, strict=True):
        cache.reserve(start + rows)
    table = ops.lane_table(spans, [caches])
    positions = torch.cat([torch.arange(start, start + rows) for _, rows, start in spans])
    lanes = LayerLanes(spans, caches, positions, max(start + rows for _, rows, start in spans), table, 0)
    with torch_cpu.prefill_chunk() if prefill else nullcontext():
        return ops.attend_lanes(q, k, v, lanes, scale, window, **sinks)


def _cache(kv_heads: int, d: int, dtype: torch.dtype = torch.float32, blocked: bool = True) -> LayerCache:
    return LayerCache(kv_heads, d, dtype, torch.device("cpu"), blocked)


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("window", [None, 4, 128], ids=["causal", "window4", "window128"])
@pytest.mark.parametrize("heads,kv_heads,d", SHAPES, ids=[f"{h}x{kv}-d{d}" for h, kv, d in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_c_path_is_transformers_gpt_oss_attention(heads, kv_heads, d, window, plan, dtype):
    """Passes of a plan (prefill chunks, a 5-row verify, a decode row) through `ops.attend_lanes`
    against the float64 reference over the cache's own keys and values (float16: rounded)."""
    passes = PLANS[plan]
    length = passes[-1][0] + passes[-1][1]
    q, k, v = _sequence(heads, kv_heads, d, length, seed=heads + d)
    sinks, scale = _sinks(heads, seed=d), d**-0.5
    cache = _cache(kv_heads, d, dtype)
    stored_k, stored_v = k.to(dtype).float(), v.to(dtype).float()  # what the cache holds
    reference = _reference(q, stored_k.transpose(0, 1), stored_v.transpose(0, 1), torch.arange(length), scale,
                           window, sinks)
    for start, rows, prefill in passes:
        part = slice(start, start + rows)
        out = _run(q[part], k[part], v[part], [cache], [(0, rows, start)], scale, window, prefill, sinks=sinks)
        error = (out.double() - reference[part]).abs().max().item()
        tiles = prefill and rows >= torch_cpu.MATRIX_MIN_ROWS and torch_cpu.lane_library().lane_attention_matrix()
        bound = 5e-5 if tiles else 5e-6  # (the AMX tiles' bound: tests/kernels/test_prefill_attention_amx.py)
        assert error <= bound * max(1.0, reference[part].abs().max().item()), (start, rows, error)
    # the sinks matter: without them the same rows are far from the reference
    plain = _run(q[:1], k[:1], v[:1], [_cache(kv_heads, d, dtype)], [(0, 1, 0)], scale, window)
    assert (plain.double() - _reference(q[:1], stored_k[:1].transpose(0, 1), stored_v[:1].transpose(0, 1),
                                        torch.arange(1), scale, window, sinks)).abs().max() > 1e-2


def test_the_reference_is_the_formula():
    """The reference (transformers' function) is p_j = exp(s_j - M) / (sum_j exp(s_j - M) + exp(s_h - M)),
    M = max(max_j s_j, s_h), over the row's visible keys."""
    q, k, v = _sequence(4, 2, 16, 20, seed=1)
    sinks, scale = _sinks(4, seed=2), 0.25
    reference = _reference(q, k.transpose(0, 1), v.transpose(0, 1), torch.arange(20), scale, 6, sinks)
    for i in (0, 5, 19):
        for h in range(4):
            low = max(0, i - 5)
            s = (k[low : i + 1, h // 2].double() @ q[i, h].double()) * scale
            top = torch.maximum(s.max(), sinks[h].double())
            weights = (s - top).exp() / ((s - top).exp().sum() + (sinks[h].double() - top).exp())
            assert torch.allclose(weights @ v[low : i + 1, h // 2].double(), reference[i, h], atol=1e-12)



@pytest.mark.parametrize("window", [None, 4, 128], ids=["causal", "window4", "window128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,d", SHAPES, ids=[f"{h}x{kv}-d{d}" for h, kv, d in SHAPES])
def test_every_row_of_a_pass_has_its_one_row_bits(heads, kv_heads, d, dtype, window, threads):
    """Lanes of a prefill chunk (37 rows from 0), a verify pass (5 rows), a decode row and a wide
    pass in one call: every row equals the same row alone, and each lane equals its solo run."""
    shape = [(0, 37), (37, 5), (300, 1), (500, 70)]
    q, lanes = _pass(heads, kv_heads, d, shape, seed=7, dtype=dtype)
    sinks, scale = _sinks(heads, seed=3), d**-0.5
    for prefill in (False, True):
        if prefill:
            with torch_cpu.prefill_chunk():
                together = torch_cpu.lane_attention(q, lanes, scale, window, blocked=True, sinks=sinks)
        else:
            together = torch_cpu.lane_attention(q, lanes, scale, window, blocked=True, sinks=sinks)
        for begin, rows, start, keys, values in lanes:
            solo = torch_cpu.lane_attention(q[begin : begin + rows], [(0, rows, start, keys, values)], scale, window,
                                            blocked=True, sinks=sinks)
            assert torch.equal(together[begin : begin + rows], solo), (prefill, begin)
            for i in range(rows):
                alone = torch_cpu.lane_attention(q[begin + i : begin + i + 1], [(0, 1, start + i, keys, values)],
                                                 scale, window, blocked=True, sinks=sinks)
                assert torch.equal(together[begin + i], alone[0]), (prefill, begin, i)


@pytest.mark.parametrize("window", [None, 4])
def test_a_verify_pass_equals_one_row_steps_from_the_same_cache(window, threads):
    """The model's path: a 5-row verify pass after a 37-row prefill chunk stores its rows and
    attends; five one-row steps from the same cache state give every row's bits (and the same cache)."""
    heads, kv_heads, d = 8, 2, 64
    q, k, v = _sequence(heads, kv_heads, d, 42, seed=5)
    sinks, scale = _sinks(heads, seed=4), 0.125
    outputs, caches = [], []
    for steps in ([(37, 5)], [(37 + i, 1) for i in range(5)]):
        cache = _cache(kv_heads, d, torch.float16)
        _run(q[:37], k[:37], v[:37], [cache], [(0, 37, 0)], scale, window, True, sinks=sinks)
        outputs.append(torch.cat([_run(q[s : s + r], k[s : s + r], v[s : s + r], [cache], [(0, r, s)], scale, window,
                                       sinks=sinks) for s, r in steps]))
        caches.append(cache.read(42))
    assert torch.equal(outputs[0], outputs[1])
    assert all(torch.equal(a, b) for a, b in zip(*caches, strict=True))


@pytest.mark.parametrize("blocked", [False, True], ids=["rows", "blocked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_without_sinks_the_bits_are_unchanged(dtype, blocked):
    """`sinks=None` is the call without the argument (decode, verify, a wide pass, a prefill chunk;
    the torch paths too); a sink of -inf (weight +0) gives those bits on the C path as well."""
    q, lanes = _pass(8, 2, 64, [(100, 6), (37, 1), (5, 16), (300, 150)], seed=8, dtype=dtype)
    minus_inf = torch.full((8,), float("-inf"))
    for prefill in (False, True):
        with torch_cpu.prefill_chunk() if prefill else nullcontext():
            for window in (None, 4, 128):
                plain = torch_cpu.lane_attention(q, lanes, 0.125, window, blocked=blocked)
                assert torch.equal(torch_cpu.lane_attention(q, lanes, 0.125, window, blocked=blocked, sinks=None), plain)
                # (on the AMX tiles too, where a 150-row chunk goes on Xeons: the sink's first alpha is +0)
                assert torch.equal(torch_cpu.lane_attention(q, lanes, 0.125, window, blocked=blocked, sinks=minus_inf),
                                   plain)
    qs, ks, vs = _sequence(8, 2, 64, 43, seed=12)
    for window in (None, 4):
        runs = []
        for extra in ({}, {"sinks": None}):
            cache = _cache(2, 64, dtype, blocked)
            runs.append(torch.cat([_run(qs[s : s + r], ks[s : s + r], vs[s : s + r], [cache], [(0, r, s)], 0.125,
                                        window, prefill, **extra) for s, r, prefill in PLANS["short"]]))
        assert torch.equal(runs[0], runs[1])
    keys, values = lanes[3][3][:, :450].float(), lanes[3][4][:, :450].float()
    tq = q[:150].transpose(0, 1).contiguous()
    positions = torch.arange(300, 450)
    for rows in (5, 150):
        for window in (None, 4, 128):
            plain = ops.attention(tq[:, :rows], keys, values, positions[:rows], 0.125, window)
            assert torch.equal(ops.attention(tq[:, :rows], keys, values, positions[:rows], 0.125, window, None), plain)
            if window is not None:
                assert torch.equal(ops.windowed_attention(tq[:, :rows], keys, values, positions[:rows], 0.125, window,
                                                          sinks=None), plain)


@pytest.mark.parametrize("window", [None, 4, 128], ids=["causal", "window4", "window128"])
@pytest.mark.parametrize("heads,kv_heads,d", SHAPES, ids=[f"{h}x{kv}-d{d}" for h, kv, d in SHAPES])
def test_the_torch_fallback_agrees_and_is_row_exact(heads, kv_heads, d, window, monkeypatch):
    """`ops.attention` / `windowed_attention` with sinks (CUDA, or no compiler): within float32 of the
    C path, short passes row-exact (each row alone), wide passes and prefill chunks too within float32;
    and `ops.attend_lanes` without the library runs them lane by lane."""
    q, lanes = _pass(heads, kv_heads, d, [(300, 70)], seed=11)
    sinks, scale = _sinks(heads, seed=6), d**-0.5
    _, rows, start, keys, values = lanes[0]
    native_out = torch_cpu.lane_attention(q, lanes, scale, window, sinks=sinks)
    tq, positions = q.transpose(0, 1).contiguous(), torch.arange(start, start + rows)
    k, v = keys[:, : start + rows], values[:, : start + rows]
    short = ops.attention(tq[:, :5], k, v, positions[:5], scale, window, sinks)
    for i in range(5):
        p = start + i
        alone = ops.attention(tq[:, i : i + 1], k[:, : p + 1], v[:, : p + 1], positions[i : i + 1], scale, window, sinks)
        assert torch.equal(short[:, i], alone[:, 0]), i
    wide = ops.attention(tq, k, v, positions, scale, window, sinks)
    with torch_cpu.prefill_chunk():
        chunk = ops.attention(tq, k, v, positions, scale, window, sinks)
    for torch_out in (short, wide, chunk):
        m = torch_out.shape[1]
        assert torch.allclose(torch_out.transpose(0, 1), native_out[:m], atol=2e-6, rtol=1e-5)
    if window is not None:  # past the window's start: the windowed path's rows and blocks
        assert torch.allclose(ops.windowed_attention(tq, k, v, positions, scale, window, sinks).transpose(0, 1),
                              native_out, atol=2e-6, rtol=1e-5)
    # the lane-by-lane fallback of ops.attend_lanes (no library): the same numbers, the same cache
    qs, ks, vs = _sequence(heads, kv_heads, d, 43, seed=12)
    results = []
    for library in (True, False):
        if not library:
            monkeypatch.setattr(torch_cpu, "lane_library", lambda: None)
        cache = _cache(kv_heads, d, torch.float16)
        results.append(torch.cat([_run(qs[s : s + r], ks[s : s + r], vs[s : s + r], [cache], [(0, r, s)], scale,
                                       window, prefill, sinks=sinks) for s, r, prefill in PLANS["short"]]))
    assert torch.allclose(results[0], results[1], atol=2e-6, rtol=1e-5) and not torch.equal(results[0], results[1])


def test_sinks_are_one_logit_per_query_head():
    q, lanes = _pass(8, 2, 64, [(10, 2)], seed=1)
    with pytest.raises(ValueError, match="one logit per query head"):
        torch_cpu.lane_attention(q, lanes, 0.125, None, sinks=torch.zeros(2))


def test_prefill_chunks_on_the_tiles_take_sinks(monkeypatch, threads):
    """Where prefill chunks run on the AMX tiles (Xeons): with sinks, a chunk's rows keep their bits
    alone, beside other lanes and one by one, and stay within the tiles' bound of the reference."""
    lib = torch_cpu.lane_library()
    if not lib.lane_attention_matrix():
        pytest.skip("no AMX-BF16 here: prefill chunks stay on the vectors (checked above)")
    monkeypatch.setattr(torch_cpu, "MATRIX_MIN_ROWS", 1)
    heads, kv_heads, d = 8, 2, 64
    sinks, scale = _sinks(heads, seed=9), d**-0.5
    for window in (None, 128):
        q, lanes = _pass(heads, kv_heads, d, [(700, 150), (40, 3)], seed=10, dtype=torch.float16)
        before = lib.lane_attention_matrix_rows()
        with torch_cpu.prefill_chunk():
            together = torch_cpu.lane_attention(q, lanes, scale, window, blocked=True, sinks=sinks)
            _, rows, start, keys, values = lanes[0]
            solo = torch_cpu.lane_attention(q[:rows], lanes[:1], scale, window, blocked=True, sinks=sinks)
            for i in (0, 77, rows - 1):
                alone = torch_cpu.lane_attention(q[i : i + 1], [(0, 1, start + i, keys, values)], scale, window,
                                                 blocked=True, sinks=sinks)
                assert torch.equal(alone[0], together[i]), i
        assert lib.lane_attention_matrix_rows() > before
        assert torch.equal(solo, together[:rows])
        reference = _reference(q[:rows], keys[:, : start + rows].float(), values[:, : start + rows].float(),
                               torch.arange(start, start + rows), scale, window, sinks)
        assert (together[:rows].double() - reference).abs().max() <= 5e-5 * reference.abs().max()


def test_register_halves_give_the_generic_bits_with_sinks(generic_lane_library):
    """On AVX2 (`HALVES`) and in the generic vectors the sink enters at the same point with the same
    exponential: a build without the halves gives every output's bits (rows and blocked keys)."""
    generic = generic_lane_library
    for heads, kv_heads, d in SHAPES:
        q, lanes = _pass(heads, kv_heads, d, [(0, 37), (37, 5), (300, 1), (500, 70)], seed=15, dtype=torch.float16)
        sinks = _sinks(heads, seed=16)
        for window in (None, 4, 128):
            for blocked in (False, True):
                fast = torch_cpu.lane_attention(q, lanes, d**-0.5, window, blocked=blocked, sinks=sinks)
                with pytest.MonkeyPatch.context() as patch:
                    patch.setattr(torch_cpu, "lane_library", lambda: generic)
                    slow = torch_cpu.lane_attention(q, lanes, d**-0.5, window, blocked=blocked, sinks=sinks)
                assert torch.equal(fast, slow), (d, window, blocked)
