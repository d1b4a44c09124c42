"""The PyTorch backend (CPU and CUDA): loader, models, row-exact forward."""
