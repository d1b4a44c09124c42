"""`agentfold bench lanes`: many agent sessions on one runtime: aggregate throughput, latency, exactness.

Several agents share one local model; the scheduler runs every active reply's verify pass as a
lane of one shared pass, and every reply must stay byte-identical to what it is alone. The work is
fixed: a pool of agent sessions (code edits that ask a pasted stdlib window back with a function
renamed, fresh functions, sampled stories), each a task and then its follow-up with the reply
appended, the context cached as a resumed session holds it. Level n serves the whole pool with n
clients at once, each client taking the next session when its last one ends: the protocol of
vLLM's `benchmark_serving --max-concurrency`, the same requests at every concurrency. So every
level does the same work, and level 1 (one session at a time) is both the one-client baseline and
the solo run every reply of every other level must equal. Speed is reported, never asserted;
equality must hold. `METHOD` below says how each figure is taken.

(Until 2026-12 each level ran its own closed loops for a fixed window: level 1's one client then
got 22 turns deep into repeating its own history, which drafts far better than the first turns
the eight clients of level 8 got through, so the levels measured different work.)
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentfold.bench.harness import BenchError
from agentfold.bench.lane_figures import _r, level_row, merge_rounds
from agentfold.bench.machine import finish_run, loadavg, machine_info, run_header, thread_info, utc_timestamp
from agentfold.bench.prompts import WARMUP_PROMPT, encode_chat
from agentfold.bench.session_pool import (
    FOLLOW_UPS,
    MIX,
    QUICK_LINES,
    QUICK_SESSIONS,
    SAMPLED_TEMPERATURE,
    SESSIONS,
    session_prompts,
)

SCHEMA = "agentfold.bench.lanes/2"
LEVELS = (1, 2, 4, 8)
QUICK_LEVELS = (1, 2)
TURNS = 2  # per session: the task, then its follow-up
MAX_TOKENS = 128
QUICK_MAX_TOKENS = 32
ROUNDS = 2  # each level runs this many times, levels up then down (1, 2, 4, 8, 8, 4, 2, 1): drift cancels
WARMUP_TOKENS = 8
RESULT_TIMEOUT_S = 1800  # one turn; a hung runtime ends the bench instead of the process hanging


# -- helpers ------------------------------------------------------------------------------------


def _result(runtime: Any, turn: Any, session: dict[str, Any]) -> Any:
    """The turn's Completion; a failed, cancelled or hung turn, or a dead worker, ends the bench (BenchError)."""
    import queue

    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while True:
        try:
            return turn.result(timeout=1.0)
        except queue.Empty:
            worker = getattr(runtime, "_thread", None)  # a worker that died never answers: do not wait it out
            if worker is not None and not worker.is_alive():
                raise BenchError(f"lanes: the runtime's worker thread ended before session {session['index']} "
                                 f"({session['name']}) got its reply") from None
            if time.monotonic() > deadline:
                raise BenchError(f"lanes: session {session['index']} ({session['name']}) got no reply within "
                                 f"{RESULT_TIMEOUT_S}s") from None
        except Exception as error:
            raise BenchError(f"lanes: session {session['index']} ({session['name']}) failed: {error!r}") from error


def _ratio(a: float | None, b: float | None) -> float | None:  # a / b, None where either is missing or 0
    return round(a / b, 4) if a and b else None


def _engine(path: Path, dtype: str | None, backend: str, quant: str, device: str, verdicts: Path | None,
            say: Callable[[str], None]) -> Any:
    """The engine as `agentfold serve` builds it (`ModelLoader._load`): suffix drafter, self-checked."""
    from agentfold.engine.factory import build_engine

    say(f"lanes: loading {path} (backend {backend}, quant {quant})")
    return build_engine(path, dtype=dtype, drafter="suffix", progress=lambda m: say(f"lanes: {m}"), backend=backend,
                        device=device, quant=quant, verdicts=verdicts)


def _engine_section(engine: Any, path: Path, backend: str, quant: str, device: str, dtype: str | None,
                    verdicts: Path | None, machine: dict[str, Any]) -> dict[str, Any]:
    from agentfold.bench.decode import _exactness_section
    from agentfold.bench.weights import backend_bytes, model_record, weights_dtype
    from agentfold.engine import backend_choice

    target = engine.backend
    weights = backend_bytes(target)
    machine["threads"] = thread_info(target)
    key = backend_choice.verdict_key(path, device, quant)
    return {
        "backend": {"name": target.name, "quant": target.quant,
                    "requested": {"backend": backend, "quant": quant, "device": device},
                    "kernels": target.describe(),
                    "auto_verdict": backend_choice.recall(verdicts, key) if backend == "auto" else None},
        "model": {**model_record(target.loaded, weights_dtype(target, dtype), weights["resident_bytes"],
                                 weights["parameters"]),
                  "quant": target.quant, "drafter": engine.drafter.name if engine.drafter else "none",
                  "max_drafts": engine.max_drafts},
        "exactness": _exactness_section(engine.exactness),
    }


def _warm_up(engine: Any, say: Callable[[str], None]) -> dict[str, Any]:
    """A few tokens serial and drafted, so no first-call cost lands in the solo runs."""
    from agentfold.engine.decode import GenerationConfig

    say("lanes: warm-up")
    prompt = encode_chat(engine.tokenizer, [{"role": "user", "content": WARMUP_PROMPT}])
    began = time.perf_counter()
    for draft in (False, True):
        engine.generate(prompt, GenerationConfig(max_tokens=WARMUP_TOKENS, draft=draft))
    return {"prompt_tokens": len(prompt), "max_tokens": WARMUP_TOKENS, "seconds": _r(time.perf_counter() - began)}


def _levels(levels: Sequence[int] | None, quick: bool, sessions: int) -> list[int]:
    """The concurrency levels to run, level 1 always among them (it is every level's solo reference)."""
    chosen = sorted({1, *(levels or (QUICK_LEVELS if quick else LEVELS))})
    if chosen[0] < 1 or chosen[-1] > sessions:
        raise BenchError(f"client levels must be between 1 and {sessions} (the sessions in the pool), "
                         f"not {list(levels or ())}")
    return chosen


def _prompt_row(session: dict[str, Any], seed: int) -> dict[str, Any]:
    ids = session["prompt"]
    return {"index": session["index"], "name": session["name"], "kind": session["kind"],
            "description": session["description"], "prompt_tokens": len(ids), "sampled": session["sampled"],
            "temperature": session["temperature"], "seed": seed + session["index"] if session["sampled"] else None,
            "prompt_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest()}


# -- one session, one level -----------------------------------------------------------------------


def _config(session: dict[str, Any], max_tokens: int, seed: int) -> Any:
    from agentfold.engine.decode import GenerationConfig
    from agentfold.engine.sampler import SamplingParams

    params = SamplingParams(temperature=session["temperature"], seed=seed + session["index"])
    return GenerationConfig(params=params, max_tokens=max_tokens, draft=True)


def context_cache(engine: Any, prompt: Sequence[int]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A session's context as a session would have it cached: the prompt but its last token,
    prefilled on the engine's plan, as snapshot arrays (each run restores its own copy)."""
    cache = engine.backend.new_cache()
    engine.backend.prefill(list(prompt[:-1]), cache, engine.plan(0, len(prompt) - 1))
    return engine.backend.cache_to_arrays(cache)


def run_session(runtime: Any, engine: Any, session: dict[str, Any], cache: Any, max_tokens: int, seed: int,
                turns: int) -> list[tuple[Any, Any]]:
    """One agent session: `turns` turns, each with the last reply and the follow-up appended to the
    chat and the cache kept, as an agent's next request finds its session."""
    from agentfold.engine.decode import first_mismatch
    from agentfold.serve.scheduler import TurnRequest

    messages, prompt, done = list(session["messages"]), list(session["prompt"]), []
    config = _config(session, max_tokens, seed)
    while len(done) < turns:
        turn = runtime.submit(TurnRequest(prompt=prompt, config=config, api="bench", client="agentfold-bench-lanes",
                                          cache=cache))
        completion = _result(runtime, turn, session)
        done.append((turn, completion))
        messages += [{"role": "assistant", "content": completion.text},
                     {"role": "user", "content": FOLLOW_UPS[session["kind"]]}]
        prompt = encode_chat(engine.tokenizer, messages)
        kept = first_mismatch(prompt, cache.tokens)  # the rendered reply may re-tokenize
        engine.backend.truncate(cache, min(cache.length if kept is None else kept, len(prompt) - 1))
    return done


def run_level(engine: Any, model_id: str, sessions: Sequence[dict[str, Any]], contexts: dict[int, Any],
              clients: int, max_tokens: int, seed: int, turns: int, lanes: bool = True) -> dict[str, Any]:
    """The whole pool of `sessions` served by `clients` clients at once on a fresh runtime
    (`max_active` = the clients): each client takes the next session from the pool when its last
    one ended, until the pool is empty."""
    from agentfold.serve.scheduler import Runtime

    runtime = Runtime(engine, model_id, max_active=clients, max_queue=clients, lanes=lanes)
    pool, lock = deque(sessions), threading.Lock()
    served: dict[int, dict[str, Any]] = {}
    drained: list[float] = []  # when each client found the pool empty
    failures: list[BaseException] = []

    def client_loop(client: int) -> None:
        try:
            while True:
                with lock:
                    if not pool:
                        drained.append(time.perf_counter())
                        return
                    session = pool.popleft()
                cache = engine.backend.arrays_to_cache(*contexts[session["index"]])
                done = run_session(runtime, engine, session, cache, max_tokens, seed, turns)
                served[session["index"]] = {"client": client, "turns": done}
        except BaseException as error:  # re-raised on the bench's thread
            failures.append(error)

    threads = [threading.Thread(target=client_loop, args=(c,), name=f"lanes-client-{c}") for c in range(clients)]
    began = time.perf_counter()
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        ended = time.perf_counter()
        figures = {"lane_stats": runtime.lanes.summary(), "counters": dict(runtime.counters)}
    finally:
        runtime.close()
    if failures:
        raise failures[0] if isinstance(failures[0], BenchError) else BenchError(f"lanes: {failures[0]!r}")
    return {"clients": clients, "began": began, "ended": ended, "drained": min(drained), "served": served,
            "figures": figures}


# -- the bench ----------------------------------------------------------------------------------


def bench_lanes(model: str | None = None, out: str | Path | None = "bench-results/lanes.json", quick: bool = False,
                levels: Sequence[int] | None = None, max_tokens: int = MAX_TOKENS, seed: int = 0,
                dtype: str | None = None, backend: str = "auto", quant: str = "auto", device: str = "auto",
                verdicts: Path | None = None, progress: Callable[[str], None] | None = None,
                sessions: int | None = None, turns: int = TURNS, rounds: int | None = None) -> dict[str, Any]:
    """The pool of `sessions` agent sessions served at each concurrency level, level 1 first (the
    solo reference), then the top level again with lanes off; the result (written to `out` unless
    None). With `rounds` (default ROUNDS, --quick 1) the levels run that many times, up then down
    (1, 2, 4, 8, 8, 4, 2, 1), and each level's rates are over all its runs: a machine whose speed
    drifts during the bench (a VM's neighbours) then moves every level alike, not the first
    level more than the last.

    `quick`: levels 1 and 2, four sessions with short code edits, at most `QUICK_MAX_TOKENS` reply
    tokens. `backend="auto"` reads and writes its verdict in `verdicts` (default the file
    `agentfold serve` uses). Raises BenchError for impossible settings; a turn that differs from its
    solo run does not raise: it is reported and `summary.all_equal` is False.
    """
    from agentfold.serve.models import resolve, verdict_file

    say = progress or (lambda message: None)
    started = time.perf_counter()
    if quick:
        max_tokens = min(max_tokens, QUICK_MAX_TOKENS)
    count = sessions or (QUICK_SESSIONS if quick else SESSIONS)
    rounds = (1 if quick else ROUNDS) if rounds is None else rounds
    if max_tokens < 2 or turns < 1 or rounds < 1:
        raise BenchError(f"max_tokens must be >= 2, turns and rounds >= 1, not {max_tokens}, {turns} and {rounds}")
    pool = session_prompts(seed, quick, count)
    chosen = _levels(levels, quick, count)
    machine = machine_info()
    result: dict[str, Any] = {**run_header(SCHEMA, utc_timestamp(), quick, machine), "seed": seed,
                              "max_tokens": max_tokens, "sessions": count, "turns_per_session": turns,
                              "levels_requested": chosen, "rounds": rounds}
    path = resolve(model)
    if backend == "auto" and verdicts is None:
        verdicts = verdict_file()
    engine = _engine(path, dtype, backend, quant, device, verdicts, say)
    result.update(_engine_section(engine, path, backend, quant, device, dtype, verdicts, machine))
    model_id = engine.backend.loaded.name
    for session in pool:
        session["prompt"] = encode_chat(engine.tokenizer, session["messages"])
    result["prompts"] = [_prompt_row(s, seed) for s in pool]
    result["warmup"] = _warm_up(engine, say)
    say(f"lanes: caching {count} sessions' contexts ({min(len(s['prompt']) for s in pool)}-"
        f"{max(len(s['prompt']) for s in pool)} tokens), as resumed sessions hold them")
    began = time.perf_counter()
    contexts = {s["index"]: context_cache(engine, s["prompt"]) for s in pool}
    result["context_prefill_seconds"] = _r(time.perf_counter() - began)

    runs: dict[int, list[dict[str, Any]]] = {}
    for r in range(rounds):
        for n in (chosen if r % 2 == 0 else chosen[::-1]):
            say(f"lanes: {count} sessions of {turns} turns, {n} at a time" + (f" (round {r + 1} of {rounds})"
                                                                               if rounds > 1 else ""))
            runs.setdefault(n, []).append(run_level(engine, model_id, pool, contexts, n, max_tokens, seed, turns))
    reference = runs[1][0]["served"]
    rows: list[dict[str, Any]] = []
    for n in chosen:
        rows.append(_level_row(pool, runs[n], reference, n, rows, say))
    top = chosen[-1]
    say(f"lanes: {count} sessions, {top} at a time, every pass alone (lanes off, for comparison)")
    off = run_level(engine, model_id, pool, contexts, top, max_tokens, seed, turns, lanes=False)
    off_row = level_row(pool, off, reference)
    gain = _ratio(rows[-1]["aggregate_tps"], off_row["aggregate_tps"])
    say(f"lanes: {top} clients, lanes off: {off_row['aggregate_tps']} tok/s; lanes on gain {gain}x")
    result.update(lanes_off={**off_row, "lanes_gain": gain}, levels=rows, method=METHOD,
                  summary={**summarize(rows, [off_row]), "lanes_gain": gain})
    if out is not None:
        finish_run(result, started, out)
    else:
        result["machine"]["loadavg_end"] = loadavg()
        result["duration_seconds"] = round(time.perf_counter() - started, 3)
    s = result["summary"]
    say(f"lanes: done in {result['duration_seconds']:.0f}s: aggregate tok/s {s['aggregate_tps']}, speedup vs 1 "
        f"{s['speedup_vs_1']}; " + ("every turn equal to its solo run" if s["all_equal"] else
                                     f"{s['equal_to_solo']['checked'] - s['equal_to_solo']['equal']} TURNS DIFFER "
                                     "from their solo runs"))
    return result


def _level_row(pool: Sequence[dict[str, Any]], runs: Sequence[dict[str, Any]], reference: dict[int, Any], n: int,
               rows: Sequence[dict[str, Any]], say: Callable[[str], None]) -> dict[str, Any]:
    """Level n's row over its runs (`merge_rounds`) against level 1 (its first run is the solo
    reference of every other run, level 1's later ones too; `rows[0]` its rate), and a progress
    line (and one per mismatch)."""
    row = merge_rounds([level_row(pool, run, None if run["served"] is reference else reference) for run in runs])
    row["speedup_vs_1"] = 1.0 if n == 1 else _ratio(row["aggregate_tps"], rows[0]["aggregate_tps"])
    for miss in row["mismatches"]:
        say(f"lanes: MISMATCH at {n} clients: session {miss['index']} {miss['name']} turn {miss['turn']} differs "
            f"from its solo run at token {miss['first_mismatch']}")
    equal = "the solo reference" if n == 1 and len(runs) == 1 else (
        f"equal to solo {row['equal_to_solo']['equal']}/{row['equal_to_solo']['checked']} turns")
    over = f" over {len(runs)} runs" if len(runs) > 1 else ""
    say(f"lanes: {n} clients: {row['completion_tokens']} tokens in {row['seconds']:g}s{over} = {row['aggregate_tps']} tok/s "
        f"({row['speedup_vs_1']}x one client; {row['steady_tps']} tok/s while all were busy), "
        f"{row['tokens_per_pass']} tok/pass, ITL p99 max {row['itl_p99_ms_max']} ms, {equal}")
    return row


def summarize(rows: Sequence[dict[str, Any]], others: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """Per-level headline figures and the equality verdict over every level (and `others`' runs)."""
    checked = sum(r["equal_to_solo"]["checked"] for r in [*rows, *others])
    equal = sum(r["equal_to_solo"]["equal"] for r in [*rows, *others])
    return {
        "levels": [r["clients"] for r in rows],
        "aggregate_tps": {str(r["clients"]): r["aggregate_tps"] for r in rows},
        "speedup_vs_1": {str(r["clients"]): r["speedup_vs_1"] for r in rows},
        "steady_tps": {str(r["clients"]): r["steady_tps"] for r in rows},
        "tokens_per_pass": {str(r["clients"]): r["tokens_per_pass"] for r in rows},
        "itl_p99_ms_max": {str(r["clients"]): r["itl_p99_ms_max"] for r in rows},
        "drafted": sum(r["drafted"] for r in rows), "accepted": sum(r["accepted"] for r in rows),
        "equal_to_solo": {"checked": checked, "equal": equal},
        "all_equal": checked > 0 and equal == checked,
    }


METHOD = {
    "engine": "build_engine as `agentfold serve` calls it: backend auto (the verdict remembered for this machine "
              "and model, else measured), suffix drafter, row-exactness self-check; in this process",
    "sessions": f"a fixed pool (bench.session_pool), a mix repeated every {len(MIX)}: six code edits (a 60-80 line "
                f"stdlib window pasted, --quick: at most {QUICK_LINES} lines of it, asked back with one function "
                "renamed), a short story, a fresh function; chat-templated with the tokenizer's template; greedy, "
                f"except the stories: temperature {SAMPLED_TEMPERATURE}, seed = --seed + the session's index; "
                "drafting on. Each session runs its turns in a closed loop: a turn, then its reply and a follow-up "
                f"({FOLLOW_UPS}) appended and the next turn submitted at once, the cache carried over as a session "
                "keeps it. Every session's context (its first prompt) is cached before the clock starts, as a "
                "resumed session's is (context_prefill_seconds, not in any rate)",
    "levels": "level n: the whole pool served by n clients at once on a fresh Runtime(max_active=n); each client "
              "takes the next session (in pool order) when its last one ended (vLLM's --max-concurrency protocol), "
              "so every level serves the same sessions, turns and tokens. With rounds > 1 the levels run again "
              "in reverse order (1, 2, 4, 8, 8, 4, 2, 1 for two), each level's rates over all its runs and each "
              "run under its `rounds`: a speed drift of the machine during the bench then weighs on every level "
              "alike (level 1 first and last)",
    "aggregate_tps": "the pool's committed tokens over the level's time, from the first submit to the last "
                     "committed token; speedup_vs_1: over level 1's, the same sessions served one at a time; "
                     "steady_tps: tokens committed until the first client found the pool empty, over that time "
                     "(all n clients busy throughout)",
    "latency": "per client, pooled over its sessions' turns: ITL percentiles over the gaps between its committed "
               "tokens inside a turn (tokens of one pass share a time, so a drafted reply's p50 can be 0); ttft: "
               "submit to the first committed tokens of each turn (queue and the follow-up's prefill included)",
    "exactness": "level 1 serves one session at a time: its turns are the solo runs; every turn of every other "
                 "level (and of the lanes-off run) must have level 1's token ids and finish reason",
    "lanes_off": "the top level again on a Runtime(lanes=False): every reply's verify pass alone, round-robin, "
                 "as before lanes; lanes_gain: the top level's aggregate_tps over this one's",
    "lane_stats": "the runtime's shared-pass telemetry (Runtime.lanes.summary()) per level; per session, "
                  "Turn.lane_passes: how many replies and rows shared each of its verify passes",
}
