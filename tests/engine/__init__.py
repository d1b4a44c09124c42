"""Tests of the decode engine: sampler, drafting, backends, MoE offload, real models."""
