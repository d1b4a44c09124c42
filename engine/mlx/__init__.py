"""The MLX backend: GGUF / mlx-lm loading and the row-exact MLX forward."""
