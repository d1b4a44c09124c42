"""`bench agent`'s stall check: does a client that is decoding stall while another prefills a long prompt?

An agent rarely has the server to itself: a second session (another agent, a sub-agent, a new
chat) sends a long prompt while the first streams its reply. The scheduler steps active replies
round-robin, and a prefill step is one decoder layer of one 512-token chunk, so the decoding reply
should wait at most a layer's share of the other's chunk between its passes, not a whole chunk.
This measures it as a client feels it, on one real `agentfold serve` (`--max-active 2`):

1. Client B streams a greedy, drafted code edit (`bench.prompts`' code-edit workload) alone, a few
   times (after one priming run that stores its prompt's snapshot): its chunk gaps give B's solo
   inter-token latency, p50 and p99.
2. Client A sends a prompt of about 8K tokens (as many as the model's window allows; stdlib
   source behind a unique prefix, so nothing is cached). Once the server has admitted it, B
   streams the same request again. B's gaps that overlap A's prefill (A's send to A's first
   token) give its max and p99 gap there; the goal is max gap <= 3x B's solo p99.

B's concurrent reply must equal its solo reply (token sha and text), with drafting on.
"""

from __future__ import annotations

import hashlib
import math
import signal
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentfold.bench.harness import START_TIMEOUT_S, BenchError, ServerProcess
from agentfold.bench.prefill import stdlib_text
from agentfold.bench.server import WARMUP, client_for, dump_reply, stream_chat

STALL_GOAL = 3.0  # B's max gap beside A's prefill over B's solo p99 gap
A_TOKENS = (8192, 2048)  # (full, quick) A's prompt, capped at the window minus A_ROOM
A_ROOM = 512  # window left beyond A's prompt: SmolLM2's 8192 gives a 7680-token prompt
A_MAX_TOKENS = 8
B_MAX_TOKENS = (192, 64)  # (full, quick): short enough to finish inside A's prefill
SOLO_REPEATS = (5, 3)  # (full, quick) measured solo runs of B, after one priming run
B_DELAY_S = 0.5  # B starts this long after the server admitted A: A is surely prefilling
MIN_OVERLAP_GAPS = 5  # fewer gaps beside A's prefill would not measure anything
MAX_ACTIVE = 2
B_SESSION = "bench-stall-b"


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (a value that occurred; None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def long_messages(tokenizer: Any, tokens: int, seed: int) -> tuple[list[dict[str, Any]], int, str]:
    """A's chat: one user message of stdlib source behind a unique prefix, `tokens` long as the server counts.

    The prefix (a fresh nonce) makes sure no snapshot of an earlier run covers any of it.
    """
    from agentfold.chat.template import render_chat

    nonce = uuid.uuid4().hex[:12]
    head = f"Request {nonce}. These files are open in the editor:\n"
    tail = "\n\nSummarize in one sentence what the first file is for."

    def count(body: str) -> int:
        messages = [{"role": "user", "content": head + body + tail}]
        return len(tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False))

    ids = list(tokenizer.encode(stdlib_text(seed, f"stall:{nonce}", 6 * tokens), add_special_tokens=False))
    take = max(0, tokens - count(""))
    reached = 0
    for _ in range(3):  # re-tokenizing a cut shifts the count by a few tokens: correct twice
        reached = count(tokenizer.decode(ids[:take]))
        if reached == tokens:
            break
        take = max(0, min(len(ids), take + tokens - reached))
    body = tokenizer.decode(ids[:take])
    reached = count(body)
    if reached > tokens:  # still over after the corrections: trim until it fits
        while reached > tokens and take > 0:
            take -= reached - tokens
            body = tokenizer.decode(ids[:take])
            reached = count(body)
    return [{"role": "user", "content": head + body + tail}], reached, nonce


def arrivals(reply: dict[str, Any], sent: float) -> list[float]:
    """Absolute `perf_counter` times of a streamed reply's content chunks (`sent`: just before the call)."""
    if reply["ttft_s"] is None:
        return []
    times = [sent + reply["ttft_s"]]
    for gap in reply["chunk_gaps_ms"]:
        times.append(times[-1] + gap / 1e3)
    return times


def overlapping_gaps(times: Sequence[float], start: float, end: float) -> list[tuple[float, float]]:
    """(gap in ms, its end in s after `start`) for consecutive arrivals whose interval overlaps [start, end]."""
    return [((b - a) * 1e3, b - start) for a, b in zip(times, times[1:], strict=False) if b > start and a < end]


class StallRun:
    """The two clients of one stall measurement against one server."""

    def __init__(self, server: ServerProcess, b_messages: list[dict[str, Any]], b_max_tokens: int, seed: int,
                 say: Callable[[str], None]) -> None:
        self.server, self.b_messages, self.b_max_tokens, self.seed, self.say = server, b_messages, b_max_tokens, seed, say
        self.b_client, self.a_client = client_for(server), client_for(server)

    def send_b(self) -> dict[str, Any]:
        """One B request; the reply with its absolute arrival times and its agentfold block checked."""
        sent = time.perf_counter()
        reply = stream_chat(self.b_client, self.b_messages, self.b_max_tokens, draft=True, session_id=B_SESSION,
                            seed=self.seed)
        if not reply["agentfold"]:
            raise BenchError("stall: B's response carried no agentfold block")
        return {**reply, "sent": sent, "times": arrivals(reply, sent), "ended": sent + reply["total_s"]}

    def solo(self, repeats: int) -> list[dict[str, Any]]:
        """B alone: a priming run (stores B's prompt snapshot), then `repeats` measured runs."""
        stream_chat(self.b_client, WARMUP, 2, draft=True, session_id="bench-stall-warmup", seed=self.seed)
        self.say("stall: B priming run (solo)")
        self.send_b()
        runs = []
        for i in range(repeats):
            runs.append(self.send_b())
            gaps = runs[-1]["chunk_gaps_ms"]
            self.say(f"stall: B solo run {i + 1}/{repeats}: {runs[-1]['agentfold']['completion_tokens']} tokens in "
                     f"{runs[-1]['chunks']} chunks, p99 gap {percentile(gaps, 99) or 0:.1f} ms")
        return runs

    def _wait_admitted(self, done: threading.Event, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not done.is_set() and self.server.health().get("active", 0) < 1:
            if time.monotonic() > deadline:
                raise BenchError(f"stall: the server did not admit A within {timeout:.0f}s: {self.server.log_tail()}")
            time.sleep(0.02)

    def concurrent(self, a_messages: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
        """A's long prompt in a thread; B once A is admitted. Returns (A's reply, B's reply)."""
        got: dict[str, Any] = {}
        done = threading.Event()

        def send_a() -> None:
            got["sent"] = time.perf_counter()
            try:
                got["reply"] = stream_chat(self.a_client, a_messages, A_MAX_TOKENS, draft=True,
                                           session_id=f"bench-stall-a-{uuid.uuid4().hex[:8]}", seed=self.seed)
            except Exception as error:  # re-raised on the main thread
                got["error"] = error
            finally:
                done.set()

        thread = threading.Thread(target=send_a, name="bench-stall-a", daemon=True)
        thread.start()
        self._wait_admitted(done)
        admitted = time.perf_counter()
        time.sleep(B_DELAY_S)
        if done.is_set():
            raise BenchError(f"stall: A finished before B started: {got.get('error') or 'its prefill was too short'}")
        self.say("stall: A admitted; B streams beside A's prefill")
        b = self.send_b()
        thread.join()
        if "error" in got:
            raise BenchError(f"stall: A's request failed: {got['error']}") from got["error"]
        a = {**got["reply"], "sent": got["sent"], "admitted": admitted}
        if not a["agentfold"] or a["ttft_s"] is None:
            raise BenchError("stall: A's reply carried no agentfold block or no content")
        a["first"] = a["sent"] + a["ttft_s"]
        return a, b


def _solo_run(run: dict[str, Any]) -> dict[str, Any]:
    block, gaps = run["agentfold"], run["chunk_gaps_ms"]
    return {"completion_tokens": block["completion_tokens"], "chunks": run["chunks"], "drafted": block["drafted"],
            "accepted": block["accepted"], "cached_tokens": block["cached_tokens"], "total_s": run["total_s"],
            "p99_gap_ms": _ms(percentile(gaps, 99)), "max_gap_ms": _ms(max(gaps, default=None)),
            "token_sha": block["token_sha"]}


def _solo_section(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """B's solo runs, and the percentiles of all their gaps together (the reference the goal is against)."""
    gaps = [g for run in runs for g in run["chunk_gaps_ms"]]
    return {"runs": [_solo_run(r) for r in runs], "gaps": len(gaps), "itl_p50_ms": _ms(percentile(gaps, 50)),
            "itl_p99_ms": _ms(percentile(gaps, 99)), "itl_max_ms": _ms(max(gaps, default=None))}


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def summarize(a: dict[str, Any], b: dict[str, Any], solo: list[dict[str, Any]], a_tokens: int) -> dict[str, Any]:
    """The section's figures: A's prefill, B's solo and beside-prefill gaps, the ratio against the goal."""
    block = a["agentfold"]
    timed = overlapping_gaps(b["times"], a["sent"], a["first"])
    gaps = [gap for gap, _ in timed]
    solo_part = _solo_section(solo)
    max_gap = max(gaps, default=None)
    stall_ratio = round(max_gap / solo_part["itl_p99_ms"], 3) if max_gap and solo_part["itl_p99_ms"] else None
    solo_shas = {r["agentfold"]["token_sha"] for r in solo}
    equal = (len(solo_shas) == 1 and b["agentfold"]["token_sha"] in solo_shas
             and all(dump_reply(b) == dump_reply(r) for r in solo))
    drafted = b["agentfold"]["drafted"]
    section = {
        "a": {"target_tokens": a_tokens, "prompt_tokens": block["prompt_tokens"], "cached_tokens": block["cached_tokens"],
              "prefill_ms": block["prefill_ms"], "ttft_ms": block["ttft_ms"], "client_ttft_s": a["ttft_s"],
              "prefill_tps": round((block["prompt_tokens"] - block["cached_tokens"]) / block["prefill_ms"] * 1e3, 1)
              if block["prefill_ms"] else None,
              "completion_tokens": block["completion_tokens"], "b_started_after_admit_s": round(b["sent"] - a["admitted"], 3)},
        "b_solo": solo_part,
        "b_beside_prefill": {
            "completion_tokens": b["agentfold"]["completion_tokens"], "chunks": b["chunks"], "drafted": drafted,
            "accepted": b["agentfold"]["accepted"], "cached_tokens": b["agentfold"]["cached_tokens"],
            "gaps_in_prefill": len(gaps), "max_gap_ms": _ms(max_gap), "p99_gap_ms": _ms(percentile(gaps, 99)),
            "p50_gap_ms": _ms(percentile(gaps, 50)), "all_gaps_max_ms": _ms(max(b["chunk_gaps_ms"], default=None)),
            "started_after_a_s": round(b["sent"] - a["sent"], 3),
            "ended_minus_a_first_token_s": round(b["ended"] - a["first"], 3),
            "finished_during_prefill": b["ended"] < a["first"], "token_sha": b["agentfold"]["token_sha"],
            "reply_sha": hashlib.sha256(dump_reply(b).encode()).hexdigest(),
            "gaps_ms": [round(g, 1) for g in gaps], "gap_ends_after_a_s": [round(t, 3) for _, t in timed]},
        "max_gap_over_solo_p99": stall_ratio, "goal_ratio": STALL_GOAL,
        "reply_equal_solo": equal, "drafted": drafted > 0,
    }
    section["goal_met"] = stall_ratio is not None and stall_ratio <= STALL_GOAL and len(gaps) >= MIN_OVERLAP_GAPS
    section["ok"] = section["goal_met"] and equal and drafted > 0
    return section


def bench_stall(path: Path, tokenizer: Any, context_length: int, quick: bool = False, dtype: str = "float32",
                seed: int = 0, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The `stall` section: one server with `--max-active 2`, B solo, then B beside A's long prefill."""
    from agentfold.bench.prompts import workloads

    say = progress or (lambda message: None)
    pick = 1 if quick else 0
    a_tokens = min(A_TOKENS[pick], context_length - A_ROOM)
    a_messages, reached, nonce = long_messages(tokenizer, a_tokens, seed)
    edit = workloads(quick)[0]
    say(f"stall: A's prompt {reached} tokens (prefix {nonce}); B: {edit['name']}, {B_MAX_TOKENS[pick]} tokens")
    server = ServerProcess(None, ["--dtype", dtype, "--max-active", str(MAX_ACTIVE), "--model", str(path)],
                           stop_signal=signal.SIGTERM, start_timeout=START_TIMEOUT_S,
                           progress=lambda m: say(f"stall server: {m}"))
    try:
        server.start()
        run = StallRun(server, edit["messages"], B_MAX_TOKENS[pick], seed, say)
        solo = run.solo(SOLO_REPEATS[pick])
        a, b = run.concurrent(a_messages)
        health = server.health_at_start
    finally:
        server.cleanup()
    section = summarize(a, b, solo, a_tokens)
    section.update({"quick": quick, "b_workload": edit["description"], "b_max_tokens": B_MAX_TOKENS[pick],
                    "a_nonce": nonce, "a_max_tokens": A_MAX_TOKENS, "b_delay_s": B_DELAY_S,
                    "server": {"max_active": MAX_ACTIVE, "startup_seconds": server.startup_seconds,
                               "exactness": health.get("exactness"), "context_length": health.get("context_length")},
                    "method": METHOD})
    s, beside = section, section["b_beside_prefill"]
    say(f"stall: A {s['a']['prompt_tokens']} tokens prefilled in {s['a']['prefill_ms'] / 1e3:.1f}s; B solo p99 "
        f"{s['b_solo']['itl_p99_ms']} ms, beside A's prefill max {beside['max_gap_ms']} ms over "
        f"{beside['gaps_in_prefill']} gaps (ratio {s['max_gap_over_solo_p99']}, goal {STALL_GOAL}), "
        f"equal {s['reply_equal_solo']}, ok {s['ok']}")
    return section


METHOD = {
    "server": f"one `agentfold serve --max-active {MAX_ACTIVE}` (both replies stepped round-robin)",
    "b": "the decode bench's code-edit prompt, greedy, drafting on, streamed through the openai client; one "
         "priming run, then the solo runs; gaps are client-side times between content chunks",
    "a": "one user message of stdlib source behind a unique prefix, as long as the window allows minus "
         f"{A_ROOM} tokens (quick: {A_TOKENS[1]}), {A_MAX_TOKENS} reply tokens",
    "overlap": f"B starts {B_DELAY_S}s after /health shows A admitted; B's gaps overlapping [A sent, A's first "
               "token] are the gaps beside A's prefill",
    "goal": f"max gap beside A's prefill <= {STALL_GOAL} x B's solo p99 gap, with at least {MIN_OVERLAP_GAPS} such "
            "gaps; ok also needs B's reply equal to its solo reply and drafted > 0",
}
