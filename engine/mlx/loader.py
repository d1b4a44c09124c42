"""Load a local checkpoint (MLX / Hugging Face folder or GGUF file) into an mlx-lm model.

Nothing is fetched from a hub: a path that is not a local folder or file is an error.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from agentfold.engine.file_digest import sha256_of
from agentfold.engine.gguf_model import LOADER_VERSION
from agentfold.engine.mlx.gguf import GGUFError, load_gguf

DTYPES = ("float32", "bfloat16", "float16", "keep")


class ModelLoadError(ValueError):
    """The checkpoint at a path cannot be loaded; the message says why."""


@dataclass
class LoadedModel:
    """An mlx-lm model with its tokenizer and what identifies its weights."""

    model: nn.Module
    tokenizer: Any  # transformers PreTrainedTokenizerFast
    config: dict[str, Any]
    path: Path
    dtype: str
    load_seconds: float = 0.0
    _fingerprint: str | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.path.stem if self.path.is_file() else self.path.name

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        eos = self.config.get("eos_token_id")
        for value in eos if isinstance(eos, list) else [eos]:
            if value is not None:
                ids.add(int(value))
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    @property
    def fingerprint(self) -> str:
        """sha256 over the load dtype, the GGUF loader's version and each weight file's sha256
        (`file_digest`: hashed once per file version on this machine)."""
        if self._fingerprint is None:
            digest = hashlib.sha256(self.dtype.encode())
            if self.path.is_file():  # a GGUF: what its blocks load to is the loader's to say
                digest.update(f"|gguf-loader/{LOADER_VERSION}".encode())
            files = [self.path] if self.path.is_file() else sorted(self.path.glob("*.safetensors"))
            for file in files:
                digest.update(sha256_of(file).encode())
            self._fingerprint = digest.hexdigest()
        return self._fingerprint


def _build_model(config: dict[str, Any], weights: dict[str, mx.array]) -> nn.Module:
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    quant = config.get("quantization")
    if quant:
        nn.quantize(
            model,
            group_size=quant["group_size"],
            bits=quant["bits"],
            class_predicate=lambda p, m: f"{p}.scales" in weights,
        )
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    return model


def _cast(model: nn.Module, dtype: str) -> None:
    if dtype in ("keep", None):
        return
    target = getattr(mx, dtype)
    from mlx.utils import tree_map

    def cast(x: Any) -> Any:
        if isinstance(x, mx.array) and mx.issubdtype(x.dtype, mx.floating) and x.dtype != target:
            return x.astype(target)
        return x

    model.update(tree_map(cast, model.parameters()))
    mx.eval(model.parameters())


def load_model(path: str | Path, dtype: str = "float32", progress: Callable[[str], None] | None = None) -> LoadedModel:
    """Load a GGUF file or an MLX / Hugging Face folder in `dtype` (`keep`: as stored)."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    path = Path(path).expanduser()
    started = time.perf_counter()
    say = progress or (lambda message: None)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path}: a model file must be .gguf (or pass a folder with config.json)")
        say(f"reading GGUF {path.name}")
        try:
            gguf = load_gguf(path, dtype)
        except GGUFError as error:
            raise ModelLoadError(f"{path}: {error}") from error
        model = _build_model(gguf.config, gguf.weights)
        loaded = LoadedModel(model, gguf.tokenizer, gguf.config, path, dtype)
    elif path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path}: no config.json in this folder")
        say(f"loading {path.name}")
        from mlx_lm.utils import load_model as mlx_load_model
        from transformers import AutoTokenizer

        model, config = mlx_load_model(path, lazy=False)
        _cast(model, dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        loaded = LoadedModel(model, tokenizer, config, path, dtype)
    else:
        raise ModelLoadError(f"{path}: no such model file or folder (models are never downloaded)")
    loaded.load_seconds = time.perf_counter() - started
    say(f"loaded {loaded.name} ({dtype}) in {loaded.load_seconds:.1f}s")
    return loaded


def convert_gguf(src: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write GGUF `src` as an MLX folder (config.json, model.safetensors, tokenizer files)."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    src, out = Path(src).expanduser(), Path(out_dir).expanduser()
    if not src.is_file():
        raise ModelLoadError(f"{src}: no such GGUF file")
    try:
        gguf = load_gguf(src, dtype)
    except GGUFError as error:
        raise ModelLoadError(f"{src}: {error}") from error
    out.mkdir(parents=True, exist_ok=True)
    staging = out / "model.partial.safetensors"  # mlx appends .safetensors to other names
    mx.save_safetensors(str(staging), gguf.weights, metadata={"format": "mlx"})
    staging.replace(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(gguf.config, indent=2) + "\n")
    gguf.tokenizer.save_pretrained(str(out))
    return out
