"""Tests of the row-exact kernels, including Triton compiled for real GPU targets."""
