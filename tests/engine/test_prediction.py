"""Predicted Outputs: a reply drafted from the text the client expects, equal to serial decoding.

The drafter is checked alone (where it proposes, how it finds its place after an edit), then on the
real SmolLM2-135M-Instruct: the serial reply to an edit request, sent back as the prediction as it
is, with a line changed, or as unrelated text, greedy and seeded sampled; every drafted reply must
equal the serial one, and the predictions that hold the reply must have been drafted from and kept.
"""

from __future__ import annotations

import pytest

from agentfold.engine.decode import Engine, GenerationConfig
from agentfold.engine.drafters import PredictionDrafter
from agentfold.engine.sampler import SamplingParams
from tests.conftest import chat_ids

GREEDY = SamplingParams()
CODE = ("def area(width, height):\n    return width * height\n\n\n"
        "def perimeter(width, height):\n    return 2 * (width + height)\n")
EDIT = f"Rename the parameter width to w everywhere and print the whole file:\n```python\n{CODE}```"
MAX_TOKENS = 48


def test_drafter_follows_the_prediction_and_rejoins_after_an_edit() -> None:
    prediction = [10, 11, 12, 13, 14, 15, 16, 17]
    drafter = PredictionDrafter(prediction, start=3)
    history = [1, 2, 3]  # the prompt: the reply has not started
    assert drafter.propose(history, 4, GREEDY) == [10, 11, 12, 13]
    assert drafter.propose([*history, 10, 11], 3, GREEDY) == [12, 13, 14]
    # the reply wrote 99 where the prediction has 12 and 13, then went on as predicted (14 15)
    assert drafter.propose([*history, 10, 11, 99], 3, GREEDY) == []  # no place in the prediction yet
    assert drafter.propose([*history, 10, 11, 99, 14, 15], 2, GREEDY) == [16, 17]
    assert drafter.propose([*history, 10, 11, 99, 14, 15, 16, 17], 2, GREEDY) == []  # the prediction is spent
    assert drafter.propose([*history, 50, 51, 52], 2, GREEDY) == []  # nothing like it
    assert drafter.fork().propose(history, 2, GREEDY) == [10, 11]


def test_drafter_prefers_the_longest_match() -> None:
    prediction = [5, 6, 7, 1, 2, 3, 4, 8, 9, 3, 4, 30]
    drafter = PredictionDrafter(prediction, start=0)
    assert drafter.propose([0, 2, 3, 4], 2, GREEDY) == [8, 9]  # "2 3 4" beats the later "3 4"
    assert drafter.propose([0, 9, 3, 4], 2, GREEDY) == [30]


def test_a_rejoin_reads_the_prediction_top_to_bottom() -> None:
    """The same tail twice in the prediction: the first rejoin takes the first place, the next one
    the place after it (an edited file's second similar line), not the first again."""
    prediction = [1, 2, 9, 5, 1, 2, 8, 6]
    drafter = PredictionDrafter(prediction, start=0)
    assert drafter.propose([0, 1, 2], 1, GREEDY) == [9]
    assert drafter.propose([0, 1, 2, 9, 4, 1, 2], 1, GREEDY) == [8]
    many = PredictionDrafter([7] * 5000 + [3, 4], start=0)  # thousands of places: a bounded search
    assert many.propose([0, 7, 7], 2, GREEDY) == [7, 7]


@pytest.fixture(scope="module")
def edit_prompt(smollm2_engine) -> list[int]:
    return chat_ids(smollm2_engine.tokenizer, EDIT)


def _reply(engine: Engine, prompt: list[int], params: SamplingParams, draft: bool, prediction: str = ""):
    ids = tuple(engine.tokenizer.encode(prediction, add_special_tokens=False)) if prediction else ()
    return engine.generate(prompt, GenerationConfig(params=params, max_tokens=MAX_TOKENS, draft=draft,
                                                    prediction=ids))


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, seed=11)], ids=["greedy", "sampled"])
def test_predicted_reply_equals_serial(smollm2_engine, edit_prompt, params: SamplingParams) -> None:
    serial = _reply(smollm2_engine, edit_prompt, params, draft=False)
    assert serial.stats.drafted == 0 and len(serial.tokens) >= 24, serial.text
    lines = serial.text.splitlines(keepends=True)
    assert len(lines) >= 4, serial.text
    edited = "".join([lines[0], "# a line the reply does not have\n", *lines[2:]])  # most of it after
    cases = {"as it is": serial.text, "a line changed": edited,
             "unrelated": "The quick brown fox jumps over the lazy dog. " * 4}
    kept = {}
    for name, prediction in cases.items():
        drafted = _reply(smollm2_engine, edit_prompt, params, draft=True, prediction=prediction)
        assert drafted.tokens == serial.tokens, name
        assert drafted.stats.draft_method == "prediction"
        counts = drafted.stats.prediction_tokens()
        assert counts["accepted_prediction_tokens"] == drafted.stats.accepted
        assert counts["accepted_prediction_tokens"] + counts["rejected_prediction_tokens"] == drafted.stats.drafted
        kept[name] = drafted.stats
    whole = kept["as it is"]
    assert whole.accepted >= len(serial.tokens) // 2 and whole.verify_passes < len(serial.tokens) // 2, whole
    # past the changed line the drafter found its place again: many more kept than the line before it holds
    before_edit = len(smollm2_engine.tokenizer.encode(lines[0], add_special_tokens=False))
    assert kept["a line changed"].accepted >= before_edit + 8, (kept["a line changed"], before_edit)
    assert kept["unrelated"].accepted <= 2


def test_prediction_drafts_without_an_engine_drafter_and_never_when_serial(smollm2_engine, edit_prompt) -> None:
    engine = Engine(smollm2_engine.backend, smollm2_engine.tokenizer, smollm2_engine.eos_token_ids, drafter=None,
                    exactness=smollm2_engine.exactness)
    serial = _reply(engine, edit_prompt, GREEDY, draft=False, prediction="anything")
    assert serial.stats.draft_method == "none" and serial.stats.drafted == 0
    assert serial.stats.prediction_tokens() == {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
    drafted = _reply(engine, edit_prompt, GREEDY, draft=True, prediction=serial.text)
    assert drafted.tokens == serial.tokens and drafted.stats.accepted > 0
    assert _reply(engine, edit_prompt, GREEDY, draft=True).stats.draft_method == "none"
