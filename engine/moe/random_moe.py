"""A random-weight MoE model of any Hugging Face config, built without its float experts.

Benchmarks of models that are not on disk (Qwen3-30B-A3B's shapes have 29 G expert weights)
need the real dimensions, not the real values: the dense weights are drawn on the target device
one tensor at a time, and each layer's experts are drawn and quantized to int8 a few experts at
a time (`expert_quant.random_layer`), so the float experts never exist in memory. The model
then runs with `engine.offload` (the quantized experts are all it has).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from agentfold.engine.mlx.loader import LoadedModel
from agentfold.engine.moe.quant import QuantizedLayer, random_layer


class IdTokenizer:
    """The text of a model without a vocabulary: each token id as a decimal word."""

    eos_token_id = None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(f" {int(i)}" for i in ids)


def random_moe(config: dict[str, Any], device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               seed: int = 0, std: float = 0.02,
               progress: Callable[[str], None] | None = None) -> tuple[LoadedModel, dict[int, QuantizedLayer]]:
    """A MoE model of `config` with random weights on `device`, and its int8 experts by layer index."""
    from agentfold.engine.torch import models as torch_models
    from agentfold.engine.torch.loader import place
    from agentfold.engine.torch.models.llama import Rope
    from agentfold.engine.torch.models.qwen3_moe import ExpertWeights, moe_blocks

    say = progress or (lambda message: None)
    device = torch.device(device)
    started = time.perf_counter()
    with torch.device("meta"):
        model = torch_models.build(config)
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"model_type {config.get('model_type')!r} has no MoE layers")
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=generator)
    args = model.args
    model.rope = Rope(args.head_dim, args.rope_theta).to(device)
    experts, inner, hidden = int(config["num_experts"]), int(config["moe_intermediate_size"]), args.hidden_size
    layers: dict[int, QuantizedLayer] = {}
    for block in blocks:
        empty = torch.empty(experts, 0, 0, dtype=dtype, device=device)
        block.set_weights(ExpertWeights(empty, empty, empty))  # float experts never exist
        layers[block.layer_index] = random_layer(experts, inner, hidden, generator, device, std)
        if block.layer_index % 8 == 0:
            say(f"random experts: layer {block.layer_index + 1} of {args.num_hidden_layers}")
    place(model, dtype, device)  # the loader's layout (linear weights transposed on CPU)
    model.eval()
    name = f"random-{config.get('model_type')}-{args.num_hidden_layers}L-{experts}E"
    loaded = LoadedModel(model, IdTokenizer(), dict(config), Path(name), str(dtype).removeprefix("torch."))
    loaded.load_seconds = time.perf_counter() - started
    return loaded, layers
