"""A `gpt-oss` GGUF (gpt-oss-20b's architecture) on the torch CPU backend, on the file's own blocks
(MXFP4 experts, Q8_0 / Q4_0 / Q5_0 attention), against transformers' GptOssForCausalLM.

The file is a tiny random one written by the gguf package as llama.cpp lays it out (biased
attention with sinks, a biased F32 router, biased MXFP4 experts split into gate / up / down, YaRN
keys). The reference is transformers' model built from the file's numbers as written here (not
from our loader's config) with the gguf package's own dequantization of every tensor, gate and up
interleaved back into OpenAI's `gate_up_proj` layout. Our block path differs from it only by
llama.cpp's int8 rounding of the activations (per 32 values), so greedy tokens and routing must
match and logits stay within the bound the other block models are held to. The sliding window is
8 keys here (OpenAI's is 128) so that the even layer's window binds on a short prompt.

As for qwen3moe (test_qwen3moe_gguf.py), the int8 rounding can flip near ties; the file (SEED) is
one whose prompt and reply hold none, and our arithmetic is fixed, so the comparison is deterministic.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from agentfold.engine.torch.loader import ModelLoadError, load_torch_model
from agentfold.engine.torch.models import gpt_oss
from agentfold.engine.torch.models.moe_blocks import BlockExperts, RowByRowLinear
from agentfold.engine.torch.models.qwen3_moe import moe_blocks
from agentfold.kernels import block_linear
from tests.helpers.exactness_checks import (
    assert_blocks_engine_drafts_exactly,
    assert_pass_rows_equal_one_row_steps,
    assert_resumed_prefill_equals_fresh,
)
from tests.helpers.gguf_files import harmony_tokenizer_fields, reference, write_tiny_gpt_oss
from tests.helpers.moe_checks import RoutingRecorder, blocks_backend, greedy

pytestmark = pytest.mark.skipif(not block_linear.supported("MXFP4", 32), reason="no C compiler: no block kernels")

SHAPE = {"hidden": 192, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 64, "experts": 8, "used": 4,
         "expert_inner": 160, "window": 8}
SEED = 1
PROMPT = [5, 17, 42, 99, 3, 250, 18, 7, 64, 128, 11, 5, 17, 42, 99, 3, 200, 31, 77, 140]
REPLY_TOKENS = 12
BLOCK_BOUND = 0.05  # the dense and qwen3moe block models' bound against float (int8 activations)
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}


@pytest.fixture(autouse=True)
def no_weight_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTFOLD_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gpt-oss")
    return write_tiny_gpt_oss(folder / "tiny-gpt-oss.MXFP4.gguf", harmony_tokenizer_fields(), seed=SEED, **SHAPE)


@pytest.fixture(scope="module")
def transformers_model(gguf_path: Path) -> torch.nn.Module:
    """transformers' gpt-oss with the gguf package's dequantized weights, float32, eager kernels."""
    from gguf import GGUFReader
    from transformers import GptOssConfig, GptOssForCausalLM

    reader = GGUFReader(str(gguf_path))
    config = GptOssConfig(
        vocab_size=len(harmony_tokenizer_fields()["tokenizer.ggml.tokens"]), hidden_size=SHAPE["hidden"],
        intermediate_size=SHAPE["expert_inner"], num_hidden_layers=SHAPE["layers"],
        num_attention_heads=SHAPE["heads"], num_key_value_heads=SHAPE["kv_heads"], head_dim=SHAPE["head_dim"],
        num_local_experts=SHAPE["experts"], num_experts_per_tok=SHAPE["used"], sliding_window=SHAPE["window"],
        rope_parameters={**YARN, "rope_theta": 150000.0}, rms_norm_eps=float(np.float32(1e-5)),
        max_position_embeddings=131072, tie_word_embeddings=False, attn_implementation="eager",
        experts_implementation="eager")
    model = GptOssForCausalLM(config).eval()

    def values(name: str) -> torch.Tensor:
        return torch.from_numpy(np.array(reference(reader, name)))  # (a copy: the reader maps the file read-only)

    def interleaved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # OpenAI's gate_up: gate, up alternate
        return torch.stack([gate, up], dim=-1).flatten(-2)

    state = {"model.embed_tokens.weight": values("token_embd.weight"), "model.norm.weight": values("output_norm.weight"),
             "lm_head.weight": values("output.weight")}
    parts = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate_inp": "mlp.router"}
    for i in range(SHAPE["layers"]):
        for part, name in parts.items():
            state[f"model.layers.{i}.{name}.weight"] = values(f"blk.{i}.{part}.weight")
            if not part.endswith("norm"):
                state[f"model.layers.{i}.{name}.bias"] = values(f"blk.{i}.{part}.bias")
        state[f"model.layers.{i}.self_attn.sinks"] = values(f"blk.{i}.attn_sinks.weight")
        gate, up = values(f"blk.{i}.ffn_gate_exps.weight"), values(f"blk.{i}.ffn_up_exps.weight")  # [E, I, H]
        experts = f"model.layers.{i}.mlp.experts"
        state[f"{experts}.gate_up_proj"] = interleaved(gate.transpose(1, 2), up.transpose(1, 2))  # [E, H, 2I]
        state[f"{experts}.gate_up_proj_bias"] = interleaved(values(f"blk.{i}.ffn_gate_exps.bias"),
                                                            values(f"blk.{i}.ffn_up_exps.bias"))
        state[f"{experts}.down_proj"] = values(f"blk.{i}.ffn_down_exps.weight").transpose(1, 2)  # [E, I, H]
        state[f"{experts}.down_proj_bias"] = values(f"blk.{i}.ffn_down_exps.bias")
    model.load_state_dict(state, strict=True)
    return model


def test_loads_on_its_blocks_with_the_file_config(gguf_path: Path):
    """gpt-oss opens with llama.cpp's keys (experts, window, YaRN) and runs on its blocks: MXFP4
    experts as views of the file with their biases, the F32 biased router in float, a sink per head
    and the window on the even layers only; `<|end|>` is not an end of generation (a harmony reply
    goes on to its next message), `<|return|>` and `<|call|>` are, and harmony's markers stay in the
    decoded text."""
    loaded = load_torch_model(gguf_path, device="cpu", quant="auto")
    config, model = loaded.config, loaded.model
    assert model.quantized == "blocks"
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"]) == ("gpt_oss", 8, 4)
    assert (config["sliding_window"], config["layer_types"]) == (8, ["sliding_attention", "full_attention"])
    assert config["rope_scaling"] == YARN
    tokens = harmony_tokenizer_fields()["tokenizer.ggml.tokens"]
    assert tokens.index("<|end|>") not in config["eos_token_id"]
    assert {tokens.index("<|return|>"), tokens.index("<|call|>")} <= set(config["eos_token_id"])
    layers = model.model.layers
    assert [layer.self_attn.window for layer in layers] == [8, None]
    assert all(layer.self_attn.sinks.shape == (4,) and layer.self_attn.sinks.abs().sum() > 0 for layer in layers)
    assert all(layer.self_attn.o_proj.bias is not None for layer in layers)
    for block in moe_blocks(model):
        assert isinstance(block.experts, BlockExperts) and block.experts.num_experts == 8
        assert isinstance(block.gate, RowByRowLinear) and block.gate.bias is not None
        assert [w.type_name for w in (*block.experts.gate_up[2].weights, *block.experts.down[2].weights)] == \
            ["MXFP4"] * 3
        assert block.experts.gate_up_bias[2].shape == (320,) and block.experts.down_bias[2].shape == (192,)
        assert not block.experts.gate_up[2].weights[0].data.flags.owndata
    ids = loaded.tokenizer.encode("<|channel|>final<|message|>def", add_special_tokens=False)
    assert ids[0] == tokens.index("<|channel|>") and "<|channel|>final<|message|>def" == loaded.tokenizer.decode(
        ids, skip_special_tokens=True)


def test_greedy_tokens_routing_and_logits_match_transformers(gguf_path: Path, transformers_model: torch.nn.Module):
    """Greedy tokens equal transformers' top-1 at every position of the reply (teacher-forced, past
    the 8-key window), every row of every layer goes to the reference's experts, and the logits stay
    within the int8-activation bound."""
    backend = blocks_backend(gguf_path)
    reply = greedy(backend, PROMPT, REPLY_TOKENS)
    sequence = PROMPT + reply
    routed_there: list[torch.Tensor] = []  # transformers' router returns (logits, gates, expert ids)
    hooks = [layer.mlp.router.register_forward_hook(lambda module, args, out: routed_there.append(out[2].clone()))
             for layer in transformers_model.model.layers]
    try:
        with torch.no_grad():
            theirs = transformers_model(torch.tensor([sequence])).logits[0].float().numpy()
    finally:
        for hook in hooks:
            hook.remove()
    assert [int(t) for t in np.argmax(theirs[len(PROMPT) - 1 : -1], axis=1)] == reply
    assert len(set(reply)) > 2  # a reply that says something, not one token repeated

    recorders = [RoutingRecorder(block.experts) for block in moe_blocks(backend.model)]
    for block, recorder in zip(moe_blocks(backend.model), recorders, strict=True):
        block.experts = recorder
    ours = backend.forward(sequence, backend.new_cache()).astype(np.float64)
    for layer, (recorder, there) in enumerate(zip(recorders, routed_there, strict=True)):
        assert torch.equal(recorder.ids[0].sort(dim=1).values, there.sort(dim=1).values), f"layer {layer}"
        assert len(set(recorder.ids[0].reshape(-1).tolist())) >= 6  # routing spreads over the experts
    expected = theirs.astype(np.float64)
    scale = np.abs(expected).max()
    assert np.abs(ours - expected).max() < BLOCK_BOUND * scale, (np.abs(ours - expected).max(), scale)
    assert np.corrcoef(ours.ravel(), expected.ravel())[0, 1] > 0.999


def test_sinks_windows_and_yarn_change_the_result(gguf_path: Path, transformers_model: torch.nn.Module):
    """The comparison above could not pass by chance of small effects: without sinks, with the
    window on every layer, or without YaRN, the reference's own logits move by more than our bound."""
    sequence = PROMPT + PROMPT[:12]
    with torch.no_grad():
        base = transformers_model(torch.tensor([sequence])).logits[0].double().numpy()
    scale = np.abs(base).max()
    attention = transformers_model.model.layers[0].self_attn
    saved = attention.sinks.data.clone()
    attention.sinks.data.fill_(-1e4)
    try:
        with torch.no_grad():
            no_sinks = transformers_model(torch.tensor([sequence])).logits[0].double().numpy()
    finally:
        attention.sinks.data.copy_(saved)
    assert np.abs(no_sinks - base).max() > BLOCK_BOUND * scale
    ours = blocks_backend(gguf_path)
    full = ours.forward(sequence, ours.new_cache())
    ours.model.model.layers[0].self_attn.window = None
    unwindowed = ours.forward(sequence, ours.new_cache())
    assert np.abs(unwindowed - full).max() > BLOCK_BOUND * scale


def test_yarn_frequencies_match_transformers():
    """YaRN's frequencies and cos / sin factor equal transformers' `_compute_yarn_parameters` for
    gpt-oss's numbers, with and without rounding the correction range (llama.cpp rounds it)."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for truncate in (False, True):
        scaling = {**YARN, "truncate": truncate}
        config = GptOssConfig(head_dim=64, rope_parameters={**scaling, "rope_theta": 150000.0})
        theirs, their_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        ours, our_factor = gpt_oss.yarn_frequencies(64, 150000.0, scaling)
        assert np.allclose(ours.numpy(), theirs.double().numpy(), rtol=1e-6, atol=0)
        assert our_factor == pytest.approx(their_factor)
    a, _ = gpt_oss.yarn_frequencies(64, 150000.0, YARN)
    b, _ = gpt_oss.yarn_frequencies(64, 150000.0, {**YARN, "truncate": True})
    assert not torch.equal(a, b)


def test_a_pass_rows_equal_one_row_passes(gguf_path: Path):
    """Row-exact by construction with sinks, windows and biased experts: the last rows of one pass
    equal the same positions decoded one by one, bit for bit, past the window."""
    assert_pass_rows_equal_one_row_steps(blocks_backend(gguf_path), PROMPT)


def test_resumed_prefill_equals_fresh(gguf_path: Path):
    """A prompt resumed from a snapshot at a plan boundary equals the fresh one cut there."""
    assert_resumed_prefill_equals_fresh(blocks_backend(gguf_path), PROMPT * 4)


def test_drafted_equals_serial_with_drafts_verified(gguf_path: Path, tmp_path: Path):
    """The engine's load-time self-check finds the model row-exact, and drafting changes no token."""
    assert_blocks_engine_drafts_exactly(gguf_path, tmp_path / "verdicts" / "backends.json", PROMPT * 3, 24)


def test_other_paths_refuse_it_in_one_line(gguf_path: Path):
    """gpt-oss's biased experts exist on the block kernels only: asked for floats or int8 it says so."""
    for quant in ("int8", None):
        with pytest.raises(ModelLoadError, match="gpt-oss runs on its GGUF blocks"):
            load_torch_model(gguf_path, device="cpu", quant=quant)
