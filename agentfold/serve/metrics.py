"""Prometheus `/metrics` (DESIGN contract 3): vLLM's metric names under an `agentfold:` prefix.

Mirroring vLLM's names (`vllm:time_to_first_token_seconds`, `vllm:spec_decode_num_accepted_tokens`,
...) lets existing Grafana dashboards and PromQL (`rate(accepted) / rate(draft_tokens)`) work by
swapping the prefix. Every figure comes from a `TurnRecord`, so `/metrics`, the SQLite row and
the response's `timings` agree. The metrics live on their own `CollectorRegistry`: two servers
(or tests) in one process never share or collide on counters.

Counters are declared without `_total`; prometheus_client appends it, so the exposed names are
`agentfold:prompt_tokens_total` etc. (colons are valid in metric names and survive exposition).
"""

from __future__ import annotations

from itertools import pairwise

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from agentfold.serve.telemetry import TurnRecord

PREFIX = "agentfold"

# vLLM's buckets, with finer ones below 10 ms for ITL: tokens of one verify pass arrive together
# (gap 0) and a tiny model's step is well under vLLM's smallest bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
AUDIT_VERDICTS = ("passed", "failed")


class Metrics:
    """The runtime's Prometheus metrics; feed it every finished turn with `observe`."""

    content_type = CONTENT_TYPE_PLAIN_0_0_4  # the text format generate_latest writes

    def __init__(self, prefix: str = PREFIX) -> None:
        self.registry = CollectorRegistry()

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"{prefix}:{name}", doc, buckets=buckets, registry=self.registry)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{prefix}:{name}", doc, labelnames=labels, registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Request arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Gap between consecutive emitted tokens (0 within one verify pass).", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request arrival to last token.", REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time waiting for the engine.", REQUEST_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Prefill of the uncached prompt.",
                                      REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to last token.", REQUEST_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished turns (cached included).")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.request_success = counter("request_success", "Turns finished, by finish reason.", ("finish_reason",))
        self.request_failure = counter("request_failure", "Turns that did not finish, by status.", ("status",))
        self.num_drafts = counter("spec_decode_num_drafts", "Verify passes that checked at least one draft.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position.", ("position",))
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens served from a cached prefix.")
        self.shared_head_hits = counter("prefix_cache_shared_head_hits",
                                        "Prompt tokens served from a prompt head another conversation left.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.audits = counter("audits", "Exactness audits, by verdict.", ("verdict",))
        for verdict in AUDIT_VERDICTS:  # export zeros, so `rate(...{verdict="failed"})` exists from the start
            self.audits.labels(verdict)
        for reason in ("stop", "length"):
            self.request_success.labels(reason)

    def observe(self, record: TurnRecord) -> None:
        """Count one finished turn; one whose status is not "ok" only counts as a failure.

        Audits are not counted here (they usually finish later): use `observe_audit`.
        """
        if record.status != "ok":
            self.request_failure.labels(record.status).inc()
            return
        self.request_success.labels(record.finish_reason).inc()
        self.ttft.observe(record.ttft_ms / 1e3)
        self.e2e.observe(record.total_ms / 1e3)
        self.queue_time.observe(record.queue_ms / 1e3)
        self.prefill_time.observe(record.prefill_ms / 1e3)
        self.decode_time.observe(record.decode_ms / 1e3)
        for before, after in pairwise(record.emit_ms):
            self.itl.observe((after - before) / 1e3)
        self.prompt_tokens.inc(record.prompt_tokens)
        self.generation_tokens.inc(record.completion_tokens)
        self.prefix_cache_hits.inc(record.cached_tokens)
        self.shared_head_hits.inc(record.head_tokens)
        self.prefix_cache_queries.inc(record.prompt_tokens)
        # every pass with drafts proposes one at position 0, so that count is the passes that drafted
        self.num_drafts.inc(record.proposed_per_position[0] if record.proposed_per_position else 0)
        self.num_draft_tokens.inc(record.drafted)
        self.num_accepted_tokens.inc(record.accepted)
        for position, count in enumerate(record.accepted_per_position):
            self.accepted_per_pos.labels(str(position)).inc(count)

    def observe_audit(self, verdict: str) -> None:
        """Count one audit outcome ("passed" or "failed")."""
        if verdict not in AUDIT_VERDICTS:
            raise ValueError(f"audit verdict must be one of {AUDIT_VERDICTS}, not {verdict!r}")
        self.audits.labels(verdict).inc()

    def render(self) -> bytes:
        """The registry in Prometheus text exposition format (serve with `content_type`)."""
        return generate_latest(self.registry)
