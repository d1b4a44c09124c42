"""The real models against a float reference we did not write, and the coder model's code working.

The reference is transformers' own model of the architecture (Qwen2, Gemma 3) loaded by its own
GGUF reader (its name mapping, its q / k handling, the gguf package's dequantization), in float32.
Our greedy reply (int8 weights, the engine's kernels) is fed to it as one teacher-forced pass: at
every position our token must be the reference's top-1 wherever the reference's top two are more
than MARGIN apart (int8 rounding may flip a near-tie, nothing else), so the replies agree token
for token for as far as no near-tie comes. Then the coder model writes a function on each backend,
and the function runs.
"""

from __future__ import annotations

import gc
import re
from pathlib import Path

import numpy as np
import pytest

from agentfold.engine.decode import GenerationConfig
from agentfold.engine.factory import build_engine
from tests.conftest import chat_ids

pytestmark = pytest.mark.slow

MARGIN = 0.5  # logits: a smaller gap between the reference's top two is a near-tie int8 may flip
TOKENS = 48
PROMPTS = {
    "coder": ["Write a Python function that reverses a string.",
              "Explain what a hash map is in two sentences.",
              "Fix the bug:\n```python\ndef mean(xs):\n    return sum(xs) / len(xs) + 1\n```"],
    "gemma3": ["Write a haiku about the sea.", "What is the capital of France? Answer in one sentence."],
}
CODE_PROMPT = "Write a Python function `reverse_string(s)` that returns the string reversed. Reply with the code only."


def reference_logits(path: Path, sequences: list[list[int]]) -> list[np.ndarray]:
    """transformers' float32 model of the GGUF (its own loader), one pass per sequence."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = [model(torch.tensor([ids])).logits[0].float().numpy() for ids in sequences]
    del model
    gc.collect()
    return out


def check_against_reference(name: str, path: Path, engine) -> None:
    replies = []
    for text in PROMPTS[name]:
        prompt = chat_ids(engine.tokenizer, text)
        completion = engine.generate(prompt, GenerationConfig(max_tokens=TOKENS, draft=False))
        replies.append((prompt, completion.tokens))
    logits = reference_logits(path, [prompt + reply for prompt, reply in replies])
    agreed = near_ties = 0
    for (prompt, reply), rows in zip(replies, logits, strict=True):
        rows = rows[len(prompt) - 1 : len(prompt) - 1 + len(reply)]
        top_two = np.sort(rows, axis=1)[:, -2:]
        margins = top_two[:, 1] - top_two[:, 0]
        for position, (token, row, margin) in enumerate(zip(reply, rows, margins, strict=True)):
            if int(np.argmax(row)) == token:
                agreed += 1
                continue
            assert margin <= MARGIN, (f"{name}: position {position} of {engine.tokenizer.decode(reply)!r}: ours "
                                      f"{token}, the reference's top-1 {int(np.argmax(row))} by {margin:.2f} logits")
            near_ties += 1
    total = sum(len(reply) for _, reply in replies)
    assert total >= len(replies) * 8 and agreed >= 0.9 * total, f"{name}: {agreed}/{total} agree"


def test_coder_greedy_tokens_match_transformers(coder_gguf: Path, coder_engine):
    check_against_reference("coder", coder_gguf, coder_engine)


def test_gemma3_greedy_tokens_match_transformers():
    from agentfold.serve.models import ModelNotFound, gemma3_path

    try:
        path = gemma3_path()
    except ModelNotFound as error:
        pytest.skip(str(error))
    check_against_reference("gemma3", path, build_engine(path, backend="torch", device="cpu"))


def run_code(reply: str) -> str:
    """Execute the reply's (first) code block, then call its reverse_string on a probe."""
    match = re.search(r"```(?:python)?\n(.*?)```", reply, re.DOTALL)
    source = match.group(1) if match else reply
    scope: dict = {}
    exec(compile(source, "<reply>", "exec"), scope)  # noqa: S102  (the model's answer, run in a test)
    return scope["reverse_string"]("AgentFold 1.5B")


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_coder_writes_working_code_on_each_backend(coder_gguf: Path, backend: str, request: pytest.FixtureRequest):
    engine = request.getfixturevalue("coder_engine") if backend == "torch" else build_engine(coder_gguf, backend="mlx")
    assert engine.backend.name == backend
    completion = engine.generate(chat_ids(engine.tokenizer, CODE_PROMPT), GenerationConfig(max_tokens=80))
    assert run_code(completion.text) == "B5.1 dloFtnegA", completion.text
