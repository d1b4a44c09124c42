"""Pipeline stages (`engine.torch.stages`): a model split by layers over real processes over
loopback gloo gives the one-process logits bit for bit, the same replies (drafted or not, greedy
or sampled), and sessions that resume after every rank restarted.

Rank 0 is this test process (`StagedBackend`); every other rank is a real `python -m agentfold.cli
stage` child on 127.0.0.1 and a free port, stopped (then killed) by the fixtures whatever happens.
"""

from __future__ import annotations

import gc
import json
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from agentfold.cli import main as cli_main
from agentfold.cli.stage import free_port, stage_command, stop_processes
from agentfold.engine.cache_layout import CacheLayoutError
from agentfold.engine.decode import Engine, GenerationConfig
from agentfold.engine.drafters import SuffixLookupDrafter
from agentfold.engine.protocol import forward_lanes
from agentfold.engine.sampler import SamplingParams
from agentfold.engine.selfcheck import check_row_exactness, probe_tokens
from agentfold.engine.torch.backend import TorchBackend
from agentfold.engine.torch.loader import load_torch_model
from agentfold.engine.torch.stage_worker import arrays_digest
from agentfold.engine.torch.stages import (
    StagedBackend,
    StageError,
    StageOptions,
    StageSetupError,
    connect,
    split_layers,
)
from agentfold.sessions import SessionManager
from tests.helpers.drafting import PinnedDepth
from tests.helpers.torch_tiny import CHATML, TINY_PROMPT, write_folder, write_gemma3_folder

GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.7, seed=2)


@contextmanager
def pipeline(folder: Path, stage_root: Path, stages: int = 2, timeout: float = 90.0,
             **load: str) -> Iterator[tuple[StagedBackend, list[subprocess.Popen]]]:
    """Ranks 1.. as child processes (stage dirs `stage_root/rank<N>`), rank 0 here; all stopped after."""
    master = f"127.0.0.1:{free_port()}"
    stage_root.mkdir(parents=True, exist_ok=True)
    extra = ["--backend", "torch", "--device", "cpu", "--timeout", str(timeout),
             *(a for key, value in load.items() for a in (f"--{key}", value))]
    processes = []
    backend = None
    try:
        for rank in range(1, stages):
            with open(stage_root / f"rank{rank}.log", "ab") as log:
                processes.append(subprocess.Popen(stage_command(rank, stages, master, folder,
                                                                stage_root / f"rank{rank}", extra),
                                                  stdout=log, stderr=subprocess.STDOUT))
        backend = StagedBackend(load_torch_model(folder, load.get("dtype", "auto"), "cpu"), load.get("quant", "auto"),
                                StageOptions(stages, master, timeout=timeout))
        yield backend, processes
    finally:
        if backend is not None:
            backend.close()
        stop_processes(processes, grace=10.0)


def engine_over(backend, tokenizer, eos) -> Engine:
    engine = Engine(backend, tokenizer, eos, drafter=SuffixLookupDrafter(min_match=3),
                    exactness=check_row_exactness(backend))
    engine.controller = PinnedDepth(max_depth=engine.controller.max_depth)
    return engine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_folder(tmp_path_factory.mktemp("stages") / "llama", "llama", seed=7, layers=4)


@pytest.fixture(scope="module")
def reference(tiny) -> TorchBackend:
    return TorchBackend(load_torch_model(tiny, device="cpu"))


@pytest.fixture(scope="module")
def staged(tiny, tmp_path_factory) -> Iterator[StagedBackend]:
    with pipeline(tiny, tmp_path_factory.mktemp("stage-dirs")) as (backend, _):
        yield backend


def test_split_layers():
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert split_layers(30, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert split_layers(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    for bad, message in ((5, "only 4 layers"), (0, ">= 1")):
        with pytest.raises(StageSetupError, match=message):
            split_layers(4, bad)


def test_logits_equal_one_process(reference, staged):
    """forward, prefill (chunked, stepped), rollback and forward_many: the same bits as TorchBackend."""
    assert staged.plan == [range(0, 2), range(2, 4)] and staged.remote[0]["backend"] == "torch"
    prompt = probe_tokens(reference.vocab_size, 70)
    ours, theirs = staged.new_cache(), reference.new_cache()
    staged.prefill(prompt, ours, boundaries=[16, 40])
    reference.prefill(prompt, theirs, boundaries=[16, 40])
    assert ours.tokens == theirs.tokens == prompt
    for tokens in ([5], [6, 7, 8, 9], list(range(100, 116)), [3]):
        assert np.array_equal(staged.forward(tokens, ours), reference.forward(tokens, theirs))
    mark_ours, mark_theirs = staged.checkpoint(ours), reference.checkpoint(theirs)
    staged.forward([11, 12, 13, 14], ours)
    reference.forward([11, 12, 13, 14], theirs)
    staged.rollback(ours, mark_ours, 1)  # the stage's rows past the kept one are overwritten next
    reference.rollback(theirs, mark_theirs, 1)
    assert np.array_equal(staged.forward([20, 21], ours), reference.forward([20, 21], theirs))
    staged.truncate(ours, 30)
    reference.truncate(theirs, 30)
    assert np.array_equal(staged.forward([22, 23, 24], ours), reference.forward([22, 23, 24], theirs))

    lanes_ours = [([9, 10, 11], ours), ([40] * 5, staged.new_cache())]
    lanes_theirs = [([9, 10, 11], theirs), ([40] * 5, reference.new_cache())]
    for a, b in zip(forward_lanes(staged, lanes_ours), forward_lanes(reference, lanes_theirs), strict=True):
        assert np.array_equal(a, b)
    stepped = staged.new_cache()
    steps = sum(1 for _ in staged.prefill_steps(prompt[:33], stepped))
    assert steps == 2 + 1 and stepped.length == 33  # one per own layer, one per remote stage
    fresh = reference.new_cache()
    reference.prefill(prompt[:33], fresh)
    assert np.array_equal(staged.forward([7], stepped), reference.forward([7], fresh))
    stats = staged.stage_stats()["stages"]
    assert stats[1]["passes"] > 0 and stats[1]["bytes_sent"] > 0 and stats[0]["bytes_sent"] > 0
    assert "stages" in staged.describe() and json.dumps(staged.describe())


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "t0.7-seed2"])
def test_engine_replies_equal_one_process(tiny, reference, staged, params):
    loaded = reference.loaded
    ours = engine_over(staged, loaded.tokenizer, loaded.eos_token_ids)
    theirs = engine_over(reference, loaded.tokenizer, loaded.eos_token_ids)
    assert ours.exactness.max_width == theirs.exactness.max_width > 1, ours.exactness.describe()
    prompt = loaded.tokenizer.encode(TINY_PROMPT)
    replies = {}
    for name, engine in (("staged", ours), ("one", theirs)):
        for draft in (True, False):
            replies[name, draft] = engine.generate(prompt, GenerationConfig(params=params, max_tokens=40, draft=draft))
    assert len({tuple(c.tokens) for c in replies.values()}) == 1
    assert replies["staged", True].stats.drafted > 0 and replies["staged", False].stats.drafted == 0
    if params.greedy:  # the random model's greedy reply loops, so the suffix drafter's drafts land
        assert replies["staged", True].stats.accepted > 0


def test_session_resumes_after_every_rank_restarts(tiny, reference, tmp_path):
    """A snapshot taken by one pipeline restores into a new one (new processes, same stage dirs)."""
    tokenizer = reference.loaded.tokenizer
    tokenizer.chat_template = CHATML
    config = GenerationConfig(max_tokens=12, draft=False)
    messages = [{"role": "user", "content": "def add(a, b):\n"}]
    prompt = probe_tokens(reference.vocab_size, 50)
    stage_root, home = tmp_path / "stage-dirs", tmp_path / "home"
    with pipeline(tiny, stage_root) as (backend, _):
        engine = Engine(backend, tokenizer, reference.loaded.eos_token_ids)
        first, info = SessionManager(engine, home).reply(messages, config)
        cache = backend.new_cache()
        backend.prefill(prompt[:40], cache)
        arrays, layout = backend.cache_to_arrays(cache)
    assert [spec["kind"] for spec in layout] == ["kv", "kv", "stage", "stage"] and arrays["2.stage"].size == 32
    assert len(list((stage_root / "rank1").glob("*.safetensors"))) >= 2  # the session's snapshot and this one

    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "for i in range(10):\n"}]
    one = Engine(reference, tokenizer, reference.loaded.eos_token_ids)
    with tempfile.TemporaryDirectory() as fresh_home:
        fresh, _ = SessionManager(one, fresh_home).reply(messages, config)
    with pipeline(tiny, stage_root) as (backend, _):
        engine = Engine(backend, tokenizer, reference.loaded.eos_token_ids)
        restored = backend.arrays_to_cache(arrays, layout)
        assert restored.tokens == prompt[:40]
        continued = engine.generate(prompt, config, restored)
        same_plan = reference.new_cache()  # a fresh one-process run that also prefilled 40 tokens first
        reference.prefill(prompt[:40], same_plan)
        assert continued.tokens == one.generate(prompt, config, same_plan).tokens
        assert continued.stats.cached_tokens == 40
        resumed, resumed_info = SessionManager(engine, home).reply(messages, config, info.session_id)
        assert resumed.tokens == fresh.tokens and resumed_info.cached_tokens > 0

        sha = bytes(arrays["2.stage"]).hex()
        (stage_root / "rank1" / f"{sha}.safetensors").unlink()  # a stage lost its file: the restore says so
        with pytest.raises(CacheLayoutError, match="no .*safetensors"):
            backend.arrays_to_cache(arrays, layout)
        tampered = dict(arrays, **{"2.stage": np.zeros(32, dtype=np.uint8)})
        with pytest.raises(CacheLayoutError):
            backend.arrays_to_cache(tampered, layout)
        assert np.array_equal(backend.forward([5], backend.new_cache()), reference.forward([5], reference.new_cache()))


def test_three_stages_and_a_stage_that_dies(tiny, reference, tmp_path):
    """A middle stage (no embedding, no head) too; a killed stage is a one-line StageError."""
    prompt = probe_tokens(reference.vocab_size, 30)
    with pipeline(tiny, tmp_path / "stage-dirs", stages=3) as (backend, processes):
        assert backend.plan == [range(0, 2), range(2, 3), range(3, 4)]
        ours, theirs = backend.new_cache(), reference.new_cache()
        backend.prefill(prompt, ours)
        reference.prefill(prompt, theirs)
        assert np.array_equal(backend.forward([1, 2, 3], ours), reference.forward([1, 2, 3], theirs))
        processes[1].kill()
        processes[1].wait()
        began = time.monotonic()
        with pytest.raises(StageError) as error:
            backend.forward([4], ours)
        assert "stage 2" in str(error.value) and "\n" not in str(error.value) and time.monotonic() - began < 20
        with pytest.raises(StageError, match="pipeline is down"):
            backend.forward([4], ours)
        backend.wire = backend._store = None  # rank 0's connections close (as when its process dies)
        gc.collect()
        assert processes[0].wait(20) == 0
    assert "rank 0 went away" in (tmp_path / "stage-dirs" / "rank1.log").read_text()


@pytest.mark.parametrize("kind", ["gemma3", "qwen3-bfloat16-float"])
def test_other_models_and_dtypes(kind, tmp_path):
    """Gemma 3 (tied head on the last stage, scaled embedding, sliding layers) on int8, and Qwen3 in
    bfloat16 on float weights (its snapshot arrays travel as bits): logits and restores bit for bit."""
    if kind == "gemma3":
        folder, load = write_gemma3_folder(tmp_path / kind, seed=1, layers=4), {}
    else:
        folder, load = write_folder(tmp_path / kind, "qwen3", seed=3, layers=3), {"dtype": "bfloat16", "quant": "none"}
    one = TorchBackend(load_torch_model(folder, load.get("dtype", "auto"), "cpu"), quant=load.get("quant", "auto"))
    prompt = probe_tokens(one.vocab_size, 60)
    with pipeline(folder, tmp_path / "stage-dirs", **load) as (backend, _):
        ours, theirs = backend.new_cache(), one.new_cache()
        backend.prefill(prompt, ours, [20])
        one.prefill(prompt, theirs, [20])
        for tokens in ([3], [4, 5, 6, 7], list(range(50, 66))):
            assert np.array_equal(backend.forward(tokens, ours), one.forward(tokens, theirs))
        restored = backend.arrays_to_cache(*backend.cache_to_arrays(ours))
        assert np.array_equal(backend.forward([9], restored), one.forward([9], theirs))


def test_setup_errors_are_one_line(tiny, tmp_path, capsys):
    with pytest.raises(StageSetupError, match="only 4 layers"):
        StagedBackend(load_torch_model(tiny, device="cpu"), options=StageOptions(5, "127.0.0.1:1"))
    master = f"127.0.0.1:{free_port()}"
    with pytest.raises(StageSetupError, match="did not all connect") as error:
        StagedBackend(load_torch_model(tiny, device="cpu"), options=StageOptions(2, master, timeout=1.5))
    assert "\n" not in str(error.value)
    with pytest.raises(StageSetupError, match="rank 0 did not listen"):
        connect(1, 2, f"127.0.0.1:{free_port()}", timeout=0.5)
    with pytest.raises(StageSetupError, match="HOST:PORT"):
        connect(1, 2, "nowhere", timeout=0.5)
    assert cli_main(["serve", "--stages", "2", "--backend", "mlx", "--stage-master", master]) == 2
    assert cli_main(["serve", "--stages", "0"]) == 2
    assert cli_main(["serve", "--no-spawn"]) == 2
    assert cli_main(["stage", "--rank", "0", "--stages", "2", "--master", master, "--model", str(tiny)]) == 2
    assert cli_main(["stage", "--rank", "1", "--stages", "2", "--master", master, "--backend", "mlx"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("agentfold: error:")]
    assert len(lines) == 5 and "the torch stages' address" in lines[0] and "--rank must be in 1..1" in lines[3]


def test_ranks_that_disagree_are_refused(tiny, tmp_path):
    """A stage loaded another way (here float weights against rank 0's int8) never joins a pass."""
    master = f"127.0.0.1:{free_port()}"
    with open(tmp_path / "rank1.log", "wb") as log:
        process = subprocess.Popen(stage_command(1, 2, master, tiny, tmp_path / "rank1",
                                                 ["--backend", "torch", "--quant", "none", "--timeout", "60"]),
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        with pytest.raises(StageSetupError, match="another quant than rank 0") as error:
            StagedBackend(load_torch_model(tiny, device="cpu"), options=StageOptions(2, master, timeout=60))
        assert "\n" not in str(error.value)
        assert process.wait(30) == 2
    finally:
        stop_processes([process], grace=1.0)
    assert "agentfold: error: rank 1 has another quant" in (tmp_path / "rank1.log").read_text()


def test_stage_file_digest_covers_arrays_and_metadata():
    arrays = {"2.keys": np.arange(6, dtype=np.float32).reshape(1, 2, 3)}
    meta = {"tokens": "ab", "length": 2}
    same = arrays_digest({"2.keys": arrays["2.keys"].copy()}, dict(meta))
    assert arrays_digest(arrays, meta) == same
    assert arrays_digest(arrays, {**meta, "length": 3}) != same
    assert arrays_digest({"2.keys": arrays["2.keys"] + 1}, meta) != same


@pytest.mark.slow
def test_smollm2_two_stages_equal_one_process(smollm2_gguf, tmp_path):
    """The real SmolLM2-135M (30 layers, tied int8 head on the last stage): logits and drafted replies."""
    from tests.conftest import chat_ids

    one = TorchBackend(load_torch_model(smollm2_gguf, device="cpu"))
    tokenizer = one.loaded.tokenizer
    # a reply that re-emits the prompt's code, so that the suffix drafter has something to draft
    prompt = chat_ids(tokenizer, "Copy this code exactly:\n\ndef area(width, height):\n    return width * height\n") + \
        tokenizer.encode("```python\ndef area(", add_special_tokens=False)
    with pipeline(smollm2_gguf, tmp_path / "stage-dirs") as (backend, _):
        ours, theirs = backend.new_cache(), one.new_cache()
        backend.prefill(prompt, ours)
        one.prefill(prompt, theirs)
        assert np.array_equal(backend.forward([28, 29, 30], ours), one.forward([28, 29, 30], theirs))
        staged_engine = engine_over(backend, tokenizer, one.loaded.eos_token_ids)
        config = GenerationConfig(max_tokens=24)
        drafted = staged_engine.generate(prompt, config)
        serial = Engine(one, tokenizer, one.loaded.eos_token_ids).generate(prompt, GenerationConfig(max_tokens=24, draft=False))
        assert drafted.tokens == serial.tokens and drafted.stats.drafted > 0


@pytest.mark.slow
def test_serve_starts_its_stages(tiny, tmp_path):
    """`agentfold serve --stages 2` starts rank 1 itself, answers, and leaves no stage behind."""
    import os

    import httpx

    from agentfold.bench.harness import ServerProcess

    server = ServerProcess(tmp_path / "home", ["--backend", "torch", "--device", "cpu", "--model", str(tiny),
                                               "--stages", "2", "--no-sessions"], start_timeout=120)
    with server:
        reply = httpx.post(server.url + "/v1/completions", json={"prompt": TINY_PROMPT, "max_tokens": 8}, timeout=60)
        assert reply.status_code == 200, reply.text
        children = subprocess.run(["pgrep", "-P", str(server.proc.pid), "-f", "agentfold.cli stage"],
                                  capture_output=True, text=True).stdout.split()
        assert len(children) == 1, "no stage process"
    assert server.proc.returncode == 130  # SIGINT: uvicorn's graceful shutdown, then the stages'
    for _ in range(50):
        try:
            os.kill(int(children[0]), 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the stage process outlived agentfold serve")
    assert "stage 1: shut down by rank 0" in server.log_path.read_text()
