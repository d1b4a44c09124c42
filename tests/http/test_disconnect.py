"""A client that leaves during a long prefill frees the worker within one scheduled step.

Codex's first turn went on prefilling for minutes after Codex exited (`/health` active 1): the
turn must be cancelled when the connection drops, and the prefill checks that between its
layer steps, not after the whole prompt.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.api_helpers import api_server, wait_idle  # noqa: F401  (fixture)


def _long_prompt(tokenizer, tokens: int) -> str:
    source = "".join(path.read_text() for path in sorted(Path(__file__).parents[1].glob("serve/*.py")))
    ids = tokenizer.encode(source)[:tokens]
    return tokenizer.decode(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_mid_prefill_cancels_its_turn(api_server, stream):  # noqa: F811
    runtime = api_server.runtime
    prompt = _long_prompt(runtime.tokenizer, 5000)  # ~10 s of prefill here: far longer than the client waits
    cancelled = runtime.counters["cancelled"]
    body = {"model": "m", "max_tokens": 8, "stream": stream, "messages": [{"role": "user", "content": prompt}]}
    with pytest.raises(httpx.ReadTimeout):
        with httpx.Client(timeout=httpx.Timeout(30.0, read=1.5)) as client:
            with client.stream("POST", api_server.v1 + "/messages", json=body) as response:
                for _ in response.iter_bytes():  # streaming: message_start comes at once, then the prefill
                    pass
    left = time.monotonic()
    assert wait_idle(runtime, timeout=30.0)
    assert time.monotonic() - left < 3.0, "the prefill went on after its client left"
    assert runtime.counters["cancelled"] == cancelled + 1
