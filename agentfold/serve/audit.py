"""Audits: a drafted reply against the serial one, the one place AgentFold checks its own claim.

Three ways in, one comparison (`engine.decode.first_mismatch` over token ids):
- inline (`"audit": true` on a request): the runtime decodes the same prompt serially right after
  the reply, on the worker, before the client gets the Completion (`Runtime._step_audit`);
- later (`--audit-rate`, `agentfold audit`, MCP `audit_turn`): `replay` decodes a stored turn's
  inputs serially from an empty cache and stores the verdict on its telemetry row;
- on demand (MCP `check_exactness`): `check_exactness` decodes one prompt drafted and serial.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

from agentfold.engine.decode import Completion, GenerationConfig, first_mismatch, token_sha
from agentfold.engine.sampler import SamplingParams
from agentfold.serve.scheduler import Turn, TurnRequest

__all__ = ["check_exactness", "config_from_inputs", "config_inputs", "first_mismatch", "replay"]

RunTurn = Callable[[TurnRequest], Awaitable[tuple[Completion, Turn]]]


def config_inputs(prompt: list[int], config: GenerationConfig, cuts: Sequence[int] = ()) -> dict[str, Any]:
    """What replaying a turn needs, JSON-ready (stored on its telemetry row). `cuts`: its prefill
    plan's cuts, which a replay follows (a long prefill chunk's bits may depend on where it is cut:
    AMX attention, `kernels.torch_cpu.MATRIX_MIN_ROWS`)."""
    return {"prompt": list(prompt), "params": asdict(config.params), "max_tokens": config.max_tokens,
            "stop": list(config.stop), "grammar": config.grammar, "draft": config.draft, "cuts": list(cuts)}


def config_from_inputs(inputs: dict[str, Any], draft: bool) -> GenerationConfig:
    return GenerationConfig(params=SamplingParams(**inputs["params"]), max_tokens=inputs["max_tokens"],
                            stop=tuple(inputs["stop"]), draft=draft, grammar=inputs.get("grammar"))


def _internal(prompt: list[int], config: GenerationConfig, api: str, cuts: Sequence[int] = ()) -> TurnRequest:
    """A turn of the runtime's own: no session cache, no telemetry row of its own."""
    return TurnRequest(prompt=prompt, config=config, api=api, internal=True, cuts=tuple(cuts))


async def replay(run_turn: RunTurn, turn_id: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """Decode a stored turn's prompt serially from an empty cache and compare token ids."""
    if not inputs.get("prompt"):
        raise ValueError(f"turn {turn_id!r} has no stored inputs to replay")
    reference, _ = await run_turn(_internal(inputs["prompt"], config_from_inputs(inputs, draft=False), "audit",
                                            inputs.get("cuts") or ()))
    replied = list(inputs.get("reply") or [])
    mismatch = first_mismatch(replied, reference.tokens)
    return {"turn_id": turn_id, "verdict": "passed" if mismatch is None else "failed",
            "mismatch_position": mismatch, "token_sha": token_sha(replied),
            "audit_token_sha": token_sha(reference.tokens)}


async def check_exactness(run_turn: RunTurn, prompt: list[int], config: GenerationConfig) -> dict[str, Any]:
    """Drafted against serial for the same prompt: equal or not, where, both hashes and timings."""
    results, tokens = {}, {}
    for name, draft in (("drafted", True), ("serial", False)):
        completion, _ = await run_turn(_internal(prompt, replace(config, draft=draft), "mcp"))
        stats = completion.stats
        tokens[name] = completion.tokens
        results[name] = {"tokens": len(completion.tokens), "token_sha": completion.token_sha,
                         "decode_tps": round(stats.decode_tps, 3), "total_ms": round(stats.total_seconds * 1e3, 3),
                         "ttft_ms": round(stats.ttft_seconds * 1e3, 3), "verify_passes": stats.verify_passes,
                         "drafted": stats.drafted, "accepted": stats.accepted}
    mismatch = first_mismatch(tokens["drafted"], tokens["serial"])
    return {"equal": mismatch is None, "mismatch_position": mismatch, **results}
