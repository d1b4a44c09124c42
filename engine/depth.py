"""How many drafts to verify next: expected tokens per second, from measured costs.

A pass of w rows costs t(w) (measured, moving average per width) and, with a conditional
acceptance a per draft position, commits 1 + a + a^2 + ... + a^k tokens for k drafts. The depth
that maximizes tokens per second is chosen; 0 (a plain serial step) whenever drafting does not
pay. While not drafting, the acceptance estimate drifts back toward its prior, so a drafter that
starts to match again gets another chance: the back-off is never permanent.

The costs are the engine's (one model, one machine), by the whole pass's rows; the acceptance is
each reply's own (`DraftOdds`): replies running side by side differ (an agent re-emitting a file
accepts nearly every draft, a sampled story few), and one shared estimate drafted too little for
the first and too much for the second. A pass shared with other replies (lanes) costs what their
rows and caches add (`DraftOdds.shared`) plus what the reply's own rows cost in a pass of its
own: the cost table holds only passes of one reply, so the lanes' overhead never reads as a
steep price per row, and a reply in wide shared passes drafts deeper than alone.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DraftOdds:
    """One reply's conditional acceptance estimate and its passes since drafts last ran."""

    acceptance: float
    undrafted: int = 0
    shared: float = 0.0  # what other replies' lanes added to its recent passes, in one-row passes (moving average)


class DepthController:
    def __init__(self, max_depth: int, prior: float = 0.6, decay: float = 0.85, recover: float = 0.02,
                 probe_every: int = 16) -> None:
        self.max_depth = max_depth
        self.prior = prior
        self.decay = decay
        self.recover = recover
        self.probe_every = probe_every
        self.serial_seconds: float | None = None  # a one-row pass, tracked all the time
        self.ratios: dict[int, float] = {}  # t(w) / t(1): stable under load, unlike seconds
        self.draft_seconds = 0.0  # drafter time per proposed token
        self.odds = DraftOdds(prior)  # the estimate of callers that keep none of their own

    def start(self, prior: float | None = None) -> DraftOdds:
        """A new reply's acceptance estimate, at the controller's prior or the one given (a client's
        prediction of the reply is usually right)."""
        return DraftOdds(self.prior if prior is None else prior)

    def observe_pass(self, rows: int, seconds: float, odds: DraftOdds | None = None, own: int | None = None) -> None:
        """A pass of `rows` rows took `seconds`; `own` of them were the reply's with `odds` (the
        rest other replies' lanes in the same pass)."""
        odds = odds or self.odds
        own = rows if own is None else own
        odds.undrafted = odds.undrafted + 1 if own == 1 else 0
        if own < rows:  # a shared pass: what the others added, beyond the reply's own rows alone
            extra = seconds / self.serial_seconds - self.ratio(own) if self.serial_seconds else 0.0
            odds.shared = 0.5 * odds.shared + 0.5 * max(0.0, extra)
            return
        odds.shared *= 0.5
        if rows == 1:
            old = self.serial_seconds
            self.serial_seconds = seconds if old is None else 0.8 * old + 0.2 * seconds
            return
        if self.serial_seconds:
            ratio = seconds / self.serial_seconds
            old = self.ratios.get(rows)
            self.ratios[rows] = ratio if old is None else 0.7 * old + 0.3 * ratio

    def seed_costs(self, pass_seconds: dict[int, float]) -> None:
        """Relative pass costs measured at load (the self-check's timings)."""
        one = pass_seconds.get(1)
        if not one:
            return
        self.serial_seconds = one
        self.ratios.update({w: t / one for w, t in pass_seconds.items() if w > 1})

    def observe_drafts(self, proposed: int, accepted: int, draft_seconds: float, odds: DraftOdds | None = None) -> None:
        """Update acceptance from one verify pass: `accepted` of the first `proposed` matched."""
        odds = odds or self.odds
        if proposed <= 0:
            odds.acceptance += (self.prior - odds.acceptance) * self.recover
            return
        # conditional acceptance: each accepted draft is a success, the first miss a failure
        trials = accepted + (1 if accepted < proposed else 0)
        rate = accepted / trials if trials else odds.acceptance
        weight = self.decay**trials
        odds.acceptance = weight * odds.acceptance + (1 - weight) * rate
        per_token = draft_seconds / proposed
        self.draft_seconds = 0.8 * self.draft_seconds + 0.2 * per_token if self.draft_seconds else per_token

    def ratio(self, rows: int) -> float:
        """Estimated cost of a `rows`-row pass relative to one row (linear between measured widths)."""
        known = {1: 1.0, **self.ratios}
        if rows in known:
            return known[rows]
        widths = sorted(known)
        lower = max(w for w in widths if w < rows)
        upper = [w for w in widths if w > rows]
        if upper:
            b = upper[0]
            return known[lower] + (known[b] - known[lower]) * (rows - lower) / (b - lower)
        if len(widths) == 1:
            return float(rows)  # nothing measured: assume the worst (linear cost)
        first = widths[0]
        slope = (known[lower] - known[first]) / (lower - first)
        return known[lower] + slope * (rows - lower)

    def depth(self, limit: int | None = None, odds: DraftOdds | None = None) -> int:
        """Drafts to verify in the next pass (0: a serial step pays best), for the reply with `odds`:
        the depth that commits the most tokens per second of a pass that also carries what other
        replies have been adding to its passes (lanes: a row more in a shared pass costs little).

        Every `probe_every` undrafted passes a short probe is allowed, so that noisy timings or a
        bad stretch never switch drafting off for good.
        """
        odds = odds or self.odds
        cap = self.max_depth if limit is None else min(self.max_depth, limit)
        if cap <= 0:
            return 0
        draft_ratio = self.draft_seconds / self.serial_seconds if self.serial_seconds else 0.0
        best_k, best_rate = 0, 1.0 / (odds.shared + 1.0)
        expected = 1.0
        for k in range(1, cap + 1):
            expected += odds.acceptance**k
            rate = expected / (odds.shared + self.ratio(k + 1) + k * draft_ratio)
            if rate > best_rate * 1.02:  # a margin: noise alone should not start drafting
                best_k, best_rate = k, rate
        if best_k == 0 and odds.undrafted >= self.probe_every:
            return min(cap, 2)
        return best_k
