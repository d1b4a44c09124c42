"""The llama.cpp row of `agentfold bench decode`: the same GGUF and prompts through llama-cpp-python.

llama.cpp is the CPU runtime people compare against, so the decode bench puts it in the same run,
on the same file, prompts and reply length: greedy serial decoding, and its prompt-lookup decoding
(`LlamaPromptLookupDecoding`, the closest thing it has to AgentFold's suffix drafter). It runs the
GGUF's own quantized weights (Q4_1 for the default model) with its own kernels, so its replies are
compared with AgentFold's serial reply and reported, never required to match. llama-cpp-python is
an optional extra (`pip install 'agentfold[llamacpp]'`, it compiles llama.cpp): without it the row
says why it is missing instead of failing the bench.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from agentfold.bench.rates import ratio, rounded, steady_tps, token_sha

NOT_INSTALLED = "llama-cpp-python is not installed (pip install llama-cpp-python)"
LOOKUP_NGRAM = 2  # LlamaPromptLookupDecoding's defaults
LOOKUP_DRAFTS = 10


class LlamaCpp:
    """llama.cpp models for one GGUF: a serial one and, where the binding has it, a prompt-lookup one.

    Two instances because llama-cpp-python fixes the drafter when a model is created.
    """

    def __init__(self, gguf: Path, n_ctx: int, threads: int) -> None:
        import llama_cpp

        self.path = gguf
        self.threads = threads
        self.version = getattr(llama_cpp, "__version__", None)
        began = time.perf_counter()
        self.serial = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads,
                                      n_threads_batch=threads, verbose=False)
        self.load_seconds = time.perf_counter() - began
        self.lookup = None
        self.lookup_missing: str | None = None
        try:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError as error:
            self.lookup_missing = f"this llama-cpp-python has no prompt-lookup decoding ({error})"
        else:
            drafter = LlamaPromptLookupDecoding(max_ngram_size=LOOKUP_NGRAM, num_pred_tokens=LOOKUP_DRAFTS)
            self.lookup = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads,
                                          n_threads_batch=threads, draft_model=drafter, verbose=False)

    def describe(self) -> dict[str, Any]:
        return {"version": self.version, "model": str(self.path), "threads": self.threads,
                "load_seconds": round(self.load_seconds, 3),
                "prompt_lookup": (self.lookup_missing if self.lookup is None else
                                  {"drafter": "LlamaPromptLookupDecoding", "max_ngram_size": LOOKUP_NGRAM,
                                   "num_pred_tokens": LOOKUP_DRAFTS}),
                "sampling": "greedy (temp 0, repeat_penalty 1)",
                "weights": "the GGUF's own (quantized) tensors, llama.cpp's kernels"}

    def close(self) -> None:
        for model in (self.serial, self.lookup):
            close = getattr(model, "close", None)
            if close is not None:
                close()


def open_llama_cpp(model_path: Path, n_ctx: int, threads: int) -> tuple[LlamaCpp | None, dict[str, Any]]:
    """The llama.cpp runner for `model_path` and its description, or None and `{"skipped": why}`."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None, {"skipped": NOT_INSTALLED}
    if model_path.suffix.lower() != ".gguf" or not model_path.is_file():
        return None, {"skipped": f"{model_path} is not a GGUF file (llama.cpp reads GGUF only)"}
    try:
        runner = LlamaCpp(model_path, n_ctx, threads)
    except (ImportError, OSError, RuntimeError, ValueError) as error:
        return None, {"skipped": f"llama-cpp-python could not load {model_path.name}: {type(error).__name__}: {error}"}
    return runner, runner.describe()


def decode(llm: Any, prompt: Sequence[int], max_tokens: int, stop_ids: Iterable[int]) -> dict[str, Any]:
    """Greedy `Llama.generate` of at most `max_tokens` tokens (the stop token included, as the engine counts).

    Rates as for the engine: (n - 1) / (t_last - t_first) after the prompt pass, which commits one
    token (drafts are only proposed after it).
    """
    stops = set(int(t) for t in stop_ids) | {int(llm.token_eos())}
    tokens: list[int] = []
    times: list[float] = []
    finish = "length"
    llm.reset()  # nothing carried from the last workload (its evaluated tokens, its n_past)
    started = time.perf_counter()
    generator = llm.generate(list(prompt), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0)
    try:
        for token in generator:
            times.append(time.perf_counter())
            tokens.append(int(token))
            if int(token) in stops:
                finish = "stop"
                break
            if len(tokens) >= max_tokens:
                break
    finally:
        generator.close()
    decode_seconds = times[-1] - times[0] if len(times) > 1 else 0.0
    return {
        "completion_tokens": len(tokens),
        "finish_reason": finish,
        "steady_tps": rounded(steady_tps(times, 1)),
        "decode_tps": rounded((len(tokens) - 1) / decode_seconds) if decode_seconds > 0 else 0.0,
        "first_pass_tokens": 1 if tokens else 0,
        "ttft_seconds": rounded(times[0] - started, 4) if times else None,
        "decode_seconds": rounded(decode_seconds, 4),
        "total_seconds": rounded((times[-1] if times else time.perf_counter()) - started, 4),
        "token_sha": token_sha(tokens),
        "tokens": tokens,
    }


def workload_row(runner: LlamaCpp, prompt: Sequence[int], max_tokens: int, stop_ids: Iterable[int],
                 serial_tokens: Sequence[int], serial_tps: float | None) -> dict[str, Any]:
    """llama.cpp serial and prompt-lookup decode of one workload, against AgentFold's serial reply."""
    stop_ids = list(stop_ids)
    serial = decode(runner.serial, prompt, max_tokens, stop_ids)
    row: dict[str, Any] = {
        "serial_tps": serial["steady_tps"],
        "agentfold_serial_vs_llama_cpp": ratio(serial_tps, serial["steady_tps"]),
        "identical_to_agentfold_serial": serial["tokens"] == list(serial_tokens),
    }
    lookup, missing = None, runner.lookup_missing
    if runner.lookup is not None:
        try:
            lookup = decode(runner.lookup, prompt, max_tokens, stop_ids)
        except ValueError as error:  # llama-cpp-python's lookup eval can overrun its scores buffer
            missing = f"llama-cpp-python's prompt lookup failed: {type(error).__name__}: {error}"
    if lookup is not None:
        row.update({
            "prompt_lookup_tps": lookup["steady_tps"],
            "prompt_lookup_speedup": ratio(lookup["steady_tps"], serial["steady_tps"]),
            "prompt_lookup_identical_to_its_serial": lookup["tokens"] == serial["tokens"],
            "prompt_lookup_identical_to_agentfold_serial": lookup["tokens"] == list(serial_tokens),
        })
    row["serial"] = {k: v for k, v in serial.items() if k != "tokens"}
    row["prompt_lookup"] = ({k: v for k, v in lookup.items() if k != "tokens"} if lookup is not None
                            else {"skipped": missing})
    return row


def prefill_rate(model_path: Path, ids: Sequence[int], threads: int) -> dict[str, Any]:
    """llama.cpp's prefill of `ids` (our tokenizer's, so both read the same tokens): one `Llama.eval`
    on a fresh context of just the room they need, its default batch sizes, timed by the wall clock."""
    if importlib.util.find_spec("llama_cpp") is None:
        return {"skipped": NOT_INSTALLED}
    if model_path.suffix.lower() != ".gguf" or not model_path.is_file():
        return {"skipped": f"{model_path} is not a GGUF file (llama.cpp reads GGUF only)"}
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=len(ids) + 8, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    try:
        began = time.perf_counter()
        llm.eval(list(ids))
        seconds = time.perf_counter() - began
    finally:
        close = getattr(llm, "close", None)
        if close is not None:
            close()
    return {"tokens": len(ids), "seconds": rounded(seconds, 4), "tps": rounded(len(ids) / seconds, 1),
            "n_batch": getattr(llm, "n_batch", None)}


class PassRunner:
    """llama.cpp passes of a few rows after a fixed context, each from the same cache state.

    The context is evaluated once; before every pass `n_tokens` goes back to it (`Llama.eval` drops
    the KV cells past `n_tokens` first), as the engine's passes start again after a rollback.
    `logits_all`: every row's logits are computed and copied out, as a verify pass needs them
    (llama-cpp-python turns it on for its own prompt-lookup drafting too).
    """

    def __init__(self, gguf: Path, context: Sequence[int], max_rows: int, threads: int) -> None:
        import llama_cpp

        self.version = getattr(llama_cpp, "__version__", None)
        self.threads = threads
        self.n_ctx = len(context) + max_rows + 8
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=self.n_ctx, n_threads=threads,
                                   n_threads_batch=threads, logits_all=True, verbose=False)
        self.llm.eval(list(context))
        self.base = self.llm.n_tokens

    def seconds(self, rows: Sequence[int]) -> float:
        """Wall time of one `Llama.eval` of `rows` after the context."""
        self.llm.n_tokens = self.base
        began = time.perf_counter()
        self.llm.eval(list(rows))
        return time.perf_counter() - began

    def describe(self) -> dict[str, Any]:
        return {"version": self.version, "threads": self.threads, "logits_all": True, "n_ctx": self.n_ctx}

    def close(self) -> None:
        close = getattr(self.llm, "close", None)
        if close is not None:
            close()


def open_pass_runner(gguf: Path, context: Sequence[int], max_rows: int,
                     threads: int) -> tuple[PassRunner | None, dict[str, Any]]:
    """A `PassRunner` on `gguf` and its description, or None and `{"skipped": why}`."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None, {"skipped": NOT_INSTALLED}
    if gguf.suffix.lower() != ".gguf" or not gguf.is_file():
        return None, {"skipped": f"{gguf} is not a GGUF file (llama.cpp reads GGUF only)"}
    try:
        runner = PassRunner(gguf, context, max_rows, threads)
    except (ImportError, OSError, RuntimeError, ValueError) as error:
        return None, {"skipped": f"llama-cpp-python could not load {gguf.name}: {type(error).__name__}: {error}"}
    return runner, runner.describe()


def perplexity(model_path: Path, tokens: Sequence[int], threads: int) -> dict[str, Any]:
    """llama.cpp's perplexity of `tokens` (our tokenizer's ids, so both score the same tokens): its
    logits for every position (`logits_all`), scored by `bench.quality.nll_sum` as ours are."""
    if importlib.util.find_spec("llama_cpp") is None:
        return {"skipped": NOT_INSTALLED}
    if model_path.suffix.lower() != ".gguf" or not model_path.is_file():
        return {"skipped": f"{model_path} is not a GGUF file (llama.cpp reads GGUF only)"}
    import llama_cpp
    import numpy as np

    from agentfold.bench.quality import nll_sum

    began = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=len(tokens) + 8, n_threads=threads,
                          n_threads_batch=threads, logits_all=True, verbose=False)
    try:
        llm.eval(list(tokens[:-1]))
        mean = nll_sum(llm.scores[: len(tokens) - 1], tokens[1:]) / (len(tokens) - 1)
    finally:
        close = getattr(llm, "close", None)
        if close is not None:
            close()
    return {"perplexity": round(float(np.exp(mean)), 4), "mean_nll": round(mean, 6), "scored_tokens": len(tokens) - 1,
            "version": getattr(llama_cpp, "__version__", None), "weights": "the GGUF's own tensors, llama.cpp's kernels",
            "seconds": round(time.perf_counter() - began, 3)}
