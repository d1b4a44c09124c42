"""The PyTorch backend: the MLX backend's interface over the torch models in `torch_models`.

The decode loop, drafters, sampler, self-check and depth controller only see `new_cache`,
`forward`, `prefill`, `checkpoint` / `rollback` / `truncate`, so they run unchanged. The cache is
static and indexed by position (`torch_models.cache`): a pass writes its rows at the cache's
length, and a rollback only lowers that length (the token list), which makes it free and exact.
Row-exactness comes from the kernels `torch_models.ops` dispatches to for the weights' device.
"""

from __future__ import annotations

import platform
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import torch

from .backend import CacheState, Checkpoint
from .loader import LoadedModel
from .torch_models import ops
from .torch_models.cache import LayerCache


class TorchBackend:
    """Runs a `torch_models` model on CPU or CUDA under inference mode."""

    name = "torch"
    has_recurrent_state = False

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = next(self.model.parameters()).device
        self.vocab_size = int(self.model.args.vocab_size)
        if self.device.type == "cpu":
            self._calibrate_cpu_matmuls()

    def _calibrate_cpu_matmuls(self) -> None:
        """Find each weight shape's row-exact GEMM height now, not inside the first timed passes."""
        from ..kernels import torch_cpu
        from .torch_models.llama import Linear
        from .torch_models.qwen3_moe import moe_blocks

        weights = [m.weight for m in self.model.modules() if isinstance(m, Linear)]
        if self.model.lm_head is None:
            weights.append(self.model.model.embed_tokens.weight)
        for block in moe_blocks(self.model):
            if block.weights.gate_proj.numel():  # (offloaded models may hold no float experts)
                weights += [block.weights.gate_proj[0], block.weights.down_proj[0]]
        with torch.inference_mode():
            for weight in weights:
                torch_cpu.block_rows(weight)

    def new_cache(self) -> CacheState:
        return CacheState(self.model.make_cache())

    def _run(self, tokens: Sequence[int], cache: CacheState, logits: bool) -> torch.Tensor | None:
        with torch.inference_mode():
            ids = torch.tensor([int(t) for t in tokens], dtype=torch.long, device=self.device)
            out = self.model(ids, cache.layers, cache.length, logits=logits)
        cache.tokens.extend(int(t) for t in tokens)
        return out

    def forward(self, tokens: Sequence[int], cache: CacheState) -> np.ndarray:
        """Logits (float32, [rows, vocab]) of a pass that appends `tokens` to `cache`."""
        return self._run(tokens, cache, logits=True).float().cpu().numpy()

    def prefill(self, tokens: Sequence[int], cache: CacheState, boundaries: Sequence[int] = ()) -> None:
        """Append `tokens` in chunks cut at absolute `boundaries`; logits are never computed."""
        start = cache.length
        end = start + len(tokens)
        offset = start
        for cut in sorted({b for b in boundaries if start < b < end} | {end}):
            if cut > offset:
                self._run(tokens[offset - start : cut - start], cache, logits=False)
            offset = cut
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def checkpoint(self, cache: CacheState) -> Checkpoint:
        return Checkpoint(cache.length, {})

    def rollback(self, cache: CacheState, checkpoint: Checkpoint, keep: int) -> None:
        """Keep the first `keep` tokens appended since `checkpoint`: rows past them are just unread."""
        del cache.tokens[checkpoint.length + keep :]

    def truncate(self, cache: CacheState, length: int) -> None:
        del cache.tokens[length:]

    # --- snapshots (sessions.store) ---

    def cache_to_arrays(self, cache: CacheState) -> tuple[dict[str, mx.array], list[dict[str, Any]]]:
        """The cache's valid rows as MLX arrays (what the snapshot store writes), and their layout."""
        arrays: dict[str, mx.array] = {"tokens": mx.array(np.asarray(cache.tokens, dtype=np.int32))}
        layout: list[dict[str, Any]] = []
        n = cache.length
        for i, layer in enumerate(cache.layers):
            keys, values = layer.read(n)
            arrays[f"{i}.keys"], arrays[f"{i}.values"] = _to_mx(keys), _to_mx(values)
            layout.append({"kind": "kv", "offset": n})
        return arrays, layout

    def arrays_to_cache(self, arrays: dict[str, mx.array], layout: list[dict[str, Any]]) -> CacheState:
        """A new cache holding `arrays` (copied: the store's hot copy is never written to)."""
        from ..sessions.store import SnapshotError

        cache = self.new_cache()
        if len(cache.layers) != len(layout):
            raise SnapshotError(f"the snapshot has {len(layout)} layers, the model {len(cache.layers)}")
        tokens = [int(t) for t in np.array(arrays["tokens"])]
        for i, (layer, spec) in enumerate(zip(cache.layers, layout, strict=True)):
            if spec.get("kind") != "kv" or spec.get("offset") != len(tokens):
                raise SnapshotError(f"layer {i}: snapshot holds {spec}, the model a {len(tokens)}-token KV cache")
            if spec["offset"]:
                keys, values = (_from_mx(arrays[f"{i}.{part}"], layer.keys) for part in ("keys", "values"))
                if keys.shape[0] != layer.keys.shape[0] or keys.shape[2] != layer.keys.shape[2]:
                    raise SnapshotError(f"layer {i}: snapshot keys are {list(keys.shape)}, not this model's")
                layer.write(0, keys, values)
        cache.tokens = tokens
        return cache

    def describe(self) -> dict[str, Any]:
        """Kernel identity and library versions: what, besides the weights, decides the bytes."""
        offload = getattr(self.model, "expert_offload", None)  # offloaded experts use other arithmetic
        return {"backend": self.name, "device": str(self.device), **ops.describe(self.device),
                "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
                **(offload.describe() if offload is not None else {})}


def _to_mx(tensor: torch.Tensor) -> mx.array:
    """A torch tensor as an MLX array of the same dtype (bfloat16 travels as int16 bits)."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return mx.array(tensor.view(torch.int16).numpy()).view(mx.bfloat16)
    return mx.array(tensor.numpy())


def _from_mx(array: mx.array, like: LayerCache | torch.Tensor) -> torch.Tensor:
    """An MLX array back as a torch tensor with `like`'s dtype and device."""
    target = like if isinstance(like, torch.Tensor) else like.keys
    if array.dtype == mx.bfloat16:
        tensor = torch.from_numpy(np.array(array.view(mx.int16))).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(np.array(array))
    if tensor.dtype != target.dtype:
        raise ValueError(f"snapshot holds {tensor.dtype}, the cache {target.dtype}")
    return tensor.to(target.device)
