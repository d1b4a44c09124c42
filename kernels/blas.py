"""Pick the BLAS that MLX's CPU backend calls, before MLX is imported.

The `mlx[cpu]` wheel links a bundled reference BLAS: row-exact but slow (every extra verify row
costs a full extra weight read). Loading an optimized BLAS with RTLD_GLOBAL before `mlx.core` is
imported makes MLX's `cblas_*` calls resolve to it. `AGENTFOLD_BLAS=reference` keeps the bundled
one; `AGENTFOLD_BLAS=/path/libopenblas.so.0` names another library.
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)


@dataclass(frozen=True)
class BlasChoice:
    """Which BLAS MLX's CPU matmuls run on, and why."""

    name: str  # openblas | reference | accelerate
    path: str | None
    note: str

    def describe(self) -> str:
        return f"{self.name} ({self.path})" if self.path else f"{self.name}: {self.note}"


_CHOICE: BlasChoice | None = None


def setup() -> BlasChoice:
    """Load the fast BLAS once per process (a no-op off Linux or after MLX is imported)."""
    global _CHOICE
    if _CHOICE is not None:
        return _CHOICE
    if sys.platform == "darwin":
        _CHOICE = BlasChoice("accelerate", None, "MLX uses Metal / Accelerate on macOS")
        return _CHOICE
    wanted = os.environ.get("AGENTFOLD_BLAS", "auto")
    if wanted == "reference":
        _CHOICE = BlasChoice("reference", None, "AGENTFOLD_BLAS=reference: MLX's bundled BLAS")
        return _CHOICE
    if "mlx.core" in sys.modules:
        _CHOICE = BlasChoice("reference", None, "mlx was imported before agentfold; bundled BLAS in use")
        return _CHOICE
    paths = [wanted] if wanted not in ("auto", "openblas") else [p for p in CANDIDATES if os.path.exists(p)]
    for path in paths:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        _CHOICE = BlasChoice("openblas", path, "loaded before mlx")
        return _CHOICE
    _CHOICE = BlasChoice(
        "reference", None, "no OpenBLAS found (apt-get install libopenblas0-pthread); MLX's bundled BLAS is slow"
    )
    return _CHOICE


def current() -> BlasChoice:
    return setup()
