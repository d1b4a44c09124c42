"""Where the coder model (Qwen2.5-Coder-1.5B-Instruct Q4_K_M) is, for the tests that need it or its tokenizer.

`AGENTFOLD_CODER_GGUF`, else the catalogue's `qwen2.5-coder` once assembled (`.ci/setup.sh` does it);
None when neither is here (those tests skip).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any


def coder_gguf() -> Path | None:
    candidates = [os.environ.get("AGENTFOLD_CODER_GGUF")]
    try:
        from agentfold.serve.models import find

        entry = find("qwen2.5-coder")
        candidates.append(str(entry.path) if entry is not None else None)
    except Exception:  # the catalogue may not know it (yet): the other places still count
        pass
    return next((Path(c) for c in candidates if c and Path(c).is_file()), None)


@functools.lru_cache(maxsize=1)
def coder_tokenizer() -> Any:
    """The coder model's tokenizer alone, from its GGUF metadata (~2.5 s)."""
    from agentfold.engine.gguf_file import GGUFFile
    from agentfold.engine.gguf_model import build_tokenizer

    path = coder_gguf()
    assert path is not None
    return build_tokenizer(GGUFFile(path).metadata, "qwen2")
