"""MoE expert offload: where an expert runs never changes a bit of the reply.

An expert's int8 products are exact on every tier and its float steps always run on the model's
device, so any budget (all experts resident, none, a random half, swaps mid-reply, experts copied
in per pass) gives the same tokens, greedy and sampled, drafted and serial. Also: the routing
profile round-trips through `agentfold profile-experts`, the counters reach the turn record, and
`bench offload` writes a complete JSON.

Runs on CPU; with a GPU the same tests run the CUDA path (grouped Triton kernel, side streams).
Without one, the grouped kernel is checked under Triton's interpreter.
"""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported: the grouped kernel on CPU

from agentfold.engine.decode import Engine, GenerationConfig  # noqa: E402
from agentfold.engine.moe.offload import ExpertOffload, install_offload  # noqa: E402
from agentfold.engine.moe.placement import ExpertPlacement, load_profile  # noqa: E402
from agentfold.engine.moe.quant import expert_forward, int_matmul, quantize_activations, random_layer  # noqa: E402
from agentfold.engine.sampler import SamplingParams  # noqa: E402
from agentfold.engine.selfcheck import check_row_exactness  # noqa: E402
from agentfold.engine.torch.backend import TorchBackend  # noqa: E402
from agentfold.engine.torch.loader import load_torch_model  # noqa: E402
from agentfold.serve.telemetry import TelemetryStore, TurnRecord  # noqa: E402
from tests.engine.test_tiny_models import FlawedOracleDrafter, PinnedDepth  # noqa: E402
from tests.helpers.torch_tiny import tiny_config, write_folder  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
MAX_TOKENS = 16
WIDTH = 5  # verify passes of up to 5 rows
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


# -- the arithmetic --------------------------------------------------------------------------


def test_expert_gives_the_same_bits_held_on_device_or_host():
    g = torch.Generator(device=DEVICE).manual_seed(0)
    layer = random_layer(4, 64, 48, g, DEVICE, std=0.05)
    x = torch.randn(7, 48, generator=g, device=DEVICE)
    xq, scale = quantize_activations(x)
    for e in range(4):
        host = expert_forward(layer, e, xq, scale)  # int8 matrices read from host memory
        held = expert_forward(layer, e, xq, scale, layer.gate_up[e].to(DEVICE).clone(), layer.down[e].to(DEVICE).clone())
        assert torch.equal(host, held)
        singles = [expert_forward(layer, e, xq[j : j + 1], scale[j : j + 1]) for j in range(7)]
        assert all(torch.equal(host[j], singles[j][0]) for j in range(7))  # a row's bits do not depend on the pass


def test_grouped_kernel_equals_cpu_integer_products():
    """The CUDA path's grouped int8 kernel (interpreted on CPU) against the CPU tier's BLAS products."""
    pytest.importorskip("triton")
    from agentfold.kernels.triton_moe import GROUP_BLOCK, grouped_int_matmul

    g = torch.Generator().manual_seed(1)
    a = torch.randint(-127, 128, (5, 80), dtype=torch.int8, generator=g)
    pool = torch.randint(-127, 128, (3, 70, 80), dtype=torch.int8, generator=g)
    rows = torch.full((2 * GROUP_BLOCK,), -1, dtype=torch.int32)
    rows[:3], rows[GROUP_BLOCK : GROUP_BLOCK + 2] = torch.tensor([0, 2, 4]), torch.tensor([1, 3])
    out = grouped_int_matmul(a.to(DEVICE), rows.to(DEVICE), torch.tensor([2, 0], dtype=torch.int32, device=DEVICE),
                             pool.to(DEVICE)).cpu()
    assert torch.equal(out[:3], int_matmul(a[[0, 2, 4]], pool[2]))
    assert torch.equal(out[GROUP_BLOCK : GROUP_BLOCK + 2], int_matmul(a[[1, 3]], pool[0]))


def test_every_tier_and_schedule_gives_the_same_layer_output():
    g = torch.Generator(device=DEVICE).manual_seed(2)
    layers = {1: random_layer(8, 64, 48, g, DEVICE), 3: random_layer(8, 64, 48, g, DEVICE)}
    x = torch.randn(6, 48, generator=g, device=DEVICE)
    ids = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(j))[:3] for j in range(6)]).to(DEVICE)
    gates = torch.rand(6, 3, generator=g, device=DEVICE)
    one = layers[1].expert_bytes
    placements = [dict(budget_bytes=16 * one), dict(budget_bytes=0), dict(budget_bytes=5 * one, adapt_every=1),
                  dict(budget_bytes=3 * one, copy_share=0.5)]
    if HAVE_TRITON:
        placements.append(dict(budget_bytes=4 * one, grouped_kernel=True))  # the CUDA path (interpreted on CPU)
    outputs = []
    for options in placements:
        offload = ExpertOffload(layers, device=DEVICE, **options)
        outputs.append([offload.run(layer, x, ids, gates) for _ in range(3) for layer in (1, 3)])
        offload.close()
    assert all(torch.equal(a, b) for run in outputs[1:] for a, b in zip(outputs[0], run, strict=True))


def test_placement_seeds_from_profile_and_swaps_past_the_margin():
    profile = {0: [0, 9, 1, 0], 2: [5, 0, 0, 5]}
    placement = ExpertPlacement([0, 2], 4, slots=3, profile=profile, adapt_every=2, decay=0.5, margin=0.5)
    assert {placement.occupant[s] for s in range(3)} == {(0, 1), (2, 0), (2, 3)}  # the largest shares
    for _ in range(2):
        placement.observe(0, np.array([2]), np.array([4]))  # expert (0, 2) becomes busy
        placement.observe(2, np.array([0, 3]), np.array([3, 3]))
        swaps = placement.end_pass()
    assert [(s.evicted, s.loaded) for s in swaps] == [((0, 1), (0, 2))]
    assert placement.slot(0, 2) >= 0 and placement.slot(0, 1) == -1
    for _ in range(2):  # (0, 1) comes back only a little busier than the weakest: no swap
        placement.observe(0, np.array([1, 2]), np.array([4, 4]))
        placement.observe(2, np.array([0, 3]), np.array([3, 3]))
        assert placement.end_pass() == []


def test_bad_settings_are_clear_errors(tmp_path):
    g = torch.Generator(device=DEVICE).manual_seed(3)
    layers = {0: random_layer(2, 64, 16, g, DEVICE)}
    with pytest.raises(ValueError, match="budget"):
        ExpertOffload(layers, -1, DEVICE)
    with pytest.raises(ValueError, match="copy_share"):
        ExpertOffload(layers, 0, DEVICE, copy_share=2.0)
    bad = tmp_path / "profile.json"
    bad.write_text(json.dumps({"layers": {}}))
    with pytest.raises(ValueError, match="routing profile"):
        load_profile(bad)
    from agentfold.engine.torch import models as torch_models
    with torch.device("meta"):
        dense = torch_models.build(tiny_config("llama", 64))
    with pytest.raises(ValueError, match="no MoE blocks"):
        install_offload(dense, 0)
    if not CUDA:
        from agentfold.cli import main

        assert main(["bench", "offload", "--out", str(tmp_path / "x.json"), "--device", "cuda"]) == 2


# -- a tiny Qwen3-MoE through the torch backend ------------------------------------------------


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    folder = write_folder(tmp_path_factory.mktemp("moe") / "qwen3-moe", "qwen3_moe", layers=3)
    loaded = load_torch_model(folder, "float32", DEVICE)
    backend = TorchBackend(loaded)
    prompt = loaded.tokenizer.encode(PROMPT)
    total = 2 * 4 * 3 * 32 * 64  # 2 MoE layers x 4 experts x int8 bytes of one expert
    return folder, loaded, backend, prompt, total


def _engine(backend: TorchBackend, loaded, report, drafter=None) -> Engine:
    engine = Engine(backend, loaded.tokenizer, set(), drafter=drafter, exactness=report)
    engine.controller = PinnedDepth(max_depth=WIDTH - 1)
    return engine


def test_any_placement_gives_the_same_tokens(moe):
    _, loaded, backend, prompt, total = moe
    vocab = backend.vocab_size
    placements = {
        "all resident": dict(budget_bytes=total),
        "none resident": dict(budget_bytes=0),
        "random half": dict(budget_bytes=total // 2,
                            profile={i: np.random.default_rng(i).permutation(4).tolist() for i in (0, 1)}),
        "swaps mid-reply": dict(budget_bytes=total // 4, adapt_every=1, decay=0.1, margin=0.0, max_swaps=2),
        "copied per pass": dict(budget_bytes=0, copy_share=1.0),
    }
    reference: dict[str, list[int]] = {}
    drafted_swaps = 0
    for name, options in placements.items():
        budget = options.pop("budget_bytes")
        install_offload(loaded.model, budget, **options)
        report = check_row_exactness(backend, max_width=WIDTH)  # the experts are part of every verify row
        assert report.max_width == WIDTH, (name, report.describe())
        for params in (GREEDY, SAMPLED):
            config = GenerationConfig(params, MAX_TOKENS, draft=False)
            serial = _engine(backend, loaded, report).generate(prompt, config)
            key = f"t={params.temperature}"
            reference.setdefault(key, serial.tokens)
            assert serial.tokens == reference[key], (name, key)
            drafter = FlawedOracleDrafter(prompt, serial.tokens, vocab)
            drafted = _engine(backend, loaded, report, drafter).generate(prompt, GenerationConfig(params, MAX_TOKENS))
            assert drafted.tokens == serial.tokens, (name, key)
            assert drafted.stats.accepted > 0 and drafted.stats.verify_passes < MAX_TOKENS
            stats = drafted.stats.offload
            assert stats["passes"] == drafted.stats.verify_passes + 1  # the prefill is a pass too
            if name == "swaps mid-reply":
                assert serial.stats.offload["swaps"] > 0
                drafted_swaps += stats["swaps"]
            if name == "copied per pass":
                assert stats["experts_per_layer"]["device"] == 0 and stats["experts_per_layer"]["streamed"] > 0
            if name == "all resident":
                assert stats["hit_rate"] == 1.0
            if name == "none resident":
                assert stats["hit_rate"] == 0.0 and stats["experts_per_layer"]["host"] > 0
    assert drafted_swaps > 0


def test_profile_round_trips_and_seeds_the_placement(moe, tmp_path):
    from agentfold.cli import main

    folder, loaded, backend, prompt, total = moe
    text = tmp_path / "calibration.txt"
    text.write_text(PROMPT * 4)
    out = tmp_path / "profile.json"
    assert main(["profile-experts", "--model", str(folder), "--text", str(text), "--out", str(out),
                 "--device", DEVICE]) == 0
    data = json.loads(out.read_text())
    tokens = data["tokens"]
    counts = load_profile(out)
    assert sorted(counts) == [0, 1] and all(int(c.sum()) == tokens * data["top_k"] for c in counts.values())
    offload = install_offload(loaded.model, total // 4, profile=out)
    busiest = max(((layer, int(e)) for layer, c in counts.items() for e in range(4)),
                  key=lambda pair: counts[pair[0]][pair[1]] / counts[pair[0]].sum())
    assert busiest in offload.placement.occupant
    assert main(["profile-experts", "--model", str(folder), "--text", str(tmp_path / "missing.txt"),
                 "--out", str(out)]) == 2


def test_offload_counters_reach_the_turn_record(moe, tmp_path):
    _, loaded, backend, prompt, total = moe
    install_offload(loaded.model, total // 2)
    completion = Engine(backend, loaded.tokenizer, set()).generate(prompt, GenerationConfig(max_tokens=4))
    stats = completion.stats.offload
    assert stats["passes"] == 5 and stats["layer_calls"] == 10 and 0.0 <= stats["hit_rate"] <= 1.0
    assert set(stats["seconds"]) == {"device", "cpu", "wait", "copy"}
    record = TurnRecord.from_completion(completion, session_id=None, api="cli", client="test", model="tiny")
    assert record.offload == stats
    with TelemetryStore(tmp_path / "telemetry.sqlite") as store:
        store.record(record)
        plain = TurnRecord.from_completion(completion, session_id=None, api="cli", client="test", model="tiny")
        plain.offload = None
        plain.turn_id = "dense"
        store.record(plain)
        store.flush()
        assert store.get_turn(record.turn_id)["offload"] == stats
        assert store.get_turn("dense")["offload"] is None


def test_bench_offload_writes_a_complete_json(tmp_path):
    from agentfold.bench.offload import SMALL_MOE, bench_offload

    plan = {"moe": {**SMALL_MOE, "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2},
            "moe_tokens": 6, "moe_width": 2, "calibration_tokens": 8, "dense_tokens": 4, "dense_width": 2,
            "dense_workload": "prose"}
    out = tmp_path / "offload.json"
    bench_offload(out, quick=True, device="cpu", progress=None, plan=plan)
    data = json.loads(out.read_text())
    assert data["schema"] == "agentfold.bench.offload/1" and data["complete"]
    assert data["duration_seconds"] > 0 and data["machine"]["cpu_count"] >= 1
    budgets = data["moe"]["budgets"]
    assert [(b["fraction"], b["copy_share"]) for b in budgets] == [(0.25, 0), (0.5, 0), (1.0, 0), (0.25, 1.0)]
    for row in budgets:
        assert row["identical"] and row["serial"]["completion_tokens"] == 6
        assert set(row["serial"]["offload"]["seconds"]) == {"device", "cpu", "wait", "copy"}
    assert budgets[2]["hit_rate"] == 1.0 and data["moe"]["identical_across_budgets"]
    assert budgets[3]["experts_per_layer"]["streamed"] > 0
    dense = data["dense"]
    assert dense["identical"] and dense["transformers"]["completion_tokens"] >= 1
    assert data["summary"]["moe_identical_across_budgets"] and "torch" in data["versions"]
