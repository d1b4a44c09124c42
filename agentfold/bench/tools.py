"""`agentfold bench tools`: tool calls through the server, scored, beside what the model's own text holds.

Cases of four kinds, written here (`CASES`): one function declared and asked for (`single`); one
of several declared (`pick`); a question that needs two calls in one reply (`several`); a
question no declared tool answers (`irrelevant`, right only with no call). Each case goes through
a real server on loopback with the official `openai` client (`tool_choice: auto`, greedy), and
its returned calls are compared with the expected names and arguments.

The same prompt is also decoded without the tool grammar and without any parsing server-side
(the model's raw text), and that text is read for calls of declared tools whose arguments fit:
what the model itself wrote. A kind where the server is right less often than the raw text is a
server-side loss; a server call whose name the raw text never wrote is a call the model did not
make (the JSON counts both as `server_right` / `raw_right` and `calls_not_written`).
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentfold.bench.machine import finish_run, machine_info, run_header, utc_timestamp

SCHEMA = "agentfold.bench.tools/1"
KINDS = ("single", "pick", "several", "irrelevant")
MAX_TOKENS = 160
QUICK_PER_KIND = 2


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str] | None = None) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required or list(properties)}}}


_S, _N, _I = {"type": "string"}, {"type": "number"}, {"type": "integer"}
TOOLS = {t["function"]["name"]: t for t in [
    _tool("get_weather", "Get the current weather in a city.", {"city": _S}),
    _tool("convert_currency", "Convert an amount of money from one currency to another.",
          {"amount": _N, "from_currency": {**_S, "description": "ISO code, e.g. USD"},
           "to_currency": {**_S, "description": "ISO code, e.g. EUR"}}),
    _tool("calculate_bmi", "Body mass index from weight in kilograms and height in meters.",
          {"weight_kg": _N, "height_m": _N}),
    _tool("read_file", "Read a text file of the project.", {"path": _S}),
    _tool("run_tests", "Run the test suite of a folder of the project.", {"folder": _S}),
    _tool("git_log", "Show the last commits of the repository.", {"count": _I}),
    _tool("search_code", "Search the project's source for a regular expression.", {"pattern": _S}),
    _tool("create_branch", "Create a git branch.", {"name": _S}),
    _tool("play_song", "Play a song by an artist for a number of minutes.", {"artist": _S, "minutes": _I}),
    _tool("set_timer", "Set a timer for a number of minutes.", {"minutes": _I}),
    _tool("translate", "Translate text into a language.", {"text": _S, "language": _S}),
    _tool("stock_price", "The latest price of a stock by its ticker symbol.", {"ticker": _S}),
]}


@dataclass(frozen=True)
class Case:
    kind: str
    tools: tuple[str, ...]
    question: str
    expected: tuple[tuple[str, dict[str, Any]], ...] = ()  # (name, arguments) of each call; () for none


PICK = ("get_weather", "convert_currency", "read_file", "git_log", "set_timer", "stock_price")
CASES = [
    Case("single", ("get_weather",), "What's the weather like in Lisbon right now?", (("get_weather", {"city": "Lisbon"}),)),
    Case("single", ("convert_currency",), "How much is 250 US dollars in euros?",
         (("convert_currency", {"amount": 250, "from_currency": "USD", "to_currency": "EUR"}),)),
    Case("single", ("calculate_bmi",), "I weigh 82 kg and I am 1.80 m tall. What is my BMI?",
         (("calculate_bmi", {"weight_kg": 82, "height_m": 1.8}),)),
    Case("single", ("read_file",), "Show me what is in setup.cfg.", (("read_file", {"path": "setup.cfg"}),)),
    Case("single", ("run_tests",), "Run the tests in the folder tests/api.", (("run_tests", {"folder": "tests/api"}),)),
    Case("single", ("git_log",), "List the last 5 commits.", (("git_log", {"count": 5}),)),
    Case("single", ("search_code",), "Find where parse_header is used in the code.",
         (("search_code", {"pattern": "parse_header"}),)),
    Case("single", ("create_branch",), "Create a branch called fix-login.", (("create_branch", {"name": "fix-login"}),)),
    Case("pick", PICK, "Is it raining in Oslo?", (("get_weather", {"city": "Oslo"}),)),
    Case("pick", PICK, "Convert 1000 Japanese yen to British pounds.",
         (("convert_currency", {"amount": 1000, "from_currency": "JPY", "to_currency": "GBP"}),)),
    Case("pick", PICK, "Open the file docs/index.md for me.", (("read_file", {"path": "docs/index.md"}),)),
    Case("pick", PICK, "What were the last 3 commits?", (("git_log", {"count": 3}),)),
    Case("pick", PICK, "Start a 25 minute timer.", (("set_timer", {"minutes": 25}),)),
    Case("pick", PICK, "What is Apple's share price? The ticker is AAPL.", (("stock_price", {"ticker": "AAPL"}),)),
    Case("pick", ("translate", "search_code", "create_branch", "run_tests"), "Translate 'good morning' into Spanish.",
         (("translate", {"text": "good morning", "language": "Spanish"}),)),
    Case("pick", ("translate", "search_code", "create_branch", "run_tests"), "Run the tests under tests/unit.",
         (("run_tests", {"folder": "tests/unit"}),)),
    Case("several", ("get_weather",), "What's the weather in Paris and in Tokyo?",
         (("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tokyo"}))),
    Case("several", ("play_song",), "Play Daft Punk for 10 minutes and then Adele for 15 minutes.",
         (("play_song", {"artist": "Daft Punk", "minutes": 10}), ("play_song", {"artist": "Adele", "minutes": 15}))),
    Case("several", ("read_file",), "Show me both README.md and LICENSE.",
         (("read_file", {"path": "README.md"}), ("read_file", {"path": "LICENSE"}))),
    Case("several", ("stock_price",), "Give me the prices of MSFT and NVDA.",
         (("stock_price", {"ticker": "MSFT"}), ("stock_price", {"ticker": "NVDA"}))),
    Case("several", ("get_weather", "set_timer"), "Set a timer for 5 minutes and tell me the weather in Rome.",
         (("set_timer", {"minutes": 5}), ("get_weather", {"city": "Rome"}))),
    Case("several", ("convert_currency",), "Convert 50 USD to EUR and 50 USD to CHF.",
         (("convert_currency", {"amount": 50, "from_currency": "USD", "to_currency": "EUR"}),
          ("convert_currency", {"amount": 50, "from_currency": "USD", "to_currency": "CHF"}))),
    Case("several", ("create_branch",), "Create two branches: feature-a and feature-b.",
         (("create_branch", {"name": "feature-a"}), ("create_branch", {"name": "feature-b"}))),
    Case("several", ("translate",), "Translate 'thank you' into French and into German.",
         (("translate", {"text": "thank you", "language": "French"}),
          ("translate", {"text": "thank you", "language": "German"}))),
    Case("irrelevant", ("calculate_bmi",), "What is the area of a triangle with base 6 and height 4?"),
    Case("irrelevant", ("get_weather",), "Write a Python function that reverses a string."),
    Case("irrelevant", ("play_song",), "How many days are there in a leap year?"),
    Case("irrelevant", ("stock_price",), "Who wrote the novel Pride and Prejudice?"),
    Case("irrelevant", ("convert_currency", "set_timer"), "Explain what a Python list comprehension is."),
    Case("irrelevant", ("git_log",), "What is 17 times 23?"),
    Case("irrelevant", ("translate",), "Sort the numbers 5, 2, 9, 1 in ascending order."),
    Case("irrelevant", ("read_file", "run_tests"), "What is the capital of Australia?"),
]

_NAMES_WRITTEN = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"|<function=([^>]+)>|\b([A-Za-z_]\w*)\(')


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, str):
        return isinstance(got, str) and got.strip().lower() == want.strip().lower()
    if isinstance(want, (int, float)) and not isinstance(want, bool):
        return isinstance(got, (int, float)) and not isinstance(got, bool) and abs(got - want) < 1e-6
    return got == want


def _matches(call: tuple[str, dict], want: tuple[str, dict]) -> bool:
    name, args = call
    return name == want[0] and isinstance(args, dict) and all(_same(args.get(k), v) for k, v in want[1].items())


def right(calls: list[tuple[str, dict]], expected: tuple[tuple[str, dict], ...]) -> bool:
    """The calls are exactly the expected ones (in any order; extra arguments allowed)."""
    if len(calls) != len(expected):
        return False
    left = list(calls)
    for want in expected:
        hit = next((i for i, call in enumerate(left) if _matches(call, want)), None)
        if hit is None:
            return False
        left.pop(hit)
    return True


def names_written(text: str) -> set[str]:
    """Every tool-like name in `text`: JSON "name" values, Qwen3-Coder's <function=NAME>, NAME(."""
    return {next(g for g in match.groups() if g) for match in _NAMES_WRITTEN.finditer(text)}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind: cases, right answers through the server and in the raw text, calls not written."""
    kinds = {}
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        if mine:
            kinds[kind] = {"cases": len(mine), "server_right": sum(r["server_right"] for r in mine),
                           "raw_right": sum(r["raw_right"] for r in mine),
                           "calls_not_written": sum(len(r["calls_not_written"]) for r in mine)}
    no_loss = all(k["server_right"] >= k["raw_right"] for k in kinds.values())
    not_written = sum(k["calls_not_written"] for k in kinds.values())
    return {"kinds": kinds, "server_right": sum(k["server_right"] for k in kinds.values()),
            "raw_right": sum(k["raw_right"] for k in kinds.values()), "cases": len(rows),
            "no_server_loss": no_loss, "calls_not_written": not_written, "ok": no_loss and not_written == 0}


def bench_tools(model: str | None, out: str | Path, *, quick: bool = False, backend: str = "auto",
                quant: str = "auto", device: str = "auto", dtype: str | None = None, verdicts: Path | None = None,
                progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every case through `agentfold serve` and raw, write the JSON to `out`, return it.

    The server is a child process as a user starts it, on the backend and quantization the engine
    loaded here chose; the raw text comes from that engine, decoded greedily on the server's prefill
    plan with no grammar and no stops, so what the model wrote is all there."""
    import openai

    from agentfold.bench.harness import ServerProcess
    from agentfold.chat.template import render_chat
    from agentfold.chat.tool_calls import parse_output
    from agentfold.chat.tools import ToolSpec
    from agentfold.engine.decode import GenerationConfig
    from agentfold.engine.factory import build_engine
    from agentfold.serve.models import resolve
    from agentfold.sessions.manager import assistant_cuts

    started = time.perf_counter()
    path = resolve(model)
    cases = [c for kind in KINDS for c in [c for c in CASES if c.kind == kind][: QUICK_PER_KIND if quick else None]]
    result = run_header(SCHEMA, utc_timestamp(), quick, machine_info())
    progress(f"tools: loading {path}")
    engine = build_engine(path, dtype=dtype, drafter="suffix", backend=backend, device=device, quant=quant,
                          verdicts=verdicts, progress=lambda m: progress(f"tools: {m}"))
    result["model"] = {"path": str(path), "name": engine.backend.loaded.name, "backend": engine.backend.name}
    chosen = engine.backend  # the server runs what `auto` chose here, so both decode the same arithmetic
    args = ["--model", str(path), "--backend", chosen.name, "--quant", chosen.quant or quant, "--device", device,
            *(["--dtype", dtype] if dtype else [])]
    rows = []
    with tempfile.TemporaryDirectory(prefix="agentfold-bench-tools-") as home, \
            ServerProcess(Path(home) / "server", args, start_timeout=900, progress=progress) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=1800)
        served_model = client.models.list().data[0].id
        for n, case in enumerate(cases, 1):
            tools = [TOOLS[name] for name in case.tools]
            specs = [ToolSpec(t["function"]["name"], t["function"]["description"], t["function"]["parameters"])
                     for t in tools]
            messages = [{"role": "user", "content": case.question}]
            began = time.perf_counter()
            reply = client.chat.completions.create(model=served_model, messages=messages, tools=tools, temperature=0,
                                                   max_tokens=MAX_TOKENS)
            message = reply.choices[0].message
            served = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
            ids = engine.tokenizer.encode(render_chat(engine.tokenizer, messages, specs), add_special_tokens=False)
            cuts = assistant_cuts(lambda head, specs=specs: engine.tokenizer.encode(
                render_chat(engine.tokenizer, head, specs, add_generation_prompt=False), add_special_tokens=False),
                messages, ids)  # the server's plan: a prefill chunk's arithmetic may depend on where it is cut
            raw_text = engine.generate(ids, GenerationConfig(max_tokens=MAX_TOKENS), cuts=cuts).text
            raw = [(c.name, c.arguments_obj) for c in parse_output(raw_text, tools=specs)[1]]
            written = names_written(raw_text)
            row = {"kind": case.kind, "question": case.question, "tools": list(case.tools),
                   "expected": [list(e) for e in case.expected], "server_calls": [list(c) for c in served],
                   "server_content": message.content or "", "raw_text": raw_text, "raw_calls": [list(c) for c in raw],
                   "server_right": right(served, case.expected), "raw_right": right(raw, case.expected),
                   "calls_not_written": [name for name, _ in served if name not in written],
                   "seconds": round(time.perf_counter() - began, 2)}
            rows.append(row)
            progress(f"tools: {n}/{len(cases)} {case.kind}: server {'right' if row['server_right'] else 'wrong'}, "
                     f"raw {'right' if row['raw_right'] else 'wrong'} ({row['seconds']} s)")
    result["cases"] = rows
    result["summary"] = summarize(rows)
    finish_run(result, started, out)
    return result
