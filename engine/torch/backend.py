"""The PyTorch backend: the MLX backend's interface over the torch models in `torch.models`.

The decode loop, drafters, sampler, self-check and depth controller only see `new_cache`,
`forward`, `prefill`, `checkpoint` / `rollback` / `truncate`, so they run unchanged. The cache is
static and indexed by position (`torch.models.cache`): a pass writes its rows at the cache's
length, and a rollback only lowers that length (the token list), which makes it free and exact.
Row-exactness comes from the kernels `torch.models.ops` dispatches to for the weights' device.
"""

from __future__ import annotations

import platform
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from agentfold.engine.cache_layout import CacheLayoutError, array_name, bits_dtype, mark_bits, tokens_array, tokens_of
from agentfold.engine.mlx.loader import LoadedModel
from agentfold.engine.protocol import CacheState, Checkpoint, Lane, prefill_in_chunks, split_lanes
from agentfold.engine.torch.models import ops, quantize
from agentfold.engine.torch.models.cache import LayerCache
from agentfold.engine.torch.models.llama import SequencePass
from agentfold.kernels import native, rowwise, torch_cpu

_DONE = object()  # what `next` gives once a chunk's layers have all run

class TorchBackend:
    """Runs a `torch.models` model on CPU or CUDA under inference mode."""

    name = "torch"
    has_recurrent_state = False
    shares_passes = True  # `forward_many` runs lanes as one pass

    def __init__(self, loaded: LoadedModel, quant: str = "auto") -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = next(self.model.parameters()).device
        self.vocab_size = int(self.model.args.vocab_size)
        self.quant = resolve_quant(quant, self.device, self.model)
        if self.device.type == "cpu":
            native.keep_heap()  # a prefill chunk's buffers reused, not mapped and faulted in per layer
        if self.quant in ("int8", "blocks"):  # (blocks: the loader attached the GGUF's own, `gguf_blocks`)
            quantize.int8_weights(self.model)
            if self.model.model.embed_tokens.weight.dtype == torch.float32:
                # Keys and values as float16, as llama.cpp keeps them: half the bytes every verify
                # row's attention reads (the C kernel widens them exactly), half the snapshot size.
                self.model.cache_dtype = torch.float16
        elif self.device.type == "cpu":
            self._calibrate_cpu_matmuls()
        # Every kernel of a pass row-exact at any width, prompt rows included: integer linear layers,
        # the C row-wise ops and the C lane attention. The self-check verifies it
        # (ExactnessReport.prefill_lanes) before prompts share passes with replies. One exception,
        # fixed by the plan: a prefill chunk of more than PROMPT_PASS_MAX rows (only ever a whole
        # chunk between two cuts, run by `prefill_steps`) attends on AMX tiles where the CPU has
        # them (torch_cpu.MATRIX_MIN_ROWS), other bits than its rows one at a time would give; the
        # prompt pieces that share passes are never that long, and a resumed prompt's chunks are a
        # fresh one's, so resumed == fresh and lanes == solo still hold.
        self.prefill_rows_exact = (self.device.type == "cpu" and self.quant in ("int8", "blocks")
                                   and torch_cpu.lane_library() is not None and rowwise.library() is not None)

    def _calibrate_cpu_matmuls(self) -> None:
        """Find each weight shape's row-exact GEMM height now, not inside the first timed passes."""
        from agentfold.engine.torch.models.llama import Linear
        from agentfold.engine.torch.models.qwen3_moe import moe_blocks
        from agentfold.kernels import torch_cpu

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

    def forward(self, tokens: Sequence[int], cache: CacheState) -> np.ndarray:
        """Logits (float32, [rows, vocab]) of a pass that appends `tokens` to `cache`."""
        with torch.inference_mode():
            ids = torch.tensor([int(t) for t in tokens], dtype=torch.long, device=self.device)
            logits = self.model(ids, cache.layers, cache.length)
        cache.tokens.extend(int(t) for t in tokens)
        return logits.float().cpu().numpy()

    def forward_many(self, lanes: Sequence[Lane], logits: Sequence[bool] | None = None) -> list[np.ndarray]:
        """Each lane's logits, all lanes' rows in one pass (`Transformer.forward_passes`): the linear
        layers run once over every row (weights read once), attention per lane on its own cache.
        `logits`: per lane whether its logits are wanted (False: prompt rows, an empty array back)."""
        with torch.inference_mode():
            ids = torch.tensor([int(t) for tokens, _ in lanes for t in tokens], dtype=torch.long, device=self.device)
            passes = [SequencePass(cache.layers, cache.length, len(tokens)) for tokens, cache in lanes]
            rows = None
            if logits is not None and not all(logits):
                index, begin = [], 0
                for (tokens, _), wanted in zip(lanes, logits, strict=True):
                    index.extend(range(begin, begin + len(tokens)) if wanted else ())
                    begin += len(tokens)
                rows = torch.tensor(index, dtype=torch.long, device=self.device)
            out = self.model.forward_passes(ids, passes, rows=rows).float().cpu().numpy()
        return split_lanes(out, lanes, logits)

    def prefill(self, tokens: Sequence[int], cache: CacheState, boundaries: Sequence[int] = ()) -> None:
        """Append `tokens` in chunks cut at absolute `boundaries`; logits are never computed."""
        prefill_in_chunks(self, tokens, cache, boundaries)

    def prefill_steps(self, tokens: Sequence[int], cache: CacheState) -> Iterator[None]:
        """Append one chunk of `tokens`, yielding after each decoder layer; the cache holds the
        chunk once the iterator is exhausted (closed early, it is unchanged: rows past its length
        are never read). Each step runs under the prefill kernels and only that step, so whatever
        runs between the steps (another reply's verify pass) keeps its own row-exact kernels."""
        if not tokens:
            return
        ids = torch.tensor([int(t) for t in tokens], dtype=torch.long, device=self.device)
        steps = self.model.layer_steps(ids, cache.layers, cache.length)
        while True:
            with torch.inference_mode(), torch_cpu.prefill_chunk():  # logits unread: batched kernels at any width
                step = next(steps, _DONE)
            if step is _DONE:
                break
            yield
        cache.tokens.extend(int(t) for t in tokens)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def checkpoint(self, cache: CacheState) -> Checkpoint:
        return Checkpoint(cache.length, {})

    def rollback(self, cache: CacheState, checkpoint: Checkpoint, keep: int) -> None:
        """Keep the first `keep` tokens appended since `checkpoint`: rows past them are just unread."""
        del cache.tokens[checkpoint.length + keep :]

    def truncate(self, cache: CacheState, length: int) -> None:
        del cache.tokens[length:]

    # --- snapshots (sessions.snapshots; engine.cache_layout) ---

    def cache_to_arrays(self, cache: CacheState) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
        """The cache's valid rows as numpy arrays (bfloat16 as uint16 bits, see `cache_layout`), and their layout."""
        arrays: dict[str, np.ndarray] = {"tokens": tokens_array(cache.tokens)}
        layout: list[dict[str, Any]] = []
        for i, layer in enumerate(cache.layers):
            layout.append(kv_to_arrays(arrays, i, layer, cache.length))
        return arrays, layout

    def _cache_for(self, arrays: Mapping[str, np.ndarray], layout: list[dict[str, Any]]) -> tuple[CacheState,
                                                                                                  list[int]]:
        """An empty cache for a snapshot with this model's layer count, and the snapshot's tokens."""
        cache = self.new_cache()
        if len(cache.layers) != len(layout):
            raise CacheLayoutError(f"the snapshot has {len(layout)} layers, the model {len(cache.layers)}")
        return cache, tokens_of(arrays)

    def arrays_to_cache(self, arrays: Mapping[str, np.ndarray], layout: list[dict[str, Any]]) -> CacheState:
        """A new cache holding `arrays` (copied: the store's hot copy is never written to). Raises
        CacheLayoutError when they do not fit this model's cache."""
        cache, tokens = self._cache_for(arrays, layout)
        n = len(tokens)
        for i, (layer, spec) in enumerate(zip(cache.layers, layout, strict=True)):
            if spec.get("kind") != "kv" or spec.get("offset") != n:
                raise CacheLayoutError(f"layer {i}: snapshot holds {spec}, the model a {n}-token KV cache")
            kv_from_arrays(arrays, i, spec, layer, n)
        cache.tokens = tokens
        return cache

    def describe(self) -> dict[str, Any]:
        """Kernel identity and library versions: what, besides the weights, decides the bytes."""
        offload = getattr(self.model, "expert_offload", None)  # offloaded experts use other arithmetic
        kernels = ops.describe(self.device)
        if getattr(self.model, "layout", None) is not None:  # sliding-window layers (Gemma 3): their own blocks
            kernels["windowed_attention"] = f"block{ops.WINDOW_BLOCK}"
        if self.quant == "int8":
            from agentfold.kernels import int8_linear

            kernels.update(int8_linear.describe())
        elif self.quant == "blocks":
            from agentfold.kernels import block_linear

            kernels.update(block_linear.describe())
        cache = self.model.cache_dtype or self.model.model.embed_tokens.weight.dtype
        return {"backend": self.name, "device": str(self.device), **kernels, "kv_cache": str(cache).replace("torch.", ""),
                "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
                **(offload.describe() if offload is not None else {})}


def resolve_quant(quant: str, device: torch.device, model: torch.nn.Module) -> str:
    """`auto`: int8 weights on CPU (row-exact by integer arithmetic, 4x fewer bytes), float on CUDA
    (the batch-invariant Triton kernels). A model already quantized (int8, or loaded on its GGUF
    blocks) stays so."""
    if quant not in ("auto", *quantize.MODES):
        raise ValueError(f"quant must be auto, {', '.join(quantize.MODES)}, not {quant!r}")
    done = getattr(model, "quantized", None)
    if done in ("int8", "blocks"):
        if quant not in ("auto", done):
            raise ValueError(f"this model's weights were loaded as {done} (load it again for {quant})")
        return done
    if quant == "blocks":
        raise ValueError("quant blocks runs a GGUF file's own blocks: load the model with it (build_engine does)")
    if quant == "auto":
        return "int8" if device.type == "cpu" else "none"
    if quant == "int8" and device.type != "cpu":
        raise ValueError("int8 weights run on the CPU; on CUDA the torch backend uses float weights")
    return quant


def kv_to_arrays(arrays: dict[str, np.ndarray], index: int, layer: LayerCache, length: int) -> dict[str, Any]:
    """Layer `index`'s keys and values of its first `length` positions into `arrays` (copies);
    its layout entry (`engine.cache_layout`)."""
    spec: dict[str, Any] = {"kind": "kv", "offset": length}
    for part, tensor in zip(("keys", "values"), layer.read(length), strict=True):
        arrays[array_name(index, part)] = _to_numpy(tensor, spec, part)
    return spec


def kv_from_arrays(arrays: Mapping[str, np.ndarray], index: int, spec: dict[str, Any], layer: LayerCache,
                   length: int) -> None:
    """Write layer `index`'s `length` snapshot positions into `layer`; CacheLayoutError when their
    shape or dtype is not this model's."""
    if not length:
        return
    keys, values = (_from_numpy(arrays, index, spec, part, layer.keys) for part in ("keys", "values"))
    expected = [layer.keys.shape[0], length, layer.keys.shape[2]]
    if list(keys.shape) != expected or values.shape != keys.shape:
        raise CacheLayoutError(f"layer {index}: snapshot keys are {list(keys.shape)}, values "
                               f"{list(values.shape)}; this model's are {expected}")
    layer.write(0, keys, values)


def _to_numpy(tensor: torch.Tensor, spec: dict[str, Any], part: str) -> np.ndarray:
    """A copy of `tensor` as a numpy array; bfloat16 as its uint16 bits, noted in the layer's `spec`."""
    tensor = tensor.detach().to("cpu", copy=True).contiguous()
    if tensor.dtype == torch.bfloat16:
        mark_bits(spec, part, "bfloat16")
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def _from_numpy(arrays: Mapping[str, np.ndarray], layer: int, spec: dict[str, Any], part: str,
                like: torch.Tensor) -> torch.Tensor:
    """A snapshot array back as a torch tensor with `like`'s dtype, on its device."""
    array = arrays.get(array_name(layer, part))
    if array is None:
        raise CacheLayoutError(f"layer {layer}: the snapshot has no {array_name(layer, part)!r} array")
    if not array.flags.writeable:  # torch cannot wrap a read-only buffer
        array = array.copy()
    if bits_dtype(spec, part, array) == "bfloat16":
        tensor = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(array)
    if tensor.dtype != like.dtype:
        raise CacheLayoutError(f"layer {layer}: snapshot holds {tensor.dtype}, the cache {like.dtype}")
    return tensor.to(like.device)
