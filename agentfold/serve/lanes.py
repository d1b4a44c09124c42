"""Lanes: the verify passes of several replies run as one forward pass.

Decode is memory-bound: a pass over 16 rows costs little more than a pass over one (SmolLM2-135M
on two Xeon cores: 43 ms for 1 row, 72 ms for 16), so eight agents stepped one pass at a time
each get an eighth of the machine. Each scheduler round instead gathers every active reply's
pending token and drafts into one pass: the rows of all replies share the linear layers, and
each reply's rows attend only to its own cache (`Backend.forward_many`). Every row's arithmetic
is independent of the other rows (DESIGN contract 1, exact by construction), so every reply is
byte-identical to its solo run; the self-check verifies it at load (`ExactnessReport.lanes`),
and the shared pass never holds more rows than the width the self-check found row-exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentfold.engine.decode import PassRequest

PROMPT_ROWS = 32  # the most prompt rows one reply puts in a shared pass (the rest in the next ones)


def plan_lanes(requests: Sequence[PassRequest], width: int, prompt_rows: int = PROMPT_ROWS) -> list[list[int]]:
    """Indices of `requests` grouped into shared passes of at most `width` rows.

    Every reply gets its pending token's row (a prompt, its first row); then each prompt in
    prefill (`PassRequest.prefill`) gets up to `prompt_rows` rows, since its rows must run some time
    and a draft may not pay; the rows left are handed out one draft at a time around the group,
    so each reply keeps as many of its drafts as fit and none starves the others. Drafts that do
    not fit are cut (the reply verifies only the drafts that ran; the tokens it commits are the
    same), and so are prompt rows (the reply asks for the rest next). `width` < 2: no sharing,
    every pass alone with its drafts.
    """
    count = len(requests)
    if not count:
        return []
    if width < 2:
        return [[i] for i in range(count)]
    passes = -(-count // width)
    size, extra = divmod(count, passes)
    groups, first = [], 0
    for index in range(passes):
        last = first + size + (index < extra)
        groups.append(list(range(first, last)))
        first = last
    for group in groups:
        budget = width - len(group)
        granted = dict.fromkeys(group, 0)
        for i in group:
            if requests[i].prefill:
                granted[i] = min(budget, prompt_rows - 1, len(requests[i].tokens) - 1)
                budget -= granted[i]
        wanting = [i for i in group if not requests[i].prefill and len(requests[i].tokens) > 1]
        while budget > 0 and wanting:
            for i in list(wanting):
                if budget == 0:
                    break
                granted[i] += 1
                budget -= 1
                if granted[i] == len(requests[i].tokens) - 1:
                    wanting.remove(i)
        for i in group:
            del requests[i].tokens[1 + granted[i] :]
    return groups


@dataclass
class LaneStats:
    """Passes with verify rows since start: how many replies and rows each held (and prompt rows
    that rode along), and the time they took."""

    passes: int = 0
    lanes: int = 0  # replies' verify passes the passes held
    rows: int = 0  # verify rows
    prompt_rows: int = 0  # prompt rows of replies in prefill that shared these passes
    seconds: float = 0.0
    by_lanes: dict[int, int] = field(default_factory=dict)  # passes by the number of replies in them
    last_seconds: float = 0.0  # the latest pass (the prefill share of a round follows it)

    def record(self, lanes: int, rows: int, seconds: float, prompt_rows: int = 0) -> None:
        self.last_seconds = seconds
        self.passes += 1
        self.lanes += lanes
        self.rows += rows
        self.prompt_rows += prompt_rows
        self.seconds += seconds
        self.by_lanes[lanes] = self.by_lanes.get(lanes, 0) + 1

    def summary(self) -> dict[str, Any]:
        per_pass = 1 / self.passes if self.passes else 0.0
        return {"passes": self.passes, "replies_per_pass": round(self.lanes * per_pass, 3),
                "rows_per_pass": round(self.rows * per_pass, 3),
                "prompt_rows_per_pass": round(self.prompt_rows * per_pass, 3),
                "pass_ms": round(1000 * self.seconds * per_pass, 3), "by_replies": dict(sorted(self.by_lanes.items()))}
