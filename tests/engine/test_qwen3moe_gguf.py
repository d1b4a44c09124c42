"""A `qwen3moe` GGUF (Qwen3-Coder-30B-A3B's architecture) on the torch CPU backend, experts on the
file's own blocks (`engine/torch/models/moe_blocks.py`), against transformers' Qwen3MoeForCausalLM.

The file is a tiny random one written by the gguf package as llama.cpp lays it out (3-D expert
tensors of mixed block types, an F32 router). The reference is transformers' model built from the
file's numbers as written here (not from our loader's config) with the gguf package's own
dequantization of every tensor loaded into it. Our float path must match it to float rounding; our
block path differs only by llama.cpp's int8 rounding of the activations (per 32 values for Q8_0,
per 256 for the K-quants), the bound test_gguf_blocks.py holds the dense block models to.

That rounding can flip a near tie: a router's k-th and (k+1)-th expert, or the head's top two
tokens (so can llama.cpp's own, against a float reference). Our block arithmetic is fixed (integer
sums, C row kernels: the same bits on any CPU), so the comparison is deterministic, and the file
(SEED) is one whose prompt and reply hold no such tie: its tokens and its routing on every row of
every layer must equal the reference's, which is also what makes the logit bound apply to every row.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from agentfold.engine.torch.backend import TorchBackend
from agentfold.engine.torch.loader import ModelLoadError, load_torch_model
from agentfold.engine.torch.models.moe_blocks import BlockExperts, RowByRowLinear
from agentfold.engine.torch.models.qwen3_moe import ReferenceExperts, moe_blocks
from agentfold.kernels import block_linear
from tests.helpers.exactness_checks import (
    assert_blocks_engine_drafts_exactly,
    assert_pass_rows_equal_one_row_steps,
    assert_resumed_prefill_equals_fresh,
)
from tests.helpers.gguf_files import reference, tiny_tokenizer_fields, write_tiny_qwen3moe
from tests.helpers.moe_checks import RoutingRecorder, blocks_backend, greedy

pytestmark = pytest.mark.skipif(not block_linear.supported("Q4_K", 256), reason="no C compiler: no block kernels")

# The tiny file's shape (hidden 256 and experts 256 wide: K-quant rows are whole 256-value blocks)
SHAPE = {"hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 32, "experts": 8, "used": 2,
         "expert_inner": 256}
SEED = 1
PROMPT = [5, 17, 42, 99, 3, 250, 18, 7, 64, 128, 11, 5, 17, 42, 99, 3, 200, 31, 77, 140]
REPLY_TOKENS = 12
# Block path against the float reference: the dense block models' bound (test_gguf_blocks.py). The
# activations are rounded to int8 before every linear layer (~0.4% of a block's largest value per
# element), which moves a logit by a few percent of the largest at most over two layers.
BLOCK_BOUND = 0.05
FLOAT_BOUND = 1e-4  # our float path against transformers: float32 summation order only


@pytest.fixture(autouse=True)
def no_weight_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTFOLD_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3moe")
    return write_tiny_qwen3moe(folder / "tiny-qwen3moe.Q4_K_M.gguf", tiny_tokenizer_fields(), seed=SEED, **SHAPE)


@pytest.fixture(scope="module")
def transformers_model(gguf_path: Path) -> torch.nn.Module:
    """transformers' Qwen3-MoE with the gguf package's dequantized weights, float32, eager kernels."""
    from gguf import GGUFReader
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    reader = GGUFReader(str(gguf_path))
    config = Qwen3MoeConfig(
        vocab_size=len(tiny_tokenizer_fields()["tokenizer.ggml.tokens"]), hidden_size=SHAPE["hidden"],
        intermediate_size=3 * SHAPE["expert_inner"], num_hidden_layers=SHAPE["layers"],
        num_attention_heads=SHAPE["heads"], num_key_value_heads=SHAPE["kv_heads"], head_dim=SHAPE["head_dim"],
        num_experts=SHAPE["experts"], num_experts_per_tok=SHAPE["used"], moe_intermediate_size=SHAPE["expert_inner"],
        norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=2048,
        tie_word_embeddings=False, attn_implementation="eager", experts_implementation="eager")
    model = Qwen3MoeForCausalLM(config).eval()

    def values(name: str) -> torch.Tensor:
        return torch.from_numpy(np.array(reference(reader, name)))  # (a copy: the reader maps the file read-only)

    state = {"model.embed_tokens.weight": values("token_embd.weight"), "model.norm.weight": values("output_norm.weight"),
             "lm_head.weight": values("output.weight")}
    parts = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
             "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate"}
    for i in range(SHAPE["layers"]):
        for part, name in parts.items():
            state[f"model.layers.{i}.{name}.weight"] = values(f"blk.{i}.{part}.weight")
        gate, up = values(f"blk.{i}.ffn_gate_exps.weight"), values(f"blk.{i}.ffn_up_exps.weight")  # [E, I, H]
        state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        state[f"model.layers.{i}.mlp.experts.down_proj"] = values(f"blk.{i}.ffn_down_exps.weight")  # [E, H, I]
    model.load_state_dict(state, strict=True)
    return model


def reference_logits(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def test_loads_on_its_blocks_with_the_file_config(gguf_path: Path):
    """qwen3moe opens with llama.cpp's keys (expert count / used / width, head_dim from key_length)
    and runs on its blocks: experts as views of the file, the F32 router in float."""
    said: list[str] = []
    loaded = load_torch_model(gguf_path, device="cpu", quant="auto", progress=said.append)
    assert loaded.model.quantized == "blocks" and any("its blocks, memory-mapped" in line for line in said)
    config = loaded.config
    assert (config["model_type"], config["num_experts"], config["num_experts_per_tok"]) == ("qwen3_moe", 8, 2)
    assert (config["moe_intermediate_size"], config["head_dim"], config["norm_topk_prob"]) == (256, 32, True)
    blocks = moe_blocks(loaded.model)
    assert len(blocks) == SHAPE["layers"]
    for block in blocks:
        assert isinstance(block.experts, BlockExperts) and block.experts.num_experts == SHAPE["experts"]
        assert isinstance(block.gate, RowByRowLinear) and block.gate.weight.shape == (8, 256)
        gate_up = block.experts.gate_up[3]
        assert gate_up.shape == (512, 256) and block.experts.down[3].shape == (256, 256)
        data = gate_up.weights[0].data
        assert not data.flags.owndata and not data.flags.writeable  # a view of the read-only file map
    kinds = [[w.type_name for w in (*b.experts.gate_up[0].weights, *b.experts.down[0].weights)] for b in blocks]
    assert kinds == [["Q4_K", "Q6_K", "Q8_0"], ["Q8_0", "Q4_K", "Q6_K"]]


def test_greedy_tokens_routing_and_logits_match_transformers(gguf_path: Path, transformers_model: torch.nn.Module):
    """Greedy tokens equal transformers' top-1 at every position of the reply (teacher-forced), every
    row of every layer goes to the reference's experts, and the logits stay within the int8-activation
    bound; the float path matches to float rounding."""
    backend = blocks_backend(gguf_path)
    reply = greedy(backend, PROMPT, REPLY_TOKENS)
    sequence = PROMPT + reply
    routed_there: list[torch.Tensor] = []  # transformers' router returns (logits, gates, expert ids)
    hooks = [layer.mlp.gate.register_forward_hook(lambda module, args, out: routed_there.append(out[2].clone()))
             for layer in transformers_model.model.layers]
    try:
        theirs = reference_logits(transformers_model, sequence)
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
        here = recorder.ids[0].sort(dim=1).values
        assert torch.equal(here, there.sort(dim=1).values), f"layer {layer}"
    expected = theirs.astype(np.float64)
    scale = np.abs(expected).max()
    assert np.abs(ours - expected).max() < BLOCK_BOUND * scale, (np.abs(ours - expected).max(), scale)
    assert np.corrcoef(ours.ravel(), expected.ravel())[0, 1] > 0.999

    floats = TorchBackend(load_torch_model(gguf_path, device="cpu", quant="none"), quant="none")
    assert all(isinstance(block.experts, ReferenceExperts) for block in moe_blocks(floats.model))
    exact = floats.forward(sequence, floats.new_cache()).astype(np.float64)
    assert np.abs(exact - expected).max() < FLOAT_BOUND * scale, np.abs(exact - expected).max()


def test_a_pass_rows_equal_one_row_passes_across_experts(gguf_path: Path):
    """Row-exact by construction: the last rows of one pass equal the same positions decoded one by
    one, bit for bit, while those rows route to different experts (so each expert's GEMM runs over
    a different subset of the rows in the two cases)."""
    backend = blocks_backend(gguf_path)
    recorders = [RoutingRecorder(block.experts) for block in moe_blocks(backend.model)]
    for block, recorder in zip(moe_blocks(backend.model), recorders, strict=True):
        block.experts = recorder
    assert_pass_rows_equal_one_row_steps(backend, PROMPT)
    for recorder in recorders:  # the rows compared routed apart: not one expert set for all of them
        routed = recorder.ids[0][9:]
        assert len({tuple(sorted(row)) for row in routed.tolist()}) > 2
        assert len(set(routed.reshape(-1).tolist())) >= 4


def test_routing_spreads_and_only_routed_experts_are_read(gguf_path: Path):
    """Tokens go to many experts with their gates renormalized (the test above could not fail if all
    went to one), and a pass reads the blocks of the experts it routed to and no others."""
    backend = blocks_backend(gguf_path)
    blocks = moe_blocks(backend.model)
    experts = [block.experts for block in blocks]
    x = torch.randn(1, SHAPE["hidden"], generator=torch.Generator().manual_seed(1))
    for block in blocks:
        ids, gates = block.route(x)
        assert ids.shape == (1, 2) and torch.allclose(gates.sum(dim=1), torch.ones(1))
    recorders = [RoutingRecorder(e) for e in experts]
    for block, recorder in zip(blocks, recorders, strict=True):
        block.experts = recorder
    backend.forward(PROMPT[:1], backend.new_cache())  # one token: k = 2 experts a layer
    for recorder, block_experts in zip(recorders, experts, strict=True):
        routed = set(recorder.ids[0].reshape(-1).tolist())
        assert len(routed) == 2
        read = {e for e in range(SHAPE["experts"])
                if block_experts.gate_up[e].weights[0]._forms or block_experts.down[e].weights[0]._forms}
        assert read == routed  # (`_forms`: the bytes a kernel took, made on an expert's first use)
    backend.forward(PROMPT, backend.new_cache())
    for recorder in recorders:
        counts = np.bincount(recorder.ids[1].reshape(-1).numpy(), minlength=SHAPE["experts"])
        assert (counts > 0).sum() >= 5 and counts.max() <= len(PROMPT)  # spread: no expert takes every token


def test_resumed_prefill_equals_fresh(gguf_path: Path):
    """A prompt resumed from a snapshot at a plan boundary equals the fresh one cut there."""
    assert_resumed_prefill_equals_fresh(blocks_backend(gguf_path), PROMPT * 4)


def test_drafted_equals_serial_with_drafts_verified(gguf_path: Path, tmp_path: Path):
    """The engine's load-time self-check finds the MoE block model row-exact, and drafting changes
    no token."""
    assert_blocks_engine_drafts_exactly(gguf_path, tmp_path / "verdicts" / "backends.json", PROMPT * 3, 24)


def test_experts_without_a_block_kernel_fall_back_to_int8_or_say_so(tmp_path: Path):
    """Experts in a type no block kernel runs (Q2_K): `auto` takes the int8 path (float experts, and
    nothing put in the weight cache, which holds no experts); `blocks` names the type."""
    path = write_tiny_qwen3moe(tmp_path / "q2k.gguf", tiny_tokenizer_fields(), seed=3, **SHAPE,
                               expert_types=[{"ffn_gate_exps": "Q2_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q8_0"}])
    loaded = load_torch_model(path, device="cpu", quant="auto")
    assert loaded.model.quantized == "int8"
    assert all(isinstance(block.experts, ReferenceExperts) for block in moe_blocks(loaded.model))
    backend = TorchBackend(loaded, quant="int8")
    logits = backend.forward(PROMPT[:4], backend.new_cache())
    assert logits.shape == (4, 320) and np.isfinite(logits).all()
    assert not (tmp_path / "cache" / "weights").exists()
    with pytest.raises(ModelLoadError, match="no block kernel for Q2_K"):
        load_torch_model(path, device="cpu", quant="blocks")


def test_models_command_lists_it(gguf_path: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch):
    from agentfold.cli import main

    monkeypatch.setenv("AGENTFOLD_MODELS", str(tmp_path / "models"))
    assert main(["models", "--json", "--model-dir", str(gguf_path.parent)]) == 0
    listed = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)}
    entry = listed["tiny-qwen3moe.Q4_K_M"]
    assert (entry["architecture"], entry["context_length"]) == ("qwen3moe", 2048)


def test_config_keys_follow_llama_cpp():
    """The experts' width falls back to feed_forward_length / expert_used_count where a file lacks
    expert_feed_forward_length (llama.cpp's own fallback); a file without expert counts is refused."""
    from agentfold.engine.gguf_file import GGUFError
    from agentfold.engine.gguf_model import config_from_metadata

    meta = {"qwen3moe.attention.head_count": 32, "qwen3moe.attention.head_count_kv": 4,
            "qwen3moe.embedding_length": 2048, "qwen3moe.block_count": 48, "qwen3moe.feed_forward_length": 6144,
            "qwen3moe.attention.layer_norm_rms_epsilon": 1e-6, "qwen3moe.attention.key_length": 128,
            "qwen3moe.expert_count": 128, "qwen3moe.expert_used_count": 8, "qwen3moe.vocab_size": 151936}
    config = config_from_metadata(meta, "qwen3moe", has_output=True)
    assert (config["moe_intermediate_size"], config["head_dim"], config["num_experts"]) == (768, 128, 128)
    assert (config["num_experts_per_tok"], config["norm_topk_prob"], config["tie_word_embeddings"]) == (8, True, False)
    with pytest.raises(GGUFError, match="expert_count"):
        config_from_metadata({k: v for k, v in meta.items() if k != "qwen3moe.expert_count"}, "qwen3moe", True)
