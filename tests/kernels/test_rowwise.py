"""The C row-wise ops (kernels/rowwise.py, csrc/rowwise.c): every row of an m-row call has the bits
of that row called alone (any row count, odd widths, 1 and 2 threads), the numbers are torch's up
to float32 rounding, and RoPE has the very bits of llama.Rope.forward's torch expression.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentfold.engine.torch.models.llama import Rope
from agentfold.kernels import native, rowwise, torch_cpu

pytestmark = pytest.mark.skipif(not native.expected(), reason="no C compiler here (or AGENTFOLD_NATIVE=0)")

ROWS = (1, 2, 3, 7, 16, 33, 64, 130)
NORM_WIDTHS = (17, 64, 576, 1536)
GATED_WIDTHS = (1, 15, 1031, 1536)  # 1031: a 1024-column task and a partial one
SPECIAL = [100.0, -100.0, 1e-30, -1e-30, 0.0, 88.5, -88.5, 30.0, -30.0]


def probe(*shape: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def with_specials(x: torch.Tensor) -> torch.Tensor:
    """x with its first values replaced by large, tiny and zero ones, and one row of all 1e-30 / 0."""
    x = x.clone()
    flat = x.view(-1)
    count = min(len(SPECIAL), flat.numel())
    flat[:count] = torch.tensor(SPECIAL[:count])
    if x.shape[0] > 2:
        x[1], x[2] = 1e-30, 0.0
    return x


def assert_rows_alone(fn, x: torch.Tensor) -> None:
    """Every row of fn(x) equals fn on that row alone, bit for bit (NaN included)."""
    together = fn(x)
    assert together is not None
    for i in range(x.shape[0]):
        alone = fn(x[i : i + 1].clone())
        assert torch.equal(together[i : i + 1].view(torch.int32), alone.view(torch.int32)), i


@pytest.mark.parametrize("d", NORM_WIDTHS)
@pytest.mark.parametrize("add_one", [False, True], ids=["weight", "1+weight"])
def test_rms_norm_rows_equal_one_row_calls(d, add_one, threads):
    weight = probe(d, seed=1, scale=0.5)
    for m in ROWS:
        x = with_specials(probe(m, d, seed=m))
        assert_rows_alone(lambda rows: rowwise.rms_norm(rows, weight, 1e-6, add_one), x)


@pytest.mark.parametrize("d", NORM_WIDTHS)
def test_rms_norm_is_torchs(d):
    """torch_cpu's float32 expression up to rounding (its sum of squares runs in another order);
    Gemma's 1 + weight exactly as gemma3.GemmaRMSNorm forms it."""
    weight = probe(d, seed=2, scale=0.5)
    x = with_specials(probe(33, d, seed=3))
    x[4] *= 1e-3
    x[5] *= 1e3
    for eps in (1e-6, 1e-5):
        torch.testing.assert_close(rowwise.rms_norm(x, weight, eps), torch_cpu._rms_norm(x, weight, eps),
                                   rtol=2e-6, atol=1e-37)
        torch.testing.assert_close(rowwise.rms_norm(x, weight, eps, add_one=True),
                                   torch_cpu._rms_norm(x, 1.0 + weight.float(), eps), rtol=2e-6, atol=1e-37)


def test_rms_norm_keeps_leading_axes():
    """x [m, heads, d] (the q / k norms) normalizes the last axis, as a [m * heads, d] call does."""
    x, weight = probe(5, 9, 64, seed=4), probe(64, seed=5)
    out = rowwise.rms_norm(x, weight, 1e-6)
    assert out.shape == x.shape
    assert torch.equal(out, rowwise.rms_norm(x.reshape(-1, 64), weight, 1e-6).view(5, 9, 64))


GATED = [
    ("silu", rowwise.silu_mul, lambda g, u: F.silu(g) * u),
    ("gelu_tanh", rowwise.gelu_tanh_mul, lambda g, u: F.gelu(g, approximate="tanh") * u),
]


@pytest.mark.parametrize("name,fn,reference", GATED, ids=[case[0] for case in GATED])
@pytest.mark.parametrize("n", GATED_WIDTHS)
def test_gated_rows_equal_one_row_calls(name, fn, reference, n, threads):
    for m in ROWS:
        gate_up = with_specials(probe(m, 2 * n, seed=m))
        assert_rows_alone(fn, gate_up)  # one fused gate / up output
        assert_rows_alone(lambda rows: fn(rows[:, :n], rows[:, n:]), gate_up)  # its two views
        assert torch.equal(fn(gate_up), fn(gate_up[:, :n].contiguous(), gate_up[:, n:].contiguous()))


@pytest.mark.parametrize("name,fn,reference", GATED, ids=[case[0] for case in GATED])
def test_gated_elements_do_not_depend_on_their_column(name, fn, reference):
    """An element has the same bits in a row's vector body and in its zero-padded last chunk."""
    gate, up = probe(1, 53, seed=6), probe(1, 53, seed=7)
    full = fn(gate, up)
    for shift in range(1, 17):
        assert torch.equal(fn(gate[:, shift:].contiguous(), up[:, shift:].contiguous()), full[:, shift:]), shift


@pytest.mark.parametrize("name,fn,reference", GATED, ids=[case[0] for case in GATED])
@pytest.mark.parametrize("n", GATED_WIDTHS)
def test_gated_is_torchs(name, fn, reference, n):
    """torch's numbers up to float32 rounding. GELU: torch's 1 + tanh(t) cancels where tanh(t) is near
    -1 (gates below about -1), leaving it ~2^-24 |gate * up| of absolute accuracy there; the kernel's
    g / (1 + exp(-2t)) does not cancel."""
    gate_up = with_specials(probe(64, 2 * n, seed=8))
    gate, up = gate_up[:, :n], gate_up[:, n:]
    ours, theirs = fn(gate_up), reference(gate, up)
    bound = 1e-6 * theirs.abs() + 1e-37
    if name == "gelu_tanh":
        bound = bound + 2.0**-23 * (gate * up).abs()
    assert ((ours - theirs).abs() <= bound).all()


def test_gelu_tanh_is_accurate():
    """Against the same formula in float64 (float64's own 1 + tanh cancels too), for gates in -8..8:
    about the error of exp's float32 argument, |2t| ulp."""
    gate, up = torch.linspace(-8, 8, 4001)[None, :], probe(1, 4001, seed=9)
    g, u = gate.double(), up.double()
    t = (2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3)
    truth = g / (1 + torch.exp(-2 * t)) * u
    error = (rowwise.gelu_tanh_mul(gate, up).double() - truth).abs() / truth.abs().clamp_min(1e-300)
    assert (error <= 4e-7 * (1 + 2 * t.abs())).all()


def test_gated_specials_are_torchs():
    """inf, -inf and NaN gates give torch's values (NaN where it has NaN)."""
    gate = torch.tensor([[float("inf"), float("-inf"), float("nan"), 1e30, -1e30, 1e20, -1e20, 89.5, -89.5]])
    up = torch.ones_like(gate)
    for _, fn, reference in GATED:
        torch.testing.assert_close(fn(gate, up), reference(gate, up), equal_nan=True, rtol=1e-6, atol=0)


def test_gated_reads_strided_views():
    """Gate and up as column views of a wider buffer (row stride larger than n)."""
    buffer = probe(6, 100, seed=10)
    gate, up = buffer[:, 3:40], buffer[:, 50:87]
    for _, fn, _ in GATED:
        assert torch.equal(fn(gate, up), fn(gate.contiguous(), up.contiguous()))


def rope_pass(m: int, heads: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(m, heads, d, generator=generator), torch.randint(0, 3000, (m,), generator=generator)


@pytest.mark.parametrize("heads,d", [(9, 64), (3, 64), (4, 48), (2, 18), (8, 256), (32, 128)])
def test_rope_is_rope_forward(heads, d, threads):
    """The bits of llama.Rope.forward's torch expression, at any positions, and every row those of
    its one-row call (with 2 threads the wider passes split their rows between both)."""
    rope = Rope(d, 10000.0)
    rope(torch.zeros(1, 1, d), torch.zeros(1, dtype=torch.int64), 3000)  # grows the table
    for m in ROWS:
        x, positions = rope_pass(m, heads, d, seed=m)
        ours = rowwise.rope(x, positions, rope.cos, rope.sin)
        assert torch.equal(ours, rope(x, positions, 3000))
        for i in range(m):
            alone = rowwise.rope(x[i : i + 1].clone(), positions[i : i + 1].clone(), rope.cos, rope.sin)
            assert torch.equal(ours[i : i + 1], alone), i


def test_rope_reads_q_and_k_views_of_a_fused_qkv():
    """q and k as views of one qkv GEMM output (row stride heads * d + 2 * kv_heads * d)."""
    rope = Rope(64, 10000.0)
    qkv = probe(7, (9 + 3 + 3) * 64, seed=11)
    positions = torch.arange(40, 47)
    q, k, _ = torch.split(qkv, [9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.view(7, 9, 64), k.view(7, 3, 64)
    rope(q, positions, 64)
    assert not q.is_contiguous()
    assert torch.equal(rowwise.rope(q, positions, rope.cos, rope.sin), rope(q, positions, 64))
    assert torch.equal(rowwise.rope(k, positions, rope.cos, rope.sin), rope(k, positions, 64))


def test_rope_refuses_positions_past_the_table():
    rope = Rope(64, 10000.0)
    rope(torch.zeros(1, 1, 64), torch.zeros(1, dtype=torch.int64), 1024)
    x = probe(2, 9, 64)
    with pytest.raises(IndexError):
        rowwise.rope(x, torch.tensor([3, rope.cos.shape[0]]), rope.cos, rope.sin)
    with pytest.raises(IndexError):
        rowwise.rope(x, torch.tensor([-1, 0]), rope.cos, rope.sin)


def test_none_where_it_does_not_apply(monkeypatch):
    """Other dtypes give None (the caller runs torch ops), and so does every op without a library."""
    x, weight = probe(3, 64), probe(64)
    rope = Rope(64, 10000.0)
    rope(torch.zeros(1, 1, 64), torch.zeros(1, dtype=torch.int64), 16)
    positions = torch.arange(3)
    assert rowwise.rms_norm(x.bfloat16(), weight, 1e-6) is None
    assert rowwise.silu_mul(x.double()) is None
    assert rowwise.gelu_tanh_mul(x.bfloat16()) is None
    assert rowwise.rope(x.view(3, 1, 64).half(), positions, rope.cos, rope.sin) is None
    monkeypatch.setattr(rowwise, "library", lambda: None)
    assert rowwise.rms_norm(x, weight, 1e-6) is None
    assert rowwise.silu_mul(x) is None
    assert rowwise.gelu_tanh_mul(x) is None
    assert rowwise.rope(x.view(3, 1, 64), positions, rope.cos, rope.sin) is None


@pytest.mark.parametrize("k, n", [(2048, 128), (2880, 32), (37, 13), (5, 1)])
@pytest.mark.parametrize("biased", [False, True], ids=["no bias", "bias"])
def test_float_rows_rows_equal_one_row_calls(k, n, biased, threads):
    """A router's GEMM: each row's bits are its one-row call's (any row count, odd widths), and the
    numbers are float64's within float32 rounding of a k-term sum."""
    wt, bias = probe(k, n, seed=2, scale=0.05), (probe(n, seed=3) if biased else None)
    for m in (1, 3, 4, 5, 130):
        x = probe(m, k, seed=m)
        assert_rows_alone(lambda rows: rowwise.float_rows(rows, wt, bias), x)
    x = probe(130, k, seed=9)
    reference = x.double() @ wt.double() + (bias.double() if biased else 0)
    bound = 4 * k * torch.finfo(torch.float32).eps * (x.abs().double() @ wt.abs().double() + 1)
    assert ((rowwise.float_rows(x, wt, bias).double() - reference).abs() <= bound).all()


def test_float_rows_sums_in_order():
    """Each output is the sequential chain acc = acc + x_t * w_t from t = 0 (float32, no fused
    multiply-add): a sum that cancels shows the order, which any other grouping would change."""
    x = torch.tensor([[1e8, 1.0, -1e8, 1.0]])
    wt = torch.ones(4, 3)
    out = rowwise.float_rows(x, wt)
    chain = torch.zeros(3)
    for t in range(4):
        chain = chain + x[0, t] * wt[t]
    assert torch.equal(out[0], chain) and out[0, 0].item() == 1.0  # (1e8 + 1) rounds to 1e8 in float32
