"""Tests that must see drafts verified: a depth controller that always drafts as deep as allowed."""

from __future__ import annotations

from agentfold.engine.depth import DepthController


class PinnedDepth(DepthController):
    """Always verify as many drafts as the self-check allows (and the room left): on a model this
    small the cost model would often draft nothing, and an exactness test must see drafts run."""

    def depth(self, limit: int | None = None, odds=None) -> int:
        return self.max_depth if limit is None else max(0, min(self.max_depth, limit))
