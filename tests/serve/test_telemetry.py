"""Telemetry rows, the SQLite store and /metrics, from real completions of a random tiny model.

The completions come from the real decode loop (a one-layer random qwen3, self-checked, with a
perturbed copy of itself as the draft model), so drafts, accepts, rejects, emit times and pass
times are the engine's own, not made-up numbers.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import fields

# isort: split
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentfold.engine.decode import Completion, Engine, GenerationConfig
from agentfold.engine.drafters import DraftModelDrafter
from agentfold.engine.mlx.backend import MLXBackend
from agentfold.engine.sampler import SamplingParams
from agentfold.engine.selfcheck import check_row_exactness
from agentfold.serve.metrics import Metrics
from agentfold.serve.telemetry import TelemetryStore, TurnRecord, timings
from tests.helpers.drafting import PinnedDepth
from tests.helpers.tiny_models import build_model, loaded_model, make_tokenizer, perturbed_copy, tiny_config

PROMPT_TEXT = "def add(a, b):\n    return a + b\n" * 3 + "def add(a, b):\n    return"

# DESIGN contract 3, field by field
CONTRACT_FIELDS = """
turn_id session_id api client model started_at finish_reason status
prompt_tokens cached_tokens prefilled_tokens completion_tokens tool_calls
queue_ms cache_restore_ms prefill_ms ttft_ms decode_ms total_ms prefill_tps decode_tps
itl_p50 itl_p90 itl_p99 itl_max pass_p50 pass_p99
draft_method verify_passes drafted accepted discarded tokens_per_pass acceptance_rate accepted_per_position
proposed_per_position snapshot_id cache_match_tokens cache_miss_reason
audit mismatch_position token_sha audit_token_sha
""".split()


@pytest.fixture(scope="module")
def completions() -> dict[str, Completion]:
    tokenizer = make_tokenizer()
    config = tiny_config("qwen3", len(tokenizer), layers=1)
    model = build_model(config, seed=100, logit_scale=4.0)
    draft = perturbed_copy(model, config, seed=7, noise=0.05)  # before the backend makes `model` int8
    backend = MLXBackend(loaded_model(model, tokenizer, config, "tiny"))
    report = check_row_exactness(backend, max_width=4, prompt_length=16)
    assert report.drafting, report.describe()
    drafter = DraftModelDrafter(MLXBackend(loaded_model(draft, tokenizer, config, "tiny-draft")))
    engine = Engine(backend, tokenizer, set(), drafter=drafter, exactness=report)
    engine.controller = PinnedDepth(max_depth=engine.controller.max_depth)

    prompt = tokenizer.encode(PROMPT_TEXT)
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.7, seed=1)
    out = {
        "serial": engine.generate(prompt, GenerationConfig(greedy, max_tokens=20, draft=False)),
        "drafted": engine.generate(prompt, GenerationConfig(greedy, max_tokens=20)),
        "sampled": engine.generate(prompt, GenerationConfig(sampled, max_tokens=20)),
    }
    cache = backend.new_cache()
    backend.prefill(prompt[:-6], cache)  # a stored prefix: this turn reuses 6 fewer than the prompt
    out["resumed"] = engine.generate(prompt, GenerationConfig(greedy, max_tokens=20), cache=cache)
    assert out["drafted"].tokens == out["serial"].tokens
    return out


@pytest.fixture(scope="module")
def records(completions) -> list[TurnRecord]:
    """Four turns in two sessions, oldest first, started a second apart."""
    base = time.time() - 60
    plan = [("serial", "s1", {}), ("drafted", "s1", {"queue_seconds": 0.002}),
            ("sampled", "s2", {"tool_calls": 1}),
            ("resumed", "s2", {"queue_seconds": 0.001, "cache_restore_seconds": 0.003, "snapshot_id": "snap-1"})]
    return [TurnRecord.from_completion(completions[name], session_id=session, api="chat", client="pytest",
                                       model="tiny-qwen3", turn_id=f"turn-{i}", started_at=base + i, **extra)
            for i, (name, session, extra) in enumerate(plan)]


@pytest.fixture
def store(tmp_path):
    with TelemetryStore(tmp_path / "telemetry.db") as s:
        yield s


def test_record_has_every_contract_field(records, completions):
    names = [f.name for f in fields(TurnRecord)]
    assert set(CONTRACT_FIELDS) <= set(names)
    drafted = records[1]
    stats = completions["drafted"].stats
    assert drafted.draft_method == "draft-model" and drafted.accepted > 0
    assert records[2].discarded > 0  # the sampled reply has rejected drafts too
    assert drafted.discarded == drafted.drafted - drafted.accepted
    assert sum(drafted.accepted_per_position) == drafted.accepted
    assert sum(drafted.proposed_per_position) == drafted.drafted
    assert drafted.tokens_per_pass == drafted.completion_tokens / drafted.verify_passes > 1
    assert drafted.ttft_ms == pytest.approx(2.0 + stats.ttft_seconds * 1e3)
    assert drafted.total_ms == pytest.approx(2.0 + stats.total_seconds * 1e3)
    assert drafted.token_sha == records[0].token_sha == completions["serial"].token_sha
    assert records[0].draft_method == "none" and records[0].drafted == 0
    assert records[0].verify_passes == records[0].completion_tokens
    resumed = records[3]
    assert resumed.cached_tokens == resumed.cache_match_tokens == resumed.prompt_tokens - 6
    assert resumed.cache_restore_ms == pytest.approx(3.0) and resumed.snapshot_id == "snap-1"
    assert all(r.audit == "skipped" and r.mismatch_position is None for r in records)


def test_itl_comes_from_real_emit_times(records, completions):
    for record, name in zip(records, ["serial", "drafted", "sampled", "resumed"], strict=True):
        stats = completions[name].stats
        gaps = np.diff(np.array(stats.emit_times) * 1e3)
        assert len(record.emit_ms) == record.completion_tokens
        assert [record.itl_p50, record.itl_p90, record.itl_p99] == pytest.approx(np.percentile(gaps, [50, 90, 99]))
        assert record.itl_max == pytest.approx(gaps.max())
        passes = np.array(stats.pass_seconds) * 1e3
        assert [record.pass_p50, record.pass_p99] == pytest.approx(np.percentile(passes, [50, 99]))
    # tokens committed in one pass share an emit time: a drafted reply has zero gaps, a serial one none
    assert min(np.diff(records[1].emit_ms)) == 0.0
    assert min(np.diff(records[0].emit_ms)) > 0.0


def test_timings(records):
    record = records[3]
    t = timings(record)
    assert t["cache_n"] == record.cached_tokens and t["prompt_n"] == record.prefilled_tokens == 6
    assert t["prompt_ms"] == record.prefill_ms and t["prompt_per_second"] == record.prefill_tps > 0
    assert t["prompt_per_token_ms"] == pytest.approx(record.prefill_ms / record.prefilled_tokens)
    assert t["predicted_n"] == record.completion_tokens and t["predicted_ms"] == record.decode_ms
    assert t["predicted_per_second"] == record.decode_tps > 0
    assert t["predicted_per_token_ms"] == pytest.approx(1e3 / record.decode_tps)
    assert (t["draft_n"], t["draft_n_accepted"]) == (record.drafted, record.accepted)
    assert timings(records[0])["draft_n"] == 0


def test_roundtrip(store, records):
    for record in records:
        store.record(record)
    store.flush()
    for record in records:
        row = store.get_turn(record.turn_id)
        assert row == record.to_dict()
        assert TurnRecord.from_dict(row) == record
        assert isinstance(row["accepted_per_position"], list) and isinstance(row["emit_ms"], list)
    assert store.get_turn("no-such-turn") is None
    store.record(TurnRecord.from_dict({**records[0].to_dict(), "status": "error"}))  # same id: replaced
    store.flush()
    assert store.get_turn(records[0].turn_id)["status"] == "error"


def test_list_turns(store, records):
    for record in records:
        store.record(record)
    store.flush()
    newest_first = [r.turn_id for r in reversed(records)]
    assert [r["turn_id"] for r in store.list_turns()] == newest_first
    assert [r["turn_id"] for r in store.list_turns(session_id="s1")] == ["turn-1", "turn-0"]
    assert [r["turn_id"] for r in store.list_turns(since=records[2].started_at)] == ["turn-3", "turn-2"]
    assert [r["turn_id"] for r in store.list_turns(session_id="s2", since=records[3].started_at)] == ["turn-3"]
    assert [r["turn_id"] for r in store.list_turns(limit=2)] == newest_first[:2]
    assert store.list_turns(session_id="nobody") == []


def test_set_audit(store, records):
    store.record(records[1])  # not flushed: the audit is queued behind the row and applied after it
    assert store.set_audit("turn-1", "passed", audit_token_sha=records[1].token_sha)
    row = store.get_turn("turn-1")
    assert (row["audit"], row["mismatch_position"], row["audit_token_sha"]) == ("passed", None, records[1].token_sha)
    assert store.set_audit("turn-1", "failed", 7, "f" * 64)
    row = store.get_turn("turn-1")
    assert (row["audit"], row["mismatch_position"], row["audit_token_sha"]) == ("failed", 7, "f" * 64)
    assert not store.set_audit("no-such-turn", "passed")
    with pytest.raises(ValueError):
        store.set_audit("turn-1", "maybe")


def test_latency_summary(store, records):
    now = time.time()
    old = TurnRecord.from_dict({**records[0].to_dict(), "turn_id": "old", "started_at": now - 7200})
    failed = TurnRecord.from_dict({**records[2].to_dict(), "turn_id": "failed", "status": "error",
                                   "started_at": now - 10})
    for record in [old, *records, failed]:
        store.record(record)
    store.flush()
    store.set_audit("turn-0", "passed")
    store.set_audit("turn-1", "failed", 3)

    def expected(rows: list[dict]) -> dict:
        ok = [r for r in rows if r["status"] == "ok"]
        ttft = [r["ttft_ms"] for r in ok]
        gaps = np.concatenate([np.diff(r["emit_ms"]) for r in ok])
        total = {k: sum(r[k] for r in ok) for k in
                 ("completion_tokens", "verify_passes", "accepted", "drafted", "cached_tokens", "prompt_tokens")}
        return {
            "turns": len(rows), "errors": len(rows) - len(ok),
            **{f"ttft_p{q}": pytest.approx(np.percentile(ttft, q)) for q in (50, 90, 99)},
            **{f"itl_p{q}": pytest.approx(np.percentile(gaps, q)) for q in (50, 90, 99)},
            "decode_tps": pytest.approx(np.mean([r["decode_tps"] for r in ok if r["decode_tps"] > 0])),
            "tokens_per_pass": pytest.approx(total["completion_tokens"] / total["verify_passes"]),
            "acceptance_rate": pytest.approx(total["accepted"] / total["drafted"]),
            "cache_hit_share": pytest.approx(total["cached_tokens"] / total["prompt_tokens"]),
            "audits_passed": sum(r["audit"] == "passed" for r in rows),
            "audits_failed": sum(r["audit"] == "failed" for r in rows),
        }

    rows = store.list_turns()
    assert len(rows) == 6
    everything = store.latency_summary()
    assert everything == {**expected(rows), "window_seconds": None, "last_n": None}
    assert (everything["errors"], everything["audits_passed"], everything["audits_failed"]) == (1, 1, 1)
    hour = store.latency_summary(window_seconds=3600)
    assert hour == {**expected([r for r in rows if r["turn_id"] != "old"]), "window_seconds": 3600, "last_n": None}
    assert hour["turns"] == 5
    last = store.latency_summary(last_n=3)
    assert last == {**expected(rows[:3]), "window_seconds": None, "last_n": 3}
    empty = store.latency_summary(window_seconds=0.001)
    assert empty["turns"] == 0 and empty["ttft_p50"] is None and empty["acceptance_rate"] is None


def test_record_never_waits_for_sqlite(store, records):
    """With the database locked by another writer, record() still returns at once; rows land after."""
    many = [TurnRecord.from_dict({**records[1].to_dict(), "turn_id": f"bulk-{i}"}) for i in range(2000)]
    blocker = sqlite3.connect(store.path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        began = time.perf_counter()
        for record in many:
            store.record(record)
        assert time.perf_counter() - began < 1.0
        assert store.list_turns(limit=1) == []  # nothing could be written yet
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    store.flush(timeout=30)
    assert len(store.list_turns(limit=5000)) == 2000


def test_flush_reports_failed_writes(store, records):
    bad = TurnRecord.from_dict({**records[0].to_dict(), "turn_id": "bad", "prompt_tokens": None})
    blocker = sqlite3.connect(store.path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # hold the writer, so the bad row is batched with good ones
    for record in (records[0], bad, records[1]):
        store.record(record)
    blocker.execute("ROLLBACK")
    blocker.close()
    with pytest.raises(RuntimeError, match="telemetry write failed"):
        store.flush()
    assert store.get_turn("bad") is None  # the good rows of the batch were kept
    assert store.get_turn("turn-0") == records[0].to_dict() and store.get_turn("turn-1") is not None
    store.record(records[2])  # and the writer keeps going
    store.flush()
    assert store.get_turn("turn-2") is not None


def test_persistence(tmp_path, records):
    path = tmp_path / "telemetry.db"
    first = TelemetryStore(path)
    for record in records:
        first.record(record)
    first.flush()
    with TelemetryStore(path) as second:  # opened while the first is live (WAL: readers alongside)
        assert [r["turn_id"] for r in second.list_turns()] == ["turn-3", "turn-2", "turn-1", "turn-0"]
    first.close()
    first.close()  # idempotent
    with pytest.raises(RuntimeError):
        first.record(records[0])
    with TelemetryStore(path) as third:
        assert third.get_turn("turn-2") == records[2].to_dict()
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    """Every sample of the rendered exposition, keyed by (name, sorted labels)."""
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics(records):
    metrics = Metrics()
    for record in records:
        metrics.observe(record)
    metrics.observe(TurnRecord.from_dict({**records[0].to_dict(), "status": "error"}))
    metrics.observe_audit("passed")
    metrics.observe_audit("passed")
    with pytest.raises(ValueError):
        metrics.observe_audit("skipped")
    got = samples(metrics)
    assert "text/plain" in metrics.content_type

    def value(name: str, **labels: str) -> float:
        return got[(f"agentfold:{name}", tuple(sorted(labels.items())))]

    assert value("prompt_tokens_total") == sum(r.prompt_tokens for r in records)
    assert value("generation_tokens_total") == sum(r.completion_tokens for r in records)
    assert value("request_success_total", finish_reason="length") == len(records)
    assert value("request_success_total", finish_reason="stop") == 0
    assert value("request_failure_total", status="error") == 1
    assert value("spec_decode_num_drafts_total") == sum(
        r.proposed_per_position[0] for r in records if r.proposed_per_position)
    assert value("spec_decode_num_draft_tokens_total") == sum(r.drafted for r in records) > 0
    assert value("spec_decode_num_accepted_tokens_total") == sum(r.accepted for r in records) > 0
    depth = max(len(r.accepted_per_position) for r in records)
    for position in range(depth):
        assert value("spec_decode_num_accepted_tokens_per_pos_total", position=str(position)) == sum(
            r.accepted_per_position[position] for r in records if position < len(r.accepted_per_position))
    assert value("prefix_cache_hits_total") == sum(r.cached_tokens for r in records) > 0
    assert value("prefix_cache_queries_total") == sum(r.prompt_tokens for r in records)
    assert value("audits_total", verdict="passed") == 2 and value("audits_total", verdict="failed") == 0
    assert value("time_to_first_token_seconds_count") == len(records)
    assert value("time_to_first_token_seconds_sum") == pytest.approx(sum(r.ttft_ms for r in records) / 1e3)
    assert value("e2e_request_latency_seconds_sum") == pytest.approx(sum(r.total_ms for r in records) / 1e3)
    gaps = np.concatenate([np.diff(r.emit_ms) for r in records]) / 1e3
    assert value("inter_token_latency_seconds_count") == len(gaps)
    assert value("inter_token_latency_seconds_sum") == pytest.approx(gaps.sum())
    assert value("inter_token_latency_seconds_bucket", le="0.0001") == np.sum(gaps <= 0.0001) > 0

    assert samples(Metrics())[("agentfold:prompt_tokens_total", ())] == 0  # its own registry, not shared
