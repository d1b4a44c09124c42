"""AgentFold: a local inference runtime for coding agents, with exact speculative decoding."""

import os

from agentfold.kernels.blas import setup as _setup_blas

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found" on every start
# torch's OpenMP workers sleep instead of spinning when they wait: on a few shared cores (MLX's BLAS
# threads, a server, other jobs) spinning workers stall each other (14x slower decode measured)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

BLAS = _setup_blas()  # must run before anything imports mlx.core

__version__ = "0.1.0"
