"""The C helpers of `int8_linear` (csrc/int8_rows.c), compiled once per machine and loaded with ctypes.

Quantizing a row and combining the GEMM's integer sums are a dozen tiny torch ops each, and at
decode sizes their dispatch costs more than the GEMM; one C call does each. The library is built
on first use with the system C compiler (`cc`, or $CC) into a cache folder, keyed by the source,
the compiler and the CPU, and loaded with ctypes. Without a compiler `library()` returns None and
`int8_linear` runs the same arithmetic as torch ops (same bits, slower).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).parent / "csrc" / "int8_rows.c"
# No -ffast-math, no contraction into fused multiply-adds: each C operation is one IEEE operation.
FLAGS = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math", "-std=c99"]
_LIB: ctypes.CDLL | None = None
_TRIED = False


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


def _native_flags(compiler: str) -> list[str]:
    """-march=native where the compiler takes it (the binary is cached per CPU anyway)."""
    probe = subprocess.run([compiler, "-march=native", "-E", "-x", "c", "-"], input=b"", capture_output=True)
    return ["-march=native"] if probe.returncode == 0 else []


def build(folder: Path | None = None) -> Path | None:
    """Compile the library into `folder` (default: the cache) unless it is there; None without a compiler."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        return None
    flags = [*FLAGS, *_native_flags(compiler)]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\n".join([SOURCE.read_text(), compiler, version, " ".join(flags), _cpu_flags(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    folder = folder or cache_folder()
    target = folder / f"int8_rows-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:  # build aside, then rename: racing builds are safe
        staging = Path(scratch) / target.name
        done = subprocess.run([compiler, *flags, "-o", str(staging), str(SOURCE), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            return None
        os.replace(staging, target)
    return target


def library() -> ctypes.CDLL | None:
    """The loaded library, built on first use; None where it cannot be built or loaded."""
    global _LIB, _TRIED
    if _TRIED:
        return _LIB
    _TRIED = True
    if os.environ.get("AGENTFOLD_NATIVE", "1") == "0":
        return None
    try:
        path = build()
        if path is None:
            return None
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError):
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.quantize_rows.argtypes = [ptr, i64, i64, ptr, ptr]
    lib.quantize_rows.restype = None
    lib.combine.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr]
    lib.combine.restype = None
    _LIB = lib
    return _LIB
