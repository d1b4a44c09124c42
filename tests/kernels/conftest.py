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
