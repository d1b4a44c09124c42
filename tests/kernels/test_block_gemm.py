"""Linear layers on GGUF blocks (kernels/block_linear.py, csrc/block_gemm.c).

Right: against the gguf package's dequantization of the same blocks times activations quantized
by an independent numpy transcription of the rule (int8 per block of 256 for the K-quants, 32
otherwise, q = rint(x * 127 / amax)), summed in float64: the kernel's float32 chain may differ
only by its rounding. Exact by construction: a row's bits are the same alone or among others,
with 1 or 2 threads, on odd shapes and mixed types, and the AVX2 and portable builds agree bit for bit.
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from agentfold.kernels import block_linear, native
from agentfold.kernels.block_linear import BlockLinear, BlockWeight
from tests.helpers.gguf_files import block_bytes

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
pytestmark = pytest.mark.skipif(not native.expected(), reason="no C compiler here (or AGENTFOLD_NATIVE=0)")


def weight(kind: str, n: int, k: int, seed: int) -> tuple[BlockWeight, np.ndarray]:
    """A random [n, k] weight of `kind` as blocks, and the gguf package's float values of it."""
    raw = block_bytes(kind, n, k, np.random.default_rng(seed))
    values = np.asarray(dequantize(raw, GGMLQuantizationType[kind]), dtype=np.float64).reshape(n, k)
    return BlockWeight(kind, np.ascontiguousarray(raw).reshape(-1), n, k), values


def quantized_activations(x: np.ndarray, size: int) -> np.ndarray:
    """x as the kernel quantizes it (float32 arithmetic, round half to even), dequantized to float64."""
    x = x.astype(np.float32)
    blocks = x.reshape(x.shape[0], -1, size)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    inverse = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), np.float32(0))
    q = np.clip(np.rint(blocks * inverse.astype(np.float32)), -127, 127)
    d = (amax / np.float32(127.0)).astype(np.float32)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


@pytest.mark.parametrize("kind", TYPES)
def test_each_type_is_the_reference_dot_product(kind: str):
    k = 512 if kind.endswith("_K") else 160
    w, values = weight(kind, 21, k, seed=len(kind))
    x = np.random.default_rng(3).standard_normal((5, k)).astype(np.float32)
    got = BlockLinear([w]).linear(torch.from_numpy(x)).numpy().astype(np.float64)
    xq = quantized_activations(x, 256 if kind.endswith("_K") else 32)
    want = xq @ values.T
    scale = np.abs(xq) @ np.abs(values).T
    assert np.all(np.abs(got - want) <= 2e-6 * scale + 1e-30), f"{kind}: max error {np.max(np.abs(got - want) / scale)}"
    loose = np.abs(x.astype(np.float64) @ values.T - want)  # the quantization itself: far larger
    assert loose.max() > 1e-4 * scale.max()


def mixed() -> tuple[BlockLinear, torch.Tensor]:
    """q / k / v-like segments of three types, odd channel counts (not multiples of 8), one bias."""
    parts = [weight("Q4_K", 13, 768, 1)[0], weight("Q6_K", 5, 768, 2)[0], weight("Q5_K", 11, 768, 4)[0]]
    return BlockLinear(parts), torch.randn(29, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16, 37])
def test_a_row_is_the_same_alone_or_in_a_pass(threads: int, rows: int):
    gemm, bias = mixed()
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
    together = gemm.linear(x, bias)
    for r in range(rows):
        assert torch.equal(gemm.linear(x[r : r + 1], bias)[0], together[r]), f"row {r} of {rows}"
    legacy = BlockLinear([weight("Q8_0", 9, 96, 7)[0], weight("Q4_1", 3, 96, 8)[0], weight("Q5_0", 6, 96, 9)[0]])
    xs = torch.randn(rows, 96, generator=torch.Generator().manual_seed(100 + rows))
    both = legacy.linear(xs)
    assert all(torch.equal(legacy.linear(xs[r : r + 1])[0], both[r]) for r in range(rows))


def test_threads_never_change_a_bit():
    gemm, bias = mixed()
    x = torch.randn(11, 768, generator=torch.Generator().manual_seed(11))
    assert torch.equal(gemm.linear(x, bias, threads=1), gemm.linear(x, bias, threads=2))


def test_strided_rows_and_bias():
    gemm, bias = mixed()
    wide = torch.randn(4, 1000, generator=torch.Generator().manual_seed(1))
    x = wide[:, 100:868]
    assert x.stride(0) == 1000
    assert torch.equal(gemm.linear(x, bias), gemm.linear(x.contiguous(), bias))
    assert torch.equal(gemm.linear(x, bias), gemm.linear(x.contiguous()) + bias)


def test_zero_rows_of_activations_give_zero():
    gemm, _ = mixed()
    assert torch.equal(gemm.linear(torch.zeros(2, 768)), torch.zeros(2, 29))



def assert_same_bits(other, monkeypatch, rows: int) -> None:
    """This machine's library and `other` (another build of the same sources) give the same bits on
    every type, odd channel counts, `rows` rows."""
    for gemm, k in (mixed()[0], 768), (BlockLinear([weight(t, 10, 64, i)[0] for i, t in enumerate(TYPES[:5])]), 64):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        fast = gemm.linear(x)
        monkeypatch.setattr(block_linear, "library", lambda: other)
        slow = gemm.linear(x)
        monkeypatch.undo()
        assert torch.equal(fast, slow), (rows, [w.type_name for w in gemm.weights])



@pytest.mark.parametrize("rows", [1, 5, 16])
def test_avx2_and_portable_give_the_same_bits(portable_library, monkeypatch, rows: int):
    if not block_linear.library().block_gemm_avx2():
        pytest.skip("this CPU has no AVX2: only the portable path runs here")
    assert_same_bits(portable_library, monkeypatch, rows)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 13])
def test_vnni_and_avx2_give_the_same_bits(no_vnni_library, monkeypatch, rows: int):
    """Where the CPU has VNNI, the library's vpdpbusd kernels (their own repacked order) against a build
    of the same sources without them: the same bits at 1..3 rows (two chains a row), more, and past
    X8_ROWS."""
    if no_vnni_library is None:
        pytest.skip("this CPU has no AVX-512 VNNI / AVX-VNNI: the AVX2 kernels run here")
    assert_same_bits(no_vnni_library, monkeypatch, rows)


def test_every_type_runs_repacked_from_a_file_map(portable_library, monkeypatch, tmp_path):
    """With AVX2, every type runs repacked 8 channels to a block; the repack leaves the file's pages to
    the page cache, and what it multiplies is still the file's blocks: the same bits as the portable
    build reading them in place, before and after."""
    lib = block_linear.library()
    if not lib.block_gemm_avx2():
        pytest.skip("this CPU has no AVX2: nothing is repacked")
    k_quants = [weight("Q4_K", 21, 512, 1)[0], weight("Q6_K", 3, 512, 2)[0], weight("Q5_K", 9, 512, 3)[0]]
    legacy = [weight(kind, 11, 96, i)[0] for i, kind in enumerate(TYPES[:5])]
    for parts, k, ids, sizes in (
            (k_quants, 512, [112, 114, 113], [3 * 2 * 1184, 1 * 2 * 1680, 2 * 2 * 1440]),  # groups x blocks x bytes
            (legacy, 96, [102, 103, 106, 107, 108], [2 * 3 * 8 * size for size in (18, 20, 22, 24, 34)])):
        path = tmp_path / f"blocks{k}.bin"
        path.write_bytes(b"".join(w.data.tobytes() for w in parts))
        with path.open("rb") as handle:
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        flat, offset, on_file = np.frombuffer(memoryview(mapped), dtype=np.uint8), 0, []
        for w in parts:
            on_file.append(BlockWeight(w.type_name, flat[offset : offset + w.data.size], w.n, w.k))
            offset += w.data.size
        gemm = BlockLinear(on_file)
        x = torch.randn(7, k, generator=torch.Generator().manual_seed(7))
        fast = gemm.linear(x)
        assert [w.kernel_form(lib)[0] for w in on_file] == ids  # ggml ids + 100
        assert [w.kernel_form(lib)[1].nbytes for w in on_file] == sizes
        monkeypatch.setattr(lib, "block_gemm_packed_type", lambda _type: 0)  # the file's layout on this build too
        assert torch.equal(fast, BlockLinear([BlockWeight(w.type_name, w.data, w.n, w.k) for w in parts]).linear(x))
        monkeypatch.undo()
        monkeypatch.setattr(block_linear, "library", lambda: portable_library)
        assert torch.equal(fast, gemm.linear(x))  # the portable build reads the released pages back
        assert torch.equal(fast, BlockLinear(parts).linear(x))
        monkeypatch.undo()


def test_shapes_it_cannot_run_are_refused():
    assert not block_linear.supported("Q4_K", 100) and not block_linear.supported("Q2_K", 256)
    assert block_linear.supported("Q4_K", 1536) and block_linear.supported("Q8_0", 576)
    with pytest.raises(ValueError):
        BlockLinear([weight("Q4_K", 8, 256, 1)[0], weight("Q4_0", 8, 64, 1)[0]])


@pytest.mark.parametrize("k", [256, 768])
def test_per_segment_rows_are_the_one_row_calls(threads: int, portable_library, monkeypatch, k: int):
    """`linear_rows` (a MoE decode row's k down projections in one call: segment s on row s) gives
    each segment's outputs the bits of that segment alone on that row alone, every type, odd channel
    counts, with a bias, on this machine's build and the portable one."""
    kinds = [*TYPES, "MXFP4", "Q4_K"]
    weights = [weight(kind, 5 + 3 * i, k, 20 + i)[0] for i, kind in enumerate(kinds)]
    gemm = BlockLinear(weights)
    x = torch.randn(len(weights), k, generator=torch.Generator().manual_seed(k))
    bias = torch.randn(gemm.n, generator=torch.Generator().manual_seed(1))
    for lib in (block_linear.library(), portable_library):
        monkeypatch.setattr(block_linear, "library", lambda lib=lib: lib)
        together = gemm.linear_rows(x, bias)
        starts = np.cumsum([0, *gemm.sizes])
        alone = torch.cat([BlockLinear([w]).linear(x[s : s + 1], bias[starts[s] : starts[s + 1]])
                           for s, w in enumerate(weights)], dim=1)
        assert together.shape == (1, gemm.n) and torch.equal(together, alone)
        monkeypatch.undo()
    with pytest.raises(ValueError, match="rows for"):
        gemm.linear_rows(x[:3])
