"""AgentFold: a local inference runtime for coding agents, with exact speculative decoding."""

import os

from agentfold.kernels.blas import setup as _setup_blas

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found" on every start

BLAS = _setup_blas()  # must run before anything imports mlx.core

__version__ = "0.1.0"
