"""`agentfold bench all`: agent workloads through the real HTTP server, against baselines, in one run.

What an operator choosing a local engine for agent work needs is not one tokens-per-second figure
but how the engine behaves on an agent's turns: how long the first token takes as the context
grows, how steady the stream is while it writes code or a tool call, how much drafting actually
pays and whether it changes any byte, how much a resumed turn saves over a cold one, what memory
it holds, and how all of that compares with other engines on the same machine and the same
prompt. This module runs it all in one go:

1. The main model is served by `agentfold serve` (a subprocess, fresh home, free port) and each
   workload session (`bench_workloads`) runs turn by turn through the official `openai` client,
   streamed; every drafted request is sent again with `"draft": false` to check equality.
2. A second server with an empty home answers the resumed turns cold.
3. Contexts longer than the main model's window (16K for SmolLM2) run on a long-context model
   (Gemma 3 270M) in a third server, or are recorded as skipped with the reason.
4. Baselines decode the exact prompt ids the server saw (read back from its telemetry), right
   after each workload's session while the server idles: stock mlx-lm, transformers on torch CPU,
   AgentFold's torch backend when present; the roofline is the weights' bytes over the measured
   copy bandwidth.
5. In this process, 1, 2, 4 and 8 concurrent agent clients on one runtime (`bench.lanes`; 1 and 2
   with --quick): aggregate throughput, per-client latency, every reply equal to its solo run.

Speed is reported, never asserted; the equality flags are the part that must hold.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentfold.bench.baselines import SPECULATIVE_SKIPPED, Baselines
from agentfold.bench.harness import BenchError, ServerProcess
from agentfold.bench.machine import copy_bandwidth, finish_run, loadavg, machine_info, run_header, utc_timestamp
from agentfold.bench.server import WARMUP, assistant_message, client_for, dump_reply, stream_chat
from agentfold.bench.weights import model_entry
from agentfold.bench.workloads import KINDS, build_sessions, describe

SCHEMA = "agentfold.bench.suite/1"
FULL_CONTEXTS = (1024, 4096, 16384)
QUICK_CONTEXTS = (1024,)
SESSION_ROOM = 1536  # tokens a session needs after its first prompt: replies, the pasted tool result
BASELINE_TURNS = {"agent-edit": 2, "agent-tool": 2, "fresh-code": 1, "prose": 1}  # the turn each baseline decodes
QUICK_BASELINES = ("agent-edit",)
QUICK_COLD = ("agent-edit",)
LONG_KINDS = ("agent-edit",)  # a 16K prefill takes minutes on two cores: one session kind at long contexts
TELEMETRY_KEYS = (
    "ttft_ms", "prefill_ms", "decode_ms", "total_ms", "queue_ms", "cache_restore_ms", "decode_tps", "prefill_tps",
    "prefilled_tokens", "completion_tokens", "itl_p50", "itl_p90", "itl_p99", "itl_max", "pass_p50", "pass_p99",
    "draft_method", "verify_passes", "drafted", "accepted", "discarded", "tokens_per_pass", "acceptance_rate",
    "accepted_per_position", "proposed_per_position", "token_sha", "emit_ms", "snapshot_id", "cache_match_tokens",
    "cache_miss_reason", "tool_calls",
)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# -- one server's sessions ----------------------------------------------------------------------


class SessionRunner:
    """Runs sessions on one server: each turn drafted, then the same request with `"draft": false`."""

    def __init__(self, server: ServerProcess, model: str, seed: int, say: Callable[[str], None]) -> None:
        self.server = server
        self.client = client_for(server)
        self.model = model
        self.seed = seed
        self.say = say
        self.rows: list[dict[str, Any]] = []
        self.history: dict[tuple[str, int, int], list[dict[str, Any]]] = {}  # requests, for the cold replay

    def warm_up(self) -> None:
        for draft in (True, False):
            stream_chat(self.client, WARMUP, 4, draft=draft, session_id="warmup", seed=self.seed)

    def run(self, session: dict[str, Any]) -> None:
        """The session turn by turn; each turn's messages are kept for the cold replay."""
        name, context = session["name"], session["context"]
        sid = f"{name}-{context}-{self.seed}"
        messages: list[dict[str, Any]] = [{"role": "system", "content": session["system"]}]
        previous: dict[str, Any] | None = None
        for index, turn in enumerate(session["turns"], start=1):
            as_user = False
            if "user" in turn:
                messages.append({"role": "user", "content": turn["user"]})
            elif previous is not None and previous["tool_calls"]:
                call_id = previous["tool_calls"][0]["id"] or "call_0"
                messages.append({"role": "tool", "tool_call_id": call_id, "content": turn["tool_result"]})
            else:  # the model did not call the tool: hand the result over as the user would
                messages.append({"role": "user", "content": f"Tool result:\n{turn['tool_result']}"})
                as_user = True
            self.history[(name, context, index)] = list(messages)
            drafted = self.send(session, turn, messages, "drafted", sid, index)
            drafted["tool_result_as_user"] = as_user
            twin = self.send(session, turn, messages, "serial", f"{sid}-serial", index)
            equal = twin["server"].get("token_sha") == drafted["server"].get("token_sha") \
                and twin["reply_sha"] == drafted["reply_sha"]
            self.say(f"{self.model} {name} @{context} turn {index} ({turn['category']}): "
                     f"{drafted['prompt_tokens']} prompt ({drafted['cached_tokens']} cached), "
                     f"ttft {drafted['client']['ttft_s']}s, {drafted['completion_tokens']} tokens, "
                     f"{(drafted['server'].get('tokens_per_pass') or 0):.2f} tok/pass"
                     + f", {'equal to serial' if equal else 'DIFFERENT from serial'}")
            messages.append(assistant_message(drafted["_reply"]))
            previous = drafted["_reply"]

    def send(self, session: dict[str, Any], turn: dict[str, Any], messages: list[dict[str, Any]], mode: str,
             session_id: str, index: int) -> dict[str, Any]:
        reply = stream_chat(self.client, list(messages), turn["max_tokens"], draft=mode != "serial",
                            session_id=session_id, tools=session.get("tools"), tool_choice=turn.get("tool_choice"),
                            seed=self.seed)
        block = reply["agentfold"] or {}
        if not block:
            raise BenchError(f"{session['name']} turn {index}: the last chunk carried no agentfold telemetry")
        row = {
            "model": self.model, "workload": session["name"], "context": session["context"], "turn": index,
            "category": turn["category"], "mode": mode, "session_id": session_id, "turn_id": block.get("turn_id"),
            "prompt_tokens": block.get("prompt_tokens"), "cached_tokens": block.get("cached_tokens"),
            "completion_tokens": block.get("completion_tokens"), "max_tokens": turn["max_tokens"],
            "finish_reason": reply["finish_reason"], "reply_sha": _sha(dump_reply(reply)),
            "text_head": reply["content"][:160],
            "tool_calls": [{"name": c["name"], "arguments": c["arguments"][:200]} for c in reply["tool_calls"]],
            "client": {k: reply[k] for k in ("ttft_s", "total_s", "chunks", "chunk_gaps_ms")},
            "loadavg": loadavg(),  # other work on the machine while this was measured
            "server": {**{k: v for k, v in block.items() if k != "exactness"}, "timings": reply["timings"]},
            "_reply": reply,
        }
        self.rows.append(row)
        return row

    def inputs(self, turn_id: str, timeout: float = 60.0) -> dict[str, Any] | None:
        """A finished turn's prompt and reply ids, read from the running server's telemetry (the writer
        thread commits a turn moments after its last chunk, so this waits for it a little)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stored = self.server.telemetry([turn_id]).get(turn_id)
            if stored and (stored.get("inputs") or {}).get("prompt"):
                return stored["inputs"]
            time.sleep(0.2)
        return None

    def finish(self) -> None:
        """Fold the stopped server's telemetry rows into the request rows."""
        stored = self.server.telemetry([r["turn_id"] for r in self.rows if r["turn_id"]])
        for row in self.rows:
            row.pop("_reply", None)
            got = stored.get(row["turn_id"])
            if got is None:
                row["server"]["telemetry"] = "missing"
                continue
            row["server"].update({k: got.get(k) for k in TELEMETRY_KEYS})


def _serve(path: Path | str, dtype: str, role: str, model_bytes_: int, say: Callable[[str], None],
           work: Callable[[ServerProcess], SessionRunner]) -> tuple[SessionRunner, dict[str, Any]]:
    """Start a server, let `work` run its requests, record its memory and /metrics, stop it, read its telemetry."""
    server = ServerProcess.for_bench(path, dtype=dtype, progress=lambda m: say(f"{role} server: {m}"))
    try:
        server.start()
        runner = work(server)
        metrics = server.metrics()
        memory = server.memory()
        server.stop()
        runner.finish()
        health = server.health_at_start
        record = {"role": role, "model": runner.model, "startup_seconds": server.startup_seconds,
                  "exactness": health.get("exactness"), "context_length": health.get("context_length"),
                  "vm_hwm_bytes": memory.get("VmHWM"), "vm_rss_bytes": memory.get("VmRSS"),
                  "model_bytes": model_bytes_, "metrics": metrics}
        return runner, record
    finally:
        server.cleanup()


# -- the suite ----------------------------------------------------------------------------------


class Suite:
    """One run: the models, what each server measured, and what was skipped and why."""

    def __init__(self, seed: int, quick: bool, dtype: str, say: Callable[[str], None]) -> None:
        self.seed, self.quick, self.dtype, self.say = seed, quick, dtype, say
        self.requests: list[dict[str, Any]] = []
        self.servers: list[dict[str, Any]] = []
        self.jobs: dict[str, dict[str, Any]] = {}  # workload -> the baseline turn (without its ids)
        self.workloads: dict[str, Any] = {}
        self.sessions: dict[tuple[str, str, int], dict[str, Any]] = {}  # (model, kind, context) -> session
        self.skipped: list[dict[str, str]] = []

    def skip(self, what: str, reason: str) -> None:
        self.skipped.append({"what": what, "reason": reason})

    def build(self, model: dict[str, Any], tokenizer: Any, context: int, short: bool,
              kinds: Sequence[str] = KINDS) -> list[dict[str, Any]]:
        """Sessions for one context; `short`: --quick's turns and reply budgets (long contexts measure TTFT)."""
        sessions = build_sessions(self.seed, context, tokenizer, quick=short, kinds=kinds)
        self.workloads[f"{model['name']}@{context}"] = [{**describe(s), "short": short} for s in sessions]
        for session in sessions:
            self.sessions[(model["name"], session["name"], context)] = session
        return sessions

    def serve(self, path: Path, model: dict[str, Any], role: str,
              work: Callable[[SessionRunner], None]) -> SessionRunner:
        """Start a server for `model`, warm it up, run `work`, keep its rows, memory, metrics and telemetry."""
        def run(server: ServerProcess) -> SessionRunner:
            runner = SessionRunner(server, model["name"], self.seed, self.say)
            runner.warm_up()
            work(runner)
            return runner

        runner, record = _serve(path, self.dtype, role, model["bytes"], self.say, run)
        self.requests += runner.rows
        self.servers.append(record)
        return runner

    def run_main(self, path: Path, model: dict[str, Any], tokenizer: Any, contexts: Sequence[int],
                 baselines: Baselines) -> SessionRunner:
        """Every session at every context the main model holds, each turn drafted and serial; at the
        smallest context, each workload's baselines right after it (the server idle meanwhile)."""
        def work(runner: SessionRunner) -> None:
            for context in contexts:
                for session in self.build(model, tokenizer, context, self.quick or context != contexts[0]):
                    runner.run(session)
                    if context == contexts[0] and (session["name"] in QUICK_BASELINES or not self.quick):
                        self.run_baselines(runner, session, baselines)

        return self.serve(path, model, "main", work)

    def run_baselines(self, runner: SessionRunner, session: dict[str, Any], baselines: Baselines) -> None:
        """The baselines on the exact prompt ids of the session's baseline turn (its serial request)."""
        from agentfold.engine.decode import token_sha

        kind = session["name"]
        turn = min(BASELINE_TURNS[kind], len(session["turns"]))
        row = next(r for r in runner.rows if r["workload"] == kind and r["context"] == session["context"]
                   and r["turn"] == turn and r["mode"] == "serial")
        got = runner.inputs(row["turn_id"])
        if got is None:
            self.skip(f"baselines on {kind}", "the server's telemetry never showed its serial turn's prompt")
            return
        job = {"model": row["model"], "context": row["context"], "turn": turn, "prompt": got["prompt"],
               "reply": got.get("reply") or [], "max_tokens": got["max_tokens"], "prompt_tokens": len(got["prompt"]),
               "reply_sha": token_sha(got.get("reply") or []), "prompt_sha256": token_sha(got["prompt"]),
               "constrained": bool(got.get("grammar"))}
        baselines.run(kind, job)
        self.jobs[kind] = {k: v for k, v in job.items() if k not in ("prompt", "reply")}

    def run_cold(self, path: Path, model: dict[str, Any], main: SessionRunner, contexts: Sequence[int]) -> None:
        """The resumed turns again, on a server with an empty home."""
        plan = [(c, k) for c in contexts for k in KINDS
                if (k in QUICK_COLD if self.quick else (c == contexts[0] or k == "agent-edit"))]
        for c in contexts:
            for k in KINDS:
                if (c, k) not in plan:
                    self.skip(f"cold turn 2 of {k} at {c} tokens", "a cold prefill of this size is measured for "
                              "agent-edit only" + (" in --quick" if self.quick else " above the smallest context"))
        if not plan:
            return

        def work(runner: SessionRunner) -> None:
            for context, kind in plan:
                session = self.sessions[(model["name"], kind, context)]
                row = runner.send(session, session["turns"][1], main.history[(kind, context, 2)], "cold",
                                  f"cold-{kind}-{context}", 2)
                self.say(f"cold {kind} @{context} turn 2: {row['prompt_tokens']} prompt, "
                         f"ttft {row['client']['ttft_s']}s")

        self.serve(path, model, "cold", work)

    def run_long(self, long_model: str | None, main: dict[str, Any], beyond: Sequence[int],
                 reference: Sequence[int]) -> dict[str, Any] | None:
        """Contexts beyond the main model's window on a long-context model (default Gemma 3 270M)."""
        from agentfold.bench.baselines import converted_folder
        from agentfold.engine.mlx.loader import load_model
        from agentfold.serve.models import ModelNotFound, gemma3_path

        try:
            path = Path(long_model) if long_model else converted_folder(gemma3_path())
            self.say(f"loading {path} in this process (tokenizer, weight bytes)")
            loaded = load_model(path, self.dtype, self.say)
        except (ModelNotFound, FileNotFoundError, ValueError) as error:
            for c in beyond:
                self.skip(f"{c}-token context", f"exceeds {main['name']}'s context {main['context_length']} and no "
                          f"long-context model is available: {error}")
            return None
        model = model_entry(loaded, self.dtype, "long")
        contexts = [c for c in [*reference[:1], *beyond] if c + SESSION_ROOM <= model["context_length"]]
        for c in beyond:
            if c not in contexts:
                self.skip(f"{c}-token context", f"exceeds both {main['name']}'s and {model['name']}'s context")
                continue
            for k in KINDS:
                if k not in LONG_KINDS:
                    self.skip(f"{k} at {c} tokens", f"exceeds {main['name']}'s context {main['context_length']}; on "
                              f"{model['name']} only {', '.join(LONG_KINDS)} runs at long contexts (each prefill "
                              "takes minutes on this machine)")
            self.skip(f"cold turn 2 at {c} tokens on {model['name']}",
                      "a second prefill of this size takes minutes; turn 1's TTFT is the cold figure")

        def work(runner: SessionRunner) -> None:
            for context in contexts:
                for session in self.build(model, loaded.tokenizer, context, True, kinds=LONG_KINDS):
                    runner.run(session)

        self.serve(path, model, "long", work)
        return model

    def run_servers(self, path: Path, loaded: Any, main: dict[str, Any], fits: Sequence[int],
                    beyond: Sequence[int], long_model: str | None) -> tuple[dict[str, Any] | None, Baselines]:
        """The main server (each workload's baselines right after it), the cold one, the long-context one:
        (the long-context model's record or None, the baselines)."""
        baselines = Baselines(path, loaded, self.dtype, self.quick, self.say)
        try:
            runner = self.run_main(path, main, loaded.tokenizer, fits, baselines)
        finally:
            baselines.close()
        if self.quick:
            self.skip("baselines on " + ", ".join(k for k in KINDS if k not in QUICK_BASELINES),
                      "--quick runs the baselines on agent-edit's code turn only")
        for key, reason in baselines.skipped.items():
            self.skip(f"baseline {key}", reason)
        self.skip("baseline mlx_lm_speculative", SPECULATIVE_SKIPPED)
        self.run_cold(path, main, runner, fits)
        long = self.run_long(long_model, main, beyond, fits) if beyond else None
        if self.quick and not beyond:
            self.skip("4K and 16K contexts", "--quick measures the 1K context only")
        return long, baselines


def _main_model(model: str | None, contexts: Sequence[int], dtype: str,
                say: Callable[[str], None]) -> tuple[Path, Any, dict[str, Any], list[int], list[int]]:
    """The main model loaded here (tokenizer, weight bytes, baselines), and the contexts it holds or not."""
    from agentfold.engine.mlx.loader import load_model
    from agentfold.serve.models import resolve

    path = resolve(model)
    say(f"loading {path} in this process (tokenizer, weight bytes, baselines)")
    loaded = load_model(path, dtype, say)
    main = model_entry(loaded, dtype, "main")
    fits = [c for c in contexts if c + SESSION_ROOM <= main["context_length"]]
    beyond = [c for c in contexts if c not in fits]
    if not fits:
        raise BenchError(f"none of the contexts {list(contexts)} fits {main['name']}'s {main['context_length']} tokens")
    return path, loaded, main, fits, beyond


def _roofline(bandwidth: dict[str, Any], models: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    return {**bandwidth, "note": "one full read of the weights per token at the measured copy bandwidth",
            "models": {m["name"]: {"bytes": m["bytes"], "tps": round(bandwidth["bandwidth_gbs"] * 1e9 / m["bytes"], 3)}
                       for m in models.values() if m}}


def _agent_section(path: Path, quick: bool, seed: int, dtype: str, say: Callable[[str], None]) -> dict[str, Any]:
    """The agent session bench on the main model (skipped in --quick: it adds minutes)."""
    if quick:  # the agent session (37 requests, a restart, a fresh server) adds minutes
        return {"skipped": "quick: run `agentfold bench agent --quick` on its own"}
    from agentfold.bench.agent import bench_agent

    try:
        return bench_agent(str(path), None, seed=seed, dtype=dtype, progress=say)
    except BenchError as error:
        return {"error": str(error)}


def _lanes_section(path: Path, quick: bool, seed: int, dtype: str, say: Callable[[str], None]) -> dict[str, Any]:
    """Concurrent agent clients on one in-process runtime, against their solo replies (`bench.lanes`)."""
    from agentfold.bench.lanes import bench_lanes

    try:
        return bench_lanes(str(path), None, quick=quick, seed=seed, dtype=dtype, progress=say)
    except BenchError as error:
        return {"error": str(error)}


def _summary(result: dict[str, Any], suite: Suite) -> dict[str, Any]:
    exact = result["sections"]["exactness"]
    resumed = [r for r in result["sections"]["resume"] if r["identical"] is not None]
    return {
        "all_equal": exact["all_equal"], "compared": exact["compared"],
        "resumed_identical_to_cold": all(r["identical"] for r in resumed) if resumed else None,
        "resumed_vs_cold_ratios": [r["ratio"] for r in resumed],
        "requests": len(suite.requests), "skipped": len(suite.skipped),
        "lanes_all_equal": (result.get("lanes") or {}).get("summary", {}).get("all_equal"),
    }


def bench_all(model: str | None = None, out: str | Path = "bench-results/suite.json", quick: bool = False,
              report_dir: str | Path | None = None, contexts: Sequence[int] | None = None,
              long_model: str | None = None, seed: int = 0, dtype: str = "float32",
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the whole suite and write its JSON (and the report when `report_dir` is given)."""
    from agentfold.bench.summary import records, sections

    say = progress or (lambda message: None)
    started = time.perf_counter()
    result: dict[str, Any] = {**run_header(SCHEMA, utc_timestamp(), quick, machine_info()), "seed": seed,
                              "sampling": "greedy (temperature 0); drafted and serial requests identical otherwise"}
    contexts = tuple(sorted(set(contexts or (QUICK_CONTEXTS if quick else FULL_CONTEXTS))))
    suite = Suite(seed, quick, dtype, say)
    main_path, loaded, main, fits, beyond = _main_model(model, contexts, dtype, say)
    say("measuring copy bandwidth")
    bandwidth = copy_bandwidth(megabytes=128 if quick else 256, repeats=2 if quick else 4)
    long, baselines = suite.run_servers(main_path, loaded, main, fits, beyond, long_model)
    models = {"main": main, "long": long}
    result.update({
        "models": models,
        "contexts": {"requested": list(contexts), "main": fits, "long": list(beyond)},
        "roofline": _roofline(bandwidth, models),
        "workloads": suite.workloads,
        "servers": suite.servers,
        "requests": suite.requests,
        "baseline_jobs": suite.jobs,
        "baselines": baselines.result(),
        "skipped": suite.skipped,
        "method": METHOD,
    })
    result["agent"] = _agent_section(main_path, quick, seed, dtype, say)
    result["lanes"] = _lanes_section(main_path, quick, seed, dtype, say)
    result["sections"] = sections(result)
    result["records"] = records(result)
    result["summary"] = _summary(result, suite)
    finish_run(result, started, out)
    exact = result["sections"]["exactness"]
    say(f"suite done in {result['duration_seconds']:.0f}s: {exact['compared']} drafted replies compared, "
        f"{'all equal to serial' if exact['all_equal'] else 'SOME DIFFER from serial'}")
    if report_dir is not None:
        from agentfold.bench.report import write_report

        written = write_report(result, report_dir)
        say(f"report: {', '.join(str(p) for p in written)}")
    return result


METHOD = {
    "client": "official openai client, streamed, against `agentfold serve` on 127.0.0.1 (own process, fresh "
              "--home, --max-active 1); ttft_s = call to first chunk with text or a tool call",
    "server": "last chunk's `agentfold` / `timings` blocks, the telemetry SQLite of the server's home (read after "
              "it stopped), GET /metrics before stopping",
    "serial_twin": "each drafted request is sent again with extra body {\"draft\": false}",
    "cold": "the resumed turn's exact messages sent to a second server with an empty home",
    "memory": "VmHWM of the server process (/proc/PID/status) after all its requests",
    "decode_rate": "server decode_tps: tokens after the first verify pass over the time after it; baselines: the "
                   "same over their token clocks (bench.steady_tps)",
    "lanes": "in this process: the engine `agentfold serve` builds, 1, 2, 4, 8 concurrent agent clients (quick: 1, "
             "2) submitted at once to one Runtime, each reply compared with its solo run (details in lanes.method)",
    "short_sessions": "contexts above the smallest (and --quick) use short replies and fewer turns: they measure "
                      "time to first token and resuming, the smallest context measures decoding",
}
