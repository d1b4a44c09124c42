"""Which experts hold a device slot: seeded from a routing profile, adapted from decayed usage.

The device has `slots` expert-sized slots (the byte budget over one expert's int8 bytes), shared
by every MoE layer: a layer whose routing is concentrated can hold more of its experts than one
whose routing is flat. The first residents are the (layer, expert) pairs a routing profile saw
most often (each layer's counts as shares of its routed rows, so layers compare fairly); without
a profile, experts are spread evenly over layers. After that, every `adapt_every` passes the
usage (routed rows per pass, decayed by `decay` each pass) decides swaps, with hysteresis: a
candidate replaces the weakest resident only if its usage beats it by the factor (1 + margin),
so two experts of similar use do not trade places back and forth.

Only the decisions live here; `engine.offload` moves the bytes. Placement never changes results:
every tier computes an expert to the same bits.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

PROFILE_SCHEMA = "agentfold.expert_profile/1"


@dataclass(frozen=True)
class Swap:
    """Slot `slot` stops holding `evicted` (layer, expert) and starts holding `loaded`."""

    slot: int
    evicted: tuple[int, int] | None
    loaded: tuple[int, int]


def load_profile(source: str | Path | Mapping[str, Any]) -> dict[int, np.ndarray]:
    """Routing counts per layer index from a profile file (or its parsed JSON)."""
    if isinstance(source, Mapping):
        data = source
    else:
        try:
            data = json.loads(Path(source).read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{source}: not a JSON routing profile ({error})") from error
    if data.get("schema") != PROFILE_SCHEMA or not isinstance(data.get("layers"), Mapping):
        raise ValueError(f"not a routing profile: schema must be {PROFILE_SCHEMA!r} with a 'layers' object")
    out: dict[int, np.ndarray] = {}
    for key, counts in data["layers"].items():
        values = np.asarray(counts, dtype=np.float64)
        if values.ndim != 1 or (values < 0).any():
            raise ValueError(f"routing profile layer {key}: counts must be a list of non-negative numbers")
        out[int(key)] = values
    return out


def save_profile(path: str | Path, counts: Mapping[int, Sequence[int]], **meta: Any) -> dict[str, Any]:
    """Write per-layer routing counts (and `meta`: model, tokens, top_k...) as a profile JSON."""
    data = {"schema": PROFILE_SCHEMA, **meta,
            "layers": {str(layer): [int(c) for c in values] for layer, values in sorted(counts.items())}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


class ExpertPlacement:
    """Device slots over (layer, expert) pairs, and the swaps that keep the most used ones resident."""

    def __init__(self, layers: Sequence[int], num_experts: int, slots: int,
                 profile: Mapping[int, Sequence[float]] | None = None, adapt_every: int = 32,
                 decay: float = 0.9, margin: float = 0.25, max_swaps: int = 16) -> None:
        if num_experts < 1 or not layers:
            raise ValueError("an expert placement needs at least one layer and one expert")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], not {decay}")
        if margin < 0 or adapt_every < 0 or max_swaps < 0 or slots < 0:
            raise ValueError("margin, adapt_every, max_swaps and slots must be >= 0")
        self.layers = list(layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.num_experts = num_experts
        self.slots = min(slots, len(self.layers) * num_experts)
        self.adapt_every, self.decay, self.margin, self.max_swaps = adapt_every, decay, margin, max_swaps
        self.slot_of = np.full((len(self.layers), num_experts), -1, dtype=np.int64)
        self.occupant: list[tuple[int, int] | None] = [None] * self.slots
        self.usage = np.zeros((len(self.layers), num_experts))
        self.window = np.zeros_like(self.usage)
        self.passes = 0
        self._seed(self.seed_scores(profile))

    def seed_scores(self, profile: Mapping[int, Sequence[float]] | None) -> np.ndarray:
        """Each layer's share of routed rows per expert (uniform where the profile has no data)."""
        scores = np.full(self.usage.shape, 1.0 / self.num_experts)
        for layer, counts in (profile or {}).items():
            if layer not in self.row:
                continue
            values = np.asarray(counts, dtype=np.float64)
            if values.shape != (self.num_experts,):
                raise ValueError(f"routing profile layer {layer} has {values.size} experts, the model "
                                 f"{self.num_experts}")
            if values.sum() > 0:
                scores[self.row[layer]] = values / values.sum()
        return scores

    def _seed(self, scores: np.ndarray) -> None:
        layer_rows, experts = np.meshgrid(np.arange(len(self.layers)), np.arange(self.num_experts), indexing="ij")
        # highest share first; ties by expert then layer, so a flat profile spreads over layers
        order = np.lexsort((layer_rows.ravel(), experts.ravel(), -scores.ravel()))
        for slot, flat in enumerate(order[: self.slots]):
            row, expert = divmod(int(flat), self.num_experts)
            self.slot_of[row, expert] = slot
            self.occupant[slot] = (self.layers[row], expert)

    def slot(self, layer: int, expert: int) -> int:
        """The device slot holding (layer, expert), or -1."""
        return int(self.slot_of[self.row[layer], expert])

    def observe(self, layer: int, experts: np.ndarray, rows: np.ndarray) -> None:
        """Count the rows routed to `experts` of `layer` in the current pass."""
        self.window[self.row[layer], experts] += rows

    def end_pass(self) -> list[Swap]:
        """Fold the pass into the decayed usage; every `adapt_every` passes, return the swaps to make."""
        self.usage *= self.decay
        self.usage += self.window
        self.window[:] = 0.0
        self.passes += 1
        if self.adapt_every and self.passes % self.adapt_every == 0:
            return self.plan()
        return []

    def plan(self) -> list[Swap]:
        """Swap the most used non-residents in for the least used residents, past the margin."""
        if self.slots == 0 or self.slots == self.slot_of.size:
            return []
        usage = self.usage.ravel()
        resident = self.slot_of.ravel() >= 0
        candidates = np.flatnonzero(~resident)
        candidates = candidates[np.argsort(-usage[candidates], kind="stable")]
        residents = np.flatnonzero(resident)
        residents = residents[np.argsort(usage[residents], kind="stable")]
        swaps = []
        for incoming, outgoing in zip(candidates[: self.max_swaps], residents[: self.max_swaps], strict=False):
            if usage[incoming] <= usage[outgoing] * (1.0 + self.margin) or usage[incoming] <= 0.0:
                break
            out_row, out_expert = divmod(int(outgoing), self.num_experts)
            in_row, in_expert = divmod(int(incoming), self.num_experts)
            slot = int(self.slot_of[out_row, out_expert])
            self.slot_of[out_row, out_expert] = -1
            self.slot_of[in_row, in_expert] = slot
            evicted = (self.layers[out_row], out_expert)
            self.occupant[slot] = (self.layers[in_row], in_expert)
            swaps.append(Swap(slot, evicted, (self.layers[in_row], in_expert)))
        return swaps

    @property
    def resident_per_layer(self) -> dict[int, int]:
        return {layer: int((self.slot_of[i] >= 0).sum()) for i, layer in enumerate(self.layers)}
