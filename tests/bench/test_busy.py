"""`bench decode --busy` (agentfold/bench/busy.py): serial decode beside one busy process, on the real
default model and a stand-in llama.cpp binding. Rates are recorded, never asserted (shared machines)."""

from __future__ import annotations

import sys
from pathlib import Path

from agentfold.bench import llamacpp as bench_llamacpp
from agentfold.bench.busy import HOG, busy_row
from tests.bench.test_decode import stand_in_llama_cpp  # noqa: F401  (the fixture)
from tests.conftest import chat_ids


def hogs_running() -> list[str]:
    """Command lines of live busy-loop processes this bench starts."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if HOG in text and sys.executable in text:
            found.append(text)
    return found


def test_busy_row_measures_both_engines_and_stops_its_competitor(smollm2_engine, tmp_path, stand_in_llama_cpp):  # noqa: F811
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    llama, _ = bench_llamacpp.open_llama_cpp(gguf, n_ctx=256, threads=2)
    prompt = chat_ids(smollm2_engine.tokenizer, "Write a Python function that adds two numbers.")
    said: list[str] = []
    row = busy_row(smollm2_engine, llama, prompt, 12, [2], {"serial_tps": 20.0, "llama_cpp_tps": 40.0}, said.append)
    assert row["serial_tps"] > 0 and row["llama_cpp_tps"] > 0
    assert row["kept"] == round(row["serial_tps"] / 20.0, 4) and row["llama_cpp_kept"] == round(row["llama_cpp_tps"] / 40.0, 4)
    assert isinstance(row["pool_alone"], bool) and row["target_kept"] == 0.4
    assert any("busy machine: serial" in line for line in said)
    assert not hogs_running()
