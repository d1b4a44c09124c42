"""MoE expert offload: a device budget for experts, the rest computed from host memory.

`install_offload(model, budget_bytes)` quantizes every MoE block's experts to int8 once
(`engine.expert_quant`), keeps all of them in (pinned) host memory, copies the ones the
placement picks (`engine.expert_placement`) into a device pool of `budget_bytes`, and replaces
each block's `experts` with an `OffloadedExperts` that, per layer call:

- runs the resident experts on the device (one grouped int8 kernel per projection on CUDA),
- meanwhile computes the integer products of the other experts in CPU worker threads from host
  memory, or copies a `copy_share` of them over PCIe into scratch slots on a side stream,
- runs every float step (dequantize, SiLU, requantize, combine in slot order) on the device.

Integer products are exact and the float steps run in one place, so the tier an expert ran on
never changes a bit of the output: any budget, any swap schedule, gives the same tokens. Swaps
(every `adapt_every` passes) are copied on their own CUDA stream and an expert starts being
used from its new slot only once its copy has finished.

`model.expert_offload` is the controller; the engine reads its counters around each reply
(`DecodeStats.offload`): expert hit rate, experts per layer by tier, swaps, device / cpu / copy time.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agentfold.engine.moe.placement import ExpertPlacement, Swap, load_profile
from agentfold.engine.moe.quant import VERSION as EXPERTS_VERSION
from agentfold.engine.moe.quant import (
    QuantizedLayer,
    combine,
    dequantize,
    int_matmul,
    quantize_activations,
    quantize_layer,
    swiglu_requant,
)

_MAX_OPEN_SPANS = 4096  # CUDA event pairs kept before the oldest are read


@dataclass
class OffloadCounters:
    """Cumulative counts and clocks; a reply's figures are the difference of two snapshots."""

    passes: int = 0
    layer_calls: int = 0
    rows: int = 0  # routed (token, slot) pairs
    experts: int = 0  # distinct experts per layer call, summed
    device_experts: int = 0
    streamed_experts: int = 0
    host_experts: int = 0
    device_rows: int = 0
    streamed_rows: int = 0
    host_rows: int = 0
    swaps: int = 0
    swap_bytes: int = 0
    streamed_bytes: int = 0
    device_seconds: float = 0.0
    cpu_seconds: float = 0.0  # busy time of the host workers, summed over threads
    wait_seconds: float = 0.0  # the model's thread waiting for host results
    copy_seconds: float = 0.0

    def minus(self, before: OffloadCounters) -> OffloadCounters:
        return OffloadCounters(**{f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self)})


class _Clock:
    """Time spans of device work: CUDA events read lazily (no sync on the hot path), or wall time."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.open: list[tuple[str, Any, Any]] = []

    def start(self, stream: Any = None) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def stop(self, counters: OffloadCounters, name: str, began: Any, stream: Any = None) -> None:
        if not self.cuda:
            setattr(counters, name, getattr(counters, name) + time.perf_counter() - began)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        self.open.append((name, began, end))
        if len(self.open) > _MAX_OPEN_SPANS:
            self.settle(counters, len(self.open) // 2)

    def settle(self, counters: OffloadCounters, count: int | None = None) -> None:
        """Add the oldest `count` (default all) open spans to the counters (waits for them)."""
        count = len(self.open) if count is None else count
        for name, began, end in self.open[:count]:
            end.synchronize()
            setattr(counters, name, getattr(counters, name) + began.elapsed_time(end) / 1e3)
        del self.open[:count]


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    """Run fn in a worker thread (inference mode is per thread) and time it."""
    began = time.perf_counter()
    with torch.inference_mode():
        result = fn(*args)
    return result, time.perf_counter() - began


class ExpertOffload:
    """Device pool, host copies, placement and host workers for every MoE layer of one model."""

    def __init__(self, layers: Mapping[int, QuantizedLayer], budget_bytes: int, device: torch.device | str,
                 profile: str | Path | Mapping[Any, Any] | None = None, *, adapt_every: int = 32,
                 decay: float = 0.9, margin: float = 0.25, max_swaps: int = 16, copy_share: float = 0.0,
                 stream_slots: int = 8, host_threads: int | None = None, grouped_kernel: bool | None = None) -> None:
        if not layers:
            raise ValueError("expert offload needs at least one MoE layer")
        if budget_bytes < 0:
            raise ValueError(f"the expert budget must be >= 0 bytes, not {budget_bytes}")
        if not 0.0 <= copy_share <= 1.0:
            raise ValueError(f"copy_share must be in [0, 1], not {copy_share}")
        self.layers = dict(sorted(layers.items()))
        first = next(iter(self.layers.values()))
        shapes = {(q.gate_up.shape, q.down.shape) for q in self.layers.values()}
        if len(shapes) != 1:
            raise ValueError("every MoE layer must have the same expert shapes")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        # the grouped Triton kernel is the CUDA path; on CPU it runs only under TRITON_INTERPRET (tests)
        self.grouped = self.cuda if grouped_kernel is None else grouped_kernel
        self.first_layer = min(self.layers)
        self.expert_bytes = first.expert_bytes
        self.budget_bytes = int(budget_bytes)
        counts = load_profile(profile) if isinstance(profile, (str, Path)) or (
            isinstance(profile, Mapping) and "schema" in profile) else profile
        self.placement = ExpertPlacement(list(self.layers), first.num_experts, self.budget_bytes // self.expert_bytes,
                                         counts, adapt_every=adapt_every, decay=decay, margin=margin,
                                         max_swaps=max_swaps)
        self.copy_share = copy_share
        self.stream_slots = stream_slots if copy_share > 0 else 0
        total = self.placement.slots + self.stream_slots
        inner, hidden = first.inner, first.hidden
        self.pool_gate_up = torch.empty(total, 2 * inner, hidden, dtype=torch.int8, device=self.device)
        self.pool_down = torch.empty(total, hidden, inner, dtype=torch.int8, device=self.device)
        self.swap_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.pending: dict[int, Any] = {}  # slot -> event of the copy that fills it
        self.counters = OffloadCounters()
        self.clock = _Clock(self.cuda)
        # each worker's torch ops are themselves multi-threaded: a few workers fill the cores
        self.host_threads = host_threads or max(1, min(4, (os.cpu_count() or 2) // 2))
        self.executor = ThreadPoolExecutor(max_workers=self.host_threads, thread_name_prefix="agentfold-experts")
        self._in_pass = False
        for slot, occupant in enumerate(self.placement.occupant):
            if occupant is not None:
                self._fill(slot, *occupant, timed=False)  # the load, not a reply's cost
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.pending.clear()

    # -- bookkeeping --------------------------------------------------------------------------

    def snapshot(self) -> OffloadCounters:
        """The counters so far (device clocks read first)."""
        self.clock.settle(self.counters)
        return OffloadCounters(**{f.name: getattr(self.counters, f.name) for f in fields(OffloadCounters)})

    def report(self, before: OffloadCounters | None = None) -> dict[str, Any]:
        """What the passes since `before` (default: ever) cost, as a JSON-ready dict."""
        d = self.snapshot().minus(before or OffloadCounters())
        calls, passes = max(d.layer_calls, 1), max(d.passes, 1)

        def share(part: int, whole: int) -> float | None:
            return round(part / whole, 4) if whole else None

        total = self.placement.slot_of.size
        return {
            "passes": d.passes,
            "layer_calls": d.layer_calls,
            "budget_bytes": self.budget_bytes,
            "expert_bytes": self.expert_bytes,
            "device_slots": self.placement.slots,
            "stream_slots": self.stream_slots,
            "resident_share": round(self.placement.slots / total, 4),
            "hit_rate": share(d.device_experts, d.experts),
            "row_hit_rate": share(d.device_rows, d.rows),
            "experts_per_layer": {"device": round(d.device_experts / calls, 3),
                                  "streamed": round(d.streamed_experts / calls, 3),
                                  "host": round(d.host_experts / calls, 3)},
            "swaps": d.swaps,
            "swap_bytes": d.swap_bytes,
            "streamed_bytes": d.streamed_bytes,
            "seconds": {"device": round(d.device_seconds, 6), "cpu": round(d.cpu_seconds, 6),
                        "wait": round(d.wait_seconds, 6), "copy": round(d.copy_seconds, 6)},
            "per_pass_ms": {"device": round(d.device_seconds * 1e3 / passes, 4),
                            "cpu": round(d.cpu_seconds * 1e3 / passes, 4),
                            "wait": round(d.wait_seconds * 1e3 / passes, 4),
                            "copy": round(d.copy_seconds * 1e3 / passes, 4)},
            "host_threads": self.host_threads,
            "adapt_every": self.placement.adapt_every,
        }

    def describe(self) -> dict[str, Any]:
        """What decides the bytes (for snapshot keys): the expert arithmetic, never the placement."""
        return {"experts": "int8 rows x int8 tokens, int32 sums, float epilogue on the device",
                "experts_version": EXPERTS_VERSION}

    def close(self) -> None:
        """Stop the host workers and free the device pool (the controller is unusable after)."""
        self.executor.shutdown(wait=True)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.pool_gate_up = self.pool_down = torch.empty(0, dtype=torch.int8, device=self.device)
        self.pending.clear()

    # -- bytes --------------------------------------------------------------------------------

    def _fill(self, slot: int, layer: int, expert: int, stream: Any = None, timed: bool = True) -> None:
        """Copy an expert's int8 matrices from host memory into a device slot (on `stream`)."""
        q = self.layers[layer]
        stream = stream or self.swap_stream
        began = self.clock.start(stream) if timed else None
        if self.cuda:
            with torch.cuda.stream(stream):
                self.pool_gate_up[slot].copy_(q.gate_up[expert], non_blocking=True)
                self.pool_down[slot].copy_(q.down[expert], non_blocking=True)
            self.pending[slot] = stream.record_event()
        else:
            self.pool_gate_up[slot].copy_(q.gate_up[expert])
            self.pool_down[slot].copy_(q.down[expert])
        if timed:
            self.clock.stop(self.counters, "copy_seconds", began, stream)

    def _ready(self, slot: int) -> bool:
        event = self.pending.get(slot)
        if event is None:
            return True
        if event.query():
            del self.pending[slot]
            return True
        return False

    def _swap(self, swaps: Sequence[Swap]) -> None:
        if not swaps:
            return
        if self.cuda:  # kernels already queued may still read the evicted experts' slots
            self.swap_stream.wait_stream(torch.cuda.current_stream(self.device))
        for swap in swaps:
            self._fill(swap.slot, *swap.loaded, stream=self.swap_stream)
        self.counters.swaps += len(swaps)
        self.counters.swap_bytes += len(swaps) * self.expert_bytes

    def _stream_in(self, q: QuantizedLayer,
                   groups: list[tuple[int, np.ndarray]]) -> list[tuple[int, int, np.ndarray]]:
        """Copy these non-resident experts into the scratch slots; the device then computes them."""
        base = self.placement.slots
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        if self.cuda:  # the previous layer's kernels may still read the scratch slots
            self.copy_stream.wait_stream(compute)
        out = []
        for i, (expert, pairs) in enumerate(groups):
            began = self.clock.start(self.copy_stream)
            if self.cuda:
                with torch.cuda.stream(self.copy_stream):
                    self.pool_gate_up[base + i].copy_(q.gate_up[expert], non_blocking=True)
                    self.pool_down[base + i].copy_(q.down[expert], non_blocking=True)
            else:
                self.pool_gate_up[base + i].copy_(q.gate_up[expert])
                self.pool_down[base + i].copy_(q.down[expert])
            self.clock.stop(self.counters, "copy_seconds", began, self.copy_stream)
            out.append((expert, base + i, pairs))
        if self.cuda:
            compute.wait_stream(self.copy_stream)
        self.counters.streamed_bytes += len(groups) * self.expert_bytes
        return out

    # -- one layer call -----------------------------------------------------------------------

    def _begin_pass(self) -> None:
        if self._in_pass:
            self._swap(self.placement.end_pass())
        self._in_pass = True
        self.counters.passes += 1

    def run(self, layer_index: int, x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """The experts of MoE layer `layer_index` for x [n, H], routed by ids / gates [n, k]."""
        if layer_index == self.first_layer:
            self._begin_pass()
        layer = self.layers[layer_index]
        n, k = ids.shape
        c = self.counters
        xq, x_scale = quantize_activations(x)
        flat = ids.reshape(-1).cpu().numpy()
        order = np.argsort(flat, kind="stable")
        experts, starts, counts = np.unique(flat[order], return_index=True, return_counts=True)
        self.placement.observe(layer_index, experts, counts)
        on_device: list[tuple[int, int, np.ndarray]] = []
        on_host: list[tuple[int, np.ndarray]] = []
        for expert, start, count in zip(experts.tolist(), starts.tolist(), counts.tolist(), strict=True):
            pairs = order[start : start + count]
            slot = self.placement.slot(layer_index, expert)
            if slot >= 0 and self._ready(slot):
                on_device.append((expert, slot, pairs))
            else:
                on_host.append((expert, pairs))
        streamed: list[tuple[int, int, np.ndarray]] = []
        if self.stream_slots and on_host:
            want = min(self.stream_slots, math.ceil(self.copy_share * len(on_host) - 1e-9))
            on_host.sort(key=lambda group: -len(group[1]))  # the busiest experts are worth a copy
            streamed, on_host = self._stream_in(layer, on_host[:want]), on_host[want:]

        out = torch.empty(n * k, layer.hidden, dtype=torch.float32, device=x.device)
        job = self._host_start(layer, xq, on_host, k) if on_host else None
        if on_device or streamed:
            self._device_part(layer, xq, x_scale, on_device + streamed, k, out)
        if job is not None:
            self._host_finish(layer, x_scale, on_host, job, k, out)

        c.layer_calls += 1
        c.rows += n * k
        c.experts += len(experts)
        c.device_experts += len(on_device)
        c.streamed_experts += len(streamed)
        c.host_experts += len(on_host)
        c.device_rows += sum(len(p) for _, _, p in on_device)
        c.streamed_rows += sum(len(p) for _, _, p in streamed)
        c.host_rows += sum(len(p) for _, p in on_host)
        return combine(out.view(n, k, layer.hidden), gates.float()).to(x.dtype)

    def _device_part(self, layer: QuantizedLayer, xq: torch.Tensor, x_scale: torch.Tensor,
                     groups: list[tuple[int, int, np.ndarray]], k: int, out: torch.Tensor) -> None:
        """Experts held in device slots: integer products, epilogue and dequantization, all on the device."""
        began = self.clock.start()
        if self.grouped:
            self._device_grouped(layer, xq, x_scale, groups, k, out)
        else:
            for expert, slot, pairs in groups:
                tokens = torch.from_numpy(pairs // k)
                rows = len(pairs)
                acc = int_matmul(xq[tokens], self.pool_gate_up[slot])
                hq, h_scale = swiglu_requant(acc, x_scale[tokens], layer.gate_up_scale[expert].expand(rows, -1))
                acc = int_matmul(hq, self.pool_down[slot])
                out[torch.from_numpy(pairs)] = dequantize(acc, h_scale, layer.down_scale[expert].expand(rows, -1))
        self.clock.stop(self.counters, "device_seconds", began)

    def _device_grouped(self, layer: QuantizedLayer, xq: torch.Tensor, x_scale: torch.Tensor,
                        groups: list[tuple[int, int, np.ndarray]], k: int, out: torch.Tensor) -> None:
        from agentfold.kernels.triton_moe import GROUP_BLOCK, grouped_int_matmul

        sizes = [len(pairs) for _, _, pairs in groups]
        blocks = [-(-size // GROUP_BLOCK) for size in sizes]
        padded = sum(blocks) * GROUP_BLOCK
        rows_gate_up = np.full(padded, -1, dtype=np.int64)
        rows_down = np.full(padded, -1, dtype=np.int64)
        real = np.empty(sum(sizes), dtype=np.int64)
        pos = done = 0
        for (_, _, pairs), size, count in zip(groups, sizes, blocks, strict=True):
            rows_gate_up[pos : pos + size] = pairs // k
            rows_down[pos : pos + size] = np.arange(done, done + size)
            real[done : done + size] = np.arange(pos, pos + size)
            pos += count * GROUP_BLOCK
            done += size
        block_slot = np.repeat([slot for _, slot, _ in groups], blocks)
        experts = np.repeat([expert for expert, _, _ in groups], sizes)
        pairs = np.concatenate([pairs for _, _, pairs in groups])
        packed = np.concatenate([rows_gate_up, rows_down, block_slot, real, experts, pairs])
        meta = torch.from_numpy(packed).to(xq.device, non_blocking=False)
        cuts = np.cumsum([padded, padded, len(block_slot), done, done])
        rows_gu, rows_dn, slots, real_t, experts_t, pairs_t = torch.tensor_split(meta, cuts.tolist())
        rows_gu, rows_dn, slots = rows_gu.to(torch.int32), rows_dn.to(torch.int32), slots.to(torch.int32)
        acc = grouped_int_matmul(xq, rows_gu, slots, self.pool_gate_up)[real_t]
        hq, h_scale = swiglu_requant(acc, x_scale[pairs_t // k], layer.gate_up_scale[experts_t])
        acc = grouped_int_matmul(hq, rows_dn, slots, self.pool_down)[real_t]
        out[pairs_t] = dequantize(acc, h_scale, layer.down_scale[experts_t])

    def _host_start(self, layer: QuantizedLayer, xq: torch.Tensor, groups: list[tuple[int, np.ndarray]],
                    k: int) -> list[Future]:
        """Queue the gate/up integer products of host experts on the worker threads."""
        xq_host = xq.cpu()
        return [self.executor.submit(_timed, int_matmul, xq_host[torch.from_numpy(pairs // k)], layer.gate_up[e])
                for e, pairs in groups]

    def _gather(self, futures: list[Future], device: torch.device) -> torch.Tensor:
        began = time.perf_counter()
        parts = []
        for future in futures:
            part, seconds = future.result()
            parts.append(part)
            self.counters.cpu_seconds += seconds
        self.counters.wait_seconds += time.perf_counter() - began
        return torch.cat(parts).to(device)

    def _host_finish(self, layer: QuantizedLayer, x_scale: torch.Tensor, groups: list[tuple[int, np.ndarray]],
                     futures: list[Future], k: int, out: torch.Tensor) -> None:
        """Host experts: epilogue on the device, down projection on the workers, dequantize on the device."""
        device = out.device
        sizes = [len(pairs) for _, pairs in groups]
        pairs = np.concatenate([pairs for _, pairs in groups])
        experts = np.repeat([e for e, _ in groups], sizes)
        meta = torch.from_numpy(np.concatenate([pairs, experts])).to(device)
        pairs_t, experts_t = meta[: len(pairs)], meta[len(pairs) :]
        acc = self._gather(futures, device)
        began = self.clock.start()
        hq, h_scale = swiglu_requant(acc, x_scale[pairs_t // k], layer.gate_up_scale[experts_t])
        self.clock.stop(self.counters, "device_seconds", began)
        hq_host = hq.cpu()
        offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        futures = [self.executor.submit(_timed, int_matmul, hq_host[offsets[i] : offsets[i + 1]], layer.down[e])
                   for i, (e, _) in enumerate(groups)]
        acc = self._gather(futures, device)
        began = self.clock.start()
        out[pairs_t] = dequantize(acc, h_scale, layer.down_scale[experts_t])
        self.clock.stop(self.counters, "device_seconds", began)


class OffloadedExperts:
    """A block's `experts` callable backed by the shared `ExpertOffload`."""

    def __init__(self, offload: ExpertOffload, layer_index: int) -> None:
        self.offload = offload
        self.layer_index = layer_index

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        return self.offload.run(self.layer_index, x, ids, gates)


def install_offload(model: torch.nn.Module, budget_bytes: int, profile: str | Path | Mapping[Any, Any] | None = None,
                    layers: Mapping[int, QuantizedLayer] | None = None, **options: Any) -> ExpertOffload:
    """Swap every MoE block's experts for offloaded ones with `budget_bytes` of device slots.

    `layers` are already quantized experts by layer index (default: quantize each block's
    `weights` now, on the model's device); `options` go to `ExpertOffload` (adapt_every, decay,
    margin, max_swaps, copy_share, stream_slots, host_threads, grouped_kernel). Returns the
    controller, also kept as `model.expert_offload`.
    """
    from agentfold.engine.torch.models.qwen3_moe import moe_blocks

    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError("the model has no MoE blocks to offload")
    device = blocks[0].gate.weight.device
    if layers is None:
        empty = [b.layer_index for b in blocks if b.weights.gate_proj.numel() == 0]
        if empty:
            raise ValueError(f"MoE layers {empty} have no float expert weights: pass their quantized `layers`")
        layers = {b.layer_index: quantize_layer(b.weights.gate_proj, b.weights.up_proj, b.weights.down_proj, device)
                  for b in blocks}
    missing = [b.layer_index for b in blocks if b.layer_index not in layers]
    if missing:
        raise ValueError(f"no quantized experts for MoE layers {missing}")
    previous = getattr(model, "expert_offload", None)
    if previous is not None:
        previous.close()  # free its pool before the new one is allocated
    try:
        offload = ExpertOffload({b.layer_index: layers[b.layer_index] for b in blocks}, budget_bytes, device,
                                profile, **options)
    except Exception:
        if previous is not None:  # its pool is gone: leave the reference experts, not a closed controller
            remove_offload(model)
        raise
    for block in blocks:
        block.experts = OffloadedExperts(offload, block.layer_index)
    model.expert_offload = offload
    return offload


def remove_offload(model: torch.nn.Module) -> None:
    """Put the reference experts back (over each block's float weights) and free the device pool."""
    from agentfold.engine.torch.models.qwen3_moe import ReferenceExperts, moe_blocks

    offload = getattr(model, "expert_offload", None)
    for block in moe_blocks(model):
        block.experts = ReferenceExperts(block.weights)
    if offload is not None:
        offload.close()
        del model.expert_offload
