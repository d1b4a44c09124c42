"""From the suite's raw request rows to its sections and its flat, self-describing records.

Pure functions over JSON-ready dicts (no model, no server), so `agentfold bench report` and the
tests can recompute or check every figure from the JSON alone. Each flat record carries the
machine, model, dtype, versions, workload, engine and context it was measured with, so a figure
copied out of the file still says what it means.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

CATEGORIES = ("code", "tool_call", "prose")


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(np.asarray(values, dtype=np.float64), q)), 3) if values else None


def percentiles(values: list[float]) -> dict[str, Any]:
    return {"n": len(values), "p50": _pct(values, 50), "p90": _pct(values, 90), "p99": _pct(values, 99),
            "max": _pct(values, 100)}


def _ratio(a: float | None, b: float | None, digits: int = 4) -> float | None:
    return round(a / b, digits) if a is not None and b else None


def server_gaps(row: dict[str, Any]) -> tuple[list[float], list[float]]:
    """(per-token gaps, gaps between verify passes) in ms from the server's emit clock."""
    emit = (row.get("server") or {}).get("emit_ms") or []
    gaps = np.diff(np.asarray(emit, dtype=np.float64)).tolist() if len(emit) > 1 else []
    return gaps, [g for g in gaps if g > 0]


def itl_section(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Inter-token latency per model, turn category (code / tool_call / prose) and mode.

    `server_token_ms`: the telemetry's per-token gaps (0 between tokens of one verify pass);
    `server_pass_ms`: the gaps between passes; `client_chunk_ms`: gaps between streamed chunks as
    the client saw them. A tool call streams as one piece when complete, so it has no client gaps.
    """
    out: dict[str, Any] = {}
    for row in requests:
        if row["mode"] not in ("drafted", "serial"):
            continue
        slot = out.setdefault(row["model"], {}).setdefault(row["category"], {}).setdefault(
            row["mode"], {"server_token_ms": [], "server_pass_ms": [], "client_chunk_ms": [], "turns": 0})
        tokens, passes = server_gaps(row)
        slot["server_token_ms"] += tokens
        slot["server_pass_ms"] += passes
        if row["category"] != "tool_call":
            slot["client_chunk_ms"] += row["client"]["chunk_gaps_ms"]
        slot["turns"] += 1
    for categories in out.values():
        for modes in categories.values():
            for mode, slot in modes.items():
                modes[mode] = {"turns": slot["turns"], **{k: percentiles(v) for k, v in slot.items() if k != "turns"}}
    return out


def drafting_section(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drafts proposed / accepted / discarded, tokens per pass and acceptance per draft position,
    summed over the drafted turns of each (model, context, workload)."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for row in requests:
        if row["mode"] == "drafted":
            groups.setdefault((row["model"], row["context"], row["workload"]), []).append(row)
    out = []
    for (model, context, workload), rows in sorted(groups.items()):
        servers = [r["server"] for r in rows]
        proposed = _sum_lists(s.get("proposed_per_position") or [] for s in servers)
        accepted = _sum_lists(s.get("accepted_per_position") or [] for s in servers)
        drafted = sum(s.get("drafted", 0) for s in servers)
        taken = sum(s.get("accepted", 0) for s in servers)
        passes = sum(s.get("verify_passes", 0) for s in servers)
        tokens = sum(s.get("completion_tokens", 0) for s in servers)
        out.append({
            "model": model, "context": context, "workload": workload, "turns": len(rows),
            "drafted": drafted, "accepted": taken, "discarded": drafted - taken,
            "verify_passes": passes, "completion_tokens": tokens,
            "tokens_per_pass": _ratio(tokens, passes), "acceptance_rate": _ratio(taken, drafted),
            "proposed_per_position": proposed, "accepted_per_position": accepted,
            "acceptance_by_position": [_ratio(a, p) for a, p in zip(accepted, proposed, strict=False)],
        })
    return out


def _sum_lists(lists: Iterable[list[int]]) -> list[int]:
    total: list[int] = []
    for values in lists:
        for i, v in enumerate(values):
            if i == len(total):
                total.append(0)
            total[i] += int(v)
    return total


def first_token_s(row: dict[str, Any]) -> tuple[float | None, str]:
    """Time to first token as the client saw it; for a tool call, which streams whole once complete,
    the server's own figure (request arrival to first token), since the client cannot see it."""
    if row["category"] == "tool_call":
        ms = row["server"].get("ttft_ms")
        return (round(ms / 1e3, 4) if ms is not None else None), "server"
    return row["client"]["ttft_s"], "client"


def ttft_section(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Time to first token of each session's first turn (nothing of it cached) by model, workload, context."""
    out = []
    for row in requests:
        if row["mode"] == "drafted" and row["turn"] == 1:
            server = row["server"]
            ttft, source = first_token_s(row)
            out.append({"model": row["model"], "workload": row["workload"], "context": row["context"],
                        "category": row["category"], "prompt_tokens": row["prompt_tokens"],
                        "cached_tokens": row["cached_tokens"], "ttft_s": ttft, "ttft_source": source,
                        "client_ttft_s": row["client"]["ttft_s"], "server_ttft_ms": server.get("ttft_ms"),
                        "server_prefill_ms": server.get("prefill_ms"),
                        "prefill_tps": _ratio(server.get("prefilled_tokens"), (server.get("prefill_ms") or 0) / 1e3, 1)})
    return sorted(out, key=lambda r: (r["model"], r["workload"], r["context"]))


def resume_section(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Resumed turns (same session, snapshot restored) against the same request on a fresh home."""
    cold = {(r["model"], r["workload"], r["context"], r["turn"]): r for r in requests if r["mode"] == "cold"}
    out = []
    for row in requests:
        if row["mode"] != "drafted" or row["turn"] < 2:
            continue
        key = (row["model"], row["workload"], row["context"], row["turn"])
        other = cold.get(key)
        entry = {"model": row["model"], "workload": row["workload"], "context": row["context"], "turn": row["turn"],
                 "prompt_tokens": row["prompt_tokens"], "cached_tokens": row["cached_tokens"],
                 "category": row["category"], "resumed_ttft_s": first_token_s(row)[0],
                 "ttft_source": first_token_s(row)[1], "resumed_server_ttft_ms": row["server"].get("ttft_ms"),
                 "cache_restore_ms": row["server"].get("cache_restore_ms")}
        if other is None:
            entry.update({"cold_ttft_s": None, "ratio": None, "identical": None,
                          "cold_skipped": "no cold request for this turn (see skipped)"})
        else:
            cold_ttft = first_token_s(other)[0]
            entry.update({"cold_ttft_s": cold_ttft, "cold_server_ttft_ms": other["server"].get("ttft_ms"),
                          "cold_cached_tokens": other["cached_tokens"],
                          "ratio": _ratio(entry["resumed_ttft_s"], cold_ttft),
                          "identical": row["server"].get("token_sha") == other["server"].get("token_sha")
                          and row["reply_sha"] == other["reply_sha"]})
        out.append(entry)
    return out


def exactness_section(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Every drafted reply against its `"draft": false` twin: equal token ids and equal text."""
    serial = {(r["model"], r["workload"], r["context"], r["turn"]): r for r in requests if r["mode"] == "serial"}
    pairs = []
    for row in requests:
        if row["mode"] != "drafted":
            continue
        twin = serial.get((row["model"], row["workload"], row["context"], row["turn"]))
        equal = twin is not None and row["server"].get("token_sha") == twin["server"].get("token_sha") \
            and row["reply_sha"] == twin["reply_sha"]
        pairs.append({"model": row["model"], "workload": row["workload"], "context": row["context"],
                      "turn": row["turn"], "category": row["category"], "completion_tokens": row["completion_tokens"],
                      "drafted_token_sha": row["server"].get("token_sha"),
                      "serial_token_sha": twin["server"].get("token_sha") if twin else None, "equal": equal})
    return {"pairs": pairs, "compared": len(pairs), "all_equal": bool(pairs) and all(p["equal"] for p in pairs)}


def engines_section(requests: list[dict[str, Any]], baselines: dict[str, Any], jobs: dict[str, Any],
                    roofline_tps: float | None) -> list[dict[str, Any]]:
    """tok/s of every engine on each baseline prompt, with its fraction of the roofline."""
    by_turn = {(r["model"], r["workload"], r["context"], r["turn"], r["mode"]): r for r in requests}
    out = []

    def add(workload: str, engine: str, tps: float | None, job: dict[str, Any], max_tokens: int | None = None,
            loadavg: list[float] | None = None, **extra: Any) -> None:
        out.append({"workload": workload, "engine": engine, "tps": tps, "roofline_fraction": _ratio(tps, roofline_tps),
                    "prompt_tokens": job["prompt_tokens"], "max_tokens": max_tokens or job["max_tokens"],
                    "turn": job["turn"], "context": job["context"], "model": job["model"],
                    "load_1m": loadavg[0] if loadavg else None, **extra})

    for workload, job in jobs.items():
        for mode, engine in (("drafted", "agentfold drafted (HTTP)"), ("serial", "agentfold serial (HTTP)")):
            row = by_turn.get((job["model"], workload, job["context"], job["turn"], mode))
            if row is not None:
                add(workload, engine, row["server"].get("decode_tps"), job, loadavg=row.get("loadavg"),
                    completion_tokens=row["completion_tokens"], identical_to_serial=True if mode == "serial" else
                    row["server"].get("token_sha") == job["reply_sha"])
        for key, engine in (("mlx_lm", "mlx_lm.generate"), ("transformers", "transformers generate (torch CPU)")):
            got = (baselines.get(key) or {}).get(workload)
            if got:
                free = job.get("constrained")  # the server decoded under the tool-call grammar, this engine did not
                add(workload, engine, got.get("steady_tps"), job, got.get("max_tokens"), got.get("loadavg"),
                    completion_tokens=got.get("completion_tokens"),
                    identical_to_serial=None if free else got.get("identical_to_serial"),
                    note="no grammar (the server's reply is a grammar-constrained tool call)" if free else None)
        torch_rows = (baselines.get("torch_backend") or {}).get(workload)
        if torch_rows:
            for mode in ("serial", "drafted"):
                got = torch_rows[mode]
                add(workload, f"agentfold torch backend {mode}", got.get("steady_tps"), job, torch_rows.get("max_tokens"),
                    torch_rows.get("loadavg"), completion_tokens=got.get("completion_tokens"),
                    identical_to_serial=got.get("token_sha") == torch_rows["serial"].get("token_sha"))
    return out


def memory_section(servers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each server's peak memory against its weights, and its own /metrics totals (warm-up included)."""
    out = []
    for s in servers:
        metrics = s.get("metrics") or {}
        out.append({"role": s["role"], "model": s["model"], "vm_hwm_bytes": s.get("vm_hwm_bytes"),
                    "model_bytes": s.get("model_bytes"),
                    "hwm_over_model": _ratio(s.get("vm_hwm_bytes"), s.get("model_bytes"), 3),
                    "startup_seconds": s.get("startup_seconds"),
                    "prompt_tokens": metrics.get("agentfold:prompt_tokens_total"),
                    "cache_hit_share": _ratio(metrics.get("agentfold:prefix_cache_hits_total"),
                                              metrics.get("agentfold:prefix_cache_queries_total"), 3),
                    "draft_tokens": metrics.get("agentfold:spec_decode_num_draft_tokens_total"),
                    "accepted_tokens": metrics.get("agentfold:spec_decode_num_accepted_tokens_total")})
    return out


def sections(result: dict[str, Any]) -> dict[str, Any]:
    """Every section of the report, recomputed from the raw rows of `result`."""
    requests = result["requests"]
    roofline = result["roofline"]["models"].get(result["models"]["main"]["name"], {}).get("tps")
    return {
        "ttft": ttft_section(requests),
        "itl": itl_section(requests),
        "drafting": drafting_section(requests),
        "exactness": exactness_section(requests),
        "resume": resume_section(requests),
        "memory": memory_section(result["servers"]),
        "engines": engines_section(requests, result["baselines"], result["baseline_jobs"], roofline),
    }


# -- flat records -------------------------------------------------------------------------------


def context_of(result: dict[str, Any]) -> dict[str, str]:
    """What every record carries about the run: machine, versions and whether it was --quick."""
    m, v = result["machine"], result["versions"]
    machine = f"{m.get('processor')}, {m.get('cpus_usable')} cpus, {m.get('memory_gb')} GB, {m.get('platform')}"
    versions = ", ".join(f"{k} {v[k]}" for k in ("python", "mlx", "mlx_lm", "agentfold", "transformers") if v.get(k))
    return {"machine": machine, "versions": versions, "blas": str(result.get("blas")), "quick": str(result["quick"])}


def records(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every headline number of `result['sections']` as one flat row with its full context."""
    run = context_of(result)
    dtypes = {m["name"]: m["dtype"] for m in result["models"].values() if m}
    main = result["models"]["main"]["name"]
    rows: list[dict[str, Any]] = []

    def add(metric: str, value: Any, unit: str, model: str, workload: str, engine: str,
            context: int | None, **extra: Any) -> None:
        if isinstance(value, bool) or value is None:
            return
        rows.append({"metric": metric, "value": value, "unit": unit, "model": model, "dtype": dtypes.get(model, "?"),
                     "workload": workload, "engine": engine, "context": context, **run, **extra})

    s = result["sections"]
    for r in s["ttft"]:
        add("ttft", r["ttft_s"], "s", r["model"], r["workload"], "agentfold drafted (HTTP)", r["context"],
            prompt_tokens=r["prompt_tokens"])
    for r in s["resume"]:
        add("resumed_ttft", r["resumed_ttft_s"], "s", r["model"], r["workload"], "agentfold drafted (HTTP)",
            r["context"], turn=r["turn"])
        add("cold_ttft", r.get("cold_ttft_s"), "s", r["model"], r["workload"], "agentfold drafted (HTTP), fresh home",
            r["context"], turn=r["turn"])
    for r in s["drafting"]:
        for metric in ("drafted", "accepted", "discarded", "tokens_per_pass", "acceptance_rate"):
            add(metric, r[metric], "tokens" if metric in ("drafted", "accepted", "discarded") else
                ("tokens/pass" if metric == "tokens_per_pass" else "fraction"), r["model"], r["workload"],
                "agentfold drafted (HTTP)", r["context"])
    for model, categories in s["itl"].items():
        for category, modes in categories.items():
            for mode, slot in modes.items():
                for source in ("server_token_ms", "server_pass_ms", "client_chunk_ms"):
                    for q in ("p50", "p90", "p99"):
                        add(f"itl_{source}_{q}", slot[source][q], "ms", model, f"all {category} turns",
                            f"agentfold {mode} (HTTP)", None)
    for r in s["engines"]:
        add("decode_tps", r["tps"], "tok/s", r["model"], r["workload"], r["engine"], r["context"],
            max_tokens=r["max_tokens"])
        add("roofline_fraction", r["roofline_fraction"], "fraction", r["model"], r["workload"], r["engine"],
            r["context"])
    for r in s["memory"]:
        add("vm_hwm", r["vm_hwm_bytes"], "bytes", r["model"], f"{r['role']} server, all its turns", "agentfold serve",
            None)
        add("vm_hwm_over_model_bytes", r["hwm_over_model"], "ratio", r["model"], f"{r['role']} server, all its turns",
            "agentfold serve", None)
    for name, roof in result["roofline"]["models"].items():
        add("roofline_tps", roof["tps"], "tok/s", name, "one weight read per token", "copy bandwidth", None)
    add("copy_bandwidth", result["roofline"]["bandwidth_gbs"], "GB/s", main, "numpy copy", "machine", None)
    return rows
