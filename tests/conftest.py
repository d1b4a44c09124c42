"""Shared fixtures: the real small models, found or converted once into a cache outside the repo."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tqdm import tqdm

from agentfold import prepare_process

prepare_process()  # the fast BLAS loads before any test module imports mlx.core

from agentfold.engine.factory import build_engine  # noqa: E402
from agentfold.engine.gguf_model import LOADER_VERSION  # noqa: E402
from agentfold.engine.mlx.loader import convert_gguf  # noqa: E402
from agentfold.serve.models import cache_dir, default_model_path, gemma3_path  # noqa: E402
from tests.helpers.backends import real_model_backend  # noqa: E402


def converted(gguf: Path, dtype: str = "float32") -> Path:
    """The MLX folder for `gguf`, converted on first use (the cache key is the file's size and mtime,
    and the GGUF loader's version: a folder the previous loader wrote holds other weights)."""
    stat = gguf.stat()
    out = cache_dir() / f"{gguf.stem}-{dtype}-{stat.st_size}-{int(stat.st_mtime)}-loader{LOADER_VERSION}"
    if not (out / "config.json").exists():
        with tqdm(total=1, desc=f"converting {gguf.name} ({dtype})", file=sys.stderr) as bar:
            convert_gguf(gguf, out, dtype)
            bar.update(1)
    return out


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_folder(smollm2_gguf: Path) -> Path:
    return converted(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_gguf: Path):
    """The real SmolLM2-135M-Instruct engine on the test backend (`tests.helpers.backends`): suffix
    drafter, self-checked."""
    return build_engine(smollm2_gguf, backend=real_model_backend())


@pytest.fixture(scope="session")
def smollm2_mlx_engine(request: pytest.FixtureRequest, smollm2_gguf: Path):
    """The same model on the MLX backend, for the tests about MLX itself (float32, suffix drafter)."""
    if real_model_backend() == "mlx":
        return request.getfixturevalue("smollm2_engine")
    return build_engine(smollm2_gguf)


def coder_gguf_path() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M, the real coding model (`.ci/setup.sh` installs and
    assembles it); tests that need it skip where it is not installed."""
    from agentfold.serve.models import ModelNotFound, coder_path

    try:
        return coder_path()
    except ModelNotFound as error:
        pytest.skip(f"the coder model is not installed: {error}")


@pytest.fixture(scope="session")
def coder_gguf() -> Path:
    return coder_gguf_path()


@pytest.fixture(scope="session")
def coder_engine(coder_gguf: Path):
    """The coder model on the test backend, suffix drafter, self-checked (its int8 weights come from
    the converted-weights cache after the first load on a machine)."""
    return build_engine(coder_gguf, backend=real_model_backend())


@pytest.fixture(scope="session")
def gemma3_folder() -> Path:
    return converted(gemma3_path())


def chat_ids(tokenizer, user: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
