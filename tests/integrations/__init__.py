"""Tests of `agentfold integrate` against golden files."""
