"""AgentFold: a local inference runtime for coding agents, with exact speculative decoding.

Importing the package does nothing but name the version: entry points call `prepare_process()`
first (the CLI's `main`, the test suite's conftest), so no import order decides which BLAS runs.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentfold.kernels.blas import BlasChoice

__version__ = "0.1.0"


def prepare_process() -> BlasChoice:
    """Process-wide set-up, before anything imports mlx.core or torch.

    Loads the fast BLAS for MLX's CPU matmuls (it must be loaded before `mlx.core`), keeps
    transformers quiet, and lets torch's OpenMP workers sleep instead of spinning while they wait:
    on a few shared cores workers that spin on and on stall each other (14x slower decode
    measured). They spin briefly first (GOMP_SPINCOUNT 20,000 iterations, about 1 ms here): a
    pass runs ~150 parallel regions a few microseconds apart (every GEMM, attention), and waking
    a sleeping worker for each cost a 1-row SmolLM2 pass 14 ms of its 33 (2-core AMD EPYC).
    Idempotent; returns the BLAS choice.
    """
    from agentfold.kernels.blas import setup

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", "20000")
    return setup()
