"""`agentfold bench lanes`: many agent sessions on one runtime: aggregate throughput, latency, exactness.

Several agents share one local model; the scheduler runs every active reply's verify pass as a
lane of one shared pass, and every reply must stay byte-identical to what it is alone. Each
client is a session in a closed loop (a turn, then the next with its reply and a follow-up
appended, the cache carried over) on the engine `agentfold serve` builds. Level n runs the first
n of eight clients (six code edits that ask a pasted stdlib window back with a function renamed,
a fresh function, a sampled story) for a fixed window, counting the tokens committed inside it;
then every client's turns run again alone and each must equal its solo run. Speed is reported,
never asserted; equality must hold. `METHOD` below says how each figure is taken.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentfold.bench.harness import BenchError
from agentfold.bench.machine import finish_run, loadavg, machine_info, run_header, thread_info, utc_timestamp
from agentfold.bench.prompts import WARMUP_PROMPT, encode_chat
from agentfold.bench.workloads import FRESH_CODE_TASKS, STORY_TOPICS, pick_windows

SCHEMA = "agentfold.bench.lanes/1"
LEVELS = (1, 2, 4, 8)
QUICK_LEVELS = (1, 2)
MAX_TOKENS = 128
QUICK_MAX_TOKENS = 32
QUICK_LINES = 24  # --quick: code-edit windows cut to this many lines around the renamed function
EDITS = 6  # code-edit prompts among the eight
SAMPLED_INDEX = 1  # the story: in every level but the first, so sampled exactness is checked from 2 clients on
SAMPLED_TEMPERATURE = 0.7
WARMUP_TOKENS = 8
DURATION_S = 30.0  # each level's window
QUICK_DURATION_S = 6.0
RESULT_TIMEOUT_S = 1800  # one level's replies; a hung runtime ends the bench instead of the process hanging
SYSTEM = "You are a coding agent working in a Python repository. Answer briefly and precisely."
FOLLOW_UPS = {"code-edit": "Good. Now write a short pytest test for the function you renamed.",
              "fresh-code": "Now add input validation to it and show the whole function again.",
              "prose": "Continue the story with one more paragraph."}


# -- the clients' prompts -----------------------------------------------------------------------


def client_prompts(seed: int = 0, quick: bool = False) -> list[dict[str, Any]]:
    """The eight clients' chats, in level order (deterministic per seed and Python install).

    Six code edits of windows from distinct stdlib files (`workloads.pick_windows`; `quick`: only
    the lines from the renamed function's first to its last mention, as short prompts), one fresh
    function, one story; the story (index `SAMPLED_INDEX`) is the sampled client.
    """
    windows = [_excerpt(w) if quick else w for w in pick_windows(seed, EDITS)]

    def edit(window: dict[str, Any]) -> dict[str, Any]:
        old, new = window["rename"]
        first, last = window["line_span"]
        user = (f"Here is `{window['file']}` lines {first}-{last}:\n\n```python\n{window['text']}```\n\n"
                f"Rename the function `{old}` to `{new}` in that code, updating every call to it. Change nothing "
                "else. Reply with the complete updated code in one ```python code block.")
        return {"name": f"edit-{Path(window['file']).stem}", "kind": "code-edit",
                "description": f"re-emit {window['file']} lines {first}-{last} renaming {old} -> {new}",
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}

    task, topic = FRESH_CODE_TASKS[seed % len(FRESH_CODE_TASKS)], STORY_TOPICS[seed % len(STORY_TOPICS)]
    fresh = {"name": "fresh-code", "kind": "fresh-code", "description": f"write {task.split('`')[1].split('(')[0]}()",
             "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content":
                          f"Write a Python function {task}. Include a docstring and type hints. Reply with the code "
                          "only."}]}
    story = {"name": "story", "kind": "prose", "description": f"a short story about {topic}",
             "messages": [{"role": "user", "content": f"Write a short story of three paragraphs about {topic}. Use "
                           "vivid, concrete details."}]}
    edits = [edit(w) for w in windows]
    clients = [edits[0], story, edits[1], fresh, *edits[2:]]
    for index, client in enumerate(clients):
        sampled = index == SAMPLED_INDEX
        client.update(index=index, temperature=SAMPLED_TEMPERATURE if sampled else 0.0, sampled=sampled)
    return clients


def _excerpt(window: dict[str, Any]) -> dict[str, Any]:
    """The window cut to the lines from the renamed function's first to its last mention (at most
    `QUICK_LINES`, a line of context either side): a short prompt that still asks for a copy."""
    old = window["rename"][0]
    lines = window["text"].splitlines()
    hits = [i for i, line in enumerate(lines) if f"{old}(" in line]
    low = max(0, min(hits) - 1)
    high = min(len(lines), max(hits) + 2, low + QUICK_LINES)
    first = window["line_span"][0] + low
    return {**window, "text": "\n".join(lines[low:high]) + "\n", "line_span": [first, first + high - low - 1],
            "lines": high - low}


# -- helpers ------------------------------------------------------------------------------------


def _result(runtime: Any, turn: Any, client: dict[str, Any]) -> Any:
    """The turn's Completion; a failed, cancelled or hung turn, or a dead worker, ends the bench (BenchError)."""
    import queue

    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while True:
        try:
            return turn.result(timeout=1.0)
        except queue.Empty:
            worker = getattr(runtime, "_thread", None)  # a worker that died never answers: do not wait it out
            if worker is not None and not worker.is_alive():
                raise BenchError(f"lanes: the runtime's worker thread ended before client {client['index']} "
                                 f"({client['name']}) got its reply") from None
            if time.monotonic() > deadline:
                raise BenchError(f"lanes: client {client['index']} ({client['name']}) got no reply within "
                                 f"{RESULT_TIMEOUT_S}s") from None
        except Exception as error:
            raise BenchError(f"lanes: client {client['index']} ({client['name']}) failed: {error!r}") from error


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(float(value), digits)


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


def _levels(levels: Sequence[int] | None, quick: bool, available: int) -> list[int]:
    chosen = sorted(set(levels or (QUICK_LEVELS if quick else LEVELS)))
    if not chosen or chosen[0] < 1 or chosen[-1] > available:
        raise BenchError(f"client levels must be between 1 and {available} (one distinct prompt per client), "
                         f"not {list(levels or ())}")
    return chosen


def _prompt_row(client: dict[str, Any], seed: int) -> dict[str, Any]:
    ids = client["prompt"]
    return {"index": client["index"], "name": client["name"], "kind": client["kind"],
            "description": client["description"], "prompt_tokens": len(ids), "sampled": client["sampled"],
            "temperature": client["temperature"], "seed": seed + client["index"] if client["sampled"] else None,
            "prompt_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest()}


# -- one client's session -----------------------------------------------------------------------


def _config(client: dict[str, Any], max_tokens: int, seed: int) -> Any:
    from agentfold.engine.decode import GenerationConfig
    from agentfold.engine.sampler import SamplingParams

    params = SamplingParams(temperature=client["temperature"], seed=seed + client["index"])
    return GenerationConfig(params=params, max_tokens=max_tokens, draft=True)


def context_cache(engine: Any, prompt: Sequence[int]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A client's context as a session would have it cached: the prompt but its last token,
    prefilled on the engine's plan, as snapshot arrays (each run restores its own copy)."""
    cache = engine.backend.new_cache()
    engine.backend.prefill(list(prompt[:-1]), cache, engine.plan(0, len(prompt) - 1))
    return engine.backend.cache_to_arrays(cache)


def run_session(runtime: Any, engine: Any, client: dict[str, Any], cache: Any, max_tokens: int, seed: int,
                deadline: float | None, turns: int | None) -> list[tuple[Any, Any]]:
    """One agent's closed loop: a turn, then the next (reply and follow-up appended, cache kept) until
    `deadline` passes or `turns` are done."""
    from agentfold.engine.decode import first_mismatch
    from agentfold.serve.scheduler import TurnRequest

    messages, prompt, done = list(client["messages"]), list(client["prompt"]), []
    config = _config(client, max_tokens, seed)
    while (deadline is None or time.perf_counter() < deadline) and (turns is None or len(done) < turns):
        turn = runtime.submit(TurnRequest(prompt=prompt, config=config, api="bench", client="agentfold-bench-lanes",
                                          cache=cache))
        completion = _result(runtime, turn, client)
        done.append((turn, completion))
        messages += [{"role": "assistant", "content": completion.text},
                     {"role": "user", "content": FOLLOW_UPS[client["kind"]]}]
        prompt = encode_chat(engine.tokenizer, messages)
        kept = first_mismatch(prompt, cache.tokens)  # the rendered reply may re-tokenize
        engine.backend.truncate(cache, min(cache.length if kept is None else kept, len(prompt) - 1))
    return done


def run_level(engine: Any, model_id: str, clients: Sequence[dict[str, Any]], contexts: dict[int, Any],
              max_tokens: int, seed: int, duration: float | None = None,
              turns: dict[int, int] | None = None, lanes: bool = True) -> dict[str, Any]:
    """Every client's session at once on a fresh runtime (`max_active` = the clients), for
    `duration` seconds (turns begun by then run to their end) or `turns[index]` turns each."""
    import threading

    from agentfold.serve.scheduler import Runtime

    caches = {c["index"]: engine.backend.arrays_to_cache(*contexts[c["index"]]) for c in clients}
    runtime = Runtime(engine, model_id, max_active=len(clients), max_queue=len(clients), lanes=lanes)
    sessions: dict[int, list[tuple[Any, Any]]] = {}
    failures: list[BaseException] = []
    began = time.perf_counter()
    deadline = began + duration if duration is not None else None

    def client_loop(client: dict[str, Any]) -> None:
        try:
            sessions[client["index"]] = run_session(runtime, engine, client, caches[client["index"]], max_tokens,
                                                    seed, deadline, None if turns is None else turns[client["index"]])
        except BaseException as error:  # re-raised on the bench's thread
            failures.append(error)

    threads = [threading.Thread(target=client_loop, args=(c,), name=f"lanes-client-{c['index']}") for c in clients]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        figures = {"lane_stats": runtime.lanes.summary(), "counters": dict(runtime.counters)}
    finally:
        runtime.close()
    if failures:
        raise failures[0] if isinstance(failures[0], BenchError) else BenchError(f"lanes: {failures[0]!r}")
    return {"began": began, "deadline": deadline, "sessions": sessions, "figures": figures}


# -- figures --------------------------------------------------------------------------------------


def emit_clock(turn: Any, completion: Any) -> list[float]:
    """When each token of a turn was committed, on the bench's clock (perf_counter): the engine's
    emit times are relative to its own start, which the turn's first delivery pins down."""
    emits = completion.stats.emit_times
    if not emits or turn.first_delta_at is None:
        return []
    offset = turn.first_delta_at - emits[0]
    return [offset + t for t in emits]


def client_row(client: dict[str, Any], session: Sequence[tuple[Any, Any]], window: tuple[float, float] | None,
               reference: Sequence[Any] | None) -> dict[str, Any]:
    """One client's figures over its session: tokens in the window, ITL, TTFT, drafting, equality."""
    from agentfold.engine.decode import first_mismatch
    from agentfold.serve.telemetry import _percentiles

    gaps, counted, ttfts, mismatch = [], 0, [], None
    for k, (turn, completion) in enumerate(session):
        times = emit_clock(turn, completion)
        gaps += [(b - a) * 1e3 for a, b in zip(times, times[1:], strict=False)]
        counted += sum(1 for t in times if window is None or window[0] <= t <= window[1])
        if turn.ttft_seconds is not None:
            ttfts.append(turn.ttft_seconds * 1e3)
        if reference is not None and mismatch is None:
            solo = reference[k]
            at = first_mismatch(completion.tokens, solo.tokens)
            if at is not None or completion.finish_reason != solo.finish_reason:
                mismatch = {"turn": k, "first_mismatch": at, "tokens": len(completion.tokens),
                            "solo_tokens": len(solo.tokens)}
    stats = [completion.stats for _, completion in session]
    passes = sum(s.verify_passes for s in stats)
    p50, p99 = _percentiles(gaps, (50, 99))
    return {
        "index": client["index"], "name": client["name"], "kind": client["kind"], "sampled": client["sampled"],
        "turns": len(session), "tokens_in_window": counted,
        "completion_tokens": sum(s.completion_tokens for s in stats),
        "token_shas": [completion.token_sha for _, completion in session],
        "ttft_ms_median": _r(statistics.median(ttfts)) if ttfts else None,
        "itl_p50_ms": _r(p50), "itl_p99_ms": _r(p99), "itl_max_ms": _r(max(gaps, default=0.0)),
        "verify_passes": passes, "drafted": sum(s.drafted for s in stats), "accepted": sum(s.accepted for s in stats),
        "tokens_per_pass": _r(sum(s.completion_tokens for s in stats) / passes, 4) if passes else None,
        **_lane_columns([p for turn, _ in session for p in getattr(turn, "lane_passes", [])]),
        "equal_to_solo": None if reference is None else mismatch is None, "mismatch": mismatch,
    }


def _lane_columns(passes: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """How many replies and rows shared a client's verify passes (`Turn.lane_passes`)."""
    if not passes:
        return {"shared_passes": None, "replies_per_pass": None, "rows_per_pass": None}
    return {"shared_passes": sum(1 for replies, _ in passes if replies > 1),
            "replies_per_pass": _r(statistics.mean(replies for replies, _ in passes), 3),
            "rows_per_pass": _r(statistics.mean(rows for _, rows in passes), 3)}


def level_row(n: int, clients: Sequence[dict[str, Any]], level: dict[str, Any],
              solo: dict[int, list[Any]]) -> dict[str, Any]:
    """Level n's figures: tokens committed inside the window over its length, per client latency,
    every turn checked against the same client's turn run alone."""
    window = (level["began"], level["deadline"])
    rows = [client_row(c, level["sessions"][c["index"]], window, solo.get(c["index"])) for c in clients]
    tokens = sum(r["tokens_in_window"] for r in rows)
    seconds = level["deadline"] - level["began"]
    drafted, accepted = sum(r["drafted"] for r in rows), sum(r["accepted"] for r in rows)
    checked = sum(r["turns"] for r in rows)
    unequal = [r for r in rows if r["equal_to_solo"] is False]
    alone = [solo[c["index"]][k] for c in clients if c["index"] in solo  # the level's own turns, run alone
             for k in range(len(level["sessions"][c["index"]]))]
    solo_tps = _ratio(sum(len(c.tokens) for c in alone), sum(c.stats.total_seconds for c in alone))
    return {
        "clients": n, "max_active": n, "window_seconds": _r(seconds, 3), "tokens_in_window": tokens,
        "aggregate_tps": _r(tokens / seconds), "speedup_vs_1": None,  # filled in once level 1 is known
        "solo_tps": solo_tps, "speedup_vs_solo": _ratio(tokens / seconds, solo_tps),
        "turns": checked, "completion_tokens": sum(r["completion_tokens"] for r in rows),
        "drafted": drafted, "accepted": accepted,
        "tokens_per_pass": _r(sum(r["completion_tokens"] for r in rows) / max(1, sum(r["verify_passes"] for r in rows)),
                              4),
        "itl_p50_ms_median": _r(statistics.median(r["itl_p50_ms"] for r in rows)),
        "itl_p99_ms": {r["name"]: r["itl_p99_ms"] for r in rows},
        "itl_p99_ms_max": _r(max(r["itl_p99_ms"] for r in rows)),
        "ttft_ms_median": _r(statistics.median(r["ttft_ms_median"] for r in rows if r["ttft_ms_median"] is not None)),
        "equal_to_solo": {"checked": checked, "equal": checked - sum(r["turns"] for r in unequal)},
        "mismatches": [{"clients": n, "index": r["index"], "name": r["name"], **r["mismatch"]} for r in unequal],
        "lane_stats": level["figures"]["lane_stats"], "runtime_counters": level["figures"]["counters"],
        "loadavg": loadavg(), "per_client": rows,
    }


# -- the bench ----------------------------------------------------------------------------------


def bench_lanes(model: str | None = None, out: str | Path | None = "bench-results/lanes.json", quick: bool = False,
                levels: Sequence[int] | None = None, max_tokens: int = MAX_TOKENS, seed: int = 0,
                dtype: str | None = None, backend: str = "auto", quant: str = "auto", device: str = "auto",
                verdicts: Path | None = None, progress: Callable[[str], None] | None = None,
                duration: float | None = None) -> dict[str, Any]:
    """Each level of concurrent sessions for `duration` seconds, then every client's turns alone;
    the result (written to `out` unless None).

    `quick`: levels 1 and 2, short code edits, at most `QUICK_MAX_TOKENS` reply tokens, a short
    window. `backend="auto"` reads and writes its verdict in `verdicts` (default the file `agentfold
    serve` uses). Raises BenchError for impossible settings; a turn that differs from its solo run
    does not raise: it is reported and `summary.all_equal` is False.
    """
    from agentfold.serve.models import resolve, verdict_file

    say = progress or (lambda message: None)
    started = time.perf_counter()
    if quick:
        max_tokens = min(max_tokens, QUICK_MAX_TOKENS)
    duration = duration or (QUICK_DURATION_S if quick else DURATION_S)
    if max_tokens < 2 or duration <= 0:
        raise BenchError(f"max_tokens must be >= 2 and the window > 0 s, not {max_tokens} and {duration}")
    clients = client_prompts(seed, quick)
    chosen = _levels(levels, quick, len(clients))
    clients = clients[:chosen[-1]]
    machine = machine_info()
    result: dict[str, Any] = {**run_header(SCHEMA, utc_timestamp(), quick, machine), "seed": seed,
                              "max_tokens": max_tokens, "window_seconds": duration, "levels_requested": chosen}
    path = resolve(model)
    if backend == "auto" and verdicts is None:
        verdicts = verdict_file()
    engine = _engine(path, dtype, backend, quant, device, verdicts, say)
    result.update(_engine_section(engine, path, backend, quant, device, dtype, verdicts, machine))
    model_id = engine.backend.loaded.name
    for client in clients:
        client["prompt"] = encode_chat(engine.tokenizer, client["messages"])
    result["prompts"] = [_prompt_row(c, seed) for c in clients]
    result["warmup"] = _warm_up(engine, say)
    say(f"lanes: caching {len(clients)} clients' contexts ({min(len(c['prompt']) for c in clients)}-"
        f"{max(len(c['prompt']) for c in clients)} tokens), as their sessions would hold them")
    began = time.perf_counter()
    contexts = {c["index"]: context_cache(engine, c["prompt"]) for c in clients}
    result["context_prefill_seconds"] = _r(time.perf_counter() - began)

    runs = {}
    for n in chosen:
        say(f"lanes: {n} concurrent session{'s' if n > 1 else ''} for {duration:g}s")
        runs[n] = run_level(engine, model_id, clients[:n], contexts, max_tokens, seed, duration=duration)
    top = chosen[-1]
    say(f"lanes: {top} concurrent sessions for {duration:g}s with every pass alone (lanes off, for comparison)")
    off = run_level(engine, model_id, clients[:top], contexts, max_tokens, seed, duration=duration, lanes=False)
    turns = {c["index"]: max(len(run["sessions"].get(c["index"], ())) for run in [*runs.values(), off])
             for c in clients}
    say(f"lanes: every client's {sum(turns.values())} turns again, alone")
    solo = {}
    for client in clients:
        alone = run_level(engine, model_id, [client], contexts, max_tokens, seed, turns=turns)
        solo[client["index"]] = [completion for _, completion in alone["sessions"][client["index"]]]
    rows = _level_rows(clients, chosen, runs, solo, say)
    off_row = level_row(top, clients[:top], off, solo)
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
        f"{s['speedup_vs_1']}, vs the same turns one at a time {s['speedup_vs_solo']}; "
        + ("every turn equal to its solo run" if s["all_equal"] else
           f"{s['equal_to_solo']['checked'] - s['equal_to_solo']['equal']} TURNS DIFFER from their solo runs"))
    return result


def _level_rows(clients: Sequence[dict[str, Any]], chosen: Sequence[int], runs: dict[int, Any],
                solo: dict[int, list[Any]], say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Each level's row, its speed-up over level 1, and a progress line (and one per mismatch)."""
    rows = [level_row(n, clients[:n], runs[n], solo) for n in chosen]
    base = next((r["aggregate_tps"] for r in rows if r["clients"] == 1), None)
    for row in rows:
        row["speedup_vs_1"] = _ratio(row["aggregate_tps"], base)
        for miss in row["mismatches"]:
            say(f"lanes: MISMATCH at {row['clients']} clients: client {miss['index']} {miss['name']} turn "
                f"{miss['turn']} differs from its solo run at token {miss['first_mismatch']}")
        say(f"lanes: {row['clients']} clients: {row['tokens_in_window']} tokens in {row['window_seconds']:g}s = "
            f"{row['aggregate_tps']} tok/s ({row['speedup_vs_1']}x one client, {row['speedup_vs_solo']}x the same "
            f"turns one at a time), {row['tokens_per_pass']} tok/pass, ITL p99 max {row['itl_p99_ms_max']} ms, equal to solo {row['equal_to_solo']['equal']}/"
            f"{row['equal_to_solo']['checked']} turns")
    return rows


def summarize(rows: Sequence[dict[str, Any]], others: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """Per-level headline figures and the equality verdict over every level (and `others`' runs)."""
    checked = sum(r["equal_to_solo"]["checked"] for r in [*rows, *others])
    equal = sum(r["equal_to_solo"]["equal"] for r in [*rows, *others])
    return {
        "levels": [r["clients"] for r in rows],
        "aggregate_tps": {str(r["clients"]): r["aggregate_tps"] for r in rows},
        "speedup_vs_1": {str(r["clients"]): r["speedup_vs_1"] for r in rows},
        "speedup_vs_solo": {str(r["clients"]): r["speedup_vs_solo"] for r in rows},
        "tokens_per_pass": {str(r["clients"]): r["tokens_per_pass"] for r in rows},
        "itl_p99_ms_max": {str(r["clients"]): r["itl_p99_ms_max"] for r in rows},
        "drafted": sum(r["drafted"] for r in rows), "accepted": sum(r["accepted"] for r in rows),
        "equal_to_solo": {"checked": checked, "equal": equal},
        "all_equal": checked > 0 and equal == checked,
    }


METHOD = {
    "engine": "build_engine as `agentfold serve` calls it: backend auto (the verdict remembered for this machine "
              "and model, else measured), suffix drafter, row-exactness self-check; in this process",
    "clients": f"{EDITS} code edits (a 60-80 line stdlib window pasted, --quick: at most {QUICK_LINES} lines of "
               "it, the window asked back with one function renamed), a fresh function, a short story; chat-templated "
               f"with the tokenizer's template; greedy, except the story: temperature {SAMPLED_TEMPERATURE}, seed = "
               "--seed + its index; drafting on",
    "sessions": "each client is an agent session in a closed loop: a turn, then its reply and a follow-up "
                f"({FOLLOW_UPS}) appended and the next turn submitted at once, the cache carried over as a session "
                "keeps it. Every client's context (its first prompt) is cached before the clock starts, as a "
                "resumed session's is (context_prefill_seconds, not in any rate)",
    "levels": "level n: the first n clients' sessions at once on a fresh Runtime(max_active=n), for window_seconds; "
              "turns begun in the window run to their end (for the equality check) but only tokens committed inside "
              "it count",
    "aggregate_tps": "tokens committed inside the window (per-token commit times on the bench's clock) over its "
                     "length; speedup_vs_1: over level 1's, the first client alone in the same loop; "
                     "speedup_vs_solo: over solo_tps, the level's own turns served one at a time (their solo runs' "
                     "tokens over seconds; level 1 runs more, later turns, which draft better)",
    "latency": "per client, pooled over its turns: ITL percentiles over the gaps between its committed tokens "
               "(tokens of one pass share a time, so a drafted reply's p50 can be 0); ttft: submit to the first "
               "committed tokens of each turn (queue and the follow-up's prefill included)",
    "exactness": "every client's turns are run again alone (the same loop, max_active=1, as many turns as its most "
                 "in any level); each turn's token ids and finish reason must equal the solo turn's",
    "lanes_off": "the top level again on a Runtime(lanes=False): every reply's verify pass alone, round-robin, "
                 "as before lanes; lanes_gain: the top level's aggregate_tps over this one's",
    "lane_stats": "the runtime's shared-pass telemetry (Runtime.lanes.summary()) per level; per client, "
                  "Turn.lane_passes: how many replies and rows shared each of its verify passes",
}
