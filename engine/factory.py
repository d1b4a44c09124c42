"""Build an Engine from a model path: load, self-check row-exactness, pick the drafter."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .backend import MLXBackend
from .decode import Engine
from .drafters import DraftModelDrafter, SuffixLookupDrafter
from .loader import LoadedModel, load_model
from .selfcheck import check_row_exactness

DRAFTERS = ("suffix", "draft-model", "none")


BACKENDS = ("mlx", "torch")


def _loader(backend: str, dtype: str | None, device: str,
            say: Callable[[str], None]) -> tuple[Callable[[str | Path | LoadedModel], LoadedModel], type]:
    """How to load a model for `backend`, and the backend class that runs it."""
    if backend == "mlx":
        if device not in ("auto", "cpu"):
            raise ValueError(f"--device {device}: the mlx backend runs on this machine's MLX device; "
                             "use --backend torch for CUDA")
        chosen = dtype or "float32"
        return (lambda m: m if isinstance(m, LoadedModel) else load_model(m, chosen, say)), MLXBackend
    if backend == "torch":
        try:
            from .torch_backend import TorchBackend
            from .torch_loader import load_torch_model
        except ImportError as error:
            raise ValueError(f"the torch backend needs PyTorch ({error}): pip install 'agentfold[torch]'") from None
        chosen = dtype or "auto"
        return (lambda m: m if isinstance(m, LoadedModel) else load_torch_model(m, chosen, device, say)), TorchBackend
    raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")


def build_engine(
    model: str | Path | LoadedModel,
    dtype: str | None = None,
    drafter: str = "suffix",
    draft_model: str | Path | LoadedModel | None = None,
    max_width: int = 16,
    self_check: bool = True,
    progress: Callable[[str], None] | None = None,
    backend: str = "mlx",
    device: str = "auto",
) -> Engine:
    """An engine whose drafted replies are byte-identical to its serial ones.

    `drafter`: suffix (prompt / session lookup), draft-model (needs `draft_model`), or none.
    `backend`: mlx, or torch on `device` (auto | cpu | cuda). `dtype` None: float32, except
    bfloat16 for torch on CUDA. The self-check caps verify passes at the widest row-exact width
    (drafting off if none).
    """
    say = progress or (lambda message: None)
    load, backend_class = _loader(backend, dtype, device, say)
    loaded = load(model)
    target = backend_class(loaded)
    if draft_model is not None and drafter == "suffix":
        drafter = "draft-model"
    chosen = None
    if drafter == "suffix":
        chosen = SuffixLookupDrafter(min_match=3)
    elif drafter == "draft-model":
        if draft_model is None:
            raise ValueError("the draft-model drafter needs a draft model path")
        chosen = DraftModelDrafter(backend_class(load(draft_model)))
    elif drafter != "none":
        raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}, not {drafter!r}")
    report = None
    if self_check and chosen is not None:
        say("checking row-exactness of verify passes")
        report = check_row_exactness(target, max_width=max_width)
        say(report.describe())
    return Engine(target, loaded.tokenizer, loaded.eos_token_ids, drafter=chosen, exactness=report)
