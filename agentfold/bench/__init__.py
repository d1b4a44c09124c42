"""Benchmarks: decode, sessions, agent transcript, load, offload, the suite and its report."""
