"""`agentfold bench tools`: the scoring, and a quick run through a real server on SmolLM2."""

from __future__ import annotations

import json

import pytest

from agentfold.bench.tools import CASES, KINDS, TOOLS, bench_tools, names_written, right, summarize


def test_every_kind_has_cases_and_every_case_names_declared_tools():
    for kind in KINDS:
        assert sum(case.kind == kind for case in CASES) >= 8, kind
    for case in CASES:
        assert set(case.tools) <= set(TOOLS)
        assert {name for name, _ in case.expected} <= set(case.tools), case
        assert (case.kind == "irrelevant") == (not case.expected)
        assert (case.kind == "several") == (len(case.expected) == 2)


def test_right_compares_names_and_arguments_in_any_order():
    want = (("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tokyo"}))
    assert right([("get_weather", {"city": "tokyo"}), ("get_weather", {"city": "Paris "})], want)
    assert not right([("get_weather", {"city": "Paris"})], want)  # one call short
    assert not right([("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Paris"})], want)
    assert right([("calculate_bmi", {"weight_kg": 82.0, "height_m": 1.8, "unit": "metric"})],
                 (("calculate_bmi", {"weight_kg": 82, "height_m": 1.8}),))  # numbers by value, extras allowed
    assert not right([("calculate_bmi", {"weight_kg": "82", "height_m": 1.8})], (("calculate_bmi", {"weight_kg": 82,
                                                                                                  "height_m": 1.8}),))
    assert right([], ()) and not right([("git_log", {"count": 1})], ())


def test_names_written_finds_every_form_and_summary_flags_a_loss():
    text = 'I will call {"name": "calc_area", "arguments": {}} and <function=Read> then get_weather(city="x")'
    assert {"calc_area", "Read", "get_weather"} <= names_written(text)
    rows = [{"kind": "single", "server_right": False, "raw_right": True, "calls_not_written": []},
            {"kind": "irrelevant", "server_right": False, "raw_right": True, "calls_not_written": ["calculate_bmi"]}]
    summary = summarize(rows)
    assert summary["no_server_loss"] is False and summary["calls_not_written"] == 1 and summary["ok"] is False
    assert summarize([{**r, "server_right": True, "calls_not_written": []} for r in rows])["ok"] is True


@pytest.mark.slow
def test_quick_run_through_a_server(tmp_path):
    out = tmp_path / "tools.json"
    result = bench_tools(None, out, quick=True, progress=lambda message: None)
    assert json.loads(out.read_text())["summary"] == result["summary"]
    assert result["summary"]["cases"] == 2 * len(KINDS) and set(result["summary"]["kinds"]) == set(KINDS)
    assert result["summary"]["calls_not_written"] == 0
    for row in result["cases"]:
        assert row["raw_text"] and row["seconds"] > 0
        if not row["server_calls"] and not row["raw_calls"]:  # no call either way: the same text
            assert row["server_content"].strip() == row["raw_text"].replace("<|im_end|>", "").strip()
