"""Row-exact operations for the decode engine, and the BLAS they run on."""
