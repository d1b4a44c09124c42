"""Row-exactness by construction: the int8 linear layers (torch and MLX) at widths 1..16.

Shapes are odd on purpose (K and N not multiples of any tile or vector width; K past the MLX
chunk of 1024), activations carry outliers like a real model's, and every check runs with 1 and
2 BLAS / OpenMP threads. Row i of an m-row call must have exactly the bits of a one-row call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch

from agentfold.kernels import int8_gemm, int8_linear, int8_rows

SHAPES = [(77, 33), (577, 129), (1537, 211), (2049, 67)]  # (K, N)
WIDTH = 16


def activations(k: int, seed: int) -> np.ndarray:
    """16 rows of float32 activations with a few large outlier channels, as in real models."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((WIDTH, k)).astype(np.float32)
    x[:, rng.integers(0, k, 3)] *= 60.0
    return x


def first_inexact_width(run: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> int | None:
    """The first width m at which some row of an m-row call differs from its one-row call."""
    single = [run(x[i : i + 1])[0] for i in range(x.shape[0])]
    for m in range(2, x.shape[0] + 1):
        out = run(x[:m])
        if not all(np.array_equal(out[i], single[i]) for i in range(m)):
            return m
    return None


def test_the_checker_catches_a_row_dependent_kernel():
    """A kernel whose rows depend on the pass height must be flagged (the check can fail)."""
    w = np.random.default_rng(0).standard_normal((33, 77)).astype(np.float32)

    def height_dependent(x: np.ndarray) -> np.ndarray:
        return (x @ w.T) * np.float32(1 + 1e-6 * x.shape[0])

    assert first_inexact_width(height_dependent, activations(77, 0)) == 2


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("native", [True, False])
def test_torch_int8_linear_is_row_exact(threads, native, monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    if not native:
        monkeypatch.setattr(int8_rows, "library", lambda: None)
    try:
        for index, (k, n) in enumerate(SHAPES):
            weight = int8_linear.quantize_weight(torch.randn(n, k, generator=torch.Generator().manual_seed(index)))
            bias = torch.randn(n, generator=torch.Generator().manual_seed(99))
            x = activations(k, index)

            def run(rows: np.ndarray, weight=weight, bias=bias) -> np.ndarray:
                return int8_linear.linear(torch.from_numpy(rows.copy()), weight, bias).numpy()

            assert first_inexact_width(run, x) is None, (k, n, threads, native)
    finally:
        torch.set_num_threads(before)


def test_native_helpers_give_the_torch_ops_bits(monkeypatch):
    if int8_rows.library() is None:
        pytest.skip("no C compiler here: the torch-op path is the only one")
    for index, (k, n) in enumerate(SHAPES):
        weight = int8_linear.quantize_weight(torch.randn(n, k, generator=torch.Generator().manual_seed(index)))
        x = torch.from_numpy(activations(k, index + 10))
        native = int8_linear.linear(x, weight)
        monkeypatch.setattr(int8_rows, "library", lambda: None)
        reference = int8_linear.linear(x, weight)
        monkeypatch.undo()
        assert torch.equal(native, reference), (k, n)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_fused_c_linear_gives_the_three_calls_bits(threads, monkeypatch):
    """A packed weight runs quantize, GEMM and combine as one C call (`int8_gemm.linear`): the same
    bits as the three calls on the plain weight and as the torch ops, rows strided or not, and
    row-exact; its values read back out of the packed layout are the weight's."""
    if int8_rows.library() is None or not int8_gemm.available():
        pytest.skip("no C compiler here")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for index, (k, n) in enumerate(SHAPES):
            plain = int8_linear.quantize_weight(torch.randn(n, k, generator=torch.Generator().manual_seed(index)))
            packed = int8_linear.Int8Weight(plain.values.clone(), plain.scales)
            int8_linear.pack(packed)
            assert packed.packed is not None and torch.equal(packed.int8_values(), plain.values)
            bias = torch.randn(n, generator=torch.Generator().manual_seed(7))
            x = torch.from_numpy(activations(k, index + 20))
            wide = torch.cat([x, x], dim=1)[:, :k]  # rows strided
            for rows in (x, wide):
                fused = int8_linear.linear(rows, packed, bias)
                assert torch.equal(fused, int8_linear.linear(rows, plain, bias)), (k, n)
            monkeypatch.setattr(int8_rows, "library", lambda: None)
            assert torch.equal(int8_linear.linear(x, plain, bias), fused), (k, n)
            monkeypatch.undo()

            def run(rows: np.ndarray, weight=packed, bias=bias) -> np.ndarray:
                return int8_linear.linear(torch.from_numpy(rows.copy()), weight, bias).numpy()

            assert first_inexact_width(run, activations(k, index)) is None, (k, n, threads)
    finally:
        torch.set_num_threads(before)


def test_int8_weights_track_the_float_layer():
    """Quantization error is small: this is the same layer, not another function. (These rows have
    outliers 150x their mean: a block holding one keeps 8 significant bits of it, and its other
    values lose most of theirs, ~2.5% of the largest output here; the model-level measure is
    `bench quality`'s perplexity.)"""
    k, n = 577, 129
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3))
    x = torch.from_numpy(activations(k, 3))
    exact = x @ w.T
    approx = int8_linear.linear(x, int8_linear.quantize_weight(w))
    assert float((approx - exact).abs().max()) < 0.03 * float(exact.abs().max())


MLX_CHECK = """
import json, sys
import numpy as np
from agentfold import prepare_process
BLAS = prepare_process()
import mlx.core as mx
from agentfold.kernels import mlx_int8
sys.path.insert(0, {tests!r})
from test_int8_kernels import SHAPES, activations, first_inexact_width
failures = []
for index, (k, n) in enumerate(SHAPES):
    w = mx.array(np.random.default_rng(index).standard_normal((n, k)).astype(np.float32))
    layer = mlx_int8.ExactLinear(w, mx.array(np.linspace(-1, 1, n).astype(np.float32)))
    run = lambda rows: np.array(layer(mx.array(rows)))
    failures.append(first_inexact_width(run, activations(k, index)))
x = mx.array(activations(577, 5))
plain, fused = mlx_int8.quantize_rows(x), mlx_int8._quantize_compiled(x)
same = [bool(np.array_equal(np.array(a), np.array(b))) for a, b in zip(plain, fused)]
print(json.dumps({{"failures": failures, "blas": BLAS.name, "compiled_equals_plain": same}}))
"""


@pytest.mark.parametrize("threads", ["1", "2"])
def test_mlx_int8_linear_is_row_exact(threads):
    """MLX's float32 GEMM (OpenBLAS here) on integer-valued operands, each thread count in its own process."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": threads, "OMP_NUM_THREADS": threads}
    script = MLX_CHECK.format(tests=os.path.dirname(__file__))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["failures"] == [None] * len(SHAPES), result
    assert result["compiled_equals_plain"] == [True, True], result


def test_activation_blocks_keep_eight_significant_bits():
    """Each block of EXP_BLOCK of a row's 16-bit integers is an int8 mantissa times 2^e, e the
    smallest that holds the block's largest value, rounded half to even: small blocks keep every
    bit, a block with an outlier keeps 8 of them (what the block kernel multiplies)."""
    q = torch.tensor([[3.0, -127.0, 128.0, 255.0, 32512.0, -20000.0, 0.0, 6.0] * 16])  # K = 128: two blocks
    q[0, 64:] = torch.tensor([3.0, -127.0, 100.0, 5.0] * 16)  # the second block fits in 8 bits
    rounded = int8_linear.block_round(q)
    first, second = rounded[0, :64], rounded[0, 64:]
    assert torch.equal(second, q[0, 64:].to(torch.int32))  # e = 0: unchanged
    assert torch.all(first % 256 == 0) and int(first.abs().max()) == 32512  # e = 8
    assert first[:8].tolist() == [0, 0, 0, 256, 32512, -19968, 0, 0]  # 255/256 rounds to 1, 128/256 to even 0
    mantissas = first // 256
    assert int(mantissas.abs().max()) <= int8_linear.MANTISSA_LEVELS


@pytest.mark.parametrize("threads", [1, 2])
def test_block_kernel_gives_the_halves_integers(threads):
    """Where the AVX-512 block kernel runs (one vpdpbusd pass over the block mantissas), the same
    bits as the two halves' pass on the same weight, at every row count and odd shapes (partial
    last blocks of k, partial blocks of channels): the same exact integers, combined once."""
    if not int8_gemm.available() or not int8_gemm.block_kernel_runs(16, 577):
        pytest.skip("no AVX-512 VNNI block kernel here")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for index, (k, n) in enumerate([*SHAPES, (576, 3072), (1536, 576)]):
            weight = int8_linear.quantize_weight(torch.randn(n, k, generator=torch.Generator().manual_seed(index)))
            int8_linear.pack(weight)
            x = torch.from_numpy(np.concatenate([activations(k, index + 40), activations(k, index + 41)]))
            bias = torch.randn(n, generator=torch.Generator().manual_seed(9))
            compared = 0
            for m in (4, 5, 7, 13, 17, 32):
                if not int8_gemm.block_kernel_runs(m, k):  # AMX tiles take these rows (where the CPU has them)
                    continue
                compared += 1
                blocks = int8_linear.linear(x[:m], weight, bias)
                sums, weight.packed.chunk_sums = weight.packed.chunk_sums, None  # the halves' pass
                halves = int8_linear.linear(x[:m], weight, bias)
                weight.packed.chunk_sums = sums
                assert torch.equal(blocks, halves), (k, n, m, threads)
            assert compared, (k, n)
    finally:
        torch.set_num_threads(before)
