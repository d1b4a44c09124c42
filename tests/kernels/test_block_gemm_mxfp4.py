"""MXFP4 (ggml type 39, gpt-oss's experts) on the GGUF block linears (csrc/block_gemm.c).

A block is an E8M0 exponent e and 32 4-bit E2M1 codes; the kernels hold a code's doubled value
kvalues[code] as w = kvalues[code] + 12 with offset 12 (as Q4_0's offset 8) and d = 2^(e - 128), and
multiply by int8 activations per 32 values, as llama.cpp multiplies MXFP4 by Q8_0. Right: against
the gguf package's dequantization (itself checked against the format's description) times the
activations as test_block_gemm's numpy transcription quantizes them, summed in float64: the float32
chain may differ by its rounding only, and block scales at the ends of E8M0's range come out exact.
Exact by construction: a row's bits are the same alone or in a pass, with 1 or 2 threads, beside other
types in one call, and on every path this machine runs (repacked AVX2, the file's layout, portable,
VNNI and the AMX tiles where the CPU has them); the VNNI and AMX variants must at least compile here.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from agentfold.kernels import block_linear, native
from agentfold.kernels.block_linear import BlockLinear, BlockWeight
from tests.kernels.test_block_gemm import quantized_activations, weight

pytestmark = pytest.mark.skipif(not native.expected(), reason="no C compiler here (or AGENTFOLD_NATIVE=0)")

KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float64)
BLOCK_BYTES = 17


def mxfp4_bytes(n: int, k: int, rng: np.random.Generator, exponents: tuple[int, int] = (118, 130)) -> np.ndarray:
    """Random MXFP4 blocks [n, k / 32 * 17]: exponents in [low, high] (2^-10 .. 2^2: weights of a
    real model's size), every code."""
    raw = rng.integers(0, 256, size=(n, k // 32, BLOCK_BYTES), dtype=np.uint8)
    raw[:, :, 0] = rng.integers(exponents[0], exponents[1] + 1, size=(n, k // 32), dtype=np.uint8)
    return raw.reshape(n, -1)


def mxfp4_weight(n: int, k: int, seed: int, **kwargs) -> tuple[BlockWeight, np.ndarray]:
    """A random [n, k] MXFP4 weight and the gguf package's float64 values of it."""
    raw = mxfp4_bytes(n, k, np.random.default_rng(seed), **kwargs)
    values = np.asarray(dequantize(raw, GGMLQuantizationType.MXFP4), dtype=np.float64).reshape(n, k)
    return BlockWeight("MXFP4", np.ascontiguousarray(raw).reshape(-1), n, k), values


def described(raw: np.ndarray) -> np.ndarray:
    """The format as its description reads (independent of gguf's code): value i < 16 of a block in
    the low nibble of byte 1 + i, value i + 16 in the high one, kvalues[code] * 2^(e - 128)."""
    blocks = raw.reshape(-1, BLOCK_BYTES)
    codes = np.concatenate([blocks[:, 1:] & 0xF, blocks[:, 1:] >> 4], axis=1)
    scale = np.ldexp(1.0, blocks[:, :1].astype(np.int64) - 128)
    return KVALUES[codes] * scale


def test_gguf_reference_is_the_described_format():
    raw = mxfp4_bytes(256, 64, np.random.default_rng(1), exponents=(0, 255))
    raw[:, 0] = np.arange(256)  # every exponent: the subnormal scales (0, 1) and float32's overflow (> 252) too
    with np.errstate(over="ignore"):
        want = described(raw).astype(np.float32)  # exact in float64; float32 rounds nothing short of overflow
        got = np.asarray(dequantize(raw, GGMLQuantizationType.MXFP4)).reshape(want.shape)
    assert np.array_equal(got, want)


def test_the_type_is_supported_on_blocks_of_32():
    assert block_linear.TYPE_IDS["MXFP4"] == GGMLQuantizationType.MXFP4.value == 39
    assert block_linear.supported("MXFP4", 2880) and block_linear.supported("MXFP4", 32)
    assert not block_linear.supported("MXFP4", 100) and not block_linear.supported("MXFP4", 48)


@pytest.mark.parametrize("k", [32, 96, 2880])
@pytest.mark.parametrize("n", [13, 37, 1001])
def test_mxfp4_is_the_reference_dot_product(n: int, k: int):
    w, values = mxfp4_weight(n, k, seed=n + k)
    gemm = BlockLinear([w])
    x = np.random.default_rng(k).standard_normal((37, k)).astype(np.float32)
    for rows in (1, 2, 3, 5, 7, 16, 37):
        got = gemm.linear(torch.from_numpy(x[:rows])).numpy().astype(np.float64)
        xq = quantized_activations(x[:rows], 32)
        want = xq @ values.T
        # per block one rounding of a * isum and one of the sum (a = dx * 2^(e - 128) and isum exact)
        scale = np.abs(xq) @ np.abs(values).T
        bound = (k // 32 + 2) * 2.0**-24 * scale
        assert np.all(np.abs(got - want) <= bound), (rows, np.max(np.abs(got - want) / scale))
        exact = x[:rows].astype(np.float64) @ values.T  # the activations' int8 rounding: small, not nothing
        error = np.linalg.norm(got - exact) / np.linalg.norm(exact)
        assert 1e-5 < error < 2e-2, (rows, error)


def scale_extremes() -> tuple[np.ndarray, np.ndarray]:
    """One-block rows s * (integers, one of them +-127) for powers of two s, whose activation scale is
    then s exactly and whose q are the integers, against channels whose exponents span E8M0's
    subnormal and large scales: each output is (s * 2^(e - 128)) * isum, exact in float32 (subnormal
    ones too: multiples of 2^-149), so it must be the float64 reference to the bit. Returns the
    kernel's outputs (of whatever library block_linear.library() gives) and the reference."""
    exponents = np.array([0, 1, 2, 3, 100, 126, 127, 128, 129, 130, 140, 150], dtype=np.uint8)
    raw = mxfp4_bytes(len(exponents), 32, np.random.default_rng(5))
    raw[:, 0] = exponents
    values = np.asarray(dequantize(raw, GGMLQuantizationType.MXFP4), dtype=np.float64).reshape(len(exponents), 32)
    ints = np.random.default_rng(6).integers(-127, 128, size=(6, 32))
    ints[:, 0] = [127, -127, 127, 127, -127, 0]
    x = (ints * np.array([1.0, 1.0, 2.0**-20, 2.0**-3, 2.0**5, 0.0])[:, None]).astype(np.float32)  # the last: zero
    out = BlockLinear([BlockWeight("MXFP4", raw.reshape(-1).copy(), len(exponents), 32)]).linear(torch.from_numpy(x))
    return out.numpy(), (x.astype(np.float64) @ values.T).astype(np.float32)


def test_block_scales_at_the_ends_of_e8m0_are_exact():
    got, want = scale_extremes()
    assert np.array_equal(got, want)
    assert np.count_nonzero((np.abs(want) < 2.0**-126) & (want != 0)) > 0  # subnormal outputs were checked


def extreme(k: int) -> tuple[BlockLinear, torch.Tensor]:
    """The largest integer sums: channels of every code 7 (w = 24, kvalues 12), of code 15 (w = 0,
    kvalues -12) and of 15 in a block's first half, 7 in its second, against rows of +-amax (q = +-127),
    where 8 of vpmaddubsw's pair sums (2 * 24 * 127 each) would overflow an int16; and the rows' x."""
    raw = mxfp4_bytes(10, k, np.random.default_rng(k)).reshape(10, -1, BLOCK_BYTES)
    raw[0:4, :, 1:] = 0x77
    raw[4:7, :, 1:] = 0xFF
    raw[7:9, :, 1:] = 0x7F
    x = torch.ones(4, k) * 2.5
    x[1] = -2.5
    x[2, k // 2 :] = -1.0
    return BlockLinear([BlockWeight("MXFP4", raw.reshape(-1).copy(), 10, k)]), x


def test_the_largest_sums_are_the_reference():
    for k in (32, 2880):
        gemm, x = extreme(k)
        values = np.asarray(dequantize(gemm.weights[0].data.reshape(10, -1), GGMLQuantizationType.MXFP4),
                            dtype=np.float64).reshape(10, k)
        xq = quantized_activations(x.numpy(), 32)
        want = xq @ values.T
        got = gemm.linear(x).numpy().astype(np.float64)
        assert np.all(np.abs(got - want) <= (k // 32 + 2) * 2.0**-24 * (np.abs(xq) @ np.abs(values).T)), k
        assert all(torch.equal(gemm.linear(x[r : r + 1])[0], torch.from_numpy(got[r]).float()) for r in range(4))


def mixed() -> tuple[BlockLinear, torch.Tensor]:
    """gpt-oss-like: an MXFP4 expert beside Q8_0 (attention) and Q4_0 weights, odd channel counts."""
    parts = [mxfp4_weight(13, 96, 1)[0], weight("Q8_0", 9, 96, 2)[0], mxfp4_weight(3, 96, 3)[0],
             weight("Q4_0", 5, 96, 4)[0]]
    return BlockLinear(parts), torch.randn(30, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 16, 37])
def test_a_row_is_the_same_alone_or_in_a_pass(threads: int, rows: int):
    gemm, bias = mixed()
    alone = BlockLinear([mxfp4_weight(37, 2880, 7)[0]])
    for g, b, k in ((gemm, bias, 96), (alone, None, 2880)):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        together = g.linear(x, b)
        for r in range(rows):
            assert torch.equal(g.linear(x[r : r + 1], b)[0], together[r]), f"row {r} of {rows}, k {k}"
    x = torch.randn(11, 96, generator=torch.Generator().manual_seed(11))
    assert torch.equal(gemm.linear(x, bias, threads=1), gemm.linear(x, bias, threads=2))


def test_mixed_with_other_types_is_the_separate_calls():
    gemm, bias = mixed()
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(3))
    separate = torch.cat([BlockLinear([w]).linear(x) for w in gemm.weights], dim=1)
    assert torch.equal(gemm.linear(x), separate)
    assert torch.equal(gemm.linear(x, bias), separate + bias)
    pair = BlockLinear([mxfp4_weight(21, 2880, 9)[0], weight("Q8_0", 11, 2880, 10)[0]])
    x = torch.randn(5, 2880, generator=torch.Generator().manual_seed(4))
    assert torch.equal(pair.linear(x), torch.cat([BlockLinear([w]).linear(x) for w in pair.weights], dim=1))




def fresh(gemm: BlockLinear) -> BlockLinear:
    """The same weights without the forms an earlier call made (each library repacks its own)."""
    return BlockLinear([BlockWeight(w.type_name, w.data, w.n, w.k) for w in gemm.weights])


def on(other, monkeypatch, gemm: BlockLinear, x: torch.Tensor, bias=None) -> torch.Tensor:
    monkeypatch.setattr(block_linear, "library", lambda: other)
    try:
        return fresh(gemm).linear(x, bias)
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 37])
def test_every_path_gives_the_same_bits(portable_library, no_vnni_library, monkeypatch, rows: int):
    """This machine's library (with AVX2: repacked 8 channels to a block, VNNI where the CPU has it),
    the same library on the file's layout (its AVX2 unpacking and the one-row channel loop), the
    portable build and, where this is a VNNI library, the build without VNNI: the same bits, past
    X8_ROWS and with a short group."""
    lib = block_linear.library()
    gemm, bias = mixed()
    alone = BlockLinear([mxfp4_weight(37, 2880, 11)[0]])
    largest, extremes = extreme(2880)
    for g, b, k in ((gemm, bias, 96), (alone, None, 2880), (largest, None, 2880)):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
        if g is largest:
            x = extremes[torch.arange(rows) % 4]
        fast = fresh(g).linear(x, b)
        assert torch.equal(fast, on(portable_library, monkeypatch, g, x, b)), (rows, k, "portable")
        if no_vnni_library is not None:
            assert torch.equal(fast, on(no_vnni_library, monkeypatch, g, x, b)), (rows, k, "no vnni")
        if lib.block_gemm_avx2():
            monkeypatch.setattr(lib, "block_gemm_packed_type", lambda _type: 0)
            try:
                in_file_layout = fresh(g).linear(x, b)
            finally:
                monkeypatch.undo()
            assert torch.equal(fast, in_file_layout), (rows, k, "file layout")


def test_repacked_form_is_the_file_bytes_reordered(portable_library, monkeypatch):
    """With AVX2 an MXFP4 weight runs repacked (id 39 + 100), 17 bytes a block a channel as the file
    holds it (4-bit codes, the table lookup in the kernel), a short group padded; and the scale
    extremes are exact on the portable build and the file's layout too."""
    lib = block_linear.library()
    if not lib.block_gemm_avx2():
        pytest.skip("this CPU has no AVX2: nothing is repacked")
    w = mxfp4_weight(21, 2880, 12)[0]
    type_id, data = w.kernel_form(lib)
    assert type_id == 139 and data.nbytes == 3 * 90 * 8 * BLOCK_BYTES  # groups x blocks x 8 channels' bytes
    repacked = data.reshape(3, 90, 8 * BLOCK_BYTES)
    file = w.data.reshape(21, 90, BLOCK_BYTES)
    assert np.array_equal(repacked[0, :, :8], file[:8, :, 0].T)  # the exponents of group 0, block by block
    assert sorted(repacked[1, 7].tobytes()) == sorted(file[8:16, 7].tobytes())  # a block's bytes, reordered
    _, want = scale_extremes()
    monkeypatch.setattr(lib, "block_gemm_packed_type", lambda _type: 0)
    assert np.array_equal(scale_extremes()[0], want)
    monkeypatch.undo()
    monkeypatch.setattr(block_linear, "library", lambda: portable_library)
    assert np.array_equal(scale_extremes()[0], want)
    monkeypatch.undo()


def test_on_the_amx_tiles_the_bits_are_the_vnni_and_portable_ones(portable_library, no_amx_library, monkeypatch):
    """Where the CPU has AMX-INT8 (and Linux grants the tiles), calls of many rows run MXFP4 there (its
    kvalues as the signed tile weights): the same bits as the VNNI build without the tiles and the
    portable build, a prefill chunk's 512 rows (K in several chunks) included."""
    lib, no_amx = block_linear.library(), no_amx_library
    for parts, k in (([mxfp4_weight(37, 160, 1)[0], mxfp4_weight(8, 160, 2)[0]], 160),
                     ([mxfp4_weight(45, 2880, 3)[0], weight("Q8_0", 19, 2880, 4)[0], mxfp4_weight(9, 2880, 5)[0]], 2880)):
        gemm = BlockLinear(parts)
        bias = torch.randn(gemm.n, generator=torch.Generator().manual_seed(5))
        for rows in (lib.block_gemm_amx_min_rows(), 33, 100, 512):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2
            before = lib.block_gemm_amx_calls()
            tiles = gemm.linear(x, bias)
            assert lib.block_gemm_amx_calls() == before + 1, "the call did not run on the AMX tiles"
            assert torch.equal(tiles, on(no_amx, monkeypatch, gemm, x, bias)), (k, rows)
            assert torch.equal(tiles, on(portable_library, monkeypatch, gemm, x, bias)), (k, rows)
            assert torch.equal(gemm.linear(x[3:4], bias)[0], tiles[3])


@pytest.mark.parametrize("march, instructions", [("sapphirerapids", ("vpdpbusd", "tdpbssd", "tdpbsud")),
                                                 ("alderlake", ("vpdpbusd",))])
def test_the_vnni_and_amx_builds_compile(tmp_path, march: str, instructions: tuple[str, ...]):
    """The paths this CPU may not run must compile: block_gemm.c built for a Xeon with AVX-512 VNNI and
    AMX, and for a CPU with AVX-VNNI alone, holds their instructions and MXFP4's table."""
    cc = native.compiler()
    if cc is None or subprocess.run([cc, f"-march={march}", "-E", "-x", "c", "-"], input=b"",
                                    capture_output=True).returncode:
        pytest.skip(f"this compiler does not know -march={march}")
    out = tmp_path / "block_gemm.s"
    done = subprocess.run([cc, *[f for f in native.FLAGS if f != "-shared"], f"-march={march}", "-S", "-o", str(out),
                           str(native.CSRC / "block_gemm.c")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assembly = out.read_text()
    for instruction in (*instructions, "mxfp4_w"):
        assert instruction in assembly, (march, instruction)

