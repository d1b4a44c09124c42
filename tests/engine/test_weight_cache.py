"""A second start reads the converted int8 weights back: the same model, bit for bit, without the file's
dequantization; and a self-check of kernels exact by construction is remembered, never a float one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from agentfold.engine.factory import build_engine
from agentfold.engine.torch import weight_cache
from agentfold.engine.torch.backend import TorchBackend
from agentfold.engine.torch.loader import load_torch_model
from agentfold.kernels import int8_gemm
from tests.helpers.gguf_files import tiny_tokenizer_fields, write_tiny_model

PROMPT = [5, 17, 42, 99, 3, 250, 18, 7, 64, 128, 11]


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "cache"
    monkeypatch.setenv("AGENTFOLD_CACHE", str(home))
    monkeypatch.delenv("AGENTFOLD_WEIGHT_CACHE", raising=False)
    return home


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("wc") / "tiny-qwen2.gguf", "qwen2", "Q4_K", tiny_tokenizer_fields(),
                            seed=3)


def int8_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every int8 weight a pass multiplies by, as the GEMM holds it, and every float tensor."""
    from agentfold.engine.torch.models.quantize import _int8_weights

    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    for i, weight in enumerate(_int8_weights(model)):
        state[f"int8.{i}.scales"] = weight.scales
        state[f"int8.{i}.values"] = weight.int8_values()
        if weight.packed is not None:
            state[f"int8.{i}.packed"] = weight.packed.data
    return state


def test_second_load_reads_the_cache_and_is_the_same_model(tiny_gguf: Path, cache_home: Path):
    said: list[str] = []
    first = load_torch_model(tiny_gguf, device="cpu", progress=said.append, quant="int8")
    assert any("rounding the weights to int8" in line for line in said)
    entries = list((cache_home / "weights").iterdir())
    assert len(entries) == 1 and (entries[0] / "entry.json").exists()

    said.clear()
    second = load_torch_model(tiny_gguf, device="cpu", progress=said.append, quant="int8")
    assert any("from the cache" in line for line in said)
    assert not any("dequantizing" in line for line in said)
    a, b = int8_state(first.model), int8_state(second.model)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert first.tokenizer.encode("def add(a, b):") == second.tokenizer.encode("def add(a, b):")
    assert first.config == second.config
    one, two = TorchBackend(first), TorchBackend(second)
    assert np.array_equal(one.forward(PROMPT, one.new_cache()), two.forward(PROMPT, two.new_cache()))


def test_cache_off_or_broken_converts_again(tiny_gguf: Path, cache_home: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("AGENTFOLD_WEIGHT_CACHE", "0")
    load_torch_model(tiny_gguf, device="cpu", quant="int8")
    assert not (cache_home / "weights").exists()
    monkeypatch.delenv("AGENTFOLD_WEIGHT_CACHE")
    load_torch_model(tiny_gguf, device="cpu", quant="int8")
    (entry,) = (cache_home / "weights").iterdir()
    (entry / "entry.json").unlink()  # a start killed while writing leaves no entry.json
    said: list[str] = []
    load_torch_model(tiny_gguf, device="cpu", progress=said.append, quant="int8")
    assert any("dequantizing" in line for line in said)


def test_another_file_is_another_entry(tmp_path: Path, tiny_gguf: Path, cache_home: Path):
    other = write_tiny_model(tmp_path / "other.gguf", "qwen2", "Q4_K", tiny_tokenizer_fields(), seed=4)
    assert weight_cache.cache_key(other, "float32") != weight_cache.cache_key(tiny_gguf, "float32")
    assert weight_cache.cache_key(tiny_gguf, "float32") != weight_cache.cache_key(tiny_gguf, "bfloat16")


def test_exact_self_check_is_remembered_float_one_is_not(tiny_gguf: Path, cache_home: Path, tmp_path: Path):
    verdicts = tmp_path / "verdicts" / "backends.json"
    said: list[str] = []
    first = build_engine(tiny_gguf, backend="torch", device="cpu", verdicts=verdicts, progress=said.append)
    assert not any("remembered" in line for line in said)
    said.clear()
    again = build_engine(tiny_gguf, backend="torch", device="cpu", verdicts=verdicts, progress=said.append)
    assert any("(remembered" in line for line in said)
    assert again.exactness.max_width == first.exactness.max_width > 1
    assert again.exactness.lane_width == first.exactness.lane_width
    assert again.exactness.pass_seconds == first.exactness.pass_seconds
    said.clear()
    build_engine(tiny_gguf, backend="torch", device="cpu", quant="none", verdicts=verdicts, progress=said.append)
    build_engine(tiny_gguf, backend="torch", device="cpu", quant="none", verdicts=verdicts, progress=said.append)
    assert not any("(remembered" in line for line in said)  # float BLAS: checked at every start


def test_gemm_choices_are_remembered(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """The int8 GEMM's choice of kernel per shape is timed once per machine, then read back."""
    if not int8_gemm.available():
        pytest.skip("no C compiler: torch._int_mm is the only kernel")
    store = tmp_path / "kernels" / "gemm-choices.json"
    monkeypatch.setattr(int8_gemm, "_choices_file", lambda: store)
    monkeypatch.setattr(int8_gemm, "_CHOICE", {})
    monkeypatch.setattr(int8_gemm, "_DISK", [])
    timed: list[tuple] = []
    real = int8_gemm._time_both
    monkeypatch.setattr(int8_gemm, "_time_both", lambda *a: timed.append(a[1:]) or real(*a))
    first = int8_gemm.faster_than_torch((96, 128), 8)
    assert len(timed) == 1 and store.exists()
    monkeypatch.setattr(int8_gemm, "_CHOICE", {})
    monkeypatch.setattr(int8_gemm, "_DISK", [])
    assert int8_gemm.faster_than_torch((96, 128), 8) == first
    assert len(timed) == 1  # read back, not timed again
