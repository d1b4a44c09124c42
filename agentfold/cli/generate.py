"""`agentfold generate`: one reply to one prompt, streamed, with its telemetry line.

The prompt goes through the same chat renderer as the servers, so a reply here equals the
server's reply to the same message.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from agentfold.cli.args import (
    add_ctx_size_arg,
    add_model_args,
    add_model_dir_arg,
    check_ctx_size,
    drafter_choice,
    progress,
)


def add_parser(sub: Any) -> None:
    gen = sub.add_parser("generate", help="generate a reply to a prompt, streamed")
    add_model_args(gen)
    add_model_dir_arg(gen)
    add_ctx_size_arg(gen)
    gen.add_argument("prompt", help="the user message (use - to read stdin)")
    gen.add_argument("--draft-model", help="a small model sharing the tokenizer, used as drafter")
    gen.add_argument("--drafter", default="suffix", choices=["suffix", "draft-model", "none"])
    gen.add_argument("--no-draft", action="store_true", help="serial reference decoding")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--system", help="system message")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--prediction", metavar="FILE",
                     help="text the reply is expected to repeat, e.g. the file being edited: drafts come from it "
                          "(OpenAI's Predicted Outputs; the reply is the one --no-draft gives)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print the telemetry line as JSON")


class HarmonyPrinter:
    """A harmony reply (gpt-oss) as a user reads it: its answer on stdout, its reasoning (the analysis
    channel) on stderr after `[reasoning] `, never the control tokens; the servers' parser reads it
    (`chat.harmony.HarmonyParser`, calls read as text: `generate` declares no tools)."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None) -> None:
        from agentfold.chat.harmony import HarmonyParser

        self.parser = HarmonyParser(enabled=False)
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.reasoning = self.answered = False

    def feed(self, text: str) -> None:
        self._show(self.parser.feed(text))

    def finish(self) -> None:
        self._show(self.parser.finish())
        if self.reasoning and not self.answered:
            self.err.write("\n")

    def _show(self, pieces: list) -> None:
        from agentfold.chat.harmony import ReasoningPiece

        for piece in pieces:
            if isinstance(piece, ReasoningPiece):
                self.err.write(piece.text if self.reasoning else "[reasoning] " + piece.text)
                self.reasoning = True
                self.err.flush()
                continue
            if self.reasoning and not self.answered:
                self.err.write("\n")
            self.answered = True
            self.out.write(getattr(piece, "text", ""))
            self.out.flush()


def run(args: argparse.Namespace) -> int:
    from agentfold.chat.harmony import is_harmony
    from agentfold.chat.template import render_chat
    from agentfold.engine.decode import GenerationConfig
    from agentfold.engine.factory import build_engine
    from agentfold.engine.sampler import SamplingParams
    from agentfold.serve.models import describe, resolve, verdict_file

    path = resolve(args.model, args.model_dir)
    described = describe(path)
    trained = described.context_length
    check_ctx_size(args.ctx_size, trained, described.name)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    prediction = Path(args.prediction).read_text(encoding="utf-8") if args.prediction else ""  # before the load
    drafter = drafter_choice(args)
    engine = build_engine(path, dtype=args.dtype, drafter=drafter, draft_model=args.draft_model,
                          progress=progress, backend=args.backend, device=args.device, quant=args.quant,
                          verdicts=verdict_file())
    tokenizer = engine.tokenizer
    if args.raw or not tokenizer.chat_template:
        ids = tokenizer.encode(prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        ids = tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False)  # the server's renderer
    context = args.ctx_size or trained
    if context is not None and len(ids) >= context:
        raise ValueError(f"the prompt is {len(ids)} tokens: no room for a reply in a context of {context} "
                         "(shorten it, or raise --ctx-size)")
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            min_p=args.min_p, seed=args.seed)
    max_tokens = args.max_tokens if context is None else min(args.max_tokens, context - len(ids))
    config = GenerationConfig(params=params, max_tokens=max_tokens, stop=tuple(args.stop), draft=not args.no_draft,
                              prediction=tuple(tokenizer.encode(prediction, add_special_tokens=False)))
    generation = engine.stream(ids, config)
    show = HarmonyPrinter() if not args.raw and tokenizer.chat_template and is_harmony(tokenizer) else None
    for delta in generation:
        if show is not None:
            show.feed(delta.text)
            continue
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    if show is not None:
        show.finish()
    completion = generation.completion
    stats = completion.stats
    sys.stdout.write("\n")
    line = {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "finish_reason": completion.finish_reason,
        "prefill_tps": round(stats.prefilled_tokens / stats.prefill_seconds, 1) if stats.prefill_seconds else None,
        "ttft_ms": round(stats.ttft_seconds * 1000, 1),
        "decode_tps": round(stats.decode_tps, 2),
        "passes": stats.verify_passes,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "tokens_per_pass": round(stats.tokens_per_pass, 2),
        "draft_method": stats.draft_method,
        "exactness": engine.exactness.describe(),
        "token_sha": completion.token_sha[:16],
    }
    if args.json:
        print(json.dumps(line), file=sys.stderr)
    else:
        print(
            f"[agentfold] {line['completion_tokens']} tokens, {line['decode_tps']} tok/s, "
            f"{line['passes']} passes, {line['drafted']} drafted, {line['accepted']} accepted, "
            f"{line['tokens_per_pass']} tokens/pass, ttft {line['ttft_ms']} ms ({line['draft_method']}; "
            f"{line['exactness']})",
            file=sys.stderr,
        )
    return 0
