"""Load-time row-exactness self-check (DESIGN contract 1).

On a probe, run one-row steps and remember their logits; then, from the same cache state, run
passes of w rows and compare every row bit for bit (and, for recurrent models, the step after
the pass, which checks the state the pass left). The widest w for which every width up to it
matches is the widest verify pass the engine may use; if even two rows differ, drafting is off.
The timings of these passes seed the depth controller's cost model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from agentfold.engine.protocol import Backend, CacheState, Checkpoint


@dataclass
class ExactnessReport:
    """What the self-check found; `max_width` 1 means drafting is off."""

    max_width: int
    checked: dict[int, bool] = field(default_factory=dict)
    max_abs_diff: dict[int, float] = field(default_factory=dict)
    pass_seconds: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0
    lanes: bool = False  # rows of different sequences in one pass (`forward_many`) were exact too

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
        return text + (", across replies too (lanes on)" if self.lanes else "")


def probe_tokens(vocab_size: int, count: int) -> list[int]:
    """A fixed, ordinary-looking token sequence (no special ids at the bottom of the vocabulary)."""
    rng = np.random.default_rng(1234)
    low = min(256, vocab_size // 4)
    return [int(t) for t in rng.integers(low, vocab_size, size=count)]


def check_row_exactness(backend: Backend, max_width: int = 16, prompt_length: int = 40) -> ExactnessReport:
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
        report.lanes = _lanes_exact(backend, cache, base, serial, rows, tokens, report.max_width)
    report.seconds = time.perf_counter() - started
    return report


def _lanes_exact(backend: Backend, cache: CacheState, base: Checkpoint, serial: list[np.ndarray],
                 rows: list[int], tokens: list[int], width: int) -> bool:
    """Whether a pass of `width` rows split between two sequences (a third of them on the probe's
    cache, the rest on a shorter one) gives every row the bits of its one-row step."""
    other = backend.new_cache()
    backend.prefill(tokens[3 : len(tokens) - width - 12], other)  # another length, other tokens
    mark = backend.checkpoint(other)
    first = max(1, width // 3)
    other_rows = rows[::-1][: width - first]
    alone = [backend.forward([token], other)[0].copy() for token in other_rows]
    backend.rollback(other, mark, 0)
    lanes = backend.forward_many([(rows[:first], cache), (other_rows, other)])
    backend.rollback(cache, base, 0)
    return (all(np.array_equal(lanes[0][j], serial[j]) for j in range(first))
            and all(np.array_equal(lanes[1][j], alone[j]) for j in range(len(other_rows))))
