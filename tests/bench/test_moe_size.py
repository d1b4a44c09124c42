"""`agentfold bench moe` on its tiny shapes: the same writer, children and record as the real-size run.

The real shapes are checked against their public numbers (dimensions, and the file sizes their block
types give) without writing them. The tiny files are written to a temporary cache, loaded by our
GGUF loader, and run through the whole bench, once through the CLI (cache from AGENTFOLD_CACHE) and
once through `bench_moe` (an explicit cache folder). Speed is never asserted, only that every rate
was measured, and that the drafted reply equals the serial one. llama.cpp's part runs where
llama-cpp-python is installed; elsewhere the record must say why it was skipped.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from agentfold.bench import moe_size
from agentfold.bench.llamacpp import NOT_INSTALLED
from agentfold.bench.moe_files import SHAPES, ensure_file, file_path, tensor_plan, tokenizer_fields
from agentfold.bench.moe_size import bench_moe
from agentfold.kernels import block_linear

pytestmark = pytest.mark.skipif(not block_linear.supported("MXFP4", 32), reason="no C compiler: no block kernels")

TINY = ("tiny-qwen3moe", "tiny-gpt-oss")
PREFILL, MAX_TOKENS = 64, 8
HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
TOP_KEYS = {"schema", "timestamp", "duration_seconds", "quick", "machine", "versions", "blas", "settings", "method",
            "models", "summary"}
MACHINE_KEYS = {"platform", "machine", "processor", "cpu_model", "cpu", "cpu_count", "cpus_usable", "threads",
                "memory_bytes", "memory_gb", "loadavg_start", "loadavg_end"}
MODEL_KEYS = {"shape", "file", "prompt_tokens", "max_tokens", "agentfold", "llama_cpp", "ratios"}
FILE_KEYS = {"path", "bytes", "gb", "seed", "writer_version", "tensor_types", "written", "write_seconds"}
MEMORY_KEYS = {"peak_rss_bytes", "peak_rss_gb", "VmHWM", "VmRSS", "RssAnon", "RssFile"}
AGENTFOLD_KEYS = {"engine", "backend", "threads", "load_seconds", "model_load_seconds", "selfcheck_seconds",
                  "warmup_seconds", "ready_seconds", "exactness", "drafter", "memory_after_load", "prefill",
                  "decode_tps", "decode", "drafted", "page_cache_read_seconds", *MEMORY_KEYS}
DRAFTED_KEYS = {"prompt_tokens", "cached_tokens", "window", "window_start", "serial_tps", "drafted_tps", "speedup",
                "tokens_per_pass", "acceptance_rate", "drafted_tokens", "accepted", "identical", "serial",
                "prediction_tokens",
                "drafted_run"}
LLAMA_KEYS = {"engine", "version", "threads", "n_ctx", "load_seconds", "warmup_seconds", "ready_seconds",
              "memory_after_load", "prefill", "decode_tps", "decode", "weights", "page_cache_read_seconds",
              "identical_to_agentfold_serial", *MEMORY_KEYS}
RATIO_KEYS = {"prefill", "decode", "drafted_vs_llama_cpp_serial", "load_seconds", "ready_seconds", "peak_rss", "note"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Each tiny shape's bench record: qwen3moe through the CLI, gpt-oss through `bench_moe`."""
    from agentfold.cli import main

    folder = tmp_path_factory.mktemp("bench-moe")
    records = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AGENTFOLD_CACHE", str(folder / "env-cache"))
        out = folder / "qwen.json"
        code = main(["bench", "moe", "--arch", "tiny-qwen3moe", "--prefill", str(PREFILL), "--max-tokens",
                     str(MAX_TOKENS), "--out", str(out)])
        assert code == 0
        records["tiny-qwen3moe"] = json.loads(out.read_text())
        records["tiny-gpt-oss"] = bench_moe("tiny-gpt-oss", folder / "gpt-oss.json", prefill=PREFILL,
                                            max_tokens=MAX_TOKENS, cache_dir=folder / "cache", progress=None)
    return records


def test_real_shapes_are_the_public_models() -> None:
    """The numbers of the two configs, and the sizes their block types give the published files
    (Q4_K_M 18.6 GB: Q6_K on llama.cpp's 24 `use_more_bits` layers; MXFP4 12.1 GB)."""
    qwen, oss = SHAPES["qwen3-coder-30b-a3b"], SHAPES["gpt-oss-20b"]
    assert (qwen.layers, qwen.hidden, qwen.heads, qwen.kv_heads, qwen.head_dim, qwen.experts, qwen.used,
            qwen.expert_inner, qwen.vocab, qwen.context, qwen.rope_theta, qwen.rms_eps) == (
        48, 2048, 32, 4, 128, 128, 8, 768, 151936, 262144, 1e7, 1e-6)
    assert (oss.layers, oss.hidden, oss.heads, oss.kv_heads, oss.head_dim, oss.experts, oss.used, oss.expert_inner,
            oss.vocab, oss.sliding_window, oss.rope_theta, oss.yarn_factor, oss.yarn_original_context,
            oss.rms_eps) == (24, 2880, 64, 8, 64, 32, 4, 2880, 201088, 128, 150000.0, 32.0, 4096, 1e-5)
    qwen_plan, oss_plan = tensor_plan(qwen), tensor_plan(oss)
    downs = [spec.kind for spec in qwen_plan if spec.name.endswith("ffn_down_exps.weight")]
    assert downs.count("Q6_K") == 24 and downs.count("Q4_K") == 24
    assert 18.4e9 < sum(spec.nbytes() for spec in qwen_plan) < 18.7e9
    assert 12.0e9 < sum(spec.nbytes() for spec in oss_plan) < 12.2e9
    assert {spec.kind for spec in oss_plan if "_exps.weight" in spec.name} == {"MXFP4"}
    assert {spec.kind for spec in oss_plan if spec.name.endswith(".bias")} == {"F32"}


@pytest.mark.parametrize("name", [*SHAPES])
def test_vocabulary_has_exactly_vocab_tokens(name: str) -> None:
    shape = SHAPES[name]
    fields = tokenizer_fields(shape)
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == len(set(tokens)) == shape.vocab == len(fields["tokenizer.ggml.token_type"])
    assert tokens[-len(shape.specials()):] == shape.specials()
    assert tokens[fields["tokenizer.ggml.eos_token_id"]] == ("<|im_end|>" if shape.arch == "qwen3moe" else "<|return|>")
    assert fields["tokenizer.ggml.merges"]  # llama.cpp refuses a gpt2 vocabulary without the key


@pytest.mark.parametrize("name", TINY)
def test_tiny_file_loads_with_its_config(name: str, runs: dict[str, dict], tmp_path: Path) -> None:
    """The written file as our loader reads it: the shape's config, its block types, the torch model on blocks."""
    from agentfold.engine.gguf_model import open_gguf
    from agentfold.engine.torch.loader import load_torch_model

    shape = SHAPES[name]
    path = Path(runs[name]["models"][name]["file"]["path"])
    gguf = open_gguf(path)
    config = gguf.config
    assert gguf.architecture == shape.arch
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["vocab_size"]) == (
        shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.vocab)
    if shape.arch == "qwen3moe":
        assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (
            shape.experts, shape.used, shape.expert_inner)
    else:
        assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"],
                config["sliding_window"], config["rope_scaling"]["factor"]) == (
            shape.experts, shape.used, shape.expert_inner, shape.sliding_window, shape.yarn_factor)
    assert set(gguf.file.type_counts()) == {kind for kind in (*shape.types.values(), *shape.more_bits.values())}
    loaded = load_torch_model(path, device="cpu", quant="blocks")
    assert getattr(loaded.model, "quantized", None) == "blocks"
    assert len(loaded.tokenizer) == shape.vocab


def test_the_cache_folder_comes_from_agentfold_cache(runs: dict[str, dict]) -> None:
    path = Path(runs["tiny-qwen3moe"]["models"]["tiny-qwen3moe"]["file"]["path"])
    assert path.parent.name == "bench" and path.parent.parent.name == "env-cache"
    assert Path(runs["tiny-gpt-oss"]["models"]["tiny-gpt-oss"]["file"]["path"]).parent.name == "cache"


@pytest.mark.parametrize("name", TINY)
def test_run_record_is_complete(name: str, runs: dict[str, dict]) -> None:
    record = runs[name]
    assert record["schema"] == moe_size.SCHEMA
    assert not TOP_KEYS - set(record), TOP_KEYS - set(record)
    assert not MACHINE_KEYS - set(record["machine"]), MACHINE_KEYS - set(record["machine"])
    assert record["machine"]["threads"]["backend"] >= 1
    model = record["models"][name]
    assert not MODEL_KEYS - set(model)
    assert not FILE_KEYS - set(model["file"]), FILE_KEYS - set(model["file"])
    assert model["file"]["written"] is True and model["file"]["bytes"] > 0
    ours = model["agentfold"]
    assert "failed" not in ours, ours
    assert not AGENTFOLD_KEYS - set(ours), AGENTFOLD_KEYS - set(ours)
    assert not DRAFTED_KEYS - set(ours["drafted"]), DRAFTED_KEYS - set(ours["drafted"])
    assert ours["prefill"]["tokens"] == PREFILL and ours["prefill"]["tps"] > 0
    assert ours["decode_tps"] > 0 and ours["decode"]["completion_tokens"] == MAX_TOKENS
    assert ours["load_seconds"] > 0 and ours["peak_rss_bytes"] > 0
    drafted = ours["drafted"]
    assert drafted["identical"] is True
    # the serial reply was the prediction: drafting ran, and every draft was the target's own token
    assert drafted["drafted_run"]["draft_method"] == "prediction" and drafted["drafted_tokens"] > 0
    assert drafted["accepted"] == drafted["drafted_tokens"] and drafted["prediction_tokens"] == MAX_TOKENS
    assert drafted["serial_tps"] > 0 and drafted["drafted_tps"] > 0
    assert record["summary"]["all_identical"] is True and record["summary"]["all_ran"] is True
    theirs = model["llama_cpp"]
    if not HAS_LLAMA_CPP:
        assert theirs == {"skipped": NOT_INSTALLED}
        assert model["ratios"] == {}
        return
    assert "failed" not in theirs, theirs
    assert not LLAMA_KEYS - set(theirs), LLAMA_KEYS - set(theirs)
    assert theirs["prefill"]["tps"] > 0 and theirs["decode_tps"] > 0 and theirs["peak_rss_bytes"] > 0
    assert theirs["threads"] == record["machine"]["threads"]["backend"]
    assert set(model["ratios"]) == RATIO_KEYS and model["ratios"]["prefill"] > 0 and model["ratios"]["decode"] > 0


def test_file_is_reused_and_a_broken_one_rewritten(tmp_path: Path) -> None:
    shape = SHAPES["tiny-gpt-oss"]
    first = ensure_file(shape, tmp_path, seed=3, say=lambda message: None)
    assert first["written"] is True
    again = ensure_file(shape, tmp_path, seed=3, say=lambda message: None)
    assert again["written"] is False and again["bytes"] == first["bytes"]
    path = file_path(shape, tmp_path)
    with open(path, "r+b") as handle:
        handle.truncate(first["bytes"] // 2)
    assert ensure_file(shape, tmp_path, seed=3, say=lambda message: None)["written"] is True
    assert ensure_file(shape, tmp_path, seed=4, say=lambda message: None)["written"] is True  # another seed
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize("argv, words", [
    (["--arch", "qwen3-30b"], "--arch must be one of"),
    (["--prefill", "lots"], "--prefill takes a whole number"),
    (["--prefill", "4"], "--prefill must be at least 16"),
    (["--max-tokens", "1"], "--max-tokens must be at least 2"),
    (["--layers", "0"], "--layers must be >= 1"),
])
def test_a_bad_argument_is_one_readable_line(argv: list[str], words: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from agentfold.cli import main

    code = main(["bench", "moe", *argv, "--cache-dir", str(tmp_path), "--out", str(tmp_path / "x.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.count("\n") == 0 and words in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # nothing written before the arguments were checked
