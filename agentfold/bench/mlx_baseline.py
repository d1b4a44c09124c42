"""Stock mlx-lm as the baseline engine: the same prompt ids, greedy, on the float model, timed alike.

A speedup only means something against the engine people would otherwise run, so the decode and
suite benches decode the same prompts with mlx-lm's own `stream_generate` and its own attention
(`stock_attention` swaps the engine's row-exact kernel out for the duration). mlx-lm runs the
float model (an int8 engine's replies may differ from it wherever the numerics decide: compared,
never required), and its rate is counted with the same `steady_tps` as the engine's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agentfold.bench.rates import rounded, steady_tps, token_sha

MLX_LM_NUM_DRAFT_TOKENS = 3  # mlx_lm.generate's command-line default


@contextmanager
def stock_attention(models: Sequence[Any]) -> Iterator[None]:
    """mlx-lm's own attention for the baselines; the engine's row-exact one again afterwards."""
    from agentfold.kernels import attention

    attention.uninstall()
    try:
        yield
    finally:
        for model in models:
            attention.install(model)


def mlx_lm_decode(model: Any, tokenizer: Any, prompt: Sequence[int], max_tokens: int, draft_model: Any = None,
                  num_draft_tokens: int = MLX_LM_NUM_DRAFT_TOKENS) -> dict[str, Any]:
    """Greedy mlx-lm `stream_generate`; decode rate as (n - 1) / (t_last - t_first), like DecodeStats.

    Speculative bursts end with the target's own token (`from_draft` False), so the first pass's
    tokens are known and `steady_tps` leaves them out, as for the engine's drafted runs.
    """
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    kwargs: dict[str, Any] = {}
    if draft_model is not None:
        kwargs = {"draft_model": draft_model, "num_draft_tokens": num_draft_tokens}
    tokens: list[int] = []
    times: list[float] = []
    flags: list[bool] = []
    finish = None
    started = time.perf_counter()
    for response in stream_generate(model, tokenizer, mx.array(list(prompt)), max_tokens=max_tokens, **kwargs):
        times.append(time.perf_counter())
        tokens.append(int(response.token))
        flags.append(bool(response.from_draft))
        finish = response.finish_reason
    decode = times[-1] - times[0] if len(times) > 1 else 0.0
    first_burst = flags.index(False) + 1 if False in flags else len(flags)
    row = {
        "completion_tokens": len(tokens),
        "finish_reason": finish,
        "steady_tps": rounded(steady_tps(times, first_burst)),
        "decode_tps": rounded((len(tokens) - 1) / decode) if decode > 0 else 0.0,
        "first_pass_tokens": first_burst,
        "ttft_seconds": rounded(times[0] - started, 4) if times else None,
        "decode_seconds": rounded(decode, 4),
        "total_seconds": rounded((times[-1] if times else time.perf_counter()) - started, 4),
        "token_sha": token_sha(tokens),
    }
    if draft_model is not None:
        row["num_draft_tokens"] = num_draft_tokens
        row["from_draft"] = sum(flags)
    return row


def mlx_dtype(dtype: str | None) -> str:
    """The dtype MLX loads a model in for `dtype` (None and torch-only names: float32)."""
    return dtype if dtype in ("float32", "bfloat16", "float16", "keep") else "float32"


def float_mlx_model(path: Path, dtype: str | None, engine_backend: Any, say: Callable[[str], None]) -> Any:
    """The float model stock mlx-lm runs for the baseline: the engine's own when it is MLX with float
    weights, else a separate load (int8 replaces an MLX model's linears in place; torch is not MLX)."""
    if getattr(engine_backend, "name", None) == "mlx" and getattr(engine_backend, "quant", None) == "none":
        return engine_backend.loaded
    from agentfold.engine.mlx.loader import load_model

    say(f"bench: loading {path.name} ({mlx_dtype(dtype)}) for the stock mlx-lm baseline")
    return load_model(path, mlx_dtype(dtype), say)
