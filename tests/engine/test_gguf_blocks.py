"""A GGUF model on its own blocks (`engine/torch/models/gguf_blocks.py`): nothing converted at load,
logits close to the float model on the gguf package's dequantized weights, and exact where drafting
needs it (a pass's rows equal one-row passes; drafted == serial, drafts verified)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agentfold.engine.torch.backend import TorchBackend
from agentfold.engine.torch.loader import ModelLoadError, load_torch_model
from agentfold.engine.torch.models.llama import MLP_ROWS
from agentfold.kernels import block_linear
from tests.helpers.exactness_checks import assert_blocks_engine_drafts_exactly, assert_pass_rows_equal_one_row_steps
from tests.helpers.gguf_files import tiny_tokenizer_fields, write_tiny_model

pytestmark = pytest.mark.skipif(not block_linear.supported("Q4_K", 256), reason="no C compiler: no block kernels")

PROMPT = [5, 17, 42, 99, 3, 250, 18, 7, 64, 128, 11, 5, 17, 42, 99, 3]
KINDS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


@pytest.fixture(autouse=True)
def no_weight_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTFOLD_CACHE", str(tmp_path / "cache"))


def tiny(tmp_path: Path, arch: str, kind: str) -> Path:
    """Weights the gguf package quantized, or valid random blocks for the types it cannot quantize."""
    return write_tiny_model(tmp_path / f"{arch}-{kind}.gguf", arch, kind, tiny_tokenizer_fields(), seed=len(kind))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", KINDS)
def test_blocks_agree_with_the_float_model(tmp_path: Path, arch: str, kind: str):
    """Against the float model on the gguf package's dequantization: only the activations' int8
    rounding (llama.cpp's Q8_K / Q8_0) differs, so the logits stay within a few percent."""
    path = tiny(tmp_path, arch, kind)
    said: list[str] = []
    blocks = load_torch_model(path, device="cpu", quant="blocks", progress=said.append)
    assert blocks.model.quantized == "blocks" and any("its blocks, memory-mapped" in line for line in said)
    assert not (tmp_path / "cache" / "weights").exists()  # nothing converted, nothing stored
    reference = load_torch_model(path, device="cpu", quant="none")
    ours, theirs = (backend.forward(PROMPT, backend.new_cache())
                    for backend in (TorchBackend(blocks, quant="blocks"), TorchBackend(reference, quant="none")))
    ours, theirs = np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    scale = np.abs(theirs).max()
    assert np.abs(ours - theirs).max() < 0.05 * scale, (kind, np.abs(ours - theirs).max(), scale)
    assert np.corrcoef(ours.ravel(), theirs.ravel())[0, 1] > 0.999


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q4_1"])
def test_a_pass_rows_equal_one_row_passes(tmp_path: Path, kind: str):
    """Row-exact by construction: the last rows of one pass equal the same positions decoded one
    by one, bit for bit (the engine's verify rows rely on it)."""
    path = tiny(tmp_path, "qwen2", kind)
    backend = TorchBackend(load_torch_model(path, device="cpu", quant="blocks"), quant="blocks")
    assert_pass_rows_equal_one_row_steps(backend, PROMPT)


def test_a_long_pass_split_for_its_mlp_keeps_every_bit(tmp_path: Path):
    """A pass of more rows than `MLP_ROWS` runs its MLP in slices of rows (a prefill chunk's, to keep
    its intermediates in reused memory): its rows still equal one-row passes, bit for bit."""
    path = tiny(tmp_path, "qwen2", "Q4_K")
    backend = TorchBackend(load_torch_model(path, device="cpu", quant="blocks"), quant="blocks")
    tokens = [int(t) for t in np.random.default_rng(3).integers(3, 250, size=2 * MLP_ROWS + 13)]
    whole = backend.forward(tokens, backend.new_cache())  # its MLP in 3 slices
    cache = backend.new_cache()
    backend.forward(tokens[: MLP_ROWS + 9], cache)  # 2 slices, cut elsewhere
    middle = backend.forward(tokens[MLP_ROWS + 9 : -6], cache)
    rows = np.concatenate([backend.forward([token], cache) for token in tokens[-6:]])
    assert np.array_equal(whole[MLP_ROWS + 9 : -6], middle)
    assert np.array_equal(whole[-6:], rows)


def test_drafted_equals_serial_with_drafts_verified(tmp_path: Path):
    assert_blocks_engine_drafts_exactly(tiny(tmp_path, "qwen2", "Q4_K"), tmp_path / "verdicts" / "backends.json",
                                        PROMPT * 4, 40)


def test_a_type_without_kernel_falls_back_or_says_so(tmp_path: Path):
    path = tiny(tmp_path, "llama", "Q2_K")
    said: list[str] = []
    model = load_torch_model(path, device="cpu", quant="auto", progress=said.append)
    assert model.model.quantized == "int8"
    with pytest.raises(ModelLoadError, match="no block kernel for Q2_K"):
        load_torch_model(path, device="cpu", quant="blocks")
