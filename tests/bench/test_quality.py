"""The quality report: perplexity arithmetic on stand-in backends, then float32 vs int8 on the real SmolLM2.

Greedy replies are only checked for being reported: a 135M model's reply changes under any numeric
change, so equality is never asserted.
"""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest

from agentfold.bench.quality import (
    DEFAULT_LIMIT_PCT,
    _across_backends,
    _first_difference,
    bench_quality,
    perplexity,
    quality_report,
    stdlib_text,
    summary_line,
)


class _Cache:
    def __init__(self) -> None:
        self.tokens: list[int] = []


class _ScriptedBackend:
    """Logits that put `confidence` on the text's true next token (0 everywhere: uniform)."""

    def __init__(self, text: list[int], vocab: int, confidence: float) -> None:
        self.text, self.vocab, self.confidence = text, vocab, confidence
        self.passes: list[int] = []

    def new_cache(self) -> _Cache:
        return _Cache()

    def forward(self, tokens: list[int], cache: _Cache) -> np.ndarray:
        start = len(cache.tokens)
        assert list(tokens) == self.text[start : start + len(tokens)]  # the context carries across chunks
        cache.tokens.extend(tokens)
        self.passes.append(len(tokens))
        logits = np.zeros((len(tokens), self.vocab), dtype=np.float32)
        for row in range(len(tokens)):
            if start + row + 1 < len(self.text):
                logits[row, self.text[start + row + 1]] = self.confidence
        return logits


def test_perplexity_of_uniform_logits_is_the_vocabulary_size():
    text = [i % 7 for i in range(50)]
    backend = _ScriptedBackend(text, vocab=32, confidence=0.0)
    scored = perplexity(backend, text, chunk=16)
    assert scored["perplexity"] == pytest.approx(32.0) and scored["scored_tokens"] == 49
    assert backend.passes == [16, 16, 16, 1]  # one forward per chunk; the last token only as a target


def test_perplexity_of_confident_logits_is_near_one():
    text = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    scored = perplexity(_ScriptedBackend(text, vocab=10, confidence=30.0), text, chunk=4)
    assert 1.0 <= scored["perplexity"] < 1.0 + 1e-6
    expected = math.log(1 + 9 * math.exp(-2.0))  # NLL with the right token 2 nats above the other 9
    assert perplexity(_ScriptedBackend(text, vocab=10, confidence=2.0), text)["mean_nll"] == pytest.approx(expected,
                                                                                                           abs=1e-6)


def test_the_text_is_fixed_and_differences_are_located():
    first, second = stdlib_text(), stdlib_text()
    assert first == second and first["files"][0] == "colorsys.py" and "def rgb_to_hsv" in first["text"]
    assert _first_difference([1, 2, 3], [1, 2, 3]) is None
    assert _first_difference([1, 2, 3], [1, 5, 3]) == 1 and _first_difference([1, 2], [1, 2, 3]) == 2


def test_replies_are_compared_across_backends_per_quant():
    replies = {"torch": {"none": [[1, 2], [3]], "int8": [[1, 2], [4]]},
               "mlx": {"none": [[1, 2], [5]], "int8": [[1, 2], [4]]}}
    same = _across_backends(replies)
    assert same["float32"]["identical"] == "1 / 2" and same["int8"]["identical"] == "2 / 2"
    assert same["int8"]["backends"] == ["mlx", "torch"]
    assert _across_backends({"torch": replies["torch"]}) == {}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch (the torch backend) is not installed")
def test_int8_perplexity_is_close_to_float32_on_smollm2(smollm2_gguf, tmp_path):
    lines: list[str] = []
    report = quality_report(smollm2_gguf, backends=["torch"], tokens=256, reply_prompts=("Say hello.",),
                            reply_max_tokens=8, progress=lines.append)
    torch_row = report["backends"]["torch"]
    float32, int8 = torch_row["float32"], torch_row["int8"]
    for scored in (float32, int8):
        assert math.isfinite(scored["perplexity"]) and scored["perplexity"] > 1
        assert scored["scored_tokens"] == 255 and scored["kernels"]["backend"] == "torch"
    assert float32["quant"] == "none" and int8["quant"] == "int8" and int8["kernels"]["linear"].startswith("int8")
    change = (int8["perplexity"] / float32["perplexity"] - 1) * 100
    assert torch_row["relative_change_pct"] == pytest.approx(change, abs=1e-3)
    assert abs(change) < 5.0  # ~1% here; the default's gate is DEFAULT_LIMIT_PCT
    assert torch_row["default_ok"] is (abs(change) <= DEFAULT_LIMIT_PCT) and report["default_ok"] is torch_row["default_ok"]
    blocks = torch_row["blocks"]  # the GGUF on its own Q4_1 blocks, the CPU default
    assert blocks["quant"] == "blocks" and blocks["kernels"]["linear"].startswith("block_gemm")
    assert blocks["scored_tokens"] == 255 and abs(torch_row["blocks_change_pct"]) < 5.0
    llama = report["llama_cpp"]  # the same token ids through llama.cpp, where it is installed
    if "perplexity" in llama:
        assert abs(llama["blocks_vs_llama_cpp_pct"]) < 2.0, llama  # the same block arithmetic as ours
    else:
        assert "skipped" in llama
    replies = torch_row["replies"]
    assert replies["count"] == 1 and replies["identical"] == f"{replies['identical_count']} / 1"
    assert report["text"]["tokens"] == 256 and report["text"]["files"][0] == "colorsys.py"
    assert "torch: ppl" in summary_line(report) and any("perplexity" in line for line in lines)
    json.dumps(report)  # the bench writes it as JSON


def test_bench_quality_reports_a_backend_that_cannot_run(tmp_path):
    """An unknown backend is recorded with its error, never a crash, and cannot make int8 the default."""
    out = tmp_path / "q.json"
    result = bench_quality(None, out, backend="no-such-backend", tokens=16, progress=None)
    on_disk = json.loads(out.read_text())
    assert on_disk == json.loads(json.dumps(result)) and on_disk["machine"]["cpu_model"]
    assert "error" in on_disk["quality"]["backends"]["no-such-backend"] and on_disk["quality"]["default_ok"] is False
