"""The C int8 GEMM (kernels/int8_gemm.py, csrc/int8_gemm.c) equals torch._int_mm bit for bit.

Exact integer sums cannot depend on the kernel, so every path (AMX-INT8, AVX-512 VNNI, AVX2, portable C),
shape, thread count and row count must give exactly torch._int_mm's int32 result. The AMX tiles take
calls of 12 rows or more where K is a multiple of 64 (576, 1536 below), so the row counts straddle that.
"""

from __future__ import annotations

import pytest
import torch

from agentfold.kernels import int8_gemm, native

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler: the C kernel cannot be built")

MS = [1, 2, 3, 7, 16, 17, 48, 64, 130]
KS = [4, 17, 64, 576, 1536]
NS = [1, 15, 16, 33, 960]


def _operands(m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    return a, w


@pytest.fixture(scope="module")
def lib():
    if not int8_gemm.available():
        pytest.fail("a C compiler is here but csrc/int8_gemm.c did not build or load")
    return int8_gemm.library()


def test_reports_a_path(lib):
    assert int8_gemm.isa() in ("amx-int8", "avx512-vnni", "avx2", "portable")


@pytest.mark.parametrize("m", MS)
def test_equals_torch_int_mm(lib, threads, m):
    for k in KS:
        for n in NS:
            a, w = _operands(m, k, n, seed=m * 10007 + k * 101 + n)
            got = int8_gemm.int_mm(a, int8_gemm.pack(w))
            assert got.dtype == torch.int32 and tuple(got.shape) == (m, n)
            assert torch.equal(got, torch._int_mm(a, w.t())), (m, k, n, threads)


@pytest.mark.parametrize("k", [4, 17, 576, 1536])
def test_extreme_values(lib, threads, k):
    m, n = 17, 33
    patterns = [
        (torch.full((m, k), -128, dtype=torch.int8), torch.full((n, k), 127, dtype=torch.int8)),
        (torch.full((m, k), -128, dtype=torch.int8), torch.full((n, k), -127, dtype=torch.int8)),
        (torch.full((m, k), 127, dtype=torch.int8), torch.full((n, k), 127, dtype=torch.int8)),
        (torch.full((m, k), 127, dtype=torch.int8), torch.full((n, k), -127, dtype=torch.int8)),
        (torch.full((m, k), -128, dtype=torch.int8), torch.full((n, k), -128, dtype=torch.int8)),  # beyond int8_linear
    ]
    g = torch.Generator().manual_seed(k)
    signs = torch.randint(0, 2, (m, k), generator=g, dtype=torch.int8)
    wsigns = torch.randint(0, 2, (n, k), generator=g, dtype=torch.int8)
    patterns.append((torch.where(signs > 0, -128, 127).to(torch.int8), torch.where(wsigns > 0, 127, -127).to(torch.int8)))
    for a, w in patterns:
        assert torch.equal(int8_gemm.int_mm(a, int8_gemm.pack(w)), torch._int_mm(a, w.t()))


def test_largest_sums_are_exact(lib, threads):
    """|sum| = 128 * 127 * K for K = 16,384: far from 2^31, and equal to the int64 product."""
    k = 16384
    a = torch.full((3, k), -128, dtype=torch.int8)
    w = torch.stack([torch.full((k,), 127, dtype=torch.int8), torch.full((k,), -127, dtype=torch.int8)])
    got = int8_gemm.int_mm(a, int8_gemm.pack(w))
    assert torch.equal(got.long(), a.long() @ w.long().t())
    assert got[0, 0].item() == -128 * 127 * k


@pytest.mark.parametrize("m", [2, 7, 48, 130])
def test_rows_do_not_depend_on_the_other_rows(lib, threads, m):
    a, w = _operands(m, 576, 960, seed=m)
    packed = int8_gemm.pack(w)
    together = int8_gemm.int_mm(a, packed)
    for j in range(m):
        assert torch.equal(together[j:j + 1], int8_gemm.int_mm(a[j:j + 1], packed)), j


def test_thread_counts_agree(lib):
    a, w = _operands(48, 1536, 576, seed=3)
    packed = int8_gemm.pack(w)
    one = int8_gemm.int_mm(a, packed, threads=1)
    for t in (2, 3, 8, 64):
        assert torch.equal(int8_gemm.int_mm(a, packed, threads=t), one)


def test_strided_rows_and_out(lib, threads):
    a, w = _operands(9, 200, 40, seed=9)
    wide = torch.zeros(9, 256, dtype=torch.int8)
    wide[:, :200] = a
    view = wide[:, :200]  # row stride 256
    packed = int8_gemm.pack(w)
    out = torch.full((9, 40), 12345, dtype=torch.int32)
    got = int8_gemm.int_mm(view, packed, out=out)
    assert got is out
    assert torch.equal(out, torch._int_mm(a, w.t()))
    repeated = a[2:3].expand(5, 200)  # row stride 0
    assert torch.equal(int8_gemm.int_mm(repeated, packed), torch._int_mm(repeated.contiguous(), w.t()))
    columns = a.t().contiguous().t()  # column-major: copied first
    assert torch.equal(int8_gemm.int_mm(columns, packed), torch._int_mm(a, w.t()))


def test_pack_layout_and_colsums(lib):
    n, k = 33, 17
    _, w = _operands(1, k, n, seed=5)
    packed = int8_gemm.pack(w)
    np_, kp = 48, 20
    padded = torch.zeros(np_, kp, dtype=torch.int8)
    padded[:n, :k] = w
    expected = padded.reshape(np_ // 16, 16, kp // 4, 4).permute(0, 2, 1, 3).reshape(-1)
    assert torch.equal(packed.data, expected)
    assert torch.equal(packed.colsums, padded.sum(dim=1, dtype=torch.int32))
    assert packed.shape == (n, k) and packed.values is None
    assert int8_gemm.pack(w, keep_values=True).values is w


def test_rejects_wrong_operands(lib):
    packed = int8_gemm.pack(torch.zeros(16, 8, dtype=torch.int8))
    with pytest.raises(ValueError):
        int8_gemm.int_mm(torch.zeros(2, 9, dtype=torch.int8), packed)
    with pytest.raises(ValueError):
        int8_gemm.int_mm(torch.zeros(2, 8, dtype=torch.int16), packed)
    with pytest.raises(ValueError):
        int8_gemm.pack(torch.zeros(16, 8, dtype=torch.float32))


def test_choice_between_kernels_never_changes_bits(lib, threads):
    a, w = _operands(7, 576, 960, seed=11)
    packed = int8_gemm.pack(w, keep_values=True)
    assert isinstance(int8_gemm.faster_than_torch(packed, 7), bool)
    assert isinstance(int8_gemm.faster_than_torch((960, 576), 7), bool)  # a shape works too (cached)
    key = (960, 576, int8_gemm.bucket(7), torch.get_num_threads())
    expected = torch._int_mm(a, w.t())
    saved = int8_gemm._CHOICE[key]
    try:
        for choice in (True, False):
            int8_gemm._CHOICE[key] = choice
            assert torch.equal(int8_gemm.matmul(a, packed), expected)
    finally:
        int8_gemm._CHOICE[key] = saved
    assert torch.equal(int8_gemm.matmul(a, int8_gemm.pack(w)), expected)  # no values kept: ours


def test_buckets():
    assert [int8_gemm.bucket(m) for m in (1, 2, 3, 5, 16, 17, 130, 10_000)] == [2, 2, 4, 8, 16, 32, 256, 512]


# --- every compiled path, built here with INT8_GEMM_FORCE_ISA (the same C source, lower paths)

@pytest.fixture(scope="module", params=[0, 1, 2, 3], ids=["portable", "avx2", "avx512-vnni", "amx-int8"])
def variant(request, tmp_path_factory):
    isa = request.param
    lib = native.build_variant([f"-DINT8_GEMM_FORCE_ISA={isa}"], tmp_path_factory.mktemp(f"isa{isa}"),
                               int8_gemm.SIGNATURES)
    assert lib is not None, "the C sources did not compile"
    compiled = lib.int8_gemm_isa()
    assert compiled <= isa
    if compiled != isa:
        pytest.skip(f"this CPU lacks the {int8_gemm.ISA_NAMES[isa]} path (compiled {int8_gemm.ISA_NAMES[compiled]})")
    return lib


def _run(lib, a: torch.Tensor, packed: int8_gemm.PackedWeight, threads: int) -> torch.Tensor:
    out = torch.empty(a.shape[0], packed.n, dtype=torch.int32)
    status = lib.int8_gemm(a.data_ptr(), a.shape[0], packed.k, a.stride(0), packed.data.data_ptr(),
                           packed.colsums.data_ptr(), packed.n, out.data_ptr(), packed.n, threads)
    assert status == 0
    return out


@pytest.mark.parametrize("t", [1, 2])
def test_every_path_equals_torch(lib, variant, t):
    for m in [1, 2, 3, 7, 11, 12, 17, 33, 64]:
        for k in [4, 17, 64, 576]:
            for n in [1, 15, 33, 960]:
                a, w = _operands(m, k, n, seed=m + 7 * k + 13 * n)
                assert torch.equal(_run(variant, a, int8_gemm.pack(w), t), torch._int_mm(a, w.t())), (m, k, n)
    w = torch.cat([torch.full((8, 1536), 127, dtype=torch.int8), torch.full((9, 1536), -127, dtype=torch.int8)])
    for m in (5, 40):  # the largest sums, on the VNNI tiles and (40 rows) on the AMX ones
        a = torch.full((m, 1536), -128, dtype=torch.int8)
        assert torch.equal(_run(variant, a, int8_gemm.pack(w), t), torch._int_mm(a, w.t()))
