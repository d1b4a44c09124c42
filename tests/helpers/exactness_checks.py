"""The checks every model family's tests make: a pass's rows equal one-row steps, and drafting ran
and changed no token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from agentfold.engine.decode import GenerationConfig
from agentfold.engine.factory import build_engine


def assert_blocks_engine_drafts_exactly(path: Path, verdicts: Path, prompt: list[int], max_tokens: int) -> None:
    """A torch CPU engine on `path`'s GGUF blocks: its load-time self-check finds verify passes
    row-exact (width > 1), and a drafted reply, with drafts really made, equals the serial one."""
    engine = build_engine(path, backend="torch", device="cpu", quant="blocks", verdicts=verdicts)
    assert engine.exactness.max_width > 1
    serial = engine.generate(prompt, GenerationConfig(max_tokens=max_tokens, draft=False))
    drafted = engine.generate(prompt, GenerationConfig(max_tokens=max_tokens, draft=True))
    assert drafted.stats.drafted > 0
    assert drafted.tokens == serial.tokens


def assert_pass_rows_equal_one_row_steps(backend: Any, prompt: list[int], split: int = 9) -> None:
    """Row-exact by construction: the rows of one pass over `prompt` past `split` equal the same
    positions decoded one by one after a pass over the first `split` tokens, bit for bit."""
    whole = backend.forward(prompt, backend.new_cache())
    cache = backend.new_cache()
    backend.forward(prompt[:split], cache)
    rows = np.concatenate([backend.forward([token], cache) for token in prompt[split:]])
    assert whole.shape == (len(prompt), rows.shape[1])
    assert np.array_equal(whole[split:], rows)


def assert_resumed_prefill_equals_fresh(backend: Any, tokens: list[int], cut: int = 30, later: int = 60) -> None:
    """Sessions' contract on a backend: a prompt resumed from a snapshot (the cache written out and
    read back) at a plan boundary `cut` equals the fresh prefill of it cut at the same boundaries,
    bit for bit in the next row's logits."""
    fresh = backend.new_cache()
    backend.prefill(tokens, fresh, boundaries=[cut, later])
    first = backend.new_cache()
    backend.prefill(tokens[:cut], first)
    resumed = backend.arrays_to_cache(*backend.cache_to_arrays(first))
    backend.prefill(tokens[cut:], resumed, boundaries=[later])
    assert np.array_equal(backend.forward([9], resumed), backend.forward([9], fresh))
