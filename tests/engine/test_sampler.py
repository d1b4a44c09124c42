"""The exact sampler (DESIGN contract 1): greedy, the hashed Gumbel noise, the filters, validation.

Pure numpy and deterministic: every "random" input comes from a fixed numpy Generator and every draw
from a fixed (seed, position), so the statistical tests give the same verdict on every run. Their
thresholds are chi-square critical values at p = 1e-6, so a correct sampler has a negligible chance
of having been unlucky with the fixed seeds chosen here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from agentfold.engine import sampler
from agentfold.engine.sampler import SamplingParams, candidates, choose, gumbel, uniform

ALPHA = 1e-6  # false-failure probability of each statistical check


# ---------------------------------------------------------------------------------------------
# helpers


def _chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df): 1 - P(df/2, x/2), P from its power series (no scipy here)."""
    if x <= 0.0:
        return 1.0
    a, z = df / 2.0, x / 2.0
    term = total = 1.0 / a
    n = 1
    while term > total * 1e-17:
        term *= z / (a + n)
        total += term
        n += 1
    lower = math.exp(a * math.log(z) - z - math.lgamma(a)) * total
    return max(0.0, 1.0 - lower)


def _chi2_isf(alpha: float, df: int) -> float:
    """The x with P(X > x) = alpha, by bisection."""
    lo, hi = 0.0, 10.0 * df + 200.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if _chi2_sf(mid, df) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def _chi2_statistic(counts: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom, pooling cells whose expected count is below 5."""
    counts = np.asarray(counts, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    small = expected < 5.0
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    cells = expected > 0
    assert counts[~cells].sum() == 0, "draws landed in a cell of probability 0"
    counts, expected = counts[cells], expected[cells]
    return float(((counts - expected) ** 2 / expected).sum()), int(cells.sum()) - 1


def _softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def _reference_candidates(logits: np.ndarray, params: SamplingParams) -> list[int]:
    """Contract 1's filters written out plainly: top-k, then top-p, then min-p, each on what is left."""
    values = [float(v) for v in np.asarray(logits, dtype=np.float64)]
    ids = list(range(len(values)))
    if params.top_k:
        ids = sorted(sorted(ids, key=lambda i: (-values[i], i))[: params.top_k])
    probs = dict(zip(ids, _softmax(np.array([values[i] for i in ids]) / params.temperature), strict=True))
    if params.top_p < 1.0:
        kept, mass = [], 0.0
        for i in sorted(ids, key=lambda i: (-probs[i], i)):
            if mass >= params.top_p:  # the prefix already reaches top_p: the rest is cut
                break
            kept.append(i)
            mass += probs[i]
        ids = sorted(kept)
    if params.min_p > 0.0:
        top = max(probs.values())
        ids = [i for i in ids if probs[i] >= params.min_p * top]
    return ids


def _cands(logits, **kw) -> list[int]:
    kw.setdefault("temperature", 1.0)
    return [int(i) for i in candidates(np.asarray(logits, dtype=np.float32), SamplingParams(**kw))]


def test_chi2_helper_matches_known_values():
    # df = 2 is exponential: the critical value is -2 ln(alpha) exactly.
    assert _chi2_isf(1e-6, 2) == pytest.approx(-2.0 * math.log(1e-6), rel=1e-9)
    # Tabulated critical values: chi2.isf(0.05, 10) = 18.307, chi2.isf(0.001, 5) = 20.515.
    assert _chi2_isf(0.05, 10) == pytest.approx(18.307, abs=1e-3)
    assert _chi2_isf(0.001, 5) == pytest.approx(20.515, abs=1e-3)
    # Large df (the histogram test below): the Wilson-Hilferty approximation gives ~181.1 at df 99.
    z, df = 4.753424, 99  # z: the standard normal's upper 1e-6 point
    wilson_hilferty = df * (1.0 - 2.0 / (9 * df) + z * math.sqrt(2.0 / (9 * df))) ** 3
    assert _chi2_isf(1e-6, df) == pytest.approx(wilson_hilferty, rel=0.01)


# ---------------------------------------------------------------------------------------------
# greedy


def test_greedy_is_argmax_for_any_seed_and_position():
    rng = np.random.default_rng(1)
    for trial in range(200):
        logits = rng.normal(0.0, 3.0, size=int(rng.integers(2, 300))).astype(np.float32)
        want = int(np.argmax(logits))
        for seed, position in [(0, 0), (trial, 7), (2**40 + 3, 123456), (-5, 2**33)]:
            assert choose(logits, position, SamplingParams(seed=seed)) == want


def test_greedy_ties_go_to_the_lowest_id():
    logits = np.zeros(16, dtype=np.float32)
    logits[[3, 7, 11, 15]] = 2.5
    logits[[0, 1]] = 2.4999998  # just below the maximum
    for seed in range(20):
        for position in (0, 1, 99, 10**9):
            assert choose(logits, position, SamplingParams(seed=seed)) == 3
            # the filters do not change a greedy choice: the lowest-id maximum survives them all
            filtered = SamplingParams(seed=seed, top_k=2, top_p=0.1, min_p=0.9)
            assert choose(logits, position, filtered) == 3
    assert choose(np.full(9, -1.0, dtype=np.float32), 4, SamplingParams(seed=3)) == 0
    assert choose(np.array([-np.inf, 5.0, 5.0], dtype=np.float32), 4, SamplingParams()) == 1


def test_params_greedy_flag():
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0.0, seed=9).greedy
    assert not SamplingParams(temperature=1e-6).greedy


# ---------------------------------------------------------------------------------------------
# the noise


def test_same_seed_and_position_give_the_same_token():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=50).astype(np.float32)
    for seed in (0, 1, 12345):
        params = SamplingParams(temperature=1.3, seed=seed, top_k=30, top_p=0.95, min_p=0.01)
        for position in (0, 5, 4096):
            first = choose(logits, position, params)
            assert all(choose(logits.copy(), position, params) == first for _ in range(5))
            # a new, equal SamplingParams draws the same token
            again = SamplingParams(temperature=1.3, seed=seed, top_k=30, top_p=0.95, min_p=0.01)
            assert choose(logits, position, again) == first


def test_different_positions_and_seeds_draw_differently():
    logits = np.zeros(64, dtype=np.float32)  # uniform over 64 tokens
    by_position = {choose(logits, p, SamplingParams(temperature=1.0, seed=7)) for p in range(300)}
    by_seed = {choose(logits, 11, SamplingParams(temperature=1.0, seed=s)) for s in range(300)}
    # 300 uniform draws over 64 tokens cover ~63 of them; a broken hash would give a handful
    assert len(by_position) > 50
    assert len(by_seed) > 50
    ids = np.arange(1000)
    u = uniform(7, 11, ids)
    assert not np.array_equal(u, uniform(7, 12, ids))
    assert not np.array_equal(u, uniform(8, 11, ids))
    assert not np.array_equal(u, uniform(11, 7, ids))  # seed and position are not interchangeable
    # almost all entries change, not just a few
    assert np.mean(u == uniform(7, 12, ids)) < 0.01
    assert np.mean(u == uniform(8, 11, ids)) < 0.01


def test_uniform_has_no_structured_collisions():
    # A 64 x 64 grid of (position, id) and of (seed, id): 4096 distinct 53-bit values each (a chance
    # collision has probability ~1e-9). Catches hashes that mix position and id by a plain xor/sum,
    # where (p, i) and (p ^ d, i ^ d) would get the same noise.
    ids = np.arange(64)
    by_position = np.concatenate([uniform(5, p, ids) for p in range(64)])
    by_seed = np.concatenate([uniform(s, 9, ids) for s in range(64)])
    assert np.unique(by_position).size == by_position.size
    assert np.unique(by_seed).size == by_seed.size


def test_uniform_is_strictly_inside_the_unit_interval():
    for seed, position in [(0, 0), (1, 2), (2**63, 2**63 + 1), (-1, 3), (2**64 - 1, 2**64 - 1)]:
        u = uniform(seed, position, np.arange(100_000))
        assert u.dtype == np.float64 and u.shape == (100_000,)
        assert np.all(u > 0.0) and np.all(u < 1.0)
        assert np.all(np.isfinite(gumbel(seed, position, np.arange(100_000))))


def test_uniform_extreme_hash_values_stay_inside_the_unit_interval(monkeypatch):
    """The hash's extreme outputs (all bits 1 or 0) must still give 0 < u < 1 and finite noise."""
    ids = np.arange(4)
    ones = np.uint64(0xFFFFFFFFFFFFFFFF)
    monkeypatch.setattr(sampler, "_splitmix64", lambda x, scratch=None: np.full_like(x, ones))
    u = uniform(0, 0, ids)
    assert np.all(u < 1.0) and np.all(u > 0.5)
    assert np.all(np.isfinite(gumbel(0, 0, ids)))
    monkeypatch.setattr(sampler, "_splitmix64", lambda x, scratch=None: np.zeros_like(x))
    u = uniform(0, 0, ids)
    assert np.all(u > 0.0) and np.all(u < 1e-15)
    assert np.all(np.isfinite(gumbel(0, 0, ids)))


def test_uniform_is_roughly_uniform_over_ids():
    n, bins = 100_000, 100
    u = uniform(2024, 17, np.arange(n))
    counts = np.histogram(u, bins=bins, range=(0.0, 1.0))[0]
    stat, df = _chi2_statistic(counts, np.full(bins, n / bins))
    assert df == bins - 1
    assert stat < _chi2_isf(ALPHA, df), stat
    # Kolmogorov-Smirnov: P(sqrt(n) D > x) ~ 2 exp(-2 x^2), which is 1e-6 at x = 2.69
    s = np.sort(u)
    d = max(np.max(np.arange(1, n + 1) / n - s), np.max(s - np.arange(n) / n))
    assert math.sqrt(n) * d < 2.69, d
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(u.var() - 1 / 12) < 0.005


def test_uniform_is_roughly_uniform_over_positions_and_seeds():
    ids = np.array([0, 5, 262_143])
    by_position = np.concatenate([uniform(3, p, ids) for p in range(4000)])
    by_seed = np.concatenate([uniform(s, 42, ids) for s in range(4000)])
    bins = 40
    for u in (by_position, by_seed):
        counts = np.histogram(u, bins=bins, range=(0.0, 1.0))[0]
        stat, df = _chi2_statistic(counts, np.full(bins, u.size / bins))
        assert stat < _chi2_isf(ALPHA, df), stat
    # consecutive positions are not correlated for a fixed id
    column = by_position.reshape(4000, 3)[:, 0]
    r = np.corrcoef(column[:-1], column[1:])[0, 1]
    assert abs(r) < 5 / math.sqrt(4000)


def test_uniform_is_a_pure_function_of_seed_position_and_id():
    n = 5000
    full = uniform(99, 1234, np.arange(n))
    rng = np.random.default_rng(3)
    subset = rng.choice(n, size=300, replace=False)  # arbitrary order
    np.testing.assert_array_equal(uniform(99, 1234, subset), full[subset])
    np.testing.assert_array_equal(uniform(99, 1234, subset.astype(np.int32)), full[subset])
    np.testing.assert_array_equal(uniform(99, 1234, subset.astype(np.uint64)), full[subset])
    for i in (0, 1, 4999):
        np.testing.assert_array_equal(uniform(99, 1234, np.array([i])), full[[i]])
    # duplicates get the same value
    dup = np.array([7, 7, 3, 7])
    np.testing.assert_array_equal(uniform(99, 1234, dup), full[dup])
    # gumbel is exactly -log(-log(u)) of the same values
    np.testing.assert_array_equal(gumbel(99, 1234, subset), -np.log(-np.log(full[subset])))


def test_numpy_integer_seed_and_position_match_python_ints():
    ids = np.arange(10)
    want = uniform(5, 77, ids)
    np.testing.assert_array_equal(uniform(np.int64(5), np.int64(77), ids), want)
    np.testing.assert_array_equal(uniform(np.uint64(5), np.int32(77), ids), want)
    logits = np.random.default_rng(4).normal(size=10).astype(np.float32)
    params = SamplingParams(temperature=0.8, seed=5)
    assert choose(logits, np.int64(77), params) == choose(logits, 77, params)


# ---------------------------------------------------------------------------------------------
# the draw follows softmax(logits / T)


def _check_frequencies(draws: list[int], probs: np.ndarray) -> None:
    counts = np.bincount(np.asarray(draws), minlength=probs.size)
    stat, df = _chi2_statistic(counts, probs * len(draws))
    assert df >= 4
    assert stat < _chi2_isf(ALPHA, df), (stat, df, counts, np.round(probs * len(draws)))


@pytest.mark.parametrize(
    ("temperature", "vary"),
    [(0.6, "seed"), (1.7, "position")],
)
def test_draws_follow_softmax(temperature, vary):
    n = 20_000
    rng = np.random.default_rng(5)
    logits = rng.permutation(np.linspace(-1.5, 1.5, 12)).astype(np.float32)
    if vary == "seed":
        draws = [choose(logits, 31, SamplingParams(temperature=temperature, seed=s)) for s in range(n)]
    else:
        params = SamplingParams(temperature=temperature, seed=77)
        draws = [choose(logits, p, params) for p in range(n)]
    probs = _softmax(logits.astype(np.float64) / temperature)
    _check_frequencies(draws, probs)


def test_filtered_draws_follow_the_renormalised_softmax_of_the_candidates():
    n = 6_000
    rng = np.random.default_rng(6)
    logits = rng.normal(0.0, 1.0, size=16).astype(np.float32)
    params = SamplingParams(temperature=0.9, top_k=10, top_p=0.9, min_p=0.08, seed=3)
    kept = candidates(logits, params)
    assert 4 < kept.size < 10  # every filter matters for this case
    draws = [choose(logits, p, params) for p in range(n)]
    assert set(draws) <= set(kept.tolist())
    probs = np.zeros(16)
    probs[kept] = _softmax(logits[kept].astype(np.float64) / params.temperature)
    _check_frequencies(draws, probs)


def test_choose_is_the_gumbel_argmax_over_the_candidates():
    rng = np.random.default_rng(7)
    for trial in range(300):
        v = int(rng.integers(2, 40))
        logits = rng.normal(0.0, 2.0, size=v).astype(np.float32)
        params = SamplingParams(
            temperature=float(rng.uniform(0.05, 3.0)),
            top_k=int(rng.integers(0, v + 2)),
            top_p=float(rng.uniform(0.05, 1.0)) if trial % 2 else 1.0,
            min_p=float(rng.uniform(0.0, 0.5)) if trial % 3 else 0.0,
            seed=int(rng.integers(0, 2**63)),
        )
        position = int(rng.integers(0, 2**31))
        ids = np.asarray(_reference_candidates(logits, params))
        scores = logits[ids].astype(np.float64) / params.temperature - np.log(
            -np.log(uniform(params.seed, position, ids))
        )
        assert choose(logits, position, params) == int(ids[np.argmax(scores)])


# ---------------------------------------------------------------------------------------------
# the filters


def test_top_k_keeps_exactly_the_k_highest():
    rng = np.random.default_rng(8)
    for _ in range(100):
        v = int(rng.integers(1, 50))
        logits = rng.normal(size=v).astype(np.float32)
        for k in range(1, v + 1):
            want = sorted(np.argsort(-logits.astype(np.float64), kind="stable")[:k].tolist())
            assert _cands(logits, top_k=k) == want
        assert _cands(logits, top_k=0) == list(range(v))  # off
        assert _cands(logits, top_k=v + 5) == list(range(v))


def test_top_k_ties_go_to_the_lowest_id():
    logits = [1.0, 3.0, 3.0, 2.0, 3.0, 0.0, 3.0]
    assert _cands(logits, top_k=1) == [1]
    assert _cands(logits, top_k=2) == [1, 2]
    assert _cands(logits, top_k=3) == [1, 2, 4]
    assert _cands(logits, top_k=4) == [1, 2, 4, 6]
    assert _cands(logits, top_k=5) == [1, 2, 3, 4, 6]
    assert _cands([0.0] * 8, top_k=3) == [0, 1, 2]


def test_top_p_exact_boundaries():
    # four equal tokens of probability exactly 1/4 (exp(0) = 1, sum 4), two of probability exactly 0
    logits = [0.0, 0.0, 0.0, 0.0, -1000.0, -1000.0]
    assert _cands(logits, top_p=1e-9) == [0]  # the most likely token is always kept
    assert _cands(logits, top_p=0.25) == [0]  # the first token's mass reaches p exactly
    assert _cands(logits, top_p=0.25 + 1e-9) == [0, 1]  # the token that crosses p is kept
    assert _cands(logits, top_p=0.5) == [0, 1]
    assert _cands(logits, top_p=0.5 + 1e-9) == [0, 1, 2]
    assert _cands(logits, top_p=0.75) == [0, 1, 2]
    assert _cands(logits, top_p=0.9999) == [0, 1, 2, 3]  # zero-probability tokens never cross
    assert _cands(logits, top_p=1.0) == list(range(6))  # off
    # the order of equal tokens is by id, wherever they sit
    assert _cands([-1000.0, 0.0, -1000.0, 0.0, 0.0, 0.0], top_p=0.5) == [1, 3]


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    rng = np.random.default_rng(9)
    for _ in range(100):
        v = int(rng.integers(2, 30))
        logits = rng.normal(0.0, 1.5, size=v).astype(np.float32)
        temperature = float(rng.choice([0.3, 1.0, 2.5]))
        probs = _softmax(logits.astype(np.float64) / temperature)
        order = np.lexsort((np.arange(v), -probs))
        cum = np.cumsum(probs[order])
        for j in range(v - 1):
            if probs[order[j + 1]] < 1e-6:
                break
            # just below the mass of the first j+1 tokens: token j crosses p and is kept, j+1 is not
            below = _cands(logits, temperature=temperature, top_p=float(cum[j]) - 1e-7)
            assert below == sorted(order[: j + 1].tolist())
            # just above it: one more token is needed
            above = _cands(logits, temperature=temperature, top_p=float(cum[j]) + 1e-7)
            assert above == sorted(order[: j + 2].tolist())


def test_top_p_depends_on_temperature():
    logits = np.array([2.0, 1.0, 0.0, -1.0], dtype=np.float32)
    cold = _cands(logits, temperature=0.3, top_p=0.9)
    hot = _cands(logits, temperature=5.0, top_p=0.9)
    assert cold == [0]
    assert hot == [0, 1, 2, 3]


def test_min_p_keeps_tokens_at_least_min_p_times_the_top():
    rng = np.random.default_rng(10)
    for _ in range(100):
        v = int(rng.integers(2, 30))
        logits = rng.normal(0.0, 1.5, size=v).astype(np.float32)
        temperature = float(rng.choice([0.4, 1.0, 3.0]))
        probs = _softmax(logits.astype(np.float64) / temperature)
        ratio = probs / probs.max()
        for m in [0.0, 1e-3, 0.05, 0.2, 0.5, 0.9, 1.0]:
            if m and np.min(np.abs(ratio - m)) < 1e-6:
                continue  # too close to a boundary for float32 logits
            got = _cands(logits, temperature=temperature, min_p=m)
            assert got == np.flatnonzero(ratio >= m).tolist()
        j = int(np.argsort(ratio)[v // 2])
        if 1e-5 < ratio[j] < 1.0 - 1e-5:
            assert j in _cands(logits, temperature=temperature, min_p=float(ratio[j]) - 1e-6)
            assert j not in _cands(logits, temperature=temperature, min_p=float(ratio[j]) + 1e-6)


def test_min_p_boundaries():
    logits = [0.0, 0.0, -1000.0, 0.0]
    assert _cands(logits, min_p=1.0) == [0, 1, 3]  # prob == max prob is kept
    assert _cands(logits, min_p=0.0) == [0, 1, 2, 3]  # off
    assert _cands(logits, min_p=1e-300) == [0, 1, 3]  # a probability of 0 is below any min_p > 0
    assert _cands([5.0, 1.0, 1.0], min_p=1.0) == [0]


def test_filters_apply_in_order_top_k_then_top_p_then_min_p():
    # top-p sees the distribution renormalised over the top-k survivors:
    # probs .4 .2 .2 .2 -> top_k=2 leaves {0: 2/3, 1: 1/3}; 2/3 already reaches 0.6, so only id 0.
    # (top-p on the full distribution would keep ids 0 and 1, since 0.4 < 0.6.)
    logits = np.log([0.4, 0.2, 0.2, 0.2])
    assert _cands(logits, top_p=0.6) == [0, 1]
    assert _cands(logits, top_k=2, top_p=0.6) == [0]
    # min-p comes after top-p: probs .4 .3 .2 .1, top_p=0.75 keeps {0, 1, 2} (0.7 < 0.75) and
    # min_p=0.45 keeps those >= 0.18, so {0, 1, 2}. (min-p first, then top-p on the renormalised
    # {.444, .333, .222}, would cut id 2 since .778 >= .75.)
    logits = np.log([0.4, 0.3, 0.2, 0.1])
    assert _cands(logits, top_p=0.75, min_p=0.45) == [0, 1, 2]
    assert _cands(logits, top_k=3, top_p=0.75, min_p=0.45) == [0, 1]  # renormalised {.44,.33,.22}
    assert _cands(logits, top_k=3, min_p=0.6) == [0, 1]


def test_candidates_match_the_reference_on_random_cases():
    rng = np.random.default_rng(11)
    for trial in range(500):
        v = int(rng.integers(1, 17))
        # coarse values make ties common
        logits = (np.round(rng.normal(0.0, 2.0, size=v) * 2.0) / 2.0).astype(np.float32)
        params = SamplingParams(
            temperature=float(rng.choice([0.25, 0.7, 1.0, 1.9])),
            top_k=int(rng.integers(0, v + 2)),
            top_p=float(rng.uniform(0.01, 1.0)) if trial % 4 else 1.0,
            min_p=float(rng.uniform(0.0, 1.0)) if trial % 3 else 0.0,
        )
        got = candidates(logits, params)
        assert got.tolist() == _reference_candidates(logits, params), params
        assert np.all(np.diff(got) > 0)  # ascending, no duplicates
        assert got.size >= 1
        assert int(np.argmax(logits)) in got.tolist()  # the greedy token always survives


def test_chosen_token_is_always_a_candidate():
    rng = np.random.default_rng(12)
    for trial in range(300):
        v = int(rng.integers(2, 64))
        logits = rng.normal(0.0, 3.0, size=v).astype(np.float32)
        params = SamplingParams(
            temperature=float(rng.uniform(0.1, 4.0)),
            top_k=int(rng.integers(0, v)),
            top_p=float(rng.uniform(0.05, 1.0)),
            min_p=float(rng.uniform(0.0, 0.6)),
            seed=trial,
        )
        allowed = set(candidates(logits, params).tolist())
        for position in range(5):
            assert choose(logits, position, params) in allowed


def test_top_k_one_equals_greedy():
    rng = np.random.default_rng(13)
    for trial in range(100):
        logits = rng.normal(size=int(rng.integers(1, 100))).astype(np.float32)
        if trial % 3 == 0:  # exact ties at the top
            logits[rng.choice(logits.size, size=min(3, logits.size), replace=False)] = logits.max()
        greedy = choose(logits, 0, SamplingParams())
        for temperature in (0.1, 1.0, 10.0):
            for seed in range(3):
                params = SamplingParams(temperature=temperature, top_k=1, seed=seed)
                assert choose(logits, trial + seed, params) == greedy


def test_min_p_one_and_tiny_top_p_equal_greedy_without_ties():
    rng = np.random.default_rng(14)
    for trial in range(50):
        logits = rng.normal(size=20).astype(np.float32)
        greedy = int(np.argmax(logits))
        assert choose(logits, trial, SamplingParams(temperature=2.0, min_p=1.0, seed=trial)) == greedy
        assert choose(logits, trial, SamplingParams(temperature=2.0, top_p=1e-9, seed=trial)) == greedy


# ---------------------------------------------------------------------------------------------
# validation


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1.0},
        {"temperature": -1e-12},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"temperature": -float("inf")},
        {"top_p": 0.0},
        {"top_p": -0.5},
        {"top_p": 1.0000001},
        {"top_p": 2.0},
        {"top_p": float("nan")},
        {"min_p": -0.01},
        {"min_p": 1.0000001},
        {"min_p": float("nan")},
        {"top_k": -1},
        {"top_k": -100},
    ],
)
def test_params_validation_rejects(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.0},
        {"temperature": 1e-9},
        {"temperature": 100.0},
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"top_k": 0},
        {"top_k": 1},
        {"seed": -3},
        {"seed": 2**64 + 5},
    ],
)
def test_params_validation_accepts(kwargs):
    SamplingParams(**kwargs)


def test_params_are_frozen():
    params = SamplingParams(temperature=1.0)
    with pytest.raises(AttributeError):
        params.temperature = 2.0  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# batch independence


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=1.5, seed=2, top_k=20, top_p=0.9, min_p=0.02),
        SamplingParams(temperature=0.3, seed=2**62, top_p=0.5),
    ],
)
def test_row_of_a_batch_equals_the_row_alone(params):
    rng = np.random.default_rng(15)
    matrix = rng.normal(0.0, 2.0, size=(9, 300)).astype(np.float32)
    fortran = np.asfortranarray(matrix)  # rows are strided views here
    base = 1000
    for j in range(matrix.shape[0]):
        position = base + j + 1
        alone = choose(matrix[j].copy(), position, params)
        assert choose(matrix[j], position, params) == alone
        assert choose(fortran[j], position, params) == alone
        assert choose(matrix[j : j + 1].copy()[0], position, params) == alone
        # other rows do not matter
        other = rng.normal(0.0, 2.0, size=matrix.shape).astype(np.float32)
        other[j] = matrix[j]
        assert choose(other[j], position, params) == alone
