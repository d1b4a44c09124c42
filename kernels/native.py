"""The CPU kernels' C library (csrc/*.c), compiled once per machine and loaded with ctypes.

Every C file is one part of ONE shared library, so that all kernels share one thread pool
(csrc/pool.c: workers that are awake when the next kernel of a pass comes). It is built on first
use with the system C compiler (`cc`, or $CC) into a cache folder, keyed by the sources, the
compiler, the flags and the CPU, and loaded with ctypes. Without a compiler (or with
AGENTFOLD_NATIVE=0) `load` returns None and the callers run torch ops instead.
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
LIBRARY = "kernels"
# No -ffast-math, no contraction into fused multiply-adds: each C operation is one IEEE operation.
FLAGS = ["-O3", "-shared", "-fPIC", "-pthread", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11"]
_LOADED: list[ctypes.CDLL | None] = []  # the library, once `load` has looked for it
_TYPED: dict[int, dict] = {}  # the signature tables already applied to it, by id


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


def sources() -> list[Path]:
    """The library's C files (each one part of it) and the headers they share."""
    return sorted([*CSRC.glob("*.c"), *CSRC.glob("*.h")])


def build(extra: Sequence[str] = (), folder: Path | None = None) -> Path | None:
    """Compile every csrc/*.c with `extra` flags into one library in `folder` (default: the cache)
    unless it is there; None without a compiler or when the compile fails."""
    cc = compiler()
    if cc is None:
        return None
    flags = [*FLAGS, *extra, *(["-march=native"] if _accepts(cc, "-march=native") else [])]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\n".join([*(f"{p.name}\n{p.read_text()}" for p in sources()), cc, version, " ".join(flags),
                                    _cpu_flags(), platform.machine()]).encode()).hexdigest()[:16]
    folder = folder or cache_folder()
    target = folder / f"{LIBRARY}-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:  # build aside, then rename: racing builds are safe
        staging = Path(scratch) / target.name
        files = [str(p) for p in sources() if p.suffix == ".c"]
        done = subprocess.run([cc, *flags, "-o", str(staging), *files, "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            return None
        os.replace(staging, target)
    return target


def identity() -> str:
    """The built library's file name (keyed by the sources, compiler, flags and CPU), or "none":
    what a remembered measurement of these kernels must match."""
    if not _IDENTITY:
        built = build() if os.environ.get("AGENTFOLD_NATIVE", "1") != "0" else None
        _IDENTITY.append(built.name if built is not None else "none")
    return _IDENTITY[0]


_IDENTITY: list[str] = []


def expected() -> bool:
    """Whether the library should load here: a C compiler is found and AGENTFOLD_NATIVE=0 is not
    set. Where this is True and `load` still returns None, the build failed (the tests fail then,
    they do not skip)."""
    return compiler() is not None and os.environ.get("AGENTFOLD_NATIVE", "1") != "0"


def load(signatures: dict[str, list | tuple[list, Any]]) -> ctypes.CDLL | None:
    """The library (built on first use, loaded once per process) with the functions in
    `signatures` typed (name -> argtypes, for functions that return nothing, or (argtypes,
    restype)); None where it cannot be built or loaded."""
    if not _LOADED:
        lib = None
        if os.environ.get("AGENTFOLD_NATIVE", "1") != "0":
            try:
                path = build()
                lib = ctypes.CDLL(str(path)) if path is not None else None
            except (OSError, subprocess.SubprocessError):
                lib = None
        _LOADED.append(lib)
    lib = _LOADED[0]
    if lib is None or id(signatures) in _TYPED:  # (callers pass module constants: typed once, not per call)
        return lib
    typed(lib, signatures)
    _TYPED[id(signatures)] = signatures  # (kept alive, so that its id is never reused)
    return lib


def typed(lib: ctypes.CDLL, signatures: dict[str, list | tuple[list, Any]]) -> ctypes.CDLL:
    """`lib` with the functions in `signatures` typed (name -> argtypes, for functions that return
    nothing, or (argtypes, restype))."""
    for function, signature in signatures.items():
        argtypes, restype = signature if isinstance(signature, tuple) else (signature, None)
        getattr(lib, function).argtypes = argtypes
        getattr(lib, function).restype = restype
    return lib


def build_variant(extra: Sequence[str], folder: Path, signatures: dict[str, list | tuple[list, Any]]) -> ctypes.CDLL | None:
    """Another build of the same sources with `extra` flags (a path forced on or off) into `folder`,
    loaded beside the main library and typed: what the tests compare the main build with. None
    where it does not compile."""
    path = build(extra, folder)
    return typed(ctypes.CDLL(str(path)), signatures) if path is not None else None


_POOL_SIGNATURES = {"pool_alone": ([], ctypes.c_int)}


def pool_alone() -> bool | None:
    """Whether the kernels' pool currently runs its jobs on the calling thread alone (it found the
    machine busy: csrc/pool.c); None without the library."""
    lib = load(_POOL_SIGNATURES)
    return None if lib is None else bool(lib.pool_alone())


# glibc's mallopt parameters (malloc.h) and the sizes kept: a prefill chunk's largest buffers (the
# coder model's 512-row gate / up output is 37 MB) stay below the threshold, and the heap keeps
# up to TRIM_KEEP bytes freed at its top instead of handing them back.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 128 << 20
TRIM_KEEP = 512 << 20
_HEAP_KEPT: list[bool] = []


def keep_heap() -> bool:
    """Have glibc serve and keep large blocks in the process heap (once per process).

    By default glibc maps every block above 32 MB afresh and returns freed memory at the heap's top
    past a threshold that follows the largest freed mapping: a prefill's per-layer buffers of tens of
    MB were mapped, faulted in page by page (the kernel zeroing each) and unmapped again, every
    layer of every chunk (with 128-row MLP slices 12% of a 2K-token prefill on a 2-core Xeon). Kept
    in the heap they are reused as they are. False where the C library is not glibc."""
    if not _HEAP_KEPT:
        kept = False
        try:
            libc = ctypes.CDLL(None)
            mallopt = getattr(libc, "mallopt", None)
            if mallopt is not None and platform.libc_ver()[0] == "glibc":
                kept = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_KEEP))
        except OSError:
            kept = False
        _HEAP_KEPT.append(kept)
    return _HEAP_KEPT[0]
