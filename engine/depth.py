"""How many drafts to verify next: expected tokens per second, from measured costs.

A pass of w rows costs t(w) (measured, moving average per width) and, with a conditional
acceptance a per draft position, commits 1 + a + a^2 + ... + a^k tokens for k drafts. The depth
that maximizes tokens per second is chosen; 0 (a plain serial step) whenever drafting does not
pay. While not drafting, the acceptance estimate drifts back toward its prior, so a drafter that
starts to match again gets another chance: the back-off is never permanent.
"""

from __future__ import annotations


class DepthController:
    def __init__(self, max_depth: int, prior: float = 0.6, decay: float = 0.85, recover: float = 0.02) -> None:
        self.max_depth = max_depth
        self.prior = prior
        self.acceptance = prior
        self.decay = decay
        self.recover = recover
        self.pass_seconds: dict[int, float] = {}
        self.draft_seconds = 0.0  # drafter time per proposed token

    def observe_pass(self, rows: int, seconds: float) -> None:
        old = self.pass_seconds.get(rows)
        self.pass_seconds[rows] = seconds if old is None else 0.7 * old + 0.3 * seconds

    def observe_drafts(self, proposed: int, accepted: int, draft_seconds: float) -> None:
        """Update acceptance from one verify pass: `accepted` of the first `proposed` matched."""
        if proposed <= 0:
            self.acceptance += (self.prior - self.acceptance) * self.recover
            return
        # conditional acceptance: each accepted draft is a success, the first miss a failure
        trials = accepted + (1 if accepted < proposed else 0)
        rate = accepted / trials if trials else self.acceptance
        weight = self.decay**trials
        self.acceptance = weight * self.acceptance + (1 - weight) * rate
        per_token = draft_seconds / proposed
        self.draft_seconds = 0.8 * self.draft_seconds + 0.2 * per_token if self.draft_seconds else per_token

    def cost(self, rows: int) -> float:
        """Estimated seconds of a `rows`-row pass (linear between measured widths)."""
        known = self.pass_seconds
        if rows in known:
            return known[rows]
        if not known:
            return float(rows)  # nothing measured yet: assume the worst (linear cost)
        widths = sorted(known)
        lower = [w for w in widths if w < rows]
        upper = [w for w in widths if w > rows]
        if lower and upper:
            a, b = lower[-1], upper[0]
            return known[a] + (known[b] - known[a]) * (rows - a) / (b - a)
        if lower:
            a = lower[-1]
            slope = (known[a] - known[widths[0]]) / (a - widths[0]) if a > widths[0] else known[a]
            return known[a] + slope * (rows - a)
        return known[upper[0]]

    def depth(self, limit: int | None = None) -> int:
        """Drafts to verify in the next pass (0: a serial step pays best)."""
        cap = self.max_depth if limit is None else min(self.max_depth, limit)
        best_k, best_rate = 0, 1.0 / self.cost(1)
        expected = 1.0
        for k in range(1, cap + 1):
            expected += self.acceptance**k
            rate = expected / (self.cost(k + 1) + k * self.draft_seconds)
            if rate > best_rate * 1.02:  # a margin: noise alone should not start drafting
                best_k, best_rate = k, rate
        return best_k
