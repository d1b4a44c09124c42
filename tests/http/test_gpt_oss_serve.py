"""A gpt-oss GGUF served end to end: the tiny random gpt-oss file (tests/helpers/gguf_files.py) with
gpt-oss's real chat template, its harmony markers as tokens of its own vocabulary, on the block
kernels, behind a real uvicorn server and the official `openai` client.

Random weights write noise, so what a free reply says is not checked; what is: the prompt is
rendered by the file's harmony template (the server reads replies as harmony), a forced call
(`tool_choice` naming the tool) is decoded under the harmony call grammar on this tokenizer (where
`<|channel|>`, `<|constrain|>` and `<|message|>` are single tokens) and comes back as a tool call
with arguments that fit the schema, drafted and serial alike. (That `<|end|>` ends no reply, and that
the markers stay in decoded text, is tests/engine/test_gpt_oss_gguf.py's.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from agentfold.engine.factory import build_engine
from agentfold.http.app import create_app
from agentfold.kernels import block_linear
from agentfold.serve.scheduler import Runtime
from tests.helpers.api_helpers import ServerThread, wait_idle
from tests.helpers.gguf_files import harmony_tokenizer_fields, write_tiny_gpt_oss

pytestmark = pytest.mark.skipif(not block_linear.supported("MXFP4", 32), reason="no C compiler: no block kernels")

TEMPLATE = (Path(__file__).resolve().parents[1] / "fixtures" / "harmony" / "openai-gpt-oss-120b.jinja").read_text()
# Enumerated values: the random model would otherwise write one endless string (any text fits one)
SCHEMA = {"type": "object", "properties": {"path": {"type": "string", "enum": ["notes.txt", "setup.py"]},
                                           "line": {"type": "integer", "enum": [1, 2, 3]}},
          "required": ["path", "line"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "read_line", "description": "One line of a file.",
                                         "parameters": SCHEMA}}


@pytest.fixture(scope="module")
def gpt_oss_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("gpt-oss-serve")
    path = write_tiny_gpt_oss(folder / "tiny-gpt-oss.gguf", harmony_tokenizer_fields(TEMPLATE), seed=1)
    engine = build_engine(path, backend="torch", device="cpu", quant="blocks", verdicts=folder / "verdicts.json")
    runtime = Runtime(engine, "gpt-oss-tiny", max_active=2)
    server = ServerThread(create_app(runtime)).start()
    try:
        yield server.url
    finally:
        wait_idle(runtime)
        server.stop()
        runtime.close()


def test_a_forced_call_comes_back_as_a_tool_call_drafted_or_not(gpt_oss_url: str):
    client = openai.OpenAI(base_url=gpt_oss_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    request = {"model": "gpt-oss-tiny", "messages": [{"role": "user", "content": "Read line 3 of notes.txt"}],
               "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "read_line"}},
               "max_tokens": 96, "temperature": 0}
    replies = [client.chat.completions.create(**request, extra_body={"draft": draft}) for draft in (False, True)]
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert call.function.name == "read_line" and set(arguments) == {"path", "line"}
        assert arguments["line"] in (1, 2, 3) and arguments["path"] in ("notes.txt", "setup.py")
    assert replies[0].choices[0].message.tool_calls[0].function.arguments == \
        replies[1].choices[0].message.tool_calls[0].function.arguments

