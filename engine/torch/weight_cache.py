"""A GGUF's int8 weights, converted once per machine and memory-mapped at every later start.

Converting a GGUF for the torch CPU backend means dequantizing every block (the gguf package's
reference, ~35 s for a 1.1 GB file on 2 cores) and rounding each linear weight to int8 per
channel; the result depends only on the file's bytes and on the versions of the loader and of the
int8 weight rounding. So the first start stores it, and later starts read it back:

    <cache root>/weights/<key>/weights.safetensors   int8 values and scales per linear, float tensors
    <cache root>/weights/<key>/tokenizer.json        the tokenizer built from the GGUF's metadata
    <cache root>/weights/<key>/entry.json            config and versions, written last (the entry is whole)

`key` is a sha256 over the file's sha256 (`file_digest`), the load dtype, `LOADER_VERSION`,
`int8_linear.VERSION` and this format's version, so any change to what the weights would be
misses the cache and converts again. The safetensors file is mapped copy-on-write
(`numpy.memmap(mode="c")`): the 933 MB float embedding of Qwen2.5-Coder is read from the page
cache as tokens need its rows. The int8 weights are then fused and packed for the GEMM as on a
first start, so the model that results is the same, bit for bit (tests/engine/test_weight_cache.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agentfold.engine.file_digest import cache_root, sha256_of
from agentfold.engine.gguf_model import LOADER_VERSION
from agentfold.engine.torch.models import quantize
from agentfold.kernels import int8_linear
from agentfold.kernels.int8_linear import Int8Weight

FORMAT_VERSION = 1
_VALUES, _SCALES = ".int8.values", ".int8.scales"
_TORCH = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8}
_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I8": np.int8}


def enabled() -> bool:
    """AGENTFOLD_WEIGHT_CACHE=0 turns the cache off (every start converts)."""
    return os.environ.get("AGENTFOLD_WEIGHT_CACHE", "1") != "0"


def cache_key(path: Path, dtype: str) -> str:
    parts = {"file": sha256_of(path), "dtype": dtype, "loader": LOADER_VERSION, "int8": int8_linear.VERSION,
             "format": FORMAT_VERSION}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def entry_dir(key: str) -> Path:
    return cache_root() / "weights" / key


def store(key: str, model: torch.nn.Module, parts: dict[str, Int8Weight], config: dict[str, Any],
          tokenizer: Any, source: Path) -> Path | None:
    """Write a quantized model's weights under `key` (None when the disk refuses: the next start
    converts again). `parts`: each linear's own int8 weight, as `quantize.int8_weights` recorded it."""
    from safetensors.torch import save_file

    folder = entry_dir(key)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=_ensure(folder.parent)))
    try:
        tensors: dict[str, torch.Tensor] = {}
        for name, param in model.named_parameters():
            if param.numel():  # the linears' float weights are gone (empty); their int8 parts follow
                tensors[name] = param.detach().contiguous()
        for name, weight in parts.items():
            tensors[name + _VALUES] = weight.int8_values().contiguous()
            tensors[name + _SCALES] = weight.scales.contiguous()
        save_file(tensors, str(staging / "weights.safetensors"))
        tokenizer.backend_tokenizer.save(str(staging / "tokenizer.json"))
        entry = {"config": config, "source": str(source), "loader": LOADER_VERSION, "int8": int8_linear.VERSION,
                 "format": FORMAT_VERSION}
        (staging / "entry.json").write_text(json.dumps(entry, indent=1) + "\n")
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
        return folder
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        return None


def _ensure(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def read(key: str) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Int8Weight], Path] | None:
    """(config, float tensors, int8 weights by linear name, the entry's folder) under `key`, or None."""
    folder = entry_dir(key)
    try:
        entry = json.loads((folder / "entry.json").read_text())
        tensors = mapped_safetensors(folder / "weights.safetensors")
    except (OSError, ValueError, KeyError):
        return None
    floats: dict[str, torch.Tensor] = {}
    parts: dict[str, Int8Weight] = {}
    for name, tensor in tensors.items():
        if name.endswith(_VALUES):
            base = name[: -len(_VALUES)]
            parts[base] = Int8Weight(tensor, tensors[base + _SCALES])
        elif not name.endswith(_SCALES):
            floats[name] = tensor
    return entry["config"], floats, parts, folder


def mapped_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as a copy-on-write memory map (nothing read yet)."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    data = np.memmap(path, dtype=np.uint8, mode="c", offset=8 + length)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        array = data[begin:end].view(_NUMPY[info["dtype"]]).reshape(info["shape"])
        tensor = torch.from_numpy(array)
        out[name] = tensor.view(torch.bfloat16) if info["dtype"] == "BF16" else tensor
    return out


def load(path: Path, dtype: str, build: Callable[[dict[str, Any]], torch.nn.Module],
         say: Callable[[str], None]) -> tuple[torch.nn.Module, dict[str, Any], Any] | None:
    """The int8 model of GGUF `path` from the cache, or None on a miss. `build(config)` makes the
    model's modules (uninitialized); the float tensors and int8 weights are then attached."""
    if not enabled():
        return None
    key = cache_key(path, dtype)
    found = read(key)
    if found is None:
        return None
    config, floats, parts, folder = found
    say(f"converted weights from the cache ({folder})")
    model = build(config)
    params = dict(model.named_parameters())
    linear_weights = {f"{name}.weight" for name in parts if name != quantize.HEAD}
    if set(floats) != set(params) - linear_weights:
        return None  # another model's layout: convert again
    for name, tensor in floats.items():
        if tuple(tensor.shape) != tuple(params[name].shape):
            return None
        params[name].data = tensor
    quantize.int8_weights(model, given=parts)
    model.eval()
    return model, config, _tokenizer(folder, path)


def _tokenizer(folder: Path, path: Path) -> Any:
    """The GGUF's tokenizer: its backend from the cached tokenizer.json, everything else (special
    tokens, chat template, add_bos) from the file's metadata, as `gguf_model.build_tokenizer` does."""
    from tokenizers import Tokenizer

    from agentfold.engine.gguf_model import build_tokenizer, open_gguf

    model = open_gguf(path)
    return build_tokenizer(model.metadata, model.architecture,
                           backend=Tokenizer.from_file(str(folder / "tokenizer.json")))
