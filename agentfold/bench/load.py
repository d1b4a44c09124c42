"""`agentfold loadtest`: many concurrent streaming clients against a real server, checked for exactness.

What it shows, in one run:

- **no errors**: every request of every client gets a complete stream;
- **exactness under load**: each reply, decoded while up to `--max-active` others interleave
  pass by pass, equals the serial reference (`"draft": false`, one request at a time, asked first);
- **fairness**: every client completes replies each round, and the fewest tokens any client got
  is at least `min_share` of the most (FIFO admission + round-robin passes; no starvation);
- **flat memory**: the server's RSS (from /health) after the last round is within a tolerance of
  its RSS after the first (a leak per request grows it round after round).

Without `--url` it starts `agentfold serve` itself (temporary home, sessions on) and stops it after.
The exit status is 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agentfold.bench.harness import ServerProcess

PROMPTS = (
    "Write a Python function that reverses a string.",
    "What does `git rebase -i` do? One sentence.",
    "Name three sorting algorithms.",
    "Explain what a mutex is in one line.",
    "Write a bash one-liner that counts lines in all .py files.",
    "What is the difference between a list and a tuple in Python?",
    "Give a regular expression that matches an email address.",
    "Write a SQL query that selects the ten newest rows of a table named events.",
)
MIB = 1 << 20


@dataclass
class ClientStats:
    """One client's share of a round."""

    replies: int = 0
    tokens: int = 0
    mismatches: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass
class RoundResult:
    seconds: float
    clients: list[ClientStats]
    rss_bytes: int

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.clients)

    @property
    def fairness(self) -> float:
        """Fewest tokens of any client over the most (1.0 = perfectly even)."""
        most = max((c.tokens for c in self.clients), default=0)
        return min(c.tokens for c in self.clients) / most if most else 0.0

    def summary(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 2), "replies": sum(c.replies for c in self.clients),
                "tokens": self.tokens, "tokens_per_second": round(self.tokens / self.seconds, 2) if self.seconds else 0,
                "min_client_tokens": min(c.tokens for c in self.clients),
                "max_client_tokens": max(c.tokens for c in self.clients),
                "min_client_replies": min(c.replies for c in self.clients), "fairness": round(self.fairness, 3),
                "errors": sum(len(c.errors) for c in self.clients),
                "mismatches": sum(c.mismatches for c in self.clients), "rss_mib": round(self.rss_bytes / MIB, 1)}


@dataclass
class LoadResult:
    """Every round, the references, and the verdict of each check."""

    clients: int
    max_tokens: int
    rss_start: int
    rounds: list[RoundResult]
    references: dict[str, str]
    min_share: float
    rss_tolerance: int
    first_errors: list[str] = field(default_factory=list)

    @property
    def errors(self) -> int:
        return sum(len(c.errors) for r in self.rounds for c in r.clients)

    @property
    def mismatches(self) -> int:
        return sum(c.mismatches for r in self.rounds for c in r.clients)

    @property
    def starved(self) -> bool:
        return any(c.replies == 0 for r in self.rounds for c in r.clients) or any(
            r.fairness < self.min_share for r in self.rounds)

    @property
    def rss_growth(self) -> int:
        return self.rounds[-1].rss_bytes - self.rounds[0].rss_bytes

    @property
    def memory_flat(self) -> bool:
        return self.rss_growth <= self.rss_tolerance

    @property
    def passed(self) -> bool:
        return not self.errors and not self.mismatches and not self.starved and self.memory_flat

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "clients": self.clients, "max_tokens": self.max_tokens,
                "errors": self.errors, "mismatches": self.mismatches, "starved": self.starved,
                "memory_flat": self.memory_flat, "rss_start_mib": round(self.rss_start / MIB, 1),
                "rss_growth_mib": round(self.rss_growth / MIB, 1),
                "rss_tolerance_mib": round(self.rss_tolerance / MIB, 1),
                "rounds": [r.summary() for r in self.rounds], "first_errors": self.first_errors[:5],
                "per_client": [[asdict(c) | {"errors": len(c.errors)} for c in r.clients] for r in self.rounds]}


def _headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


async def _reference(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> str:
    """The serial reply: no drafting, nothing else running."""
    response = await http.post("/v1/chat/completions", json={
        "model": "agentfold", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0, "draft": False})
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"] or ""


async def _client(client: Any, prompt: str, reference: str, deadline: float, max_tokens: int,
                  stats: ClientStats) -> None:
    """Stream replies one after another: at least one, then more until the deadline (the last is finished)."""
    while True:
        text, tokens = "", 0
        try:
            stream = await client.chat.completions.create(
                model="agentfold", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                temperature=0, stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
        except Exception as error:  # noqa: BLE001  (counted and reported, the run goes on)
            stats.errors.append(f"{type(error).__name__}: {error}")
            await asyncio.sleep(0.5)
        else:
            stats.replies += 1
            stats.tokens += tokens
            stats.mismatches += text != reference
        if time.monotonic() >= deadline:
            return


async def run_load(base_url: str, clients: int = 16, duration: float = 120.0, rounds: int = 2,
                   max_tokens: int = 16, api_key: str | None = None, min_share: float = 0.5,
                   rss_tolerance: int = 64 * MIB, progress: Any = None) -> LoadResult:
    """References first (serially), then `rounds` rounds of `duration / rounds` seconds each."""
    from openai import AsyncOpenAI

    say = progress or (lambda message: None)
    if clients < 1 or rounds < 1 or duration <= 0 or max_tokens < 1:
        raise ValueError("clients, rounds, duration and max_tokens must all be positive")
    async with httpx.AsyncClient(base_url=base_url, headers=_headers(api_key), timeout=600) as http:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(clients)]
        references: dict[str, str] = {}
        for prompt in dict.fromkeys(prompts):
            references[prompt] = await _reference(http, prompt, max_tokens)
        say(f"{len(references)} serial references computed")
        rss_start = (await http.get("/health")).json().get("rss_bytes", 0)
        results: list[RoundResult] = []
        # one OpenAI client per simulated user, built before the clock starts (each loads TLS certificates)
        users = [AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key or "unused", max_retries=0, timeout=600)
                 for _ in range(clients)]
        try:
            for number in range(rounds):
                stats = [ClientStats() for _ in range(clients)]
                started = time.monotonic()
                deadline = started + duration / rounds
                await asyncio.gather(*(_client(user, p, references[p], deadline, max_tokens, s)
                                       for user, p, s in zip(users, prompts, stats, strict=True)))
                seconds = time.monotonic() - started
                rss = (await http.get("/health")).json().get("rss_bytes", 0)
                results.append(RoundResult(seconds, stats, rss))
                say(f"round {number + 1}: {json.dumps(results[-1].summary())}")
        finally:
            for user in users:
                await user.close()
    first_errors = [e for r in results for c in r.clients for e in c.errors]
    return LoadResult(clients, max_tokens, rss_start, results, references, min_share, rss_tolerance, first_errors)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "loadtest", help="concurrent streaming clients: errors, exactness, fairness, memory",
        description="Run concurrent streaming clients against a server (started here unless --url) and check "
                    "that every reply equals its serial reference, no client starves and memory stays flat.")
    parser.add_argument("--url", help="a running server (default: start `agentfold serve` on a free port)")
    parser.add_argument("--api-key", help="the server's API key, if it has one")
    parser.add_argument("--model", help="model for the server started here (default: embedded SmolLM2-135M)")
    parser.add_argument("--max-active", type=int, default=4, help="--max-active of the server started here")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load, over all rounds")
    parser.add_argument("--rounds", type=int, default=2, help="memory is compared between the first and the last")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per reply")
    parser.add_argument("--min-share", type=float, default=0.5,
                        help="fewest tokens of a client over the most, per round, at least (default 0.5)")
    parser.add_argument("--rss-tolerance-mib", type=float, default=64.0,
                        help="allowed RSS growth from the first round to the last (default 64 MiB)")
    parser.add_argument("--out", help="write the full result as JSON here")
    return parser


def run(args: argparse.Namespace) -> int:
    """`agentfold loadtest`: start a server unless --url, run the load, print the verdict; 0 only if it passed."""

    def say(message: str) -> None:
        print(f"[agentfold] {message}", file=sys.stderr, flush=True)

    server = None
    url = args.url
    with tempfile.TemporaryDirectory(prefix="agentfold-loadtest-") as home:
        try:
            if url is None:
                extra = ["--max-active", str(args.max_active), *(["--model", args.model] if args.model else [])]
                say("starting agentfold serve (loading the model)")
                server = ServerProcess(Path(home) / "home", extra, log_path=Path(home) / "serve.log").start()
                url = server.url
            say(f"{args.clients} clients for {args.duration:g} s ({args.rounds} rounds) against {url}")
            result = asyncio.run(run_load(url, args.clients, args.duration, args.rounds, args.max_tokens,
                                          args.api_key, args.min_share, int(args.rss_tolerance_mib * MIB), say))
        finally:
            if server is not None:
                server.stop()
    report = result.to_dict()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    brief = {k: v for k, v in report.items() if k not in ("per_client",)}
    print(json.dumps(brief, indent=2))
    say("PASSED" if result.passed else "FAILED")
    return 0 if result.passed else 1
