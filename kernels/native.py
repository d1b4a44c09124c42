"""The small C libraries of the CPU kernels (csrc/*.c), compiled once per machine and loaded with ctypes.

Each library is built on first use with the system C compiler (`cc`, or $CC) into a cache folder,
keyed by its source, the compiler, the flags and the CPU, and loaded with ctypes. Without a
compiler (or with AGENTFOLD_NATIVE=0) `load` returns None and the callers run torch ops instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CSRC = Path(__file__).parent / "csrc"
# No -ffast-math, no contraction into fused multiply-adds: each C operation is one IEEE operation.
FLAGS = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11"]
_LOADED: dict[str, ctypes.CDLL | None] = {}


def cache_folder() -> Path:
    base = os.environ.get("AGENTFOLD_KERNELS") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "agentfold", "kernels")
    return Path(base)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _accepts(compiler: str, flag: str) -> bool:
    probe = subprocess.run([compiler, flag, "-E", "-x", "c", "-"], input=b"", capture_output=True)
    return probe.returncode == 0


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def build(name: str, extra: Sequence[str] = (), folder: Path | None = None) -> Path | None:
    """Compile csrc/`name`.c with `extra` flags into `folder` (default: the cache) unless it is
    there; None without a compiler or when the compile fails."""
    cc = compiler()
    if cc is None:
        return None
    source = CSRC / f"{name}.c"
    flags = [*FLAGS, *extra, *(["-march=native"] if _accepts(cc, "-march=native") else [])]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\n".join([source.read_text(), cc, version, " ".join(flags), _cpu_flags(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    folder = folder or cache_folder()
    target = folder / f"{name}-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:  # build aside, then rename: racing builds are safe
        staging = Path(scratch) / target.name
        done = subprocess.run([cc, *flags, "-o", str(staging), str(source), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            return None
        os.replace(staging, target)
    return target


def load(name: str, signatures: dict[str, list | tuple[list, Any]],
         variants: Sequence[Sequence[str]] = ((),)) -> ctypes.CDLL | None:
    """csrc/`name`.c loaded (built on first use with the first of `variants`' extra flags that
    compiles), its functions typed by `signatures` (name -> argtypes, for functions that return
    nothing, or (argtypes, restype)); None
    where it cannot be built or loaded. Loaded once per process."""
    if name in _LOADED:
        return _LOADED[name]
    _LOADED[name] = None
    if os.environ.get("AGENTFOLD_NATIVE", "1") == "0":
        return None
    for extra in variants:
        try:
            path = build(name, extra)
            if path is None:
                continue
            lib = ctypes.CDLL(str(path))
        except (OSError, subprocess.SubprocessError):
            continue
        for function, signature in signatures.items():
            argtypes, restype = signature if isinstance(signature, tuple) else (signature, None)
            getattr(lib, function).argtypes = argtypes
            getattr(lib, function).restype = restype
        _LOADED[name] = lib
        break
    return _LOADED[name]
