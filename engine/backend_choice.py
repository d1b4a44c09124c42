"""`--backend auto`: the backend that verifies widest and fastest on this machine, for this model.

On a CUDA device only the torch backend runs; on an Apple chip MLX is the Metal path. On a CPU
both can run, and which is faster depends on the CPU, the BLAS and the model, so the first load
builds both engines, runs each one's row-exactness self-check (which also times passes of every
width), and keeps the one with the widest row-exact width and then the highest expected decode
rate. The verdict is remembered per machine, model and library versions in a small JSON file, so
later starts load only the chosen backend (whose self-check still runs: a width that fails is
never used).
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

from agentfold.engine.selfcheck import ExactnessReport

TYPICAL_ACCEPTANCE = 0.7  # per-draft acceptance used to compare pass costs (code edits run higher)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, sysctl's brand string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def candidates(device: str) -> list[str]:
    """Backends that can run here on `device`, most likely winner first.

    On a CPU other than Apple's, torch with the kernels' C library is the only candidate: its
    int8 GEMM and row kernels have no MLX counterpart (MLX's CPU path multiplies the same
    integers as float32 matrices), and measuring MLX cost minutes for nothing (Qwen2.5-Coder-1.5B
    on a 2-core AMD EPYC: 29 s to load and a self-check, to find ~2.2 tok/s against torch's
    ~11.9). Without a C compiler both are measured."""
    torch_ok = _importable("torch")
    if device == "cuda" or (device == "auto" and torch_ok and _cuda_visible()):
        return ["torch"]
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return ["mlx"]  # Metal
    if torch_ok and torch_kernels_built():
        return ["torch"]
    return ["torch", "mlx"] if torch_ok else ["mlx"]


def why_only(name: str, device: str) -> str:
    """Why `candidates(device)` holds only `name`, for the start-up line."""
    if name == "torch" and device != "cuda" and not (device == "auto" and _cuda_visible()):
        return "its C kernels run here, MLX's CPU path has none; nothing to measure"
    return "the only backend for this device"


def torch_kernels_built() -> bool:
    """Whether the torch CPU backend runs on the kernels' C library here (built, or buildable)."""
    from agentfold.kernels import native

    return native.expected()


def expected_rate(report: ExactnessReport, acceptance: float = TYPICAL_ACCEPTANCE) -> float:
    """Tokens per second at the best verify width: (expected tokens a w-row pass commits) / its cost."""
    seconds = report.pass_seconds
    best = 1.0 / seconds[1] if seconds.get(1) else 0.0
    for width in range(2, report.max_width + 1):
        if seconds.get(width):
            committed = (1 - acceptance**width) / (1 - acceptance)
            best = max(best, committed / seconds[width])
    return best


def verdict_key(model_path: Path, device: str, quant: str) -> str:
    """What a verdict depends on: machine, CPU, threads, model file, libraries, kernel choice."""
    stat = model_path.stat() if model_path.exists() else None
    versions = {name: _version(name) for name in ("mlx", "mlx_lm", "torch")}
    return json.dumps({"machine": platform.machine(), "cpu": cpu_model(), "cpus": os.cpu_count(),
                       "model": str(model_path.resolve()), "size": stat.st_size if stat else None,
                       "mtime": int(stat.st_mtime) if stat else None, "device": device, "quant": quant,
                       "versions": versions}, sort_keys=True)


def recall(path: Path | None, key: str) -> dict[str, Any] | None:
    if path is None or not path.exists():
        return None
    try:
        return json.loads(path.read_text()).get(key)
    except (OSError, ValueError):
        return None


def remember(path: Path | None, key: str, verdict: dict[str, Any]) -> None:
    if path is None:
        return
    try:
        known = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        known = {}
    known[key] = verdict
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as staging:
            staging.write(json.dumps(known, indent=1, sort_keys=True) + "\n")
        os.replace(staging.name, path)  # whole files only, whichever concurrent writer wins
    except OSError:
        pass  # a read-only cache only costs the next start another measurement


def pick(reports: dict[str, ExactnessReport]) -> tuple[str, dict[str, Any]]:
    """The winner among self-checked backends, and the verdict to print and remember."""
    scores = {name: (report.max_width, expected_rate(report)) for name, report in reports.items()}
    winner = max(scores, key=lambda name: scores[name])
    verdict = {"backend": winner, "cpu": cpu_model(),
               "measured": {name: {"max_width": width, "expected_tok_s": round(rate, 1),
                                   "pass_ms": {str(w): round(s * 1000, 1) for w, s in reports[name].pass_seconds.items()}}
                            for name, (width, rate) in scores.items()}}
    return winner, verdict


def describe(verdict: dict[str, Any], remembered: bool) -> str:
    """One line: the chosen backend and what the others measured."""
    measured = verdict.get("measured", {})
    parts = [f"{name}: row-exact to {m['max_width']} rows, ~{m['expected_tok_s']} tok/s"
             for name, m in sorted(measured.items(), key=lambda item: item[0] != verdict["backend"])]
    source = "remembered" if remembered else "measured now"
    return f"backend auto -> {verdict['backend']} ({'; '.join(parts)}; {source})"


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _cuda_visible() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name.replace("_", "-"))
    except metadata.PackageNotFoundError:
        return None

