"""`bench decode --busy`: serial decode while another process keeps a core busy.

A laptop that runs an agent also runs its compiler, tests and IDE. This section starts one
busy-loop process (pure Python spinning, what a CPU-bound build step does to one core) and decodes
the same workload serially again with the engine and with llama.cpp on the same file, so the
record says what share of its idle rate each keeps. The engine's kernel pool notices workers that
wait for a core and runs its jobs on the calling thread alone for a while (`kernels/csrc/pool.c`);
`pool_alone` in the row says whether it did at the end of the run.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from agentfold.bench import llamacpp as bench_llamacpp
from agentfold.bench.rates import completion_row, ratio

HOG = "while True: pass"
SETTLE_S = 1.0  # the busy process on its core before the first measured token


def busy_row(engine: Any, llama: Any, prompt: Sequence[int], max_tokens: int, stop_ids: Sequence[int],
             idle: dict[str, Any], say: Callable[[str], None]) -> dict[str, Any]:
    """Serial decode of `prompt` beside one busy process; `idle`: the workload's idle row (serial_tps,
    llama_cpp_tps). Every rate is the steady decode rate, as in the idle rows."""
    from agentfold.engine.decode import GenerationConfig
    from agentfold.kernels import native

    say(f"bench: busy machine: serial decode beside one busy process ({len(prompt)} prompt tokens)")
    hog = subprocess.Popen([sys.executable, "-c", HOG])
    try:
        time.sleep(SETTLE_S)
        serial = engine.generate(list(prompt), GenerationConfig(max_tokens=max_tokens, draft=False))
        ours = completion_row(serial)["steady_tps"]
        theirs = None
        if llama is not None:
            theirs = bench_llamacpp.decode(llama.serial, prompt, max_tokens, stop_ids)["steady_tps"]
        alone = native.pool_alone()
    finally:
        hog.kill()
        hog.wait()
    row = {
        "competitor": f"one `{sys.executable} -c '{HOG}'` process",
        "serial_tps": ours,
        "idle_serial_tps": idle.get("serial_tps"),
        "kept": ratio(ours, idle.get("serial_tps")),
        "llama_cpp_tps": theirs,
        "idle_llama_cpp_tps": idle.get("llama_cpp_tps"),
        "llama_cpp_kept": ratio(theirs, idle.get("llama_cpp_tps")),
        "pool_alone": alone,
        "target_kept": 0.4,
    }
    say(f"bench: busy machine: serial {ours or 0:.1f} tok/s ({row['kept'] or 0:.0%} of idle), "
        f"llama.cpp {theirs or 0:.1f} tok/s ({row['llama_cpp_kept'] or 0:.0%} of idle)")
    return row
