"""The decode engine: backends, drafters, the exact sampler and the verify loop."""
