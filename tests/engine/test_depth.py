"""The depth controller: a shared cost model, each reply's own acceptance."""

from __future__ import annotations

import pytest

from agentfold.engine.depth import DepthController


def _controller() -> DepthController:
    controller = DepthController(max_depth=15)
    controller.seed_costs({1: 0.040, 2: 0.042, 4: 0.046, 8: 0.055, 16: 0.075})  # rows are cheap
    return controller


def test_each_reply_drafts_by_its_own_acceptance():
    """An agent re-emitting a file (every draft accepted) keeps drafting deep beside a sampled
    story whose drafts miss; one shared estimate would have pulled both to the middle."""
    controller = _controller()
    echo, story = controller.start(), controller.start()
    for _ in range(20):
        controller.observe_drafts(8, 8, 0.001, echo)
        controller.observe_drafts(4, 0, 0.001, story)
    assert echo.acceptance > 0.9 and story.acceptance < 0.1
    assert controller.depth(None, echo) >= 12
    assert controller.depth(None, story) <= 1
    assert controller.odds.acceptance == controller.prior  # nobody else's estimate moved
    fresh = controller.start()
    assert fresh.acceptance == controller.prior and controller.depth(None, fresh) == controller.depth()


def test_a_reply_that_stopped_drafting_probes_again():
    controller = _controller()
    odds = controller.start()
    for _ in range(30):
        controller.observe_drafts(4, 0, 0.001, odds)
    assert controller.depth(None, odds) == 0
    for _ in range(controller.probe_every):
        controller.observe_pass(1, 0.040, odds)
    assert controller.depth(None, odds) == 2  # the probe
    assert controller.depth(None, controller.start()) > 2  # another reply never stopped


def test_a_reply_in_shared_passes_drafts_deeper_than_alone():
    """Beside other replies' lanes a draft adds little to the pass it joins: at a fair acceptance
    the reply drafts deeper there than alone, and the shared passes never enter the cost table
    (whose rows are one reply's: the lanes' overhead is not a price per row)."""
    controller = _controller()
    alone, shared = controller.start(), controller.start()
    for odds in (alone, shared):
        odds.acceptance = 0.7
    for _ in range(8):
        controller.observe_pass(6, 0.050, alone, own=6)
        controller.observe_pass(30, 0.120, shared, own=6)
    assert alone.shared < 0.01 and shared.shared == pytest.approx(0.120 / 0.040 - controller.ratio(6), rel=0.01)
    assert 30 not in controller.ratios and 6 in controller.ratios
    assert controller.depth(None, shared) > controller.depth(None, alone) >= 1
    for _ in range(8):  # alone again: the others' share fades
        controller.observe_pass(6, 0.050, shared, own=6)
    assert shared.shared < 0.01 and controller.depth(None, shared) == controller.depth(None, alone)
