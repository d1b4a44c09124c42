"""MLX pipeline stages (`engine.mlx.stages`) over mlx.core.distributed's ring, on real processes and
loopback sockets: the one-process `MLXBackend`'s logits bit for bit, the same replies (drafted or
not, greedy or sampled), and snapshots and sessions that resume after every rank restarted.

MLX's ring starts once per process, so rank 0 runs in a child too (`tests/helpers/mlx_stage_driver`,
writing its logits and results to files) and rank 1 is a real `agentfold stage --backend mlx`
child; this process compares them with its own one-process `MLXBackend`. Every child is stopped
(terminated, then killed) by `pipeline` whatever happens. One pipeline per scenario, shared.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

from agentfold.cli import main as cli_main
from agentfold.cli.stage import stage_command, stop_processes
from agentfold.engine.decode import Engine, GenerationConfig
from agentfold.engine.mlx.backend import MLXBackend
from agentfold.engine.mlx.loader import load_model
from agentfold.engine.mlx.stage_wire import write_local_hostfile
from agentfold.engine.mlx.stages import MLXStagedBackend, MLXStageOptions, StageSetupError
from agentfold.engine.selfcheck import probe_tokens
from agentfold.sessions import SessionManager
from tests.helpers.mlx_stage_driver import PARAMS, drafting_engine, logit_passes
from tests.helpers.torch_tiny import CHATML, TINY_PROMPT, write_folder

ROOT = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "user", "content": "def add(a, b):\n"}]


def launch(scenario: str, rank0_model: Path, stage_model: Path, root: Path, plan: dict[str, Any],
           processes: list[subprocess.Popen]) -> Path:
    """Start rank 1 (`agentfold stage --backend mlx`, KV files in `root/rank1`) and rank 0 (the
    driver, last in `processes`) on a fresh loopback ring; returns the scenario's folder."""
    out = root / scenario
    out.mkdir(parents=True, exist_ok=True)
    hostfile = write_local_hostfile(out / "hostfile.json", 2)
    (out / "plan.json").write_text(json.dumps(plan))
    with open(out / "rank1.log", "wb") as handle:
        processes.append(subprocess.Popen(
            stage_command(1, 2, "", stage_model, root / "rank1", ["--timeout", "60"], hostfile),
            stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT))
    with open(out / "rank0.log", "wb") as handle:
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.mlx_stage_driver", scenario, str(rank0_model), str(hostfile),
             str(out), str(out / "plan.json")], stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT))
    return out


def result_of(driver: subprocess.Popen, out: Path) -> dict[str, Any]:
    assert driver.wait(150) == 0, (out / "rank0.log").read_text()[-3000:]
    return json.loads((out / "result.json").read_text())


@contextmanager
def stopped_after(processes: list[subprocess.Popen]) -> Iterator[list[subprocess.Popen]]:
    """Every process started in the block is stopped after it (terminated, then killed), whatever happens."""
    try:
        yield processes
    finally:
        stop_processes(processes[::-1], grace=10.0)


def logits(out: Path) -> dict[str, np.ndarray]:
    return safetensors.numpy.load_file(str(out / "logits.safetensors"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_folder(tmp_path_factory.mktemp("mlx-stages") / "llama", "llama", seed=7, layers=4)


@pytest.fixture(scope="module")
def reference(tiny) -> MLXBackend:
    return MLXBackend(load_model(tiny))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mlx-pipeline")


@pytest.fixture(scope="module")
def first(tiny, root, tmp_path_factory) -> dict[str, Any]:
    """The `main` scenario on one pipeline (shared by the tests below), and beside it the `refused`
    one (rank 1 loaded other weights, same config) on another: rank 0 mostly computes while rank 1
    waits, so the two share this machine's cores well."""
    other = write_folder(tmp_path_factory.mktemp("other") / "llama", "llama", seed=8, layers=4)
    plan = {"prompt": TINY_PROMPT, "template": CHATML, "messages": MESSAGES, "home": str(root / "home")}
    with stopped_after([]) as processes:
        out = launch("main", tiny, tiny, root, plan, processes)
        refused_out = launch("refused", tiny, other, root / "refused-ranks", {}, processes)
        result = result_of(processes[1], out)
        refused = result_of(processes[3], refused_out)
        stages = [processes[0].wait(30), processes[2].wait(30)]
    assert stages == [0, 2] and "stage 1: shut down by rank 0" in (out / "rank1.log").read_text()
    refused["log"] = (refused_out / "rank1.log").read_text()
    return {**result, "logits": logits(out), "refused": refused}


def test_logits_equal_one_process(first, reference):
    """forward, chunked and stepped prefill, rollback, truncate and forward_many: MLXBackend's bits."""
    ours = first["logits"]
    theirs, steps = logit_passes(reference)
    assert len(ours) == len(theirs) == 9
    for i, expected in enumerate(theirs):
        assert ours[f"l{i}"].dtype == np.float32 and np.array_equal(ours[f"l{i}"], expected), f"pass {i}"
    assert first["steps"] == 2 + 1 and steps == 4  # rank 0's two layers and the ring; one process: 4 layers
    described = first["describe"]
    assert described["stages"] == [[0, 2], [2, 4]] and described["stage_transport"] == "ring"
    assert described["stage_kernels"][0]["backend"] == "mlx" and described["linear"].startswith("mlx_int8")
    stats = first["stats"]
    assert stats["transport"] == "ring" and [s["layers"] for s in stats["stages"]] == [[0, 2], [2, 4]]
    assert all(s["passes"] > 0 and s["bytes_sent"] > 0 for s in stats["stages"])
    assert stats["stages"][1]["round_trip_seconds"] > 0


@pytest.mark.parametrize("params", ["greedy", "sampled"])
def test_engine_replies_equal_one_process(first, reference, params):
    loaded = reference.loaded
    engine = drafting_engine(reference)
    assert first["max_width"] == engine.exactness.max_width > 1
    prompt = loaded.tokenizer.encode(TINY_PROMPT)
    serial = engine.generate(prompt, GenerationConfig(params=PARAMS[params], max_tokens=40, draft=False)).tokens
    drafted, alone = first["replies"][f"{params}-drafted"], first["replies"][f"{params}-serial"]
    assert drafted["tokens"] == alone["tokens"] == serial
    assert drafted["drafted"] > 0 and alone["drafted"] == 0
    if params == "greedy":  # the random model's greedy reply loops, so the suffix drafter's drafts land
        assert drafted["accepted"] > 0


def test_session_resumes_after_every_rank_restarts(first, tiny, reference, root):
    """The snapshot and the session of the first pipeline restore into new processes (same stage dir)."""
    assert [spec["kind"] for spec in first["layout"]] == ["kv", "kv", "stage", "stage"]
    assert len(list((root / "rank1").glob("*.safetensors"))) >= 2  # the session's snapshot and the cache's
    messages = [*MESSAGES, {"role": "assistant", "content": first["first"]},
                {"role": "user", "content": "for i in range(10):\n"}]
    plan = {"template": CHATML, "messages": messages, "home": str(root / "home"), "session": first["session"],
            "layout": first["layout"], "stage_dir": str(root / "rank1")}
    (root / "resume").mkdir()
    (root / "main" / "snapshot.safetensors").rename(root / "resume" / "snapshot.safetensors")
    with stopped_after([]) as processes:
        out = launch("resume", tiny, tiny, root, plan, processes)  # new processes; while they start:
        reference.loaded.tokenizer.chat_template = CHATML
        config = GenerationConfig(max_tokens=12, draft=False)
        plain = Engine(reference, reference.loaded.tokenizer, reference.loaded.eos_token_ids)
        fresh, _ = SessionManager(plain, root / "fresh-home").reply(messages, config)
        prompt = probe_tokens(reference.vocab_size, 50)
        same_plan = reference.new_cache()  # a one-process run that also prefilled 40 tokens first
        reference.prefill(prompt[:40], same_plan)
        continued = plain.generate(prompt, config, same_plan).tokens
        result = result_of(processes[1], out)
    assert result["restored"] == prompt[:40] and result["continued_cached"] == 40
    assert result["continued"] == continued
    assert result["resumed"] == fresh.tokens and result["resumed_cached"] > 0
    lost, tampered = result["errors"]
    assert "stage 1: no " in lost and ".safetensors" in lost and "stage 1:" in tampered
    assert np.array_equal(logits(root / "resume")["after"], reference.forward([5], reference.new_cache()))


def test_a_stage_with_another_model_is_refused(first):
    """Rank 1 loaded other weights (same config): rank 0 gets one readable line, rank 1 exits with it."""
    error = first["refused"]["setup_error"]
    assert "stage 1: rank 1 has another model (config or weights) than rank 0" in error and "\n" not in error
    assert "agentfold: error: rank 1 has another model" in first["refused"]["log"]


def test_setup_errors_are_one_line(tiny, tmp_path, capsys):
    """Wrong ranks, hostfiles and options, and a model MLX stages cannot run: one line, no traceback."""
    hostfile = write_local_hostfile(tmp_path / "hostfile.json", 2)
    moe = write_folder(tmp_path / "moe", "qwen3_moe", seed=1, layers=2)
    with pytest.raises(StageSetupError, match="llama, qwen2 and qwen3 models only") as error:
        MLXStagedBackend(load_model(moe), options=MLXStageOptions(2, str(hostfile), timeout=1))
    assert "\n" not in str(error.value)
    with pytest.raises(StageSetupError, match="only 4 layers"):
        MLXStagedBackend(load_model(tiny), options=MLXStageOptions(5, str(hostfile), timeout=1))
    stage = ["stage", "--backend", "mlx", "--stages", "2", "--model", str(tiny)]
    assert cli_main([*stage, "--rank", "0", "--hostfile", str(hostfile)]) == 2
    assert cli_main([*stage, "--rank", "1", "--hostfile", str(tmp_path / "missing.json")]) == 2
    assert cli_main([*stage, "--rank", "1"]) == 2
    assert cli_main(["serve", "--backend", "mlx", "--stages", "2", "--no-spawn"]) == 2
    assert cli_main(["serve", "--backend", "mlx", "--stages", "2", "--stage-master", "127.0.0.1:1"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("agentfold: error:")]
    assert len(lines) == 5, lines
    assert "--rank must be in 1..1" in lines[0] and "cannot read the hostfile" in lines[1]
    assert "needs --hostfile" in lines[2] and "needs --hostfile" in lines[3] and "--hostfile" in lines[4]
