"""16 concurrent streaming clients through the real server: no errors, exact replies, fair, flat memory.

The quick CI variant of `agentfold loadtest` (agentfold.bench.load.run_load, the same code): two
short rounds on the full serving stack (sessions on) with 4 tokens per reply. Every streamed reply,
decoded while up to three others interleave pass by pass, must equal its serial `draft: false`
reference; every client completes a reply in every round and gets at least half the tokens of the
luckiest; the server's RSS after round 2 is within 64 MiB of its RSS after round 1. The full run
is `agentfold loadtest --clients 16 --duration 120` (docs/operations.md).
"""

from __future__ import annotations

import asyncio

import pytest

from agentfold.bench.load import MIB, run_load
from tests.helpers.reliability_helpers import service_server

CLIENTS = 16


@pytest.mark.slow
def test_sixteen_streaming_clients(smollm2_engine, tmp_path):
    with service_server(smollm2_engine, tmp_path / "home", max_active=4) as (url, service):
        result = asyncio.run(run_load(url, clients=CLIENTS, duration=8, rounds=2, max_tokens=4, min_share=0.5,
                                      rss_tolerance=64 * MIB))
        counters = dict(service.runtime.counters)
    report = result.to_dict()
    assert result.errors == 0, report["first_errors"]
    assert result.mismatches == 0, report
    assert len(result.references) == 8 and all(result.references.values())
    for round_ in result.rounds:
        assert len(round_.clients) == CLIENTS
        assert all(c.replies >= 1 and c.tokens >= 1 for c in round_.clients), report["per_client"]
        assert round_.fairness >= 0.5, report["rounds"]
    assert result.memory_flat, report
    replies = sum(c.replies for r in result.rounds for c in r.clients)
    assert counters["completed"] >= replies + len(result.references) and counters["failed"] == 0
    assert result.passed
