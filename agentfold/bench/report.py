"""`agentfold bench report`: the suite's Markdown summary and PNG plots, from its JSON alone.

The JSON keeps every raw request row, so the report recomputes its tables from them
(`bench_summary.sections`) instead of trusting numbers copied elsewhere; running it again on the
same file gives the same Markdown. Plots use matplotlib's Agg backend (no display) at a small
size, so they can be committed next to the README.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentfold.bench.summary import context_of, sections

PLOTS = ("tps_by_workload.png", "acceptance_by_position.png", "ttft_vs_context.png", "resumed_vs_cold.png")
DPI = 80
MIN_PROPOSED = 5  # acceptance plot: positions with fewer drafts than this are noise
FIGSIZE = (8, 4.2)


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "**NO**"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _table(head: Sequence[str], rows: list[Sequence[Any]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(_fmt(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows), ""]


# -- markdown -----------------------------------------------------------------------------------


def short_name(name: str) -> str:
    """A model name without the conversion cache's suffix (`-float32-<size>-<mtime>`)."""
    return re.sub(r"-(float32|bfloat16|float16|keep)-\d+-\d+$", "", name)


def _short_models(value: Any) -> Any:
    """`value` with every model name shortened (tables and plots only; the JSON keeps full names)."""
    if isinstance(value, dict):
        return {(short_name(k) if isinstance(k, str) else k): _short_models(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_short_models(v) for v in value]
    if isinstance(value, str):
        return short_name(value)
    return value


def markdown(result: dict[str, Any], s: dict[str, Any], plot_names: Sequence[str] = PLOTS) -> str:
    """The summary: run context, then one table per section, then what was skipped and why."""
    run = context_of(result)
    lines = [f"# AgentFold bench suite ({'quick' if result['quick'] else 'full'} run)", "",
             f"- When: {result['timestamp']}, {result['duration_seconds']:.0f} s in all; seed {result['seed']}",
             f"- Machine: {run['machine']}; load average {result['machine'].get('loadavg_start')} at start, "
             f"{result['machine'].get('loadavg_end')} at end",
             f"- Versions: {run['versions']}; BLAS: {run['blas']}"]
    for role, m in result["models"].items():
        if m:
            lines.append(f"- Model ({role}): {short_name(m['name'])} ({m['model_type']}, {m['dtype']}, {m['parameters']:,} "
                         f"parameters, {m['bytes'] / 1e6:.0f} MB of weights, context {m['context_length']})")
    roof = result["roofline"]
    lines.append(f"- Roofline: copy bandwidth {roof['bandwidth_gbs']} GB/s over the weight bytes = "
                 + ", ".join(f"{short_name(n)}: {r['tps']:.1f} tok/s" for n, r in roof["models"].items()))
    lines += [f"- Sampling: {result['sampling']}", "", "## Decode rate by workload and engine", "",
              "Same prompt ids (the server's, read back from its telemetry) and token budget for every engine, "
              "greedy; each workload's baselines run right after the server answered it. tok/s counts the tokens "
              "after the first verify pass over the time after it; the last column is the machine's load then.", ""]
    lines += _table(["workload", "prompt", "tokens", "engine", "tok/s", "of roofline", "same tokens as serial",
                     "load (1 min)"],
                    [(e["workload"], e["prompt_tokens"], e["max_tokens"], e["engine"], e["tps"],
                      _pct(e["roofline_fraction"]), e.get("note") or e.get("identical_to_serial"), e.get("load_1m"))
                     for e in s["engines"]])
    lines += ["## Time to first token against context", "",
              "First turn of each session: nothing cached, the whole prompt is prefilled. Measured on the "
              "client, except for tool calls (they stream whole once complete): there the server's figure.", ""]
    lines += _table(["model", "workload", "context", "prompt tokens", "TTFT s", "measured by", "prefill tok/s"],
                    [(r["model"], r["workload"], r["context"], r["prompt_tokens"], r["ttft_s"], r["ttft_source"],
                      r["prefill_tps"]) for r in s["ttft"]])
    lines += ["## Inter-token latency (ms)", "",
              "Server: per-token gaps from the telemetry clock (0 within a verify pass) and gaps between "
              "passes. Client: gaps between streamed chunks; a tool call arrives whole, so it has none.", ""]
    itl_rows = []
    for model, categories in s["itl"].items():
        for category, modes in categories.items():
            for mode, slot in modes.items():
                def trio(key: str, slot: dict[str, Any] = slot) -> str:
                    q = slot[key]
                    return "/".join(_fmt(q[k], 1) for k in ("p50", "p90", "p99"))
                itl_rows.append((model, category, mode, slot["turns"], trio("server_token_ms"),
                                 trio("server_pass_ms"), trio("client_chunk_ms")))
    lines += _table(["model", "turns", "mode", "n", "server per token p50/p90/p99", "server per pass p50/p90/p99",
                     "client per chunk p50/p90/p99"], itl_rows)
    lines += ["## Drafting", ""]
    lines += _table(["model", "context", "workload", "proposed", "accepted", "discarded", "tokens/pass", "accepted",
                     "acceptance by position (1, 2, 3, ...)"],
                    [(r["model"], r["context"], r["workload"], r["drafted"], r["accepted"], r["discarded"],
                      r["tokens_per_pass"], _pct(r["acceptance_rate"]),
                      " ".join(_pct(a) for a in r["acceptance_by_position"][:8])) for r in s["drafting"]])
    exact = s["exactness"]
    lines += ["## Exactness", "", f"{exact['compared']} drafted replies compared with the same request sent with "
              f"`\"draft\": false`: {'**all equal**' if exact['all_equal'] else '**SOME DIFFER**'} "
              "(token ids and text).", ""]
    differ = [p for p in exact["pairs"] if not p["equal"]]
    if differ:
        lines += _table(["model", "workload", "context", "turn"],
                        [(p["model"], p["workload"], p["context"], p["turn"]) for p in differ])
    lines += ["## Resumed against cold", "",
              "Turn 2 of a session on the server that answered turn 1 (snapshot restored) against the same "
              "messages on a server with an empty home.", ""]
    lines += _table(["model", "workload", "context", "prompt tokens", "cached", "resumed TTFT s", "cold TTFT s",
                     "resumed / cold", "identical"],
                    [(r["model"], r["workload"], r["context"], r["prompt_tokens"], r["cached_tokens"],
                      r["resumed_ttft_s"], r.get("cold_ttft_s"), r["ratio"], r["identical"]) for r in s["resume"]])
    lines += ["## Memory and server totals", "",
              "Peak resident memory of each server process after all its requests; the last columns are the "
              "server's own `/metrics` (warm-up included).", ""]
    lines += _table(["server", "model", "start-up s", "peak RSS (VmHWM) MB", "weights MB", "peak / weights",
                     "prompt tokens from cache", "drafts accepted"],
                    [(r["role"], r["model"], r["startup_seconds"], _mb(r["vm_hwm_bytes"]), _mb(r["model_bytes"]),
                      r["hwm_over_model"], _pct(r["cache_hit_share"]),
                      f"{_fmt(r['accepted_tokens'], 0)} / {_fmt(r['draft_tokens'], 0)}") for r in s["memory"]])
    if result["skipped"]:
        lines += ["## Skipped", ""] + [f"- {x['what']}: {x['reason']}" for x in result["skipped"]] + [""]
    lines += ["## Plots", ""] + [f"![{name[:-4]}]({name})" for name in plot_names] + [""]
    return "\n".join(lines)


def _mb(value: int | None) -> str:
    return "-" if not value else f"{value / 1e6:.0f}"


# -- plots --------------------------------------------------------------------------------------


def _figure() -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_tps(s: dict[str, Any], result: dict[str, Any], path: Path) -> Path:
    fig, ax = _figure()
    workloads = list(dict.fromkeys(e["workload"] for e in s["engines"]))
    engines = list(dict.fromkeys(e["engine"] for e in s["engines"]))
    width = 0.8 / max(1, len(engines))
    for j, engine in enumerate(engines):
        values = [next((e["tps"] or 0 for e in s["engines"] if e["workload"] == w and e["engine"] == engine), 0)
                  for w in workloads]
        ax.bar([i + j * width for i in range(len(workloads))], values, width, label=engine)
    main = result["models"]["main"]["name"]
    roof = result["roofline"]["models"].get(main, {}).get("tps")
    main = short_name(main)
    if roof:
        ax.axhline(roof, color="k", linestyle="--", linewidth=1, label=f"roofline {roof:.0f} tok/s")
    ax.set_xticks([i + width * (len(engines) - 1) / 2 for i in range(len(workloads))], workloads)
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"Decode rate by workload and engine ({main})")
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_acceptance(s: dict[str, Any], path: Path) -> Path:
    fig, ax = _figure()
    for r in s["drafting"]:
        keep = [(i + 1, a) for i, (a, p) in enumerate(zip(r["acceptance_by_position"], r["proposed_per_position"],
                                                          strict=False)) if p >= MIN_PROPOSED]
        if r["drafted"] >= 4 * MIN_PROPOSED and keep:
            ax.plot([k[0] for k in keep], [k[1] or 0 for k in keep], marker="o",
                    label=f"{r['workload']} @{r['context']} ({r['model'][:18]}, {r['drafted']} drafts)")
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / proposed")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Draft acceptance by position (positions with at least {MIN_PROPOSED} drafts)")
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_ttft(s: dict[str, Any], path: Path) -> Path:
    fig, ax = _figure()
    series: dict[str, list[tuple[int, float]]] = {}
    for r in s["ttft"]:
        if r["ttft_s"] is not None:
            series.setdefault(f"{r['workload']} ({r['model'][:18]})", []).append((r["prompt_tokens"], r["ttft_s"]))
    for label, points in series.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens (nothing cached)")
    ax.set_ylabel("time to first token, s")
    ax.set_title("Time to first token against context")
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_resume(s: dict[str, Any], path: Path) -> Path:
    fig, ax = _figure()
    rows = [r for r in s["resume"] if r.get("cold_ttft_s") is not None]
    labels = [f"{r['workload']}\n@{r['context']} t{r['turn']}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["resumed_ttft_s"] or 0 for r in rows], 0.4, label="resumed (same server)")
    ax.bar([x + 0.2 for x in xs], [r["cold_ttft_s"] or 0 for r in rows], 0.4, label="cold (empty home)")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("time to first token, s")
    ax.set_title("Resumed turn against the same request cold")
    ax.legend(fontsize=8)
    return _save(fig, path)


# -- entry points -------------------------------------------------------------------------------


def write_report(result: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write report.md and the four plots into `out_dir`; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    s = _short_models(sections(result))
    written = [plot_tps(s, result, out / PLOTS[0]), plot_acceptance(s, out / PLOTS[1]), plot_ttft(s, out / PLOTS[2]),
               plot_resume(s, out / PLOTS[3])]
    report = out / "report.md"
    report.write_text(markdown(result, s))
    return [report, *written]


def report_from_file(path: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """`agentfold bench report RESULTS.json [--out-dir DIR]` (default DIR: next to the JSON, named after it)."""
    source = Path(path)
    result = json.loads(source.read_text())
    if not str(result.get("schema", "")).startswith("agentfold.bench.suite/"):
        raise ValueError(f"{source} is not a bench suite result (schema {result.get('schema')!r})")
    return write_report(result, out_dir or source.with_suffix(""))
