"""Rank 0 of an MLX pipeline, in a process of its own (MLX's ring starts once per process).

`python -m tests.helpers.mlx_stage_driver SCENARIO MODEL HOSTFILE OUT INPUT` joins the ring as
rank 0 (`MLXStagedBackend`), runs one scenario of `tests/engine/test_stages_mlx.py` and writes what
the test compares with its own one-process `MLXBackend`: logits to `OUT/logits.safetensors`, the
rest to `OUT/result.json`. INPUT is a JSON file of the prompt text, chat template and home folder.

Scenarios: `main` (logits of every kind of pass, engine replies, a session and a snapshot),
`resume` (the snapshot and the session after every rank restarted; a lost stage file), `refused`
(a stage that disagrees: the setup error's text).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from agentfold import prepare_process

prepare_process()  # the BLAS every agentfold process runs (the stages' CLI does the same)

# isort: split
import numpy as np  # noqa: E402
import safetensors.numpy  # noqa: E402

from agentfold.engine.cache_layout import CacheLayoutError  # noqa: E402
from agentfold.engine.decode import Engine, GenerationConfig  # noqa: E402
from agentfold.engine.drafters import SuffixLookupDrafter  # noqa: E402
from agentfold.engine.mlx.loader import load_model  # noqa: E402
from agentfold.engine.mlx.stages import MLXStagedBackend, MLXStageOptions, StageSetupError  # noqa: E402
from agentfold.engine.protocol import forward_lanes  # noqa: E402
from agentfold.engine.sampler import SamplingParams  # noqa: E402
from agentfold.engine.selfcheck import check_row_exactness, probe_tokens  # noqa: E402
from agentfold.sessions import SessionManager  # noqa: E402
from tests.helpers.drafting import PinnedDepth  # noqa: E402

PARAMS = {"greedy": SamplingParams(), "sampled": SamplingParams(temperature=0.7, seed=2)}


def logit_passes(backend: Any) -> tuple[list[np.ndarray], int]:
    """The passes `test_logits_equal_one_process` compares with one process (any backend), in this
    order, and how many steps the stepped prefill took."""
    prompt = probe_tokens(backend.vocab_size, 70)
    ours = backend.new_cache()
    backend.prefill(prompt, ours, boundaries=[16, 40])
    out = [backend.forward(tokens, ours) for tokens in ([5], [6, 7, 8, 9], list(range(100, 116)), [3])]
    mark = backend.checkpoint(ours)
    backend.forward([11, 12, 13, 14], ours)
    backend.rollback(ours, mark, 1)  # the stage's rows past the kept one are overwritten next
    out.append(backend.forward([20, 21], ours))
    backend.truncate(ours, 30)
    out.append(backend.forward([22, 23, 24], ours))
    out += forward_lanes(backend, [([9, 10, 11], ours), ([40] * 5, backend.new_cache())])
    stepped = backend.new_cache()
    steps = sum(1 for _ in backend.prefill_steps(prompt[:33], stepped))
    assert stepped.length == 33
    out.append(backend.forward([7], stepped))
    return out, steps


def drafting_engine(backend: Any) -> Engine:
    """An engine drafting by suffix lookup as deep as the self-check allows (drafts always run)."""
    loaded = backend.loaded
    engine = Engine(backend, loaded.tokenizer, loaded.eos_token_ids, drafter=SuffixLookupDrafter(min_match=3),
                    exactness=check_row_exactness(backend))
    engine.controller = PinnedDepth(max_depth=engine.controller.max_depth)
    return engine


def replies(engine: Engine, prompt: list[int]) -> dict[str, Any]:
    done = {}
    for name, params in PARAMS.items():
        for draft in (True, False):
            reply = engine.generate(prompt, GenerationConfig(params=params, max_tokens=40, draft=draft))
            done[f"{name}-{'drafted' if draft else 'serial'}"] = {"tokens": reply.tokens,
                                                                 "drafted": reply.stats.drafted,
                                                                 "accepted": reply.stats.accepted}
    return done


def main_scenario(backend: MLXStagedBackend, plan: dict[str, Any], out: Path) -> dict[str, Any]:
    tokenizer, eos = backend.loaded.tokenizer, backend.loaded.eos_token_ids
    passes, steps = logit_passes(backend)
    logits = {f"l{i}": array for i, array in enumerate(passes)}
    engine = drafting_engine(backend)
    result = {"max_width": engine.exactness.max_width, "replies": replies(engine, tokenizer.encode(plan["prompt"]))}
    tokenizer.chat_template = plan["template"]
    config = GenerationConfig(max_tokens=12, draft=False)
    first, info = SessionManager(Engine(backend, tokenizer, eos), plan["home"]).reply(plan["messages"], config)
    cache = backend.new_cache()
    backend.prefill(probe_tokens(backend.vocab_size, 50)[:40], cache)
    arrays, layout = backend.cache_to_arrays(cache)
    safetensors.numpy.save_file(arrays, str(out / "snapshot.safetensors"))
    safetensors.numpy.save_file(logits, str(out / "logits.safetensors"))
    return {**result, "steps": steps, "first": first.text, "session": info.session_id, "layout": layout,
            "stats": backend.stage_stats(), "describe": backend.describe()}


def resume_scenario(backend: MLXStagedBackend, plan: dict[str, Any], out: Path) -> dict[str, Any]:
    tokenizer, eos = backend.loaded.tokenizer, backend.loaded.eos_token_ids
    tokenizer.chat_template = plan["template"]
    config = GenerationConfig(max_tokens=12, draft=False)
    arrays = safetensors.numpy.load_file(str(out / "snapshot.safetensors"))
    layout = plan["layout"]
    engine = Engine(backend, tokenizer, eos)
    restored = backend.arrays_to_cache(arrays, layout)
    tokens = list(restored.tokens)
    prompt = probe_tokens(backend.vocab_size, 50)
    continued = engine.generate(prompt, config, restored)
    resumed, info = SessionManager(engine, plan["home"]).reply(plan["messages"], config, plan["session"])
    result: dict[str, Any] = {"restored": tokens, "continued": continued.tokens,
                              "continued_cached": continued.stats.cached_tokens, "resumed": resumed.tokens,
                              "resumed_cached": info.cached_tokens, "errors": []}
    sha = bytes(arrays["2.stage"]).hex()
    (Path(plan["stage_dir"]) / f"{sha}.safetensors").unlink()  # a stage lost its file: the restore says so
    tampered = dict(arrays, **{"2.stage": np.zeros(32, dtype=np.uint8)})
    for attempt in (arrays, tampered):
        try:
            backend.arrays_to_cache(attempt, layout)
        except CacheLayoutError as error:
            result["errors"].append(str(error))
    safetensors.numpy.save_file({"after": backend.forward([5], backend.new_cache())}, str(out / "logits.safetensors"))
    return result


def main(argv: list[str]) -> int:
    scenario, model, hostfile, out, plan_file = argv
    out_dir = Path(out)
    plan = json.loads(Path(plan_file).read_text())
    try:
        backend = MLXStagedBackend(load_model(model), options=MLXStageOptions(2, hostfile, timeout=60))
    except StageSetupError as error:
        result: dict[str, Any] = {"setup_error": str(error)}
    else:
        run = main_scenario if scenario == "main" else resume_scenario
        result = run(backend, plan, out_dir)
        backend.close()
    (out_dir / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
