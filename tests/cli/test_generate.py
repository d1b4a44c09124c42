"""`agentfold generate` on the embedded model: `--prediction FILE` drafts from the file and prints
the reply `--no-draft` prints; a prediction file that cannot be read is one line and exit 2."""

from __future__ import annotations

import json

from agentfold.cli import main
from tests.helpers.backends import real_model_backend

PROMPT = "Print this file again with mul renamed to times:\ndef add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"


def _generate(capsys, *extra: str) -> tuple[str, dict]:
    code = main(["generate", "--backend", real_model_backend(), "--json", "--max-tokens", "32", *extra, PROMPT])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out, json.loads(out.err.strip().splitlines()[-1])


def test_prediction_file_drafts_the_serial_reply(capsys, tmp_path):
    serial_text, serial = _generate(capsys, "--no-draft")
    file = tmp_path / "expected.py"
    file.write_text(serial_text.rstrip("\n"), encoding="utf-8")
    text, line = _generate(capsys, "--prediction", str(file))
    assert text == serial_text and line["token_sha"] == serial["token_sha"]
    assert line["draft_method"] == "prediction" and line["accepted"] > line["completion_tokens"] // 2, line


def test_unreadable_prediction_is_one_line_exit_2(capsys, tmp_path):
    assert main(["generate", "--prediction", str(tmp_path / "missing.py"), "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "missing.py" in err and len(err.splitlines()) == 1, err


def test_a_harmony_reply_prints_its_answer_and_its_reasoning_apart():
    """gpt-oss's reply as `generate` shows it, however the stream is cut: the final message on
    stdout, the analysis on stderr after `[reasoning] `, no control token on either."""
    import io

    from agentfold.cli.generate import HarmonyPrinter

    reply = ("<|channel|>analysis<|message|>The user wants a greeting; keep it short.<|end|>"
             "<|start|>assistant<|channel|>final<|message|>Hello, Ada!")
    for size in range(1, 8):
        out, err = io.StringIO(), io.StringIO()
        printer = HarmonyPrinter(out, err)
        for at in range(0, len(reply), size):
            printer.feed(reply[at : at + size])
        printer.finish()
        assert out.getvalue() == "Hello, Ada!", size
        assert err.getvalue() == "[reasoning] The user wants a greeting; keep it short.\n", size
