"""Which backend the real-model tests run on: the one `agentfold serve` picks on CPUs like CI's.

`--backend auto` chooses torch on x86 Linux CPUs (its int8 prefill and decode measure several
times faster than MLX's CPU backend there), so the API, session and scheduler tests run what a
user gets. `AGENTFOLD_TEST_BACKEND=mlx` runs them on MLX (on Apple chips, say); the MLX backend
keeps its own real-model tests (`smollm2_mlx_engine`) either way.
"""

from __future__ import annotations

import importlib.util
import os


def real_model_backend() -> str:
    chosen = os.environ.get("AGENTFOLD_TEST_BACKEND")
    if chosen:
        if chosen not in ("mlx", "torch"):
            raise ValueError(f"AGENTFOLD_TEST_BACKEND must be mlx or torch, not {chosen!r}")
        return chosen
    return "torch" if importlib.util.find_spec("torch") is not None else "mlx"
