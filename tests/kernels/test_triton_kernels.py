"""The CUDA path's Triton kernels: each matches its torch reference, and row j of an m-row call
has the bits of a one-row call for m = 1..16 (what keeps drafted == serial on a GPU).

Without a GPU they run under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set before
Triton is imported), on tiny shapes because the interpreter is slow; with one, the same tests run
compiled on CUDA, in float32 and bfloat16.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton_ops = pytest.importorskip("agentfold.kernels.triton_ops")

DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]
WIDTHS = range(1, 17)


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_matches_reference_and_is_row_invariant(dtype):
    x = _randn(16, 100, dtype=dtype, seed=1)  # K spans two tiles, N two tiles
    w = _randn(72, 100, dtype=dtype, seed=2)
    torch.testing.assert_close(triton_ops.linear(x, w), triton_ops.linear_reference(x, w), **_tolerance(dtype))
    singles = [triton_ops.linear(x[j : j + 1], w)[0] for j in range(16)]
    for m in WIDTHS:
        out = triton_ops.linear(x[:m], w)
        for j in range(m):
            assert torch.equal(out[j], singles[j]), (m, j)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference_and_is_row_invariant(dtype):
    x = _randn(16, 48, dtype=dtype, seed=3)
    weight = _randn(48, dtype=dtype, seed=4)
    torch.testing.assert_close(triton_ops.rms_norm(x, weight, 1e-6), triton_ops.rms_norm_reference(x, weight, 1e-6),
                               **_tolerance(dtype))
    singles = [triton_ops.rms_norm(x[j : j + 1], weight, 1e-6)[0] for j in range(16)]
    for m in WIDTHS:
        out = triton_ops.rms_norm(x[:m], weight, 1e-6)
        assert all(torch.equal(out[j], singles[j]) for j in range(m)), m


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_matches_reference_with_gqa(dtype):
    q = _randn(4, 6, 16, dtype=dtype, seed=5)
    k = _randn(2, 40, 16, dtype=dtype, seed=6)
    v = _randn(2, 40, 16, dtype=dtype, seed=7)
    positions = torch.tensor([3, 17, 20, 31, 38, 39], device=DEVICE)  # one split, two, three
    torch.testing.assert_close(triton_ops.attention(q, k, v, positions, 0.25),
                               triton_ops.attention_reference(q, k, v, positions, 0.25), **_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_rows_are_one_row_steps(dtype):
    """A verify pass (rows at start..start+m-1 over start+m keys) against decode steps (p + 1 keys each)."""
    heads, kv_heads, d, start = 1, 1, 16, 14
    q = _randn(heads, 16, d, dtype=dtype, seed=8)
    k = _randn(kv_heads, start + 16, d, dtype=dtype, seed=9)
    v = _randn(kv_heads, start + 16, d, dtype=dtype, seed=10)
    positions = torch.arange(start, start + 16, device=DEVICE)
    singles = [triton_ops.attention(q[:, j : j + 1], k[:, : start + j + 1], v[:, : start + j + 1],
                                    positions[j : j + 1], 0.25)[:, 0] for j in range(16)]
    for m in WIDTHS:
        out = triton_ops.attention(q[:, :m], k[:, : start + m], v[:, : start + m], positions[:m], 0.25)
        for j in range(m):
            assert torch.equal(out[:, j], singles[j]), (m, j)


def test_bad_input_is_one_clear_error():
    x = _randn(2, 8, dtype=torch.float32, seed=11)
    with pytest.raises(ValueError, match="columns"):
        triton_ops.linear(x, _randn(4, 9, dtype=torch.float32, seed=12))
    with pytest.raises(ValueError, match="kv heads"):
        triton_ops.attention(_randn(3, 1, 8, dtype=torch.float32, seed=13), _randn(2, 4, 8, dtype=torch.float32, seed=1),
                             _randn(2, 4, 8, dtype=torch.float32, seed=2), torch.tensor([3], device=DEVICE), 1.0)
