"""Tests of the benchmarks (most are slow: real servers, real model)."""
