"""`--backend auto`: measure every backend once per machine and model, keep the winner, remember it."""

from __future__ import annotations

import json

# isort: split
import pytest

from agentfold.engine import backend_choice
from agentfold.engine.factory import build_engine
from agentfold.engine.selfcheck import ExactnessReport
from tests.helpers.torch_tiny import write_folder


def report(width: int, one_row: float, per_row: float) -> ExactnessReport:
    seconds = {w: one_row + per_row * (w - 1) for w in range(1, width + 1)}
    return ExactnessReport(max_width=width, checked={w: True for w in range(2, width + 1)}, pass_seconds=seconds)


def test_pick_prefers_width_then_rate():
    wide_slow = report(16, 0.10, 0.01)
    narrow_fast = report(4, 0.02, 0.001)
    winner, verdict = backend_choice.pick({"mlx": wide_slow, "torch": narrow_fast})
    assert winner == "mlx"  # a wider row-exact width wins first
    fast = report(16, 0.02, 0.002)
    winner, verdict = backend_choice.pick({"mlx": wide_slow, "torch": fast})
    assert winner == "torch" and verdict["measured"]["torch"]["expected_tok_s"] > verdict["measured"]["mlx"][
        "expected_tok_s"]
    assert "backend auto -> torch" in backend_choice.describe(verdict, remembered=True)


def test_expected_rate_counts_drafted_tokens():
    flat = report(8, 0.05, 0.0)  # a wide pass costs what one row costs: drafting multiplies the rate
    assert backend_choice.expected_rate(flat) > 2.5 / 0.05
    assert backend_choice.expected_rate(report(1, 0.05, 0.0)) == pytest.approx(20.0)


def test_auto_takes_torch_without_measuring_where_its_kernels_build(tmp_path):
    """On a CPU with a compiler, torch's C kernels win: MLX is not loaded or measured at all."""
    if not backend_choice.torch_kernels_built() or backend_choice.candidates("auto") == ["mlx"]:
        pytest.skip("no C compiler here, or an Apple chip (MLX is the Metal path)")
    folder = write_folder(tmp_path / "llama", "llama", seed=3)
    said: list[str] = []
    engine = build_engine(folder, backend="auto", device="cpu", verdicts=tmp_path / "backends.json",
                          progress=said.append)
    assert engine.backend.name == "torch"
    assert not any("measuring" in line or "mlx" in line.split("->")[-1] for line in said if "backend auto" in line)
    assert not (tmp_path / "backends.json").exists()  # nothing measured, nothing to remember


def test_auto_measures_once_then_remembers(tmp_path, monkeypatch):
    """Where both backends could win (no C kernels for torch), each is measured once, then remembered."""
    monkeypatch.setattr(backend_choice, "torch_kernels_built", lambda: False)
    folder = write_folder(tmp_path / "llama", "llama", seed=3)
    verdicts = tmp_path / "backends.json"
    said: list[str] = []
    engine = build_engine(folder, backend="auto", device="cpu", verdicts=verdicts, progress=said.append)
    lines = [line for line in said if line.startswith("backend auto")]
    assert any("measuring torch" in line for line in lines) and any("measuring mlx" in line for line in lines)
    assert "measured now" in lines[-1]
    stored = json.loads(verdicts.read_text())
    (verdict,) = stored.values()
    assert verdict["backend"] == engine.backend.name
    assert set(verdict["measured"]) == {"torch", "mlx"}
    assert engine.exactness.max_width > 1  # int8 arithmetic: row-exact by construction on any CPU

    said.clear()
    again = build_engine(folder, backend="auto", device="cpu", verdicts=verdicts, progress=said.append)
    assert again.backend.name == engine.backend.name
    assert not any("measuring" in line for line in said)
    assert any("remembered" in line for line in said)


def test_only_one_candidate_on_cuda_requests():
    assert backend_choice.candidates("cuda") == ["torch"]
