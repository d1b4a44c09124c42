"""The GGUF block linears on AMX-INT8 tiles (csrc/block_gemm.c, "AMX-INT8: many rows on tiles").

A call of block_gemm_amx_min_rows() rows or more runs on the tiles where the CPU has AMX-INT8 and
Linux grants the tile state. Its integers are the VNNI and portable paths' (each sub-block's scale
folded into the weights, split into a low and a high byte, two tile products: the same sums
regrouped) and its chains the same IEEE operations, so the outputs must be the same bits: here
against a build of the same sources without the tiles (-DBLOCK_GEMM_NO_AMX: the VNNI kernels) and
the portable build, on every type, odd channel counts (a panel of 16 channels with one group of 8, a
short group), rows that leave a tile part empty (21, 33, 100) and a prefill chunk (512, K in two
chunks), 1 and 2 threads, with biases. The library's counter of calls on the tiles shows that the
path ran. On a CPU without AMX every test skips.
"""

from __future__ import annotations

import pytest
import torch

from agentfold.kernels import block_linear, native
from agentfold.kernels.block_linear import BlockLinear
from tests.kernels.test_block_gemm import TYPES, weight

pytestmark = pytest.mark.skipif(not native.expected(), reason="no C compiler here (or AGENTFOLD_NATIVE=0)")


@pytest.fixture(scope="module")
def lib():
    lib = block_linear.library()
    if not lib.block_gemm_amx():
        pytest.skip("this CPU has no AMX-INT8 (or Linux refused the tile state, or a build without it): "
                    "the VNNI / AVX2 kernels run every call here")
    return lib




def on(other, monkeypatch, gemm: BlockLinear, x: torch.Tensor, bias, threads: int) -> torch.Tensor:
    """gemm's output computed by the library `other`."""
    monkeypatch.setattr(block_linear, "library", lambda: other)
    try:
        return gemm.linear(x, bias, threads=threads)
    finally:
        monkeypatch.undo()


def on_tiles(lib, gemm: BlockLinear, x: torch.Tensor, bias, threads: int) -> torch.Tensor:
    """gemm's output from this machine's library, which must have run it on the tiles."""
    before = lib.block_gemm_amx_calls()
    out = gemm.linear(x, bias, threads=threads)
    assert lib.block_gemm_amx_calls() == before + 1, "the call did not run on the AMX tiles"
    return out


def activations(rows: int, k: int, seed: int) -> torch.Tensor:
    """Random rows, and two that stress the quantizer: ties at .5 (id = 1 where the block's amax is
    127) and an all-zero row."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 2
    x[0] = torch.arange(k) % 200 - 100 + 0.5
    x[0, ::32] = 127.0
    x[min(1, rows - 1)] = 0.0
    return x


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [21, 33, 100])
@pytest.mark.parametrize("kind", TYPES)
def test_each_type_on_tiles_is_the_vnni_and_portable_bits(lib, no_amx_library, portable_library, monkeypatch,
                                                          kind: str, rows: int, threads: int):
    k = 768 if kind.endswith("_K") else 160  # several blocks along K
    # 37 channels: two whole panels of 16 and a panel of one short group; 8: a panel of one group
    gemm = BlockLinear([weight(kind, 37, k, 1)[0], weight(kind, 8, k, 2)[0]])
    bias = torch.randn(gemm.n, generator=torch.Generator().manual_seed(3))
    x = activations(max(rows, lib.block_gemm_amx_min_rows()), k, rows)
    for b in (None, bias):
        tiles = on_tiles(lib, gemm, x, b, threads)
        assert torch.equal(tiles, on(no_amx_library, monkeypatch, gemm, x, b, threads)), (kind, rows, threads)
        assert torch.equal(tiles, on(portable_library, monkeypatch, gemm, x, b, threads)), (kind, rows, threads)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_prefill_chunk_of_mixed_types_in_two_k_chunks(lib, no_amx_library, portable_library, monkeypatch,
                                                        threads: int):
    """512 rows, the coder's q / k / v mix (Q4_K, Q4_K, Q6_K) plus Q5_K, odd channel counts, K = 9
    blocks of 256 (the tiles' K chunks of 8 blocks at 512 rows: the chains cross a chunk), and the
    legacy types likewise (K = 65 blocks of 32)."""
    for parts, k in (([weight("Q4_K", 45, 2304, 1)[0], weight("Q4_K", 16, 2304, 2)[0], weight("Q6_K", 21, 2304, 3)[0],
                       weight("Q5_K", 9, 2304, 4)[0]], 2304),
                     ([weight(kind, 19, 2080, i)[0] for i, kind in enumerate(TYPES[:5])], 2080)):
        gemm = BlockLinear(parts)
        bias = torch.randn(gemm.n, generator=torch.Generator().manual_seed(5))
        x = activations(512, k, 7)
        tiles = on_tiles(lib, gemm, x, bias, threads)
        assert torch.equal(tiles, on(no_amx_library, monkeypatch, gemm, x, bias, threads))
        assert torch.equal(tiles, on(portable_library, monkeypatch, gemm, x, bias, threads))


def test_a_row_is_the_same_on_tiles_or_alone(lib):
    """Row-exactness across paths: a row of a pass on the tiles is that row computed alone (one row:
    the VNNI kernels), and the rows around the tiles' threshold agree."""
    gemm = BlockLinear([weight("Q4_K", 29, 512, 1)[0], weight("Q6_K", 11, 512, 2)[0]])
    x = activations(40, 512, 9)
    before = lib.block_gemm_amx_calls()
    together = gemm.linear(x)
    assert lib.block_gemm_amx_calls() == before + 1
    for r in (0, 1, 15, 16, 31, 32, 39):
        assert torch.equal(gemm.linear(x[r : r + 1])[0], together[r]), r
    least = lib.block_gemm_amx_min_rows()
    assert 1 < least <= 40
    before = lib.block_gemm_amx_calls()
    below = gemm.linear(x[: least - 1])
    assert lib.block_gemm_amx_calls() == before  # fewer rows: the VNNI kernels
    assert torch.equal(below, together[: least - 1])
    assert torch.equal(on_tiles(lib, gemm, x[:least], None, 2), together[:least])


def test_describe_names_the_tiles(lib):
    assert block_linear.describe()["block_gemm"].endswith("avx2+vnni+amx")


def test_agentfold_amx_0_keeps_a_process_off_the_tiles(lib):
    """AGENTFOLD_AMX=0 (what the benchmark sets to measure a CPU without AMX on this one): the same
    library in a fresh process reports no tiles for the linears or the prefill attention, a prefill
    chunk's call runs on the VNNI kernels (the tiles' call counter stays 0) with the same bits, and
    the attention kernel's name (part of snapshot keys) says which path ran."""
    import json
    import os
    import subprocess
    import sys

    script = """
import json, torch
from agentfold.kernels import block_linear, torch_cpu
from tests.kernels.test_block_gemm import weight
lib = block_linear.library()
gemm = block_linear.BlockLinear([weight("Q4_K", 40, 512, 3)[0]])
x = torch.randn(48, 512, generator=torch.Generator().manual_seed(5))
out = gemm.linear(x, threads=2)
print(json.dumps({"amx": lib.block_gemm_amx(), "calls": lib.block_gemm_amx_calls(),
                  "attention": torch_cpu.attention_kernel(), "sum": out.double().sum().item(),
                  "bits": out.view(torch.int32).sum().item()}))
"""
    runs = {}
    for value in ("1", "0"):
        env = {**os.environ, "AGENTFOLD_AMX": value}
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[value] = json.loads(done.stdout.strip().splitlines()[-1])
    assert runs["1"]["amx"] == 1 and runs["1"]["calls"] >= 1
    assert runs["0"]["amx"] == 0 and runs["0"]["calls"] == 0
    assert "amx" not in runs["0"]["attention"] and runs["0"]["attention"] != runs["1"]["attention"]
    assert runs["0"]["bits"] == runs["1"]["bits"] and runs["0"]["sum"] == runs["1"]["sum"]
