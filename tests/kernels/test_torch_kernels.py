"""Row-exact CPU kernels of the torch backend: row j of a k-row call has a one-row call's bits.

Each op runs on 16 probe rows, once per row alone and once per width 2..16 (and wider, for the
blocked matmul), at the shapes of SmolLM2-135M and of the tiny test models, in both weight layouts
the loader produces. The batched prefill path is checked against the per-row one for closeness.
"""

from __future__ import annotations

# isort: split
import pytest
import torch

from agentfold.kernels import torch_cpu

WIDTHS = range(2, 17)


def rows_match_single(fn, x: torch.Tensor, widths=WIDTHS) -> list[int]:
    """The widths at which some row of fn(x[:w]) differs from fn on that row alone."""
    single = [fn(x[i : i + 1].clone()) for i in range(x.shape[0])]
    return [w for w in widths if not all(torch.equal(fn(x[:w].clone())[i : i + 1], single[i]) for i in range(w))]


def probe(rows: int, width: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))


# SmolLM2-135M's q/o, gate/up and down projections (its output head is checked by the engine's
# self-check in test_torch_backend); the tiny models' attention, MLP, expert and router shapes
SHAPES = [(576, 576), (1536, 576), (576, 1536), (64, 64), (128, 64), (64, 128), (32, 64), (4, 64)]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_linear_is_row_exact(shape):
    n, k = shape
    weight = (probe(n, k, seed=1) / k**0.5).t().contiguous().t()  # as the loader stores CPU weights
    small = k < 512
    x = probe(40 if small else 16, k)
    widths = range(2, 41) if small else WIDTHS  # small: also passes wider than one GEMM block
    assert rows_match_single(lambda rows: torch_cpu.linear(rows, weight), x, widths) == []
    assert 1 <= torch_cpu.block_rows(weight) <= torch_cpu.PROBE_ROWS
    assert torch.allclose(torch_cpu.linear(x, weight), x @ weight.t(), atol=1e-5)


def test_linear_is_row_exact_on_contiguous_weights():
    """Expert weights stay [out, in] in memory: another GEMM variant, the same guarantee."""
    weight = probe(32, 64, seed=1)
    assert rows_match_single(lambda rows: torch_cpu.linear(rows, weight), probe(40, 64), range(2, 41)) == []


def test_block_rows_cuts_wide_passes():
    """Blocks are the widest exact GEMM height: a wider pass is several GEMMs, each exact."""
    weight = probe(1536, 576, seed=2)
    step = torch_cpu.block_rows(weight)
    x = probe(3 * step + 1, 576)
    blocks = torch.cat([torch.mm(x[i : i + step], weight.t()) for i in range(0, x.shape[0], step)])
    assert torch.equal(torch_cpu.linear(x, weight), blocks)


def test_rowwise_ops_in_row_blocks_up_to_a_shared_pass(threads):
    """SmolLM2's MLP width over up to 64 rows (a shared lanes pass): elementwise exp runs in blocks
    of rows that stay on one thread, and every row still has its one-row bits."""
    x = probe(torch_cpu.PER_ROW_LIMIT, 1536, seed=5) * 3
    for fn in (torch_cpu.silu, torch_cpu.sigmoid):
        assert rows_match_single(fn, x, widths=[2, 21, 22, 43, 64]) == []


@pytest.mark.parametrize("width", [4, 64, 576, 40000])
def test_rowwise_ops_are_row_exact(width, threads):
    x = probe(16, width) * 3
    weight = probe(1, width, seed=3)[0]
    assert rows_match_single(lambda rows: torch_cpu.rms_norm(rows, weight, 1e-6), x) == []
    assert rows_match_single(torch_cpu.silu, x) == []
    assert rows_match_single(torch_cpu.sigmoid, x) == []
    assert rows_match_single(torch_cpu.softmax, x) == []
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    assert torch.allclose(torch_cpu.rms_norm(x, weight, 1e-6), expected, atol=1e-5)


def test_rms_norm_of_per_head_rows(threads):
    """Qwen3's q/k norms see tokens x heads rows (512 for 16 tokens of 32 heads): still row-exact."""
    x = probe(16 * 32, 128) * 3
    weight = probe(1, 128, seed=3)[0]
    single = [torch_cpu.rms_norm(x[i : i + 1].clone(), weight, 1e-6) for i in range(x.shape[0])]
    for tokens in (2, 5, 16):
        out = torch_cpu.rms_norm(x[: tokens * 32].clone(), weight, 1e-6)
        assert all(torch.equal(out[i : i + 1], single[i]) for i in range(tokens * 32)), tokens


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 2), (4, 4)])
def test_attention_rows_equal_one_row_steps(heads, kv_heads, threads):
    """Query row i of a pass at positions start..start+m sees keys 0..start+i, like the step at start+i."""
    d, start, capacity = 64, 37, 256
    keys = probe(kv_heads * capacity, d, seed=4).view(kv_heads, capacity, d)
    values = probe(kv_heads * capacity, d, seed=5).view(kv_heads, capacity, d)
    q = probe(heads * 16, d, seed=6).view(heads, 16, d)

    def run(first: int, rows: int) -> torch.Tensor:
        end = start + first + rows
        positions = torch.arange(start + first, end)
        return torch_cpu.attention(q[:, first : first + rows].contiguous(), keys[:, :end], values[:, :end],
                                   positions, 0.125)

    single = [run(i, 1) for i in range(16)]
    for width in WIDTHS:
        out = run(0, width)
        assert all(torch.equal(out[:, i : i + 1], single[i]) for i in range(width)), width


def test_prefill_attention_matches_the_row_path():
    """Wide passes (prefill chunks) take batched attention: the same numbers up to rounding."""
    heads, kv_heads, d, start, m = 9, 3, 64, 20, torch_cpu.PREFILL_BLOCK + 8  # two blocks
    keys = probe(kv_heads * (start + m), d, seed=7).view(kv_heads, start + m, d)
    values = probe(kv_heads * (start + m), d, seed=8).view(kv_heads, start + m, d)
    q = probe(heads * m, d, seed=9).view(heads, m, d)
    positions = torch.arange(start, start + m)
    batched = torch_cpu.attention(q, keys, values, positions, 0.125)
    rows = torch.stack([torch_cpu.attend_row(q[:, i], keys[:, : start + i + 1], values[:, : start + i + 1], 0.125)
                        for i in range(m)], dim=1)
    assert torch.allclose(batched, rows, atol=1e-5)


def test_a_short_prefill_chunk_is_batched_and_decode_rows_are_not():
    """Inside `prefill_chunk()` a 12-row pass takes the batched path (the same numbers up to rounding,
    the same bits every time); outside it, and after it, the verify path's row-exactness holds."""
    heads, kv_heads, d, start, m = 9, 3, 64, 40, 12
    keys = probe(kv_heads * (start + m), d, seed=10).view(kv_heads, start + m, d)
    values = probe(kv_heads * (start + m), d, seed=11).view(kv_heads, start + m, d)
    q = probe(heads * m, d, seed=12).view(heads, m, d)
    positions = torch.arange(start, start + m)
    verify = torch_cpu.attention(q, keys, values, positions, 0.125)
    with torch_cpu.prefill_chunk():
        chunk = torch_cpu.attention(q, keys, values, positions, 0.125)
        again = torch_cpu.attention(q, keys, values, positions, 0.125)
    block = torch_cpu.attend_block(q, keys, values, positions, 0.125)
    assert torch.equal(chunk, block) and torch.equal(chunk, again) and torch.allclose(chunk, verify, atol=1e-5)
    with pytest.raises(RuntimeError), torch_cpu.prefill_chunk():
        raise RuntimeError("a failed chunk")
    after = torch_cpu.attention(q, keys, values, positions, 0.125)
    single = [torch_cpu.attention(q[:, i : i + 1].contiguous(), keys[:, : start + i + 1], values[:, : start + i + 1],
                                  positions[i : i + 1], 0.125) for i in range(m)]
    assert torch.equal(after, verify) and all(torch.equal(after[:, i : i + 1], single[i]) for i in range(m))
