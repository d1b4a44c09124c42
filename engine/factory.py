"""Build an Engine from a model path: load, self-check row-exactness, pick the drafter."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from agentfold.engine import backend_choice
from agentfold.engine.decode import Engine
from agentfold.engine.drafters import DraftModelDrafter, SuffixLookupDrafter
from agentfold.engine.mlx.loader import LoadedModel
from agentfold.engine.selfcheck import remembered_check

if TYPE_CHECKING:  # imports torch
    from agentfold.engine.mlx.stages import MLXStageOptions
    from agentfold.engine.torch.stages import StageOptions

DRAFTERS = ("suffix", "draft-model", "none")


BACKENDS = ("auto", "mlx", "torch")
QUANTS = ("auto", "int8", "blocks", "none")


def _loader(backend: str, dtype: str | None, device: str, say: Callable[[str], None],
            quant: str | None = None) -> tuple[Callable[[str | Path | LoadedModel], LoadedModel], type]:
    """How to load a model for `backend`, and the backend class that runs it (`quant`: how a torch
    CPU model is quantized at load, `loader.load_torch_model`; None: by the backend)."""
    if backend == "mlx":
        if device not in ("auto", "cpu"):
            raise ValueError(f"--device {device}: the mlx backend runs on this machine's MLX device; "
                             "use --backend torch for CUDA")
        from agentfold.engine.mlx.backend import MLXBackend  # (imports mlx-lm: ~1 s a torch start need not pay)
        from agentfold.engine.mlx.loader import load_model

        chosen = dtype or "float32"
        return (lambda m: m if isinstance(m, LoadedModel) else load_model(m, chosen, say)), MLXBackend
    if backend == "torch":
        try:
            from agentfold.engine.torch.backend import TorchBackend
            from agentfold.engine.torch.loader import load_torch_model
        except ImportError as error:
            raise ValueError(f"the torch backend needs PyTorch ({error}): pip install 'agentfold[torch]'") from None
        chosen = dtype or "auto"
        return (lambda m: m if isinstance(m, LoadedModel) else load_torch_model(m, chosen, device, say, quant)), TorchBackend
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
    quant: str = "auto",
    verdicts: Path | None = None,
    stages: StageOptions | MLXStageOptions | None = None,
) -> Engine:
    """An engine whose drafted replies are byte-identical to its serial ones.

    `drafter`: suffix (prompt / session lookup), draft-model (needs `draft_model`), or none.
    `backend`: mlx, torch on `device` (auto | cpu | cuda), or auto (`backend_choice`: the one
    that verifies widest and fastest here, remembered in the `verdicts` file). `quant`: blocks runs
    a GGUF's linear layers on the file's own blocks (torch on CPU, `kernels.block_linear`), int8 on
    int8 weights, both with exact integer sums (row-exact by construction); auto is blocks where
    every weight's type has a block kernel, else int8 (the default wherever it runs); none keeps float weights (row-exact only as far as the BLAS happens
    to be). `dtype` None: float32, except bfloat16 for torch on CUDA. The self-check caps verify
    passes at the widest row-exact width (drafting off if none). `stages`: a
    `torch.stages.StageOptions` or `mlx.stages.MLXStageOptions` to split the model by layers over
    processes (on that backend). With `verdicts`, a self-check of kernels exact by construction is
    remembered next to it (`selfcheck.remembered_check`) and not run again for the same weights.
    """
    say = progress or (lambda message: None)
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {', '.join(QUANTS)}, not {quant!r}")
    if stages is not None:  # pipeline stages (engine.torch.stages, engine.mlx.stages): the options' backend
        wanted = getattr(stages, "backend", "torch")
        if backend not in ("auto", wanted):
            raise ValueError(f"these --stages options are for the {wanted} backend, not {backend}")
        backend = wanted
    if backend == "auto":
        return _build_auto(model, dtype, drafter, draft_model, max_width, self_check, say, device, quant, verdicts)
    load, backend_class = _loader(backend, dtype, device, say, quant if stages is None else None)
    loaded = load(model)
    if stages is not None and backend == "mlx":
        from agentfold.engine.mlx.stages import MLXStagedBackend

        target = MLXStagedBackend(loaded, quant=quant, options=stages, progress=say)
    elif stages is not None:
        from agentfold.engine.torch.stages import StagedBackend

        target = StagedBackend(loaded, quant=quant, options=stages, progress=say)
    else:
        target = backend_class(loaded, quant=quant)
    if draft_model is not None and drafter == "suffix":
        drafter = "draft-model"
    chosen = None
    if drafter == "suffix":
        chosen = SuffixLookupDrafter(min_match=3)
    elif drafter == "draft-model":
        if draft_model is None:
            raise ValueError("the draft-model drafter needs a draft model path")
        chosen = DraftModelDrafter(backend_class(load(draft_model), quant=quant))
    elif drafter != "none":
        raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}, not {drafter!r}")
    report = None
    if self_check and chosen is not None:
        say("checking row-exactness of verify passes")
        store = verdicts.parent / "selfchecks.json" if verdicts is not None else None
        report, remembered = remembered_check(target, max_width, store)
        say(report.describe() + (" (remembered: the same weights, kernels and CPU were checked before)"
                                 if remembered else ""))
    return Engine(target, loaded.tokenizer, loaded.eos_token_ids, drafter=chosen, exactness=report)


def _build_auto(model: str | Path | LoadedModel, dtype: str | None, drafter: str,
                draft_model: str | Path | LoadedModel | None, max_width: int, self_check: bool,
                say: Callable[[str], None], device: str, quant: str, verdicts: Path | None) -> Engine:
    """`backend="auto"`: the remembered verdict for this machine and model, else measure every
    candidate (load + self-check) and keep the winner's engine."""
    if isinstance(model, LoadedModel):
        raise ValueError("backend auto needs a model path (a loaded model already belongs to one backend)")
    names = backend_choice.candidates(device)
    common = {"dtype": dtype, "drafter": drafter, "draft_model": draft_model, "max_width": max_width,
              "self_check": self_check, "progress": say, "device": device, "quant": quant, "verdicts": verdicts}
    if len(names) == 1 or not self_check or drafter == "none":
        say(f"backend auto -> {names[0]} (preferred here; nothing to measure)" if len(names) > 1
            else f"backend auto -> {names[0]} ({backend_choice.why_only(names[0], device)})")
        return build_engine(model, backend=names[0], **common)
    key = backend_choice.verdict_key(Path(model), device, quant)
    known = backend_choice.recall(verdicts, key)
    if known is not None and known.get("backend") in names:
        say(backend_choice.describe(known, remembered=True))
        return build_engine(model, backend=known["backend"], **common)
    engines: dict[str, Engine] = {}
    for name in names:
        say(f"backend auto: measuring {name}")
        try:
            engines[name] = build_engine(model, backend=name, **common)
        except (ValueError, RuntimeError) as error:  # e.g. an architecture one backend lacks
            say(f"backend auto: {name} cannot run this model ({error})")
    if not engines:
        raise ValueError(f"no backend can run {model}")
    winner, verdict = backend_choice.pick({name: engine.exactness for name, engine in engines.items()})
    backend_choice.remember(verdicts, key, verdict)
    say(backend_choice.describe(verdict, remembered=False))
    return engines[winner]
