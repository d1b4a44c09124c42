"""AgentFold: a local inference runtime for coding agents, with exact speculative decoding."""

from agentfold.kernels.blas import setup as _setup_blas

BLAS = _setup_blas()  # must run before anything imports mlx.core

__version__ = "0.1.0"
