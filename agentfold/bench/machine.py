"""What every bench record says about the run itself: the machine, the versions, the load, the time.

A tokens-per-second figure is only comparable with another taken on a known machine under a known
load, so every bench JSON (decode, sessions, agent, suite, offload, quality) opens with the same
header (`run_header`) and is closed by the same step (`finish_run`: the load average at the end,
the duration, the file written). The copy bandwidth measured here is the roofline's numerator.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import resource
import sys
import threading
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import agentfold
from agentfold.kernels import blas


def utc_timestamp() -> str:
    """Now, in UTC, to the second (ISO 8601): the `timestamp` of a bench record."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the platform has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _processor() -> str:
    processor = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return processor


VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                "amx_tile", "amx_int8", "amx_bf16")  # the /proc/cpuinfo flags the kernels choose paths by


def cpu_identity(cpuinfo: str | None = None) -> dict[str, Any]:
    """The first CPU's vendor, family, model and stepping numbers and the vector flags among
    VECTOR_FLAGS it has (Linux's /proc/cpuinfo, or `cpuinfo` text; empty elsewhere). A VM's model
    name can be as bare as "AMD EPYC" for both a Zen 3 (family 25, model 1: AVX2 only) and a Zen 4
    (family 25, model 17: AVX-512 VNNI), whose kernels and figures differ."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8")
        except OSError:
            return {}
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    identity: dict[str, Any] = {"vendor": fields.get("vendor_id")}
    for name, key in (("family", "cpu family"), ("model", "model"), ("stepping", "stepping")):
        identity[name] = int(fields[key]) if fields.get(key, "").isdigit() else None
    flags = set(fields.get("flags", "").split())
    identity["vector_flags"] = [flag for flag in VECTOR_FLAGS if flag in flags]
    return identity


def machine_info() -> dict[str, Any]:
    """Platform, processor, cores usable by this process, memory, threads and the starting load."""
    memory = None
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    from agentfold.engine.backend_choice import cpu_model

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": _processor(),
        "cpu_model": cpu_model(),
        "cpu": cpu_identity(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "memory_bytes": memory,
        "memory_gb": round(memory / 2**30, 2) if memory else None,
        "threads": thread_info(),
        "loadavg_start": loadavg(),
    }


def thread_info(backend: Any | None = None) -> dict[str, Any]:
    """Threads each library decodes with here (they share the same few cores), and the environment
    variables that set them; `backend` is the count the chosen backend runs with."""
    torch_threads = None
    if "torch" in sys.modules:
        torch_threads = int(sys.modules["torch"].get_num_threads())
    openblas = None
    if blas.current().path and blas.current().name == "openblas":
        import ctypes

        try:
            openblas = int(ctypes.CDLL(blas.current().path).openblas_get_num_threads())
        except (OSError, AttributeError):
            openblas = None
    env = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                                   "AGENTFOLD_AMX")}
    chosen = None
    if backend is not None:
        chosen = torch_threads if getattr(backend, "name", None) == "torch" else openblas
    return {"backend": chosen, "torch": torch_threads, "openblas": openblas,
            "env": {k: v for k, v in env.items() if v is not None}}


def versions() -> dict[str, str | None]:
    """Python and the libraries whose versions decide a bench's numbers."""

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    import mlx.core as mx
    import numpy as np

    return {
        "python": platform.python_version(),
        "mlx": getattr(mx, "__version__", installed("mlx")),
        "mlx_lm": installed("mlx-lm"),
        "agentfold": agentfold.__version__,
        "numpy": np.__version__,
        "transformers": installed("transformers"),
    }


def copy_bandwidth(megabytes: int = 256, repeats: int = 3) -> dict[str, Any]:
    """Best-of-`repeats` numpy copy of a `megabytes` array; bytes moved = read + write (STREAM copy)."""
    import numpy as np

    src = np.ones(megabytes * (1 << 20) // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in before timing
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - began)
    moved = 2 * src.nbytes
    del src, dst
    return {
        "method": "numpy copyto, one thread, read + write bytes counted",
        "array_mb": megabytes,
        "repeats": repeats,
        "best_seconds": round(best, 5),
        "bandwidth_gbs": round(moved / best / 1e9, 3),
    }


def run_header(schema: str, timestamp: str, quick: bool, machine: dict[str, Any]) -> dict[str, Any]:
    """What every bench JSON starts with: schema, time, machine, versions and BLAS."""
    return {"schema": schema, "timestamp": timestamp, "duration_seconds": None, "quick": quick,
            "machine": machine, "versions": versions(), "blas": blas.current().describe()}


def finish_run(result: dict[str, Any], started: float, out: str | Path) -> None:
    """Close a bench record (end load average, duration) and write it as JSON to `out`."""
    result["machine"]["loadavg_end"] = loadavg()
    result["duration_seconds"] = round(time.perf_counter() - started, 3)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


def memory_now() -> dict[str, Any]:
    """This process's peak RSS (getrusage) and, on Linux, /proc's peak and current RSS by kind."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    result: dict[str, Any] = {"peak_rss_bytes": int(peak), "peak_rss_gb": round(peak / 1e9, 3)}
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                    result[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return result


def rss_line() -> str:
    """This process's RSS now, anonymous and of files, for a progress line."""
    memory = memory_now()
    return (f"RSS {memory.get('VmRSS', 0) / 1e9:.1f} GB: {memory.get('RssAnon', 0) / 1e9:.1f} anonymous, "
            f"{memory.get('RssFile', 0) / 1e9:.1f} of files")


class Ticker:
    """Calls `say(message())` every `seconds` on a thread until stopped (for a phase with no steps of its own)."""

    def __init__(self, seconds: float, message: Callable[[], str], say: Callable[[str], None]) -> None:
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(seconds, message, say), daemon=True)

    def _run(self, seconds: float, message: Callable[[], str], say: Callable[[str], None]) -> None:
        while not self.stop_event.wait(seconds):
            say(message())

    def __enter__(self) -> Ticker:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        self.thread.join()
