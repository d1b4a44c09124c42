"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """Run a test with 1 and with 2 threads (torch's and the C kernels' pool) (a row's arithmetic must not depend on either)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def generic_lane_library(tmp_path_factory):
    """The lane attention built without its AVX2 register halves (the generic vectors), once for
    every test that compares the two builds' bits (a build takes ~35 s on 2 cores)."""
    from agentfold.kernels import native, torch_cpu

    if not torch_cpu.lane_library().lane_attention_halves():
        pytest.skip("this build has no register-halves path (AVX-512, or no AVX2 / F16C)")
    generic = native.build_variant(["-DLANE_ATTENTION_NO_HALVES"], tmp_path_factory.mktemp("no-halves"),
                                   torch_cpu._LANE_SIGNATURE)
    assert generic is not None, "the C sources did not compile"
    assert generic.lane_attention_halves() == 0
    return generic


@pytest.fixture(scope="session")
def portable_library(tmp_path_factory):
    """The block GEMM built portable (no AVX2), once for every test that compares its bits."""
    from agentfold.kernels import block_linear, native

    lib = native.build_variant(["-DBLOCK_GEMM_FORCE_PORTABLE"], tmp_path_factory.mktemp("portable"),
                               block_linear.SIGNATURES)
    assert lib is not None, "the C sources did not compile"
    assert lib.block_gemm_avx2() == 0 and not lib.block_gemm_amx()
    return lib


@pytest.fixture(scope="session")
def no_vnni_library(tmp_path_factory):
    """The block GEMM built without the VNNI kernels (None where the CPU has no VNNI: nothing to
    compare), once for every test that compares its bits."""
    from agentfold.kernels import block_linear, native

    if not block_linear.library().block_gemm_vnni():
        return None
    lib = native.build_variant(["-DBLOCK_GEMM_NO_VNNI"], tmp_path_factory.mktemp("no-vnni"), block_linear.SIGNATURES)
    assert lib is not None and lib.block_gemm_avx2() and not lib.block_gemm_vnni()
    return lib


@pytest.fixture(scope="session")
def no_amx_library(tmp_path_factory):
    """The block GEMM built without the tiles, where this CPU runs them (the VNNI kernels at every
    row count), once for every test that compares its bits."""
    from agentfold.kernels import block_linear, native

    if not block_linear.library().block_gemm_amx():
        pytest.skip("this CPU has no AMX-INT8 (or Linux refused the tile state): the VNNI / AVX2 kernels run here")
    other = native.build_variant(["-DBLOCK_GEMM_NO_AMX"], tmp_path_factory.mktemp("no-amx"), block_linear.SIGNATURES)
    assert other is not None and other.block_gemm_vnni() and not other.block_gemm_amx()
    return other
