"""Long prefill chunks' attention on the AMX-BF16 tiles (csrc/lane_attention.c, `lane_attention_prefill`).

A lane of a pass inside `prefill_chunk()` with at least `torch_cpu.MATRIX_MIN_ROWS` rows attends on
the tiles where the CPU has them: other bits than the vector path, so the tests check what makes
that safe. A chunk's rows have the same bits alone or beside other lanes, with 1 or 2 threads, from
a float32 or float16 cache, keys in blocks or rows, and wherever the chunk starts (each row's bits
are its own); decode and verify rows, short chunks and wide passes outside a prefill keep the
vector path's bits (a build without the tile path gives the same); the error against float64
stays within a stated bound. Without AMX (or without the kernel's permission) they skip.
"""

from __future__ import annotations

import pytest
import torch

from agentfold.kernels import native, torch_cpu

pytestmark = pytest.mark.skipif(not native.expected(), reason="no C compiler here (or AGENTFOLD_NATIVE=0)")

HEADS, KV_HEADS, D = 12, 2, 128  # Qwen2.5-Coder-1.5B's attention
SCALE = D**-0.5


@pytest.fixture
def tiles():
    """The library, where prefill chunks run on the tiles here; else the test skips."""
    lib = torch_cpu.lane_library()
    assert lib is not None, "the C sources did not compile"
    if not lib.lane_attention_matrix():
        pytest.skip("no AMX-BF16 here (CPU, compiler or the kernel's tile permission): prefill stays on vectors")
    return lib


def _lane(context: int, rows: int, generator: torch.Generator, dtype: torch.dtype, heads: int = HEADS,
          kv_heads: int = KV_HEADS, d: int = D, sharp: float = 1.0):
    """Queries of `rows` rows at positions context.. and a cache of keys and values for them (its
    capacity a multiple of 256, as LayerCache rounds it)."""
    capacity = -(-(context + rows) // 256) * 256
    keys = torch.randn(kv_heads, capacity, d, generator=generator).to(dtype)
    values = torch.randn(kv_heads, capacity, d, generator=generator).to(dtype)
    return torch.randn(rows, heads, d, generator=generator) * sharp, keys, values


def _attend(parts, prefill: bool, blocked: bool = True, window: int | None = None, scale: float = SCALE):
    """One call over lanes `parts` [(q, start, keys, values)] -> each lane's output."""
    q = torch.cat([p[0] for p in parts])
    lanes, begin = [], 0
    for part_q, start, keys, values in parts:
        lanes.append((begin, part_q.shape[0], start, keys, values))
        begin += part_q.shape[0]
    if prefill:
        with torch_cpu.prefill_chunk():
            out = torch_cpu.lane_attention(q, lanes, scale, window, blocked=blocked)
    else:
        out = torch_cpu.lane_attention(q, lanes, scale, window, blocked=blocked)
    return [out[b : b + r] for b, r, *_ in lanes]


def _reference(q, keys, values, start, window=None, scale=SCALE):
    """float64 attention of rows q [rows, heads, d] at positions start.. over keys, values."""
    group = q.shape[1] // keys.shape[0]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        p = start + i
        low = 0 if window is None else max(0, p - window + 1)
        grouped = q[i].double().view(keys.shape[0], group, -1)
        k, v = keys[:, low : p + 1].double(), values[:, low : p + 1].double()
        weights = torch.softmax(torch.einsum("ghd,gkd->ghk", grouped, k) * scale, dim=-1)
        out[i] = torch.einsum("ghk,gkd->ghd", weights, v).reshape(q.shape[1], -1)
    return out


def test_only_chunks_of_the_plan_reach_the_tiles():
    """The threshold sits above every prompt piece whose cut depends on what shares its pass
    (prefill requests of at most PROMPT_PASS_MAX rows, PROMPT_ROWS per shared pass): what takes the
    tiles is always a whole chunk between two cuts of the plan."""
    from agentfold.engine import decode
    from agentfold.serve import lanes

    assert torch_cpu.MATRIX_MIN_ROWS > decode.PROMPT_PASS_MAX >= lanes.PROMPT_ROWS


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("context,rows", [(0, 129), (1001, 129), (333, 511), (4100, 130)])
def test_a_chunk_has_the_same_bits_alone_beside_other_lanes_and_on_any_thread_count(tiles, context, rows, dtype):
    """A chunk's rows on the tiles: the same bits alone, as one lane of a call with other lanes'
    decode and verify rows and another chunk (in either order), and with 1 or 2 threads; the other
    lanes' rows keep the bits they have without a prefill (the vector path)."""
    generator = torch.Generator().manual_seed(context + rows)
    q, keys, values = _lane(context, rows, generator, dtype)
    chunk = (q, context, keys, values)
    decode_q, decode_k, decode_v = _lane(700, 1, generator, dtype)
    verify_q, verify_k, verify_v = _lane(45, 7, generator, dtype)
    other_q, other_k, other_v = _lane(17, 300, generator, dtype)
    decode, verify, other = (decode_q, 700, decode_k, decode_v), (verify_q, 45, verify_k, verify_v), \
        (other_q, 17, other_k, other_v)
    before = tiles.lane_attention_matrix_rows()
    results = {}
    for threads in (1, 2):
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            results[threads, "alone"] = _attend([chunk], prefill=True)[0]
            shared = _attend([decode, chunk, verify, other], prefill=True)
            results[threads, "shared"] = shared[1]
            results[threads, "other"] = shared[3]
            results[threads, "first"] = _attend([chunk, other, decode], prefill=True)[0]
            for got, lane in ((shared[0], decode), (shared[2], verify)):
                assert torch.equal(got, _attend([lane], prefill=False)[0])
        finally:
            torch.set_num_threads(saved)
    # the tiles ran: the chunk in each of the three calls, the 300-row lane beside it in two, twice
    assert tiles.lane_attention_matrix_rows() - before == 2 * (3 * rows + 2 * 300)
    reference = results[1, "alone"]
    assert all(torch.equal(results[t, k], reference) for t in (1, 2) for k in ("alone", "shared", "first"))
    assert torch.equal(results[1, "other"], results[2, "other"])
    vector = _attend([chunk], prefill=False)[0]
    assert not torch.equal(vector, reference)  # (the tiles' bits are their own)
    assert torch.allclose(vector, reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_each_row_s_bits_are_its_own_wherever_the_chunk_starts(tiles, monkeypatch, dtype, threads):
    """Rows on the tiles depend on their own query, keys and values alone: the last 65 rows of a
    511-row chunk have the bits they get in a 65-row chunk of their own, in a 129-row chunk that
    starts elsewhere, or one by one (1-row lanes put on the tiles here to show it), and keys as rows
    give the bits of keys in blocks."""
    monkeypatch.setattr(torch_cpu, "MATRIX_MIN_ROWS", 1)
    generator = torch.Generator().manual_seed(11)
    context, rows = 1234, 511
    q, keys, values = _lane(context, rows, generator, dtype)
    whole = _attend([(q, context, keys, values)], prefill=True)[0]
    tail = _attend([(q[-65:], context + rows - 65, keys, values)], prefill=True)[0]
    middle = _attend([(q[-129:], context + rows - 129, keys, values)], prefill=True)[0]
    assert torch.equal(tail, whole[-65:]) and torch.equal(middle, whole[-129:])
    for i in (0, 17, 255, 510):
        alone = _attend([(q[i : i + 1], context + i, keys, values)], prefill=True)[0]
        assert torch.equal(alone[0], whole[i]), i
    assert torch.equal(_attend([(q, context, keys, values)], prefill=True, blocked=False)[0], whole)


@pytest.mark.parametrize("window", [None, 37, 300])
def test_smollm2_shapes_and_windows(tiles, window):
    """SmolLM2's heads (9 over 3, d 64) and sliding windows: the same bits alone and beside a
    decode lane, and float64's numbers within the bound below."""
    generator = torch.Generator().manual_seed(5)
    q, keys, values = _lane(700, 150, generator, torch.float16, heads=9, kv_heads=3, d=64)
    d_q, d_k, d_v = _lane(80, 1, generator, torch.float16, heads=9, kv_heads=3, d=64)
    scale = 64**-0.5
    alone = _attend([(q, 700, keys, values)], prefill=True, window=window, scale=scale)[0]
    shared = _attend([(d_q, 80, d_k, d_v), (q, 700, keys, values)], prefill=True, window=window, scale=scale)
    assert torch.equal(shared[1], alone)
    assert torch.equal(shared[0], _attend([(d_q, 80, d_k, d_v)], prefill=False, window=window, scale=scale)[0])
    reference = _reference(q, keys, values, 700, window, scale)
    assert (alone.double() - reference).abs().max() <= 5e-5 * reference.abs().max()


# The bound, relative to the largest output and to the outputs' RMS: the tiles' largest error
# under 5e-5, their RMS error under 1.5e-5 and under 8x the vector path's plus 5e-6. (The splits
# leave a floor of ~2^-18 whatever the context, ~3-9e-6 RMS here; the vector path's float32 sums
# grow with the context instead, ~3e-7 over 200 keys, 1-2e-6 over 2-5K. On the coder's own data:
# csrc/lane_attention.c.)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("context,rows,sharp", [(0, 200, 1.0), (2000, 129, 1.0), (2000, 129, 4.0), (5000, 131, 2.0)])
def test_the_error_against_float64_is_within_the_bound(tiles, context, rows, sharp, dtype):
    generator = torch.Generator().manual_seed(context + rows)
    q, keys, values = _lane(context, rows, generator, dtype, sharp=sharp)
    reference = _reference(q, keys, values, context)
    top, spread = reference.abs().max(), reference.pow(2).mean().sqrt()
    tile_error = _attend([(q, context, keys, values)], prefill=True)[0].double() - reference
    vector_error = _attend([(q, context, keys, values)], prefill=False)[0].double() - reference
    tile_rms, vector_rms = tile_error.pow(2).mean().sqrt() / spread, vector_error.pow(2).mean().sqrt() / spread
    assert tile_error.abs().max() <= 5e-5 * top
    assert tile_rms <= 1.5e-5 and tile_rms <= 8 * vector_rms + 5e-6, (float(tile_rms), float(vector_rms))


def test_decode_verify_and_short_chunks_keep_the_vector_bits(tiles, tmp_path):
    """Everything but a long prefill chunk has the bits of a build without the tile path: decode
    and verify rows, a wide pass outside a prefill, a prefill chunk one row short of the
    threshold, and head sizes the tiles do not take (d 24). The tile path's counter stays put."""
    vectors = native.build_variant(["-DLANE_ATTENTION_NO_MATRIX"], tmp_path, torch_cpu._LANE_SIGNATURE)
    assert vectors is not None, "the C sources did not compile"
    assert vectors.lane_attention_matrix() == 0
    generator = torch.Generator().manual_seed(3)
    cases = [([_lane(900, 1, generator, torch.float16), _lane(31, 8, generator, torch.float16)], False, D),
             ([_lane(500, 200, generator, torch.float16)], False, D),
             ([_lane(500, torch_cpu.MATRIX_MIN_ROWS - 1, generator, torch.float32)], True, D),
             ([_lane(300, 140, generator, torch.float32, heads=4, kv_heads=2, d=24)], True, 24)]
    starts = [[900, 31], [500], [500], [300]]
    before = tiles.lane_attention_matrix_rows()
    for (lanes, prefill, d), at in zip(cases, starts, strict=True):
        parts = [(q, start, k, v) for (q, k, v), start in zip(lanes, at, strict=True)]
        ours = _attend(parts, prefill, scale=d**-0.5)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch_cpu, "lane_library", lambda: vectors)
            theirs = _attend(parts, prefill, scale=d**-0.5)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), (prefill, d)
    assert tiles.lane_attention_matrix_rows() == before


def test_the_kernel_name_says_where_prefill_runs(tiles):
    """Snapshot keys carry the attention kernel: a cache prefilled on the tiles is never taken for
    one prefilled on vectors."""
    assert torch_cpu.attention_kernel().endswith("+amx-bf16-prefill")
    assert torch_cpu.VERSION >= 6
