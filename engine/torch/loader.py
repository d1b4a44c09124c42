"""Load a local checkpoint into a torch model: a Hugging Face safetensors folder or a GGUF file.

GGUF files go through `engine.gguf_model` (llama.cpp's names, permutations and tokenizer undone, weights
the gguf package's reference dequantization to float32) and then numpy into torch. Folders need config.json, *.safetensors and a
tokenizer. Routed experts are stacked per layer into `ExpertWeights`. On CPU every linear weight
is stored transposed ([in, out] in memory, still an [out, in] tensor): that is the layout in which
the CPU GEMM is fastest for the few rows of a decode or verify pass.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from agentfold.engine.mlx.loader import LoadedModel, ModelLoadError
from agentfold.engine.torch import models as torch_models

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_STACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.switch_mlp\.(gate_proj|up_proj|down_proj)\.weight")


def resolve_device(device: str) -> torch.device:
    """`auto` is CUDA when a GPU is visible, else CPU; asking for CUDA without one is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError("--device cuda: no CUDA GPU is visible to torch")
        return torch.device("cuda")
    raise ModelLoadError(f"device must be auto, cpu or cuda, not {device!r}")


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """`auto` (or MLX's `keep`) is float32 on CPU, bfloat16 on CUDA."""
    if dtype in ("auto", "keep"):
        return "bfloat16" if device.type == "cuda" else "float32"
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype must be one of auto, {', '.join(DTYPES)}, not {dtype!r}")
    return dtype


def _read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], Any]:
    from agentfold.engine.gguf_model import GGUFError, build_tokenizer, open_gguf

    try:
        gguf = open_gguf(path)
        weights = {name: torch.from_numpy(value) for name, value in gguf.tensors()}
    except GGUFError as error:
        raise ModelLoadError(f"{path}: {error}") from error
    return gguf.config, weights, build_tokenizer(gguf.metadata, gguf.architecture)


def _read_folder(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{path}: config.json is unreadable ({error})") from error
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: config.json is not a JSON object")
    if config.get("model_type") not in torch_models.MODEL_TYPES:
        raise ModelLoadError(f"{path}: model_type {config.get('model_type')!r} is not supported by the torch backend "
                             f"(supported: {', '.join(torch_models.MODEL_TYPES)})")
    if config.get("quantization") or config.get("quantization_config"):
        raise ModelLoadError(f"{path}: quantized checkpoints are not supported by the torch backend")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weight files in this folder")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            weights.update(load_file(str(file)))
        except (SafetensorError, OSError) as error:
            raise ModelLoadError(f"{file}: unreadable safetensors file ({error})") from error
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as error:  # noqa: BLE001  (transformers raises many kinds)
        raise ModelLoadError(f"{path}: no usable tokenizer in this folder ({type(error).__name__})") from error
    return config, weights, tokenizer


def _take_experts(weights: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    """Move routed-expert tensors out of `weights` into each MoE block's `ExpertWeights`."""
    from agentfold.engine.torch.models.qwen3_moe import ExpertWeights, moe_blocks

    blocks = {block.layer_index: block for block in moe_blocks(model)}
    parts: dict[int, dict[str, dict[int, torch.Tensor]]] = {i: {} for i in blocks}
    stacked: dict[int, dict[str, torch.Tensor]] = {i: {} for i in blocks}
    for name in list(weights):
        per_expert, whole = _EXPERT.fullmatch(name), _STACKED.fullmatch(name)
        if per_expert and int(per_expert.group(1)) in blocks:
            layer, expert, proj = int(per_expert.group(1)), int(per_expert.group(2)), per_expert.group(3)
            parts[layer].setdefault(proj, {})[expert] = weights.pop(name)
        elif whole and int(whole.group(1)) in blocks:
            stacked[int(whole.group(1))][whole.group(2)] = weights.pop(name)
    for layer, block in blocks.items():
        count = block.weights.num_experts
        tensors = dict(stacked[layer])
        for proj, experts in parts[layer].items():
            if sorted(experts) != list(range(count)):
                raise ModelLoadError(f"layer {layer}: {proj} has experts {sorted(experts)[:4]}..., expected {count}")
            tensors[proj] = torch.stack([experts[e] for e in range(count)])
        missing = {"gate_proj", "up_proj", "down_proj"} - set(tensors)
        if missing:
            raise ModelLoadError(f"layer {layer}: no expert weights for {', '.join(sorted(missing))}")
        expected = {"gate_proj": block.weights.gate_proj.shape, "up_proj": block.weights.up_proj.shape,
                    "down_proj": block.weights.down_proj.shape}
        for proj, shape in expected.items():
            if tensors[proj].shape != shape:
                raise ModelLoadError(f"layer {layer}: {proj} experts are {list(tensors[proj].shape)}, "
                                     f"the config says {list(shape)}")
        block.set_weights(ExpertWeights(tensors["gate_proj"], tensors["up_proj"], tensors["down_proj"]))


def place(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Cast and move parameters and expert weights; on CPU store linear weights transposed."""
    from agentfold.engine.torch.models.llama import Linear
    from agentfold.engine.torch.models.qwen3_moe import ExpertWeights, moe_blocks

    transposed = {id(m.weight) for m in model.modules() if isinstance(m, Linear)}
    if getattr(model, "lm_head", None) is None:
        transposed.add(id(model.model.embed_tokens.weight))  # tied: it is the output head too
    for param in model.parameters():
        data = param.data.to(device=device, dtype=dtype)
        if device.type == "cpu" and id(param) in transposed:
            data = data.t().contiguous().t()
        param.data = data
    for module in model.modules():  # buffers (RoPE tables) move but keep their float32
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, buffer.to(device))
    for block in moe_blocks(model):
        w = block.weights
        block.set_weights(ExpertWeights(*(p.to(device=device, dtype=dtype).contiguous()
                                          for p in (w.gate_proj, w.up_proj, w.down_proj))))


def build_model(config: dict[str, Any], weights: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device) -> torch.nn.Module:
    """The torch model of `config` holding `weights` (Hugging Face names), on `device`."""
    try:
        model = torch_models.build(config)
    except (KeyError, TypeError, ValueError) as error:
        raise ModelLoadError(f"config.json: {error}") from error
    weights = dict(weights)
    _take_experts(weights, model)
    if getattr(model, "lm_head", None) is None:
        weights.pop("lm_head.weight", None)  # tied: some checkpoints still carry a copy
    expected = dict(model.named_parameters())
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise ModelLoadError(f"the weights do not match the {config['model_type']} config: {what}")
    for name, param in expected.items():
        if weights[name].shape != param.shape:
            raise ModelLoadError(f"{name}: weight is {list(weights[name].shape)}, the config says {list(param.shape)}")
        param.data = weights[name]
    place(model, dtype, device)
    model.eval()
    return model


def load_torch_model(path: str | Path, dtype: str = "auto", device: str = "auto",
                     progress: Callable[[str], None] | None = None, quant: str | None = None) -> LoadedModel:
    """Load a GGUF file or a Hugging Face folder for the torch backend (dtype `auto`: see resolve_dtype).

    `quant` (None: floats, for the backend to quantize) readies a GGUF bound for the CPU as the
    backend would run it: `blocks` (and `auto`, where every linear weight's type has a block kernel)
    on the file's own blocks (`gguf_blocks`: nothing converted); `int8` (and `auto` otherwise)
    rounded to int8 here and kept in the converted-weights cache (`weight_cache`), so the next start
    of the same file reads them back. (Pipeline stages quantize only their own layers, after
    pruning, so they load without it.)
    """
    path = Path(path).expanduser()
    say = progress or (lambda message: None)
    target = resolve_device(device)
    dtype = resolve_dtype(dtype, target)
    started = time.perf_counter()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path}: a model file must be .gguf (or pass a folder with config.json)")
        if quant == "blocks" and target.type != "cpu":
            raise ModelLoadError(f"{path}: the block kernels run on the CPU (use --quant int8 on {target.type})")
        model, config, tokenizer = _load_gguf(path, dtype, target, quant if target.type == "cpu" else None, say)
    elif path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path}: no config.json in this folder")
        if quant == "blocks":
            raise ModelLoadError(f"{path}: quant blocks runs a GGUF file's own blocks; this is a folder")
        say(f"loading {path.name}")
        config, weights, tokenizer = _read_folder(path)
        model = build_model(config, weights, DTYPES[dtype], target)
    else:
        raise ModelLoadError(f"{path}: no such model file or folder (models are never downloaded)")
    loaded = LoadedModel(model, tokenizer, config, path, dtype)  # type: ignore[arg-type]
    loaded.load_seconds = time.perf_counter() - started
    say(f"loaded {loaded.name} ({dtype}, torch on {target.type}"
        f"{', on its GGUF blocks' if getattr(model, 'quantized', None) == 'blocks' else ''}) in {loaded.load_seconds:.1f}s")
    return loaded


def _architecture(path: Path) -> str | None:
    """A GGUF's `general.architecture` (None where the header cannot be read: the loader says why later)."""
    from agentfold.engine.gguf_file import GGUFError, GGUFFile

    try:
        return str(GGUFFile(path).metadata.get("general.architecture", ""))
    except GGUFError:
        return None


def _load_gguf(path: Path, dtype: str, target: torch.device, quant: str | None,
               say: Callable[[str], None]) -> tuple[torch.nn.Module, dict[str, Any], Any]:
    """A GGUF's model: on its blocks, int8 (from the weight cache where it holds this file, else
    converted and stored there), or float (`quant` None or none)."""
    from agentfold.engine.gguf_model import GGUFError, build_tokenizer, open_gguf
    from agentfold.engine.torch import weight_cache
    from agentfold.engine.torch.models import gguf_blocks, quantize
    from agentfold.engine.torch.models.qwen3_moe import moe_blocks

    if quant in ("auto", "blocks"):  # (None off the CPU: see load_torch_model)
        try:
            gguf = open_gguf(path)
        except GGUFError as error:
            raise ModelLoadError(f"{path}: {error}") from error
        missing = gguf_blocks.unsupported_types(gguf)
        if not missing:
            say(f"reading GGUF {path.name} (its blocks, memory-mapped)")
            model = gguf_blocks.load(gguf, DTYPES[dtype])
            return model, gguf.config, build_tokenizer(gguf.metadata, gguf.architecture)
        if quant == "blocks" or gguf.architecture == "gpt-oss":
            raise ModelLoadError(f"{path}: no block kernel for {', '.join(missing)}"
                                 f"{'' if quant == 'blocks' else ' (gpt-oss runs on its blocks only)'}")
    elif _architecture(path) == "gpt-oss":
        # its biased experts and clamped SwiGLU exist on the block kernels only
        raise ModelLoadError(f"{path}: gpt-oss runs on its GGUF blocks on the CPU (--quant blocks), "
                             "not as floats or int8")
    int8 = quant in ("auto", "int8")
    if int8:
        cached = weight_cache.load(path, dtype, torch_models.build, say)
        if cached is not None:
            return cached
    say(f"reading GGUF {path.name} (dequantizing its blocks)")
    config, weights, tokenizer = _read_gguf(path)
    model = build_model(config, weights, DTYPES[dtype], target)
    del weights
    if int8:
        cacheable = weight_cache.enabled() and not moe_blocks(model)  # (it holds parameters; routed experts are not)
        say(f"rounding the weights to int8{' (once: kept in the weight cache for later starts)' if cacheable else ''}")
        parts: dict[str, Any] = {}
        quantize.int8_weights(model, record=parts)
        if cacheable:
            folder = weight_cache.store(weight_cache.cache_key(path, dtype), model, parts, config, tokenizer, path)
            say(f"converted weights kept in {folder}" if folder else "the weight cache could not be written")
    return model, config, tokenizer
