"""`agentfold bench sessions`: time to first token of a turn resumed from disk after a restart.

The claim persistent sessions make is that a restarted runtime answers turn N of a long
conversation almost as soon as it is asked, because the KV cache of everything before the last
reply is read back from disk instead of being prefilled again. This bench measures that claim the
way it would be felt, with real processes:

1. This process loads the model and runs the first turns of a fixed conversation through a
   `SessionManager` on a fresh home, which stores a snapshot at the start of each reply.
2. A worker process (a restart: `python -m agentfold.bench.sessions`) loads the model, opens the
   same home and answers turn N: it restores the last snapshot and prefills only the last reply
   and the new message.
3. Another worker of the same kind answers the same messages on an empty home: a cold prefill.

Both workers time the request to its first token inside the process, after the model is loaded
(load and start-up are reported separately), and return their reply tokens, which must be equal:
resuming may change how much is prefilled, never the reply. Snapshot write and restore rates are
the bytes of each `SnapshotStore.save` / `SnapshotStore.load` over its seconds, and disk bytes per
1,000 tokens come from the stored snapshots' sizes.

The conversation is built from Python standard library source files, so two machines with the
same Python bench the same prompts. Speed is reported, never asserted: `identical` must hold.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentfold.bench.harness import BenchError
from agentfold.bench.prompts import encode_chat

SCHEMA = "agentfold.bench.sessions/1"
GOAL_CONTEXT = 8192  # the context label the goal is judged at
GOAL_RATIO = 0.10  # resumed TTFT at most 10% of cold TTFT
CONTEXT_HEADROOM = 512  # tokens kept free below the model's context for the reply (8192 -> 7680)
MB = 1e6

# Big stdlib modules whose source fills the conversation (the first ones present are used, in order).
FILL_SOURCES = ("argparse.py", "pydoc.py", "inspect.py", "tarfile.py", "typing.py", "subprocess.py")
# Smaller ones quoted in the later, short turns.
TURN1_SOURCE = ("textwrap.py", 400, 220)  # (file, first token, tokens)
TURN2_SOURCE = ("bisect.py", 60, 160)
SYSTEM_PROMPT = "You are a senior Python engineer reviewing standard library code with the user. Answer briefly."
REPLY_TOKENS = 64  # measured reply and setup replies (full run)
QUICK_REPLY_TOKENS = 12
WORKER_TIMEOUT_S = 3600


# -- the conversation ---------------------------------------------------------------------------


def _stdlib_file(name: str) -> Path:
    return Path(os.path.dirname(os.__file__)) / name


def _fill_text() -> tuple[str, list[str]]:
    """Concatenated source of the FILL_SOURCES present (more than 8K tokens of real code)."""
    parts, used = [], []
    for name in FILL_SOURCES:
        path = _stdlib_file(name)
        if path.is_file():
            parts.append(path.read_text(encoding="utf-8"))
            used.append(name)
    if not parts:
        raise BenchError(f"none of {', '.join(FILL_SOURCES)} found in {_stdlib_file('')}")
    return "\n\n".join(parts), used


def _excerpt(tokenizer: Any, name: str, start: int, count: int) -> str:
    path = _stdlib_file(name)
    text = path.read_text(encoding="utf-8") if path.is_file() else _fill_text()[0]
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[start : start + count])


def _user_turns(tokenizer: Any, fill_tokens: int) -> tuple[list[str], dict[str, Any]]:
    """The three user messages: a long excerpt of stdlib source, then two short ones (turn N = 2).

    Deterministic for a given Python install and tokenizer.
    """
    fill, files = _fill_text()
    fill_ids = tokenizer.encode(fill, add_special_tokens=False)
    if fill_tokens > len(fill_ids):
        raise BenchError(f"only {len(fill_ids)} tokens of stdlib source for a {fill_tokens}-token excerpt")
    big = tokenizer.decode(fill_ids[: max(fill_tokens, 0)])
    first = files[0]
    users = [
        f"Here is the start of `{first}` from the Python standard library:\n```python\n{big}\n```\n"
        "What does this module do? Answer in two sentences.",
        f"Now look at this part of `{TURN1_SOURCE[0]}`:\n```python\n{_excerpt(tokenizer, *TURN1_SOURCE)}\n```\n"
        "Is there anything risky in it?",
        f"And this from `{TURN2_SOURCE[0]}`:\n```python\n{_excerpt(tokenizer, *TURN2_SOURCE)}\n```\n"
        "Summarize it in one sentence.",
    ]
    source = {"fill_files": files, "fill_tokens": fill_tokens, "turn1": list(TURN1_SOURCE),
              "turn2": list(TURN2_SOURCE),
              "sha256": hashlib.sha256("\x00".join(users).encode()).hexdigest()}
    return users, source


def conversation(tokenizer: Any, target_tokens: int, reply_tokens: int) -> tuple[list[str], dict[str, Any]]:
    """User messages sized so that turn 2's prompt is about `target_tokens` tokens, counting
    `reply_tokens` for each of the two earlier replies (a shorter reply makes the prompt shorter)."""
    filler = tokenizer.decode(tokenizer.encode(_fill_text()[0], add_special_tokens=False)[:reply_tokens])
    users, _ = _user_turns(tokenizer, 0)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for text in users[:2]:
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": filler}]
    messages.append({"role": "user", "content": users[2]})
    overhead = len(encode_chat(tokenizer, messages))
    if target_tokens - overhead < 64:
        raise BenchError(f"a {target_tokens}-token context is too short for this conversation ({overhead} tokens)")
    return _user_turns(tokenizer, target_tokens - overhead)


# -- timing the store ---------------------------------------------------------------------------


def _time_store(store: Any) -> dict[str, list[dict[str, Any]]]:
    """Wrap the store's snapshot writes and `store.load` (on this instance) to record bytes and seconds of each.

    A write is the file half of a save (`SnapshotStore.stage` then the staged write, which the
    session manager runs on its writer thread); a state already stored is not written again.
    """
    record: dict[str, list[dict[str, Any]]] = {"saves": [], "loads": []}
    write, load = store._write_staged, store.load

    def timed_write(staged: Any) -> str:
        began = time.perf_counter()
        snapshot_id = write(staged)
        seconds = time.perf_counter() - began
        row = store.row(snapshot_id) or {}
        record["saves"].append({"snapshot_id": snapshot_id, "tokens": row.get("token_count"),
                                "bytes": row.get("bytes"), "seconds": round(seconds, 5), "written": True})
        return snapshot_id

    def timed_load(row: dict[str, Any], backend: Any) -> Any:
        began = time.perf_counter()
        hot = row["id"] in getattr(store, "_hot", {})
        cache = load(row, backend)
        record["loads"].append({"snapshot_id": row["id"], "tokens": row["token_count"], "bytes": row["bytes"],
                                "seconds": round(time.perf_counter() - began, 5), "from_memory": hot})
        return cache

    store._write_staged, store.load = timed_write, timed_load
    return record


def _rate(rows: Sequence[dict[str, Any]]) -> float | None:
    """MB/s over rows with bytes and seconds."""
    size = sum(r["bytes"] or 0 for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    return round(size / seconds / MB, 1) if size and seconds > 0 else None


# -- the worker (a restarted process) -----------------------------------------------------------


def worker(job: dict[str, Any]) -> dict[str, Any]:
    """Load the model as the server does, open `job["home"]` and answer `job["messages"]`.

    The first token is timed from the request (before the prompt is rendered) to the first
    committed token; model load and manager start-up are reported apart from it.
    """
    began = time.perf_counter()
    from agentfold.engine.decode import GenerationConfig
    from agentfold.engine.factory import build_engine
    from agentfold.engine.mlx.loader import load_model
    from agentfold.sessions import SessionManager

    imported = time.perf_counter()
    loaded = load_model(job["model"], job["dtype"])
    engine = build_engine(loaded, dtype=job["dtype"], self_check=job["self_check"])
    built = time.perf_counter()
    manager = SessionManager(engine, job["home"])  # hashes the weights for the snapshot key
    ready = time.perf_counter()
    timings = _time_store(manager.store)

    first: list[float] = []
    generate = engine.generate

    def timed_generate(prompt: Sequence[int], config: Any, cache: Any = None, cuts: Sequence[int] = (),
                       on_prefill: Any = None) -> Any:
        generation = engine.stream(prompt, config, cache, cuts, on_prefill)
        for delta in generation:
            if delta.tokens and not first:
                first.append(time.perf_counter())
        return generation.completion

    engine.generate = timed_generate  # the manager calls engine.generate: see when its first token lands
    config = GenerationConfig(max_tokens=job["max_tokens"], draft=True)
    requested = time.perf_counter()
    try:
        completion, info = manager.reply(job["messages"], config, session_id=job.get("session_id"))
    finally:
        engine.generate = generate
    done = time.perf_counter()
    stats = completion.stats
    ttft = first[0] - requested
    restore = sum(r["seconds"] for r in timings["loads"])
    save = sum(r["seconds"] for r in timings["saves"])
    return {
        "pid": os.getpid(),
        "import_seconds": round(imported - began, 3),
        "model_load_seconds": round(loaded.load_seconds, 3),
        "engine_build_seconds": round(built - imported, 3),  # load + self-check
        "manager_init_seconds": round(ready - built, 3),
        "startup_seconds": round(ready - began, 3),
        "self_check": job["self_check"],
        "exactness": engine.exactness.describe(),
        "ttft_seconds": round(ttft, 4),
        "ttft_breakdown": {
            "restore_seconds": round(restore, 4),
            "snapshot_save_seconds": round(save, 4),
            "other_seconds": round(ttft - restore - save, 4),  # render, prefill, first pass
        },
        "manager_ttft_seconds": round(stats.ttft_seconds, 4),  # the manager's own clock (after render)
        "reply_seconds": round(done - requested, 4),
        "prompt_tokens": info.prompt_tokens,
        "cached_tokens": info.cached_tokens,
        "prefilled_tokens": info.prompt_tokens - info.cached_tokens,
        "restored_snapshot_id": info.snapshot_id,
        "saved_snapshot_id": info.saved_snapshot_id,
        "miss_reasons": info.miss_reasons,
        "session_id": info.session_id,
        "turn_index": info.turn_index,
        "reply_tokens": len(completion.tokens),
        "finish_reason": completion.finish_reason,
        "draft_method": stats.draft_method,
        "decode_tps": round(stats.decode_tps, 3),
        "tokens": completion.tokens,
        "token_sha": completion.token_sha,
        "text_head": completion.text[:200],
        "saves": timings["saves"],
        "loads": timings["loads"],
    }


def run_worker(job: dict[str, Any]) -> dict[str, Any]:
    """Run `worker(job)` in a new Python process; its answer is the last line of its stdout."""
    began = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "agentfold.bench.sessions"], input=json.dumps(job),
                              capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise BenchError(f"session worker did not answer within {WORKER_TIMEOUT_S}s") from None
    if done.returncode != 0 or not done.stdout.strip():
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise BenchError(f"session worker exited with {done.returncode}: {tail}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    answer["process_seconds"] = round(time.perf_counter() - began, 3)
    return answer


def _worker_main() -> int:
    from agentfold import prepare_process

    blas = prepare_process()  # the BLAS `agentfold serve` loads, before the worker imports mlx.core
    print(json.dumps({**worker(json.load(sys.stdin)), "blas": blas.describe()}), flush=True)
    return 0


# -- the benchmark ------------------------------------------------------------------------------


def _context_length(config: dict[str, Any]) -> int | None:
    for key in ("max_position_embeddings", "context_length", "n_ctx", "max_seq_len"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _setup_turns(manager: Any, users: Sequence[str], config: Any, context: int,
                 say: Callable[[str], None]) -> tuple[list[dict[str, str]], str | None, list[dict[str, Any]]]:
    """Turns 0 and 1 answered here, each reply's start stored: (the messages so far, session id, a row per turn)."""
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    session, setup_turns = None, []
    for index, text in enumerate(users[:2]):
        messages.append({"role": "user", "content": text})
        began = time.perf_counter()
        completion, info = manager.reply(messages, config, session)
        session = info.session_id
        messages.append({"role": "assistant", "content": completion.text})
        setup_turns.append({"turn": index, "prompt_tokens": info.prompt_tokens,
                            "cached_tokens": info.cached_tokens, "reply_tokens": len(completion.tokens),
                            "seconds": round(time.perf_counter() - began, 3),
                            "saved_snapshot_id": info.saved_snapshot_id})
        say(f"bench sessions: {context}: setup turn {index}: {info.prompt_tokens} prompt tokens "
            f"({info.cached_tokens} restored), {time.perf_counter() - began:.1f}s")
    return messages, session, setup_turns


def _one_context(engine: Any, model_path: Path, dtype: str, context: int, target: int, reply_tokens: int,
                 self_check: bool, say: Callable[[str], None]) -> dict[str, Any]:
    """Setup turns here, then turn 2 resumed in one worker and cold in another; one JSON row."""
    from agentfold.engine.decode import GenerationConfig
    from agentfold.sessions import SessionManager

    tokenizer = engine.tokenizer
    users, source = conversation(tokenizer, target, reply_tokens)
    setup_config = GenerationConfig(max_tokens=reply_tokens, draft=False)
    with tempfile.TemporaryDirectory(prefix="agentfold-bench-resume-") as resume_home, \
            tempfile.TemporaryDirectory(prefix="agentfold-bench-cold-") as cold_home:
        manager = SessionManager(engine, resume_home)
        timings = _time_store(manager.store)
        setup_began = time.perf_counter()
        messages, session, setup_turns = _setup_turns(manager, users, setup_config, context, say)
        messages.append({"role": "user", "content": users[2]})
        setup_seconds = time.perf_counter() - setup_began
        expected_snapshot = setup_turns[-1]["saved_snapshot_id"]
        snapshot_row = manager.store.row(expected_snapshot) if expected_snapshot else None
        del manager

        job = {"model": str(model_path), "dtype": dtype, "messages": messages, "max_tokens": reply_tokens,
               "self_check": self_check}
        say(f"bench sessions: {context}: restarted worker answers turn 2 from the stored session")
        resumed = run_worker({**job, "home": resume_home, "session_id": session})
        say(f"bench sessions: {context}: resumed ttft {resumed['ttft_seconds']:.3f}s "
            f"({resumed['cached_tokens']} tokens restored, {resumed['prefilled_tokens']} prefilled; "
            f"model load {resumed['model_load_seconds']:.1f}s)")
        say(f"bench sessions: {context}: worker on an empty home answers the same turn cold")
        cold = run_worker({**job, "home": cold_home, "session_id": None})
        say(f"bench sessions: {context}: cold ttft {cold['ttft_seconds']:.3f}s ({cold['prefilled_tokens']} prefilled)")

    identical = resumed["tokens"] == cold["tokens"]
    ratio = round(resumed["ttft_seconds"] / cold["ttft_seconds"], 4) if cold["ttft_seconds"] > 0 else None
    saves = [s for s in timings["saves"] + resumed["saves"] + cold["saves"] if s["written"] and s["bytes"]]
    restores = [r for r in resumed["loads"] if not r["from_memory"]]
    largest = max(saves, key=lambda s: s["tokens"] or 0) if saves else None
    per_1k = round(largest["bytes"] / largest["tokens"] * 1000) if largest and largest["tokens"] else None
    say(f"bench sessions: {context}: resumed/cold ttft {ratio} "
        f"({'identical' if identical else 'DIFFERENT'} replies), write {_rate(saves)} MB/s, "
        f"restore {_rate(restores)} MB/s, {per_1k} bytes per 1,000 tokens")
    return {
        "context": context,
        "target_prompt_tokens": target,
        "prompt_tokens": cold["prompt_tokens"],
        "turn_index": 2,
        "reply_max_tokens": reply_tokens,
        "conversation": {**source, "setup_turns": setup_turns, "setup_seconds": round(setup_seconds, 3)},
        "resumed_ttft_seconds": resumed["ttft_seconds"],
        "cold_ttft_seconds": cold["ttft_seconds"],
        "resumed_ttft_over_cold": ratio,
        "cold_over_resumed": round(1 / ratio, 2) if ratio else None,
        "identical": identical,
        "restored_setup_snapshot": expected_snapshot is not None and resumed["restored_snapshot_id"] == expected_snapshot,
        "restored_tokens": resumed["cached_tokens"],
        "snapshot": {
            "restored_bytes": snapshot_row["bytes"] if snapshot_row else None,
            "restored_tokens": snapshot_row["token_count"] if snapshot_row else None,
            "write_mb_s": _rate(saves),
            "restore_mb_s": _rate(restores),
            "disk_bytes_per_1k_tokens": per_1k,
            "saves": saves,
            "restores": restores,
        },
        "resumed": resumed,
        "cold": cold,
    }


def bench_sessions(model: str | None, out: str | Path, contexts: Sequence[int] = (2048, 8192), quick: bool = False,
                   progress: Callable[[str], None] | None = print, dtype: str = "float32") -> dict[str, Any]:
    """Resumed-after-restart vs cold time to first token at each context size; writes JSON to `out`.

    `contexts` are labels in tokens; each point's prompt is the label, capped at the model's
    context less CONTEXT_HEADROOM (SmolLM2's 8192 becomes 7680) so the prompt and reply fit.
    `quick`: only the smallest context, short replies, no self-check in the workers.
    """
    from agentfold.bench.machine import finish_run, machine_info, run_header, utc_timestamp
    from agentfold.bench.weights import model_bytes, model_record
    from agentfold.engine.factory import build_engine
    from agentfold.engine.mlx.loader import load_model
    from agentfold.serve.models import resolve

    say = progress or (lambda message: None)
    started = time.perf_counter()
    timestamp = utc_timestamp()
    contexts = sorted({int(c) for c in contexts})
    if not contexts:
        raise ValueError("contexts must name at least one context size")
    if quick:
        contexts = contexts[:1]
    reply_tokens = QUICK_REPLY_TOKENS if quick else REPLY_TOKENS
    self_check = not quick
    machine = machine_info()

    path = resolve(model)
    say(f"bench sessions: loading model {path}")
    loaded = load_model(path, dtype)
    engine = build_engine(loaded, dtype=dtype, drafter="none", self_check=False)  # setup turns only
    size, params = model_bytes(engine.backend.model)
    limit = _context_length(loaded.config)

    points: dict[str, dict[str, Any]] = {}
    for context in contexts:
        target = min(context, limit - CONTEXT_HEADROOM) if limit else context
        say(f"bench sessions: {context}: conversation of ~{target} tokens, turn 2 after a restart")
        points[str(context)] = _one_context(engine, path, dtype, context, target, reply_tokens, self_check, say)

    goal_point = points.get(str(GOAL_CONTEXT))
    goal_ratio = goal_point["resumed_ttft_over_cold"] if goal_point else None
    all_saves = [s for p in points.values() for s in p["snapshot"]["saves"]]
    all_restores = [r for p in points.values() for r in p["snapshot"]["restores"]]
    result: dict[str, Any] = {
        **run_header(SCHEMA, timestamp, quick, machine),
        "model": {**model_record(loaded, dtype, size, params), "context_length": limit},
        "method": {
            "conversation": ("system + 3 user turns of Python stdlib source; turns 0-1 answered here (snapshots "
                             "at each reply's start), turn 2 timed"),
            "resumed": ("a new process (python -m agentfold.bench.sessions) loads the model, opens the same home "
                        "and answers turn 2 in the same session: restore, prefill the rest, first token"),
            "cold": "the same kind of process on an empty home: prefill all of turn 2's prompt, first token",
            "ttft": ("inside the worker, from the request (before the chat template is rendered) to the first "
                     "committed token; model load, self-check and manager start-up excluded and reported"),
            "snapshot_rates": ("bytes / seconds of SnapshotStore.save (write, sha256, fsync, index) and "
                               "SnapshotStore.load from disk after the restart (read, sha256, parse); MB = 1e6 "
                               "bytes; the file is in the OS page cache when it is restored"),
            "sampling": "greedy",
            "worker_self_check": self_check,
        },
        "contexts": points,
        "summary": {
            "all_identical": all(p["identical"] for p in points.values()),
            "resumed_ttft_over_cold": {c: p["resumed_ttft_over_cold"] for c, p in points.items()},
            "resumed_ttft_seconds": {c: p["resumed_ttft_seconds"] for c, p in points.items()},
            "cold_ttft_seconds": {c: p["cold_ttft_seconds"] for c, p in points.items()},
            "write_mb_s": _rate(all_saves),
            "restore_mb_s": _rate(all_restores),
            "disk_bytes_per_1k_tokens": max((p["snapshot"]["disk_bytes_per_1k_tokens"] or 0 for p in points.values()),
                                            default=None),
            "goal": f"resumed TTFT <= {GOAL_RATIO:.0%} of cold at {GOAL_CONTEXT} tokens of context",
            "goal_ratio": goal_ratio,
            "goal_met": None if goal_ratio is None else goal_ratio <= GOAL_RATIO,
        },
    }
    finish_run(result, started, out)
    say(f"bench sessions: done in {result['duration_seconds']:.0f}s")
    return result


if __name__ == "__main__":  # the worker: one job on stdin, one JSON answer on stdout
    sys.exit(_worker_main())
