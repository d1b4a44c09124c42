"""Load-time row-exactness self-check (DESIGN contract 1).

On a probe, run one-row steps and remember their logits; then, from the same cache state, run
passes of w rows and compare every row bit for bit (and, for recurrent models, the step after
the pass, which checks the state the pass left). The widest w for which every width up to it
matches is the widest verify pass the engine may use; if even two rows differ, drafting is off.
The timings of these passes seed the depth controller's cost model.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agentfold.engine.protocol import Backend, CacheState, Checkpoint

LANE_WIDTH = 64  # the widest shared pass checked: the row-exact kernels' per-row limit (kernels.*.PER_ROW_LIMIT)
CHECK_VERSION = 1  # bump when what the check runs changes (remembered reports are keyed by it)


@dataclass
class ExactnessReport:
    """What the self-check found; `max_width` 1 means drafting is off."""

    max_width: int
    checked: dict[int, bool] = field(default_factory=dict)
    max_abs_diff: dict[int, float] = field(default_factory=dict)
    pass_seconds: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0
    lane_width: int = 0  # rows of a shared pass (`forward_many`) found exact across sequences; 0: lanes off
    prefill_lanes: bool = False  # prompt rows may run in any pieces, shared passes included (see below)

    @property
    def lanes(self) -> bool:
        """Whether rows of different sequences may share a pass (lanes)."""
        return self.lane_width > 1

    @property
    def drafting(self) -> bool:
        return self.max_width > 1

    def describe(self) -> str:
        if not self.checked:
            return "row-exactness not checked"
        failed = [w for w, ok in sorted(self.checked.items()) if not ok]
        if not self.drafting:
            return f"drafting off: a {failed[0]}-row pass is not row-exact on this backend"
        text = f"row-exact up to {self.max_width} rows"
        if failed:
            text += f" ({failed[0]} rows differ by {self.max_abs_diff[failed[0]]:.1e}: passes capped)"
        return (text + (f", {self.lane_width} rows across replies (lanes on)" if self.lanes else "")
                + (", prompts in shared passes" if self.prefill_lanes else ""))


def probe_tokens(vocab_size: int, count: int) -> list[int]:
    """A fixed, ordinary-looking token sequence (no special ids at the bottom of the vocabulary)."""
    rng = np.random.default_rng(1234)
    low = min(256, vocab_size // 4)
    return [int(t) for t in rng.integers(low, vocab_size, size=count)]


def check_row_exactness(backend: Backend, max_width: int = 16, prompt_length: int = 40,
                        lane_width: int = LANE_WIDTH) -> ExactnessReport:
    """The widest row-exact verify pass up to `max_width` rows and, where the backend shares passes,
    the widest shared pass (up to `lane_width` rows, lanes of at most `max_width` rows each)."""
    started = time.perf_counter()
    vocab = backend.vocab_size or 1000
    tokens = probe_tokens(vocab, prompt_length + max_width + 1)
    prompt, rows = tokens[:prompt_length], tokens[prompt_length:]
    cache = backend.new_cache()
    backend.prefill(prompt, cache)
    base = backend.checkpoint(cache)

    serial: list[np.ndarray] = []
    for token in rows:
        began = time.perf_counter()
        serial.append(backend.forward([token], cache)[0].copy())
        one_row = time.perf_counter() - began
    report = ExactnessReport(max_width=1, pass_seconds={1: one_row})
    backend.rollback(cache, base, 0)

    for width in range(2, max_width + 1):
        began = time.perf_counter()
        logits = backend.forward(rows[:width], cache)
        report.pass_seconds[width] = time.perf_counter() - began
        same = all(np.array_equal(logits[j], serial[j]) for j in range(width))
        diff = max(float(np.max(np.abs(logits[j] - serial[j]))) for j in range(width))
        if same and backend.has_recurrent_state:
            after = backend.forward([rows[width]], cache)[0]
            same = np.array_equal(after, serial[width])
            diff = max(diff, float(np.max(np.abs(after - serial[width]))))
        backend.rollback(cache, base, 0)
        report.checked[width] = same
        report.max_abs_diff[width] = diff
        if not same:
            break
        report.max_width = width
    if report.drafting and getattr(backend, "shares_passes", False):  # lanes that run one by one gain nothing
        for width in dict.fromkeys((max(lane_width, report.max_width), report.max_width)):
            if _lanes_exact(backend, cache, base, serial, rows, tokens, width, report.max_width):
                report.lane_width = width
                break
    if report.lanes and getattr(backend, "prefill_rows_exact", False):
        report.prefill_lanes = _prefill_lanes_exact(backend, cache, base, rows, tokens[:prompt_length])
    report.seconds = time.perf_counter() - started
    return report


def _prefill_lanes_exact(backend: Backend, cache: CacheState, base: Checkpoint, rows: list[int],
                         prompt: list[int]) -> bool:
    """Whether a prompt prefilled in pieces, one of them a lane (no logits) of a shared pass with
    the probe's verify rows, leaves the cache a one-chunk prefill leaves, bit for bit, and the
    shared pass's verify rows their bits: the backend's claim (`prefill_rows_exact`) that every
    kernel of a pass is row-exact at any width, prompt rows included, checked on this machine."""
    whole = backend.new_cache()
    backend.prefill(prompt, whole)
    alone = backend.forward(rows[:2], cache)
    backend.rollback(cache, base, 0)
    pieces = backend.new_cache()
    third = len(prompt) // 3
    backend.prefill(prompt[:third], pieces, [third // 2])
    shared = backend.forward_many([(rows[:2], cache), (prompt[third:], pieces)], logits=[True, False])
    backend.rollback(cache, base, 0)
    got, want = backend.cache_to_arrays(pieces)[0], backend.cache_to_arrays(whole)[0]
    return (np.array_equal(shared[0], alone) and shared[1].shape[0] == 0 and got.keys() == want.keys()
            and all(np.array_equal(got[name], want[name]) for name in want))


def _lanes_exact(backend: Backend, cache: CacheState, base: Checkpoint, serial: list[np.ndarray],
                 rows: list[int], tokens: list[int], width: int, lane_rows: int) -> bool:
    """Whether a pass of `width` rows split into lanes of at most `lane_rows` rows (the first on the
    probe's cache, each other on a shorter cache of its own, other tokens) gives every row the bits
    of that lane's pass alone: the probe's rows its one-row steps, the others their own pass of
    at most `lane_rows` rows, which the width check has just found equal to one-row steps (one
    pass per lane instead of a step per row: wide shared passes cost little to check)."""
    first = min(lane_rows, max(1, width // 3))
    lanes, expected, marks = [(rows[:first], cache)], [serial[:first]], []
    left, shift = width - first, 0
    span = len(tokens) - lane_rows - 1  # the probe's prompt and then some: enough to vary lengths
    while left > 0:
        count, shift = min(lane_rows, left), shift + 1
        other = backend.new_cache()
        backend.prefill(tokens[1 + shift % 4 : span - 2 * (shift % 5)], other)  # other tokens, another length
        mark = backend.checkpoint(other)
        other_rows = [rows[(j * (shift + 1) + shift) % len(rows)] for j in range(count)]
        expected.append(backend.forward(other_rows, other).copy())  # its own pass: row-exact up to lane_rows
        backend.rollback(other, mark, 0)
        lanes.append((other_rows, other))
        marks.append(mark)
        left -= count
    outputs = backend.forward_many(lanes)
    backend.rollback(cache, base, 0)
    for (_, other), mark in zip(lanes[1:], marks, strict=True):
        backend.rollback(other, mark, 0)
    return all(np.array_equal(got[j], want[j]) for got, want in zip(outputs, expected, strict=True)
               for j in range(len(want)))


def remembered_check(backend: Backend, max_width: int, store: Path | None) -> tuple[ExactnessReport, bool]:
    """`check_row_exactness`, or the report it gave before for the same weights, kernels and machine;
    and whether it was remembered.

    Only backends whose every kernel is row-exact by its arithmetic (`prefill_rows_exact`: integer
    linear layers, fixed per-row chains) are remembered: there the check is a guard against a
    build that breaks the construction, and the same weights through the same library on the same
    CPU and thread count give the same bits again. On a 1.5B model it is ~25 s of every start on
    2 cores. Where exactness is an accident of a vendor kernel (float BLAS), it runs every time.
    """
    key = _memo_key(backend, max_width) if store is not None and getattr(backend, "prefill_rows_exact", False) else None
    known = _read_memo(store).get(key) if key else None
    if known is not None:
        try:
            return _report_from_json(known), True
        except (TypeError, ValueError, KeyError):
            pass
    report = check_row_exactness(backend, max_width=max_width)
    if key:
        _write_memo(store, key, asdict(report))
    return report, False


def _memo_key(backend: Backend, max_width: int) -> str | None:
    loaded = getattr(backend, "loaded", None)
    describe = getattr(backend, "describe", None)
    if loaded is None or describe is None:
        return None
    from agentfold.engine.backend_choice import cpu_model
    from agentfold.kernels import native

    parts = {"weights": loaded.fingerprint, "kernels": describe(), "library": native.identity(), "cpu": cpu_model(),
             "cpus": os.cpu_count(),
             "max_width": max_width, "lane_width": LANE_WIDTH, "check": CHECK_VERSION}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _report_from_json(value: dict[str, Any]) -> ExactnessReport:
    ints = {name: {int(k): v for k, v in value[name].items()} for name in ("checked", "max_abs_diff", "pass_seconds")}
    return ExactnessReport(**{**value, **ints})


def _read_memo(store: Path | None) -> dict[str, Any]:
    try:
        value = json.loads(store.read_text()) if store is not None else {}
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _write_memo(store: Path, key: str, report: dict[str, Any]) -> None:
    known = _read_memo(store)
    known[key] = report
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=store.parent, suffix=".tmp", delete=False) as staging:
            staging.write(json.dumps(known, indent=1, sort_keys=True) + "\n")
        os.replace(staging.name, store)
    except OSError:
        pass  # the next start checks again
