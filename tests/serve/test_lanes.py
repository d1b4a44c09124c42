"""Lanes: concurrent replies share verify passes and stay byte-identical to their solo runs.

`plan_lanes` is checked on its own; then real replies on SmolLM2 (torch, and MLX in the slow
suite) run side by side through the runtime, greedy and sampled, with drafting, against each
reply run alone with drafting and with `"draft": false`. The runtime's lane counters prove the
passes were shared and held drafts: a test where every pass ran alone would prove nothing.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from agentfold.engine.decode import PROMPT_PASS_MAX, GenerationConfig, PassRequest
from agentfold.engine.sampler import SamplingParams
from agentfold.engine.selfcheck import check_row_exactness
from agentfold.serve.lanes import PROMPT_ROWS, LaneStats, plan_lanes
from agentfold.serve.scheduler import Runtime, TurnRequest
from tests.conftest import chat_ids


def _requests(*sizes: int) -> list[PassRequest]:
    return [PassRequest(list(range(100, 100 + size)), cache=None) for size in sizes]


def test_plan_shares_rows_fairly_within_the_width():
    requests = _requests(9, 1, 4, 6)  # pending token + 8, 0, 3, 5 drafts
    groups = plan_lanes(requests, 8)
    assert groups == [[0, 1, 2, 3]]
    assert [len(r.tokens) for r in requests] == [3, 1, 2, 2]  # 4 drafts handed out one at a time
    assert [r.tokens for r in requests][0] == [100, 101, 102]  # a prefix of what was asked: cut, not changed


def test_plan_splits_more_replies_than_rows_into_even_passes():
    requests = _requests(*[3] * 10)
    groups = plan_lanes(requests, 4)
    assert groups == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert sum(len(requests[i].tokens) for i in groups[0]) == 4  # one row each, no room for drafts
    assert [len(requests[i].tokens) for i in groups[1]] == [2, 1, 1]  # one spare row
    assert all(sum(len(requests[i].tokens) for i in g) <= 4 for g in groups)


def test_plan_without_lanes_runs_every_pass_alone_with_its_drafts():
    requests = _requests(5, 7)
    assert plan_lanes(requests, 0) == [[0], [1]]
    assert [len(r.tokens) for r in requests] == [5, 7]
    assert plan_lanes([], 16) == []


def test_plan_gives_prompt_rows_before_drafts():
    """A reply in prefill gets up to `prompt_rows` rows after every pending row, before any draft;
    the rest of its prompt waits for the next pass."""
    requests = _requests(5, 3, 40)
    requests[2].prefill = True
    assert plan_lanes(requests, 12, prompt_rows=6) == [[0, 1, 2]]
    assert [len(r.tokens) for r in requests] == [3, 3, 6]  # 3 pending + 5 more prompt rows, then 4 drafts
    assert requests[2].tokens == list(range(100, 106))  # a prefix of the prompt's rows
    prompt = _requests(50)
    prompt[0].prefill = True
    plan_lanes(prompt, 64)
    assert len(prompt[0].tokens) == 32  # PROMPT_ROWS at most, even with room


def test_lane_stats_summary():
    stats = LaneStats()
    stats.record(3, 9, 0.06, prompt_rows=4)
    stats.record(1, 4, 0.04)
    assert stats.summary() == {"passes": 2, "replies_per_pass": 2.0, "rows_per_pass": 6.5, "prompt_rows_per_pass": 2.0,
                               "pass_ms": 50.0, "by_replies": {1: 1, 3: 1}}


# --- real replies side by side -------------------------------------------------------------------

LISTS = [
    "alpha, bravo, charlie, delta, echo, foxtrot, golf, hotel, india, juliet",
    "red, orange, yellow, green, blue, indigo, violet, black, white, grey",
    "one, two, three, four, five, six, seven, eight, nine, ten",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday",
]
CONFIGS = [GenerationConfig(max_tokens=28), GenerationConfig(max_tokens=28),
           GenerationConfig(params=SamplingParams(temperature=0.8, seed=11), max_tokens=28),
           GenerationConfig(params=SamplingParams(temperature=0.6, top_p=0.9, seed=5), max_tokens=20)]


def _side_by_side(engine) -> None:
    """Four replies at once equal each run alone (drafted) and serially; passes were shared."""
    assert engine.exactness.lanes, engine.exactness.describe()
    prompts = [chat_ids(engine.tokenizer, f"Repeat this list exactly, once: {items}") for items in LISTS]
    alone = [engine.generate(p, c) for p, c in zip(prompts, CONFIGS, strict=True)]
    serial = [engine.generate(p, GenerationConfig(params=c.params, max_tokens=c.max_tokens, draft=False))
              for p, c in zip(prompts, CONFIGS, strict=True)]
    runtime = Runtime(engine, "m", max_active=len(prompts))
    try:
        turns = [runtime.submit(TurnRequest(p, c)) for p, c in zip(prompts, CONFIGS, strict=True)]
        together = [turn.result(timeout=300) for turn in turns]
    finally:
        runtime.close()
    assert [c.tokens for c in together] == [c.tokens for c in alone] == [c.tokens for c in serial]
    assert [c.text for c in together] == [c.text for c in alone]
    lanes = runtime.lanes
    shared = sum(count for replies, count in lanes.by_lanes.items() if replies > 1)
    assert shared >= 3, lanes.summary()  # passes really held several replies
    assert lanes.rows > lanes.lanes, lanes.summary()  # ... and drafts among their rows
    assert sum(c.stats.drafted for c in together) > 0 and sum(c.stats.accepted for c in together) > 0
    assert max(rows for turn in turns for _, rows in turn.lane_passes) <= engine.exactness.lane_width
    assert all(any(replies > 1 for replies, _ in turn.lane_passes) for turn in turns)


def test_replies_side_by_side_equal_their_solo_runs(smollm2_engine):
    _side_by_side(smollm2_engine)


@pytest.mark.slow
def test_replies_side_by_side_equal_their_solo_runs_mlx(smollm2_mlx_engine):
    _side_by_side(smollm2_mlx_engine)


class _CrossTalk:
    """A backend whose shared passes of more than `above` rows leak one lane into another (as a
    kernel that mixed rows would): the self-check must find it and cap or turn off sharing."""

    def __init__(self, backend, above: int = 0) -> None:
        self._backend = backend
        self._above = above

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def forward_many(self, lanes, **kwargs):
        out = self._backend.forward_many(lanes, **kwargs)
        if sum(len(tokens) for tokens, _ in lanes) > self._above:
            out[-1] = out[-1] + np.float32(1e-3) * out[0][:1]
        return out


def test_inexact_lanes_are_found_and_not_shared(smollm2_engine):
    report = check_row_exactness(_CrossTalk(smollm2_engine.backend), max_width=4, lane_width=12)
    assert report.max_width == 4 and not report.lanes and report.lane_width == 0
    assert "lanes" not in report.describe()
    capped = check_row_exactness(_CrossTalk(smollm2_engine.backend, above=8), max_width=4, lane_width=12)
    assert capped.lane_width == 4, capped  # the wide shared pass leaked: shared passes keep to one reply's width
    honest = check_row_exactness(smollm2_engine.backend, max_width=4, lane_width=12)
    assert honest.lane_width == 12 and "12 rows across replies (lanes on)" in honest.describe()


def test_a_prompt_prefilled_while_others_decode_rides_in_their_passes(smollm2_engine):
    """A prompt arriving while two replies decode (a chunk of at most PROMPT_PASS_MAX rows, as a
    turn's new message is) is prefilled in pieces that ride in their shared passes (no logits for
    its rows): every reply still equals its solo and serial runs."""
    engine = smollm2_engine
    assert engine.exactness.prefill_lanes and "prompts in shared passes" in engine.exactness.describe()
    first = [chat_ids(engine.tokenizer, f"Repeat this list exactly, once: {items}") for items in LISTS[:2]]
    late = chat_ids(engine.tokenizer, "Repeat these lists exactly, once each: " + "; ".join(LISTS))
    prompts, configs = [*first, late], [CONFIGS[0], CONFIGS[2], GenerationConfig(max_tokens=16)]
    alone = [engine.generate(p, c) for p, c in zip(prompts, configs, strict=True)]
    serial = [engine.generate(p, GenerationConfig(params=c.params, max_tokens=c.max_tokens, draft=False))
              for p, c in zip(prompts, configs, strict=True)]
    runtime = Runtime(engine, "m", max_active=3)
    try:
        assert runtime.prompts_in_passes
        turns = [runtime.submit(TurnRequest(p, c)) for p, c in zip(first, configs, strict=False)]
        deadline = time.monotonic() + 300
        while not all(turn.first_delta_at for turn in turns) and time.monotonic() < deadline:
            time.sleep(0.001)  # both decode before the long prompt comes
        turns.append(runtime.submit(TurnRequest(late, configs[2])))
        together = [turn.result(timeout=300) for turn in turns]
    finally:
        runtime.close()
    assert PROMPT_ROWS < len(late) <= PROMPT_PASS_MAX
    assert [c.tokens for c in together] == [c.tokens for c in alone] == [c.tokens for c in serial]
    assert runtime.lanes.prompt_rows > 0, runtime.lanes.summary()  # prompt rows shared decode passes
    assert turns[2].prefill_passes >= 2  # ... in pieces
    assert together[2].stats.prefilled_tokens == len(late)
