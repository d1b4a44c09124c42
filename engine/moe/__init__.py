"""Mixture-of-experts: expert offload, placement, routing profiles, exact int8 experts."""
