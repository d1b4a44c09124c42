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


def build_engine(
    model: str | Path | LoadedModel,
    dtype: str = "float32",
    drafter: str = "suffix",
    draft_model: str | Path | LoadedModel | None = None,
    max_width: int = 16,
    self_check: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Engine:
    """An engine whose drafted replies are byte-identical to its serial ones.

    `drafter`: suffix (prompt / session lookup), draft-model (needs `draft_model`), or none.
    The self-check caps verify passes at the widest row-exact width (drafting off if none).
    """
    say = progress or (lambda message: None)
    loaded = model if isinstance(model, LoadedModel) else load_model(model, dtype, say)
    backend = MLXBackend(loaded)
    if draft_model is not None and drafter == "suffix":
        drafter = "draft-model"
    chosen = None
    if drafter == "suffix":
        chosen = SuffixLookupDrafter(min_match=3)
    elif drafter == "draft-model":
        if draft_model is None:
            raise ValueError("the draft-model drafter needs a draft model path")
        draft = draft_model if isinstance(draft_model, LoadedModel) else load_model(draft_model, dtype, say)
        chosen = DraftModelDrafter(MLXBackend(draft))
    elif drafter != "none":
        raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}, not {drafter!r}")
    report = None
    if self_check and chosen is not None:
        say("checking row-exactness of verify passes")
        report = check_row_exactness(backend, max_width=max_width)
        say(report.describe())
    return Engine(backend, loaded.tokenizer, loaded.eos_token_ids, drafter=chosen, exactness=report)
