"""`agentfold models`, short model names, `--version`: finding and naming models without loading them."""

from __future__ import annotations

import json
import shutil

import pytest

import agentfold
from agentfold.bench.harness import free_port
from agentfold.cli import main
from agentfold.serve.models import ModelNotFound, available_models, default_model_path, gguf_metadata, resolve


@pytest.fixture
def no_weights_loaded(monkeypatch):
    """Fails the test if anything builds an engine or reads tensors (listing must read headers only)."""
    import agentfold.engine.factory as factory

    def refuse(*args, **kwargs):
        raise AssertionError("listing models loaded weights")

    monkeypatch.setattr(factory, "build_engine", refuse)
    monkeypatch.setattr("gguf.GGUFReader", refuse)


def test_models_lists_both_shipped_models_with_context_lengths(no_weights_loaded, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("AGENTFOLD_MODELS", str(tmp_path / "cache"))  # an empty conversion cache
    assert main(["models", "--json"]) == 0
    listed = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)}
    smollm2, gemma3 = listed["SmolLM2-135M-Instruct.Q4_1"], listed["gemma-3-270m-q4_k_m"]
    assert (smollm2["context_length"], smollm2["architecture"]) == (8192, "llama") and "smollm2" in smollm2["aliases"]
    assert (gemma3["context_length"], gemma3["architecture"]) == (32768, "gemma3") and "gemma3" in gemma3["aliases"]
    assert smollm2["size_bytes"] == default_model_path().stat().st_size and gemma3["size_bytes"] > 100_000_000
    assert main(["models"]) == 0
    table = capsys.readouterr().out
    assert "32768" in table and "8192" in table and "smollm2" in table


def test_models_lists_the_coder_model_once_installed(no_weights_loaded, capsys):
    from agentfold.serve.models import CODER_SHA256, ModelNotFound, coder_chunks, coder_path

    try:
        coder_chunks()
    except ModelNotFound:
        pytest.skip("the coder model's chunk packages are not installed")
    assert main(["models", "--json"]) == 0
    listed = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)}
    coder = listed["qwen2.5-coder-1.5b-instruct-q4_k_m"]
    assert (coder["architecture"], coder["context_length"]) == ("qwen2", 32768)
    assert {"qwen2.5-coder", "coder"} <= set(coder["aliases"]) and coder["size_bytes"] > 1_000_000_000
    assert resolve("coder") == coder_path() == resolve("qwen2.5-coder")
    from agentfold.engine.file_digest import sha256_of

    assert sha256_of(coder_path()) == CODER_SHA256


def test_model_dir_and_cache_entries(monkeypatch, capsys, tmp_path):
    cache, shelf = tmp_path / "cache", tmp_path / "shelf"
    (cache / "some-model-float32").mkdir(parents=True)
    (cache / "some-model-float32" / "config.json").write_text('{"model_type": "qwen3", "max_position_embeddings": 40960}')
    shelf.mkdir()
    shutil.copy(default_model_path(), shelf / "MyCoder-7B-Instruct.Q4_K_M.gguf")
    monkeypatch.setenv("AGENTFOLD_MODELS", str(cache))
    assert main(["models", "--json", "--model-dir", str(shelf)]) == 0
    listed = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)}
    mine = listed["MyCoder-7B-Instruct.Q4_K_M"]
    assert mine["aliases"] == ["mycoder-7b-instruct"] and mine["context_length"] == 8192
    assert listed["some-model-float32"]["context_length"] == 40960 and listed["some-model-float32"]["source"] == "cache"
    assert resolve("mycoder-7b-instruct", [shelf]) == shelf / "MyCoder-7B-Instruct.Q4_K_M.gguf"
    assert resolve("some-model-float32") == cache / "some-model-float32"


def test_short_names_resolve():
    assert resolve("smollm2") == default_model_path() == resolve("SmolLM2-135M-Instruct.Q4_1")
    assert resolve("gemma3").name == "gemma-3-270m-q4_k_m.gguf"


def test_unknown_model_name_is_one_line_exit_2(capsys):
    with pytest.raises(ModelNotFound, match="known names: smollm2, gemma3"):
        resolve("llama-70b")
    assert main(["generate", "--model", "llama-70b", "hi"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "llama-70b" in err and "smollm2" in err and "gemma3" in err


def test_gguf_header_reader_stops_before_the_vocabulary():
    meta = gguf_metadata(default_model_path())
    assert meta["general.architecture"] == "llama" and meta["llama.context_length"] == 8192
    assert not any(key.startswith("tokenizer.") for key in meta)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"agentfold {agentfold.__version__}"
    assert main(["version"]) == 0 and capsys.readouterr().out.strip() == f"agentfold {agentfold.__version__}"


def test_models_entries_are_the_catalogue():
    names = [entry.name for entry in available_models(cache=False)]
    assert names[:2] == ["SmolLM2-135M-Instruct.Q4_1", "gemma-3-270m-q4_k_m"], names


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_ctx_size_past_the_trained_context_is_refused(command, capsys, tmp_path):
    extra = ["--home", str(tmp_path), "--port", str(free_port())] if command == "serve" else ["hi"]
    assert main([command, "--model", "gemma3", "--ctx-size", "40000", *extra]) == 2
    err = capsys.readouterr().err
    assert "--ctx-size 40000 is larger than gemma-3-270m-q4_k_m's trained context of 32768" in err, err
    assert len(err.strip().splitlines()) == 1
