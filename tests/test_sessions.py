"""Resumed equals fresh (DESIGN contract 2), and the snapshot store that makes resuming safe.

Every reply served from stored snapshots, in the same process or after a restart, must be token
for token the reply of a fresh manager with an empty home given the same messages. The real
SmolLM2 runs a 5-turn, 3,000-token conversation; random tiny dense (qwen3) and hybrid recurrent
(qwen3_next) models run the same check with a 64-token chunk grid, and the store's failure paths:
other keys, damaged files, eviction under a byte budget, forks.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import agentfold  # noqa: F401  (picks the BLAS before mlx.core is imported)

# isort: split
import pytest

from agentfold.engine.decode import Completion, Engine, GenerationConfig
from agentfold.engine.factory import build_engine
from agentfold.kernels import attention
from agentfold.sessions import SessionManager

try:
    from tests.tiny_models import CORPUS, build_model, loaded_model, make_tokenizer, tiny_config
except ImportError:  # pytest's rootdir-less import mode puts tests/ itself on sys.path
    from tiny_models import CORPUS, build_model, loaded_model, make_tokenizer, tiny_config

WORKER = Path(__file__).with_name("session_worker.py")
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SERIAL = GenerationConfig(max_tokens=12, draft=False)
DRAFTED = GenerationConfig(max_tokens=12, draft=True)
SYSTEM = {"role": "system", "content": "You write small, correct Python."}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def fresh_reply(engine: Engine, messages: list[dict], config: GenerationConfig) -> Completion:
    """The reference: a fresh manager with an empty home, so nothing can be reused."""
    with tempfile.TemporaryDirectory() as home:
        completion, info = SessionManager(engine, home).reply(messages, config)
    assert info.cached_tokens == 0 and info.snapshot_id is None
    return completion


# --- tiny random models -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Engine]:
    """Tiny qwen3 / qwen3_next engines (suffix drafter, self-checked) on a 64-token chunk grid."""
    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHATML
    engines = {}
    for index, arch in enumerate(("qwen3", "qwen3_next")):
        config = tiny_config(arch, len(tokenizer))
        model = build_model(config, seed=300 + index, logit_scale=4.0)
        attention.install(model)  # in case an earlier test restored mlx-lm's own attention
        loaded = loaded_model(model, tokenizer, config, tmp_path_factory.mktemp(arch))
        engine = build_engine(loaded, drafter="suffix")
        engine.chunk_size = 64
        engines[arch] = engine
    return engines


TINY_USERS = ["".join(CORPUS[i : i + 3]) + f"# turn {i}\n" for i in range(5)]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_tiny_resumed_equals_fresh(tiny, arch, tmp_path):
    engine = tiny[arch]
    runs = {"serial": (SessionManager(engine, tmp_path / "serial"), SERIAL),
            "drafted": (SessionManager(engine, tmp_path / "drafted"), DRAFTED)}
    sessions: dict[str, str] = {}
    last: dict[str, object] = {}
    drafted = 0
    messages = [SYSTEM]
    for turn, text in enumerate(TINY_USERS):
        messages.append(user(text))
        fresh = fresh_reply(engine, messages, SERIAL)
        for name, (manager, config) in runs.items():
            completion, info = manager.reply(messages, config, sessions.get(name))
            assert completion.tokens == fresh.tokens, (name, turn)
            assert completion.stats.cached_tokens == info.cached_tokens
            assert info.saved_snapshot_id is not None and info.cuts
            if turn:  # resumed from the previous turn's snapshot at the start of its reply
                assert info.session_id == sessions[name]
                assert info.cached_tokens >= last[name].cuts[-1] > 0
                assert info.snapshot_id is not None
            sessions[name], last[name] = info.session_id, info
            drafted += completion.stats.drafted
        messages.append({"role": "assistant", "content": fresh.text})
    assert len(runs["serial"][0].turns(sessions["serial"])) == len(TINY_USERS)
    assert info.prompt_tokens > 4 * engine.chunk_size  # the plan crossed the chunk grid
    assert drafted > 0


def test_prompt_ids_resume_on_the_chunk_grid(tiny, tmp_path):
    """Raw prompt ids (no messages, no cuts): snapshots land on absolute chunk boundaries only."""
    engine = tiny["qwen3_next"]
    manager = SessionManager(engine, tmp_path / "home")
    ids = engine.tokenizer.encode("".join(CORPUS) * 2)
    first, info = manager.reply(ids[:150], SERIAL)
    assert info.saved_snapshot_id and manager.store.row(info.saved_snapshot_id)["token_count"] == 128
    prompt = ids[:150] + first.tokens + ids[150:200]
    resumed, info = manager.reply(prompt, SERIAL, info.session_id)
    assert info.cached_tokens == 128
    assert resumed.tokens == fresh_prompt_reply(engine, prompt)


def fresh_prompt_reply(engine: Engine, prompt: list[int]) -> list[int]:
    with tempfile.TemporaryDirectory() as home:
        return SessionManager(engine, home).reply(prompt, SERIAL)[0].tokens


def conversation(manager: SessionManager, turns: int, texts: list[str] | None = None):
    """Run `turns` turns in a new session; returns the messages (with a last assistant reply) and infos."""
    messages, infos = [SYSTEM], []
    session = None
    for text in (texts or TINY_USERS)[:turns]:
        messages.append(user(text))
        completion, info = manager.reply(messages, SERIAL, session)
        session = info.session_id
        messages.append({"role": "assistant", "content": completion.text})
        infos.append(info)
    return messages, infos


def test_other_key_is_not_reused(tiny, tmp_path):
    engine = tiny["qwen3"]
    home = tmp_path / "home"
    messages, _ = conversation(SessionManager(engine, home), 2)
    messages.append(user(TINY_USERS[2]))
    fresh = fresh_reply(engine, messages, SERIAL)

    backend = copy.copy(engine.backend)
    backend.loaded = dataclasses.replace(engine.backend.loaded, dtype="bfloat16")  # another dtype label
    tokenizer = copy.deepcopy(engine.tokenizer)
    tokenizer.chat_template = CHATML + "{# v2 #}"  # renders the same tokens, is another template
    others = [Engine(backend, engine.tokenizer, engine.eos_token_ids, chunk_size=64),
              Engine(engine.backend, tokenizer, engine.eos_token_ids, chunk_size=64)]
    keys = {SessionManager(engine, home).key}
    for other in others:
        manager = SessionManager(other, home)
        assert manager.key not in keys
        keys.add(manager.key)
        assert manager.render(messages) == SessionManager(engine, home).render(messages)
        completion, info = manager.reply(messages, SERIAL)
        assert info.cached_tokens == 0 and info.snapshot_id is None
        assert any("key mismatch" in reason for reason in info.miss_reasons)
        assert completion.tokens == fresh.tokens
    completion, info = SessionManager(engine, home).reply(messages, SERIAL)
    assert info.cached_tokens > 0 and completion.tokens == fresh.tokens


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
def test_damaged_snapshot_is_dropped(tiny, tmp_path, damage):
    engine = tiny["qwen3_next"]
    home = tmp_path / "home"
    manager = SessionManager(engine, home)
    messages, infos = conversation(manager, 2)
    messages.append(user(TINY_USERS[2]))
    fresh = fresh_reply(engine, messages, SERIAL)
    victim = infos[-1].saved_snapshot_id
    path = manager.store.dir / manager.store.row(victim)["file"]
    data = path.read_bytes()
    if damage == "flip":  # the same manager: its in-memory copy must notice the file changed
        with open(path, "r+b") as handle:
            handle.seek(len(data) // 2)
            handle.write(bytes(b ^ 0xFF for b in data[len(data) // 2 : len(data) // 2 + 16]))
    else:  # a restarted manager
        if damage == "truncate":
            path.write_bytes(data[: len(data) // 2])
        else:
            path.unlink()
        manager = SessionManager(engine, home)

    completion, info = manager.reply(messages, SERIAL, infos[-1].session_id)
    if damage == "flip":
        assert any("checksum mismatch" in reason for reason in info.miss_reasons), info.miss_reasons
    else:  # a restarted store drops a row whose file is gone or cut short at start-up (sessions.recovery)
        assert victim in manager.store.recovered.dropped_rows
    assert completion.tokens == fresh.tokens
    assert manager.store.row(victim) is None and not path.exists()
    assert info.snapshot_id == infos[0].saved_snapshot_id  # fell back to the turn before
    assert info.cached_tokens == manager.store.row(info.snapshot_id)["token_count"] > 0


def test_eviction_keeps_budget_and_pins(tiny, tmp_path):
    engine = tiny["qwen3"]
    manager = SessionManager(engine, tmp_path / "home", budget_bytes=None)
    store = manager.store
    _, (pinned_turn,) = conversation(manager, 1, ["def pinned(x):\n    return x\n"])
    manager.pin(pinned_turn.session_id)
    messages, infos = conversation(manager, 4)
    manager.pin_snapshot(infos[0].saved_snapshot_id)
    store.budget_bytes = store.total_bytes()  # full now

    def check(in_use: set[str]) -> None:
        rows = {r["id"]: r for r in manager.list_snapshots()}
        assert {p.name for p in store.dir.glob("*.safetensors")} == {r["file"] for r in rows.values()}
        assert pinned_turn.saved_snapshot_id in rows and infos[0].saved_snapshot_id in rows
        protected = {pinned_turn.saved_snapshot_id, infos[0].saved_snapshot_id} | in_use
        assert store.total_bytes() <= store.budget_bytes or set(rows) <= protected

    messages.append(user(TINY_USERS[4]))
    _, info = manager.reply(messages, SERIAL, infos[-1].session_id)
    check({info.snapshot_id, info.saved_snapshot_id})
    assert info.snapshot_id == infos[-1].saved_snapshot_id  # the one in use survived
    evicted = {i.saved_snapshot_id for i in infos[1:3]}
    assert not evicted & {r["id"] for r in manager.list_snapshots()}

    _, other = manager.reply([SYSTEM, user("class Other:\n    pass\n")], SERIAL)
    check({other.saved_snapshot_id})
    assert store.total_bytes() <= store.budget_bytes

    manager.pin(pinned_turn.session_id, False)
    manager.pin_snapshot(infos[0].saved_snapshot_id, False)
    store.budget_bytes = 0
    assert store.evict(keep={other.saved_snapshot_id})
    assert [r["id"] for r in manager.list_snapshots()] == [other.saved_snapshot_id]


def test_fork_continues_independently(tiny, tmp_path):
    engine = tiny["qwen3_next"]
    manager = SessionManager(engine, tmp_path / "home")
    messages, infos = conversation(manager, 3)
    first = infos[0].session_id
    forked = manager.fork(first, 1)
    assert [t["snapshot_id"] for t in manager.turns(forked)] == [i.saved_snapshot_id for i in infos[:2]]
    assert {s["id"]: s["parent"] for s in manager.list_sessions()}[forked] == first

    branch = messages[:5] + [user("def mul(a, b):\n    return a * b\n")]  # after turn 1's reply
    main = messages + [user(TINY_USERS[3])]
    for session, prompt, resumed_from in ((first, main, infos[2]), (forked, branch, infos[1])):
        completion, info = manager.reply(prompt, SERIAL, session)
        assert info.snapshot_id == resumed_from.saved_snapshot_id
        assert info.cached_tokens > 0 and completion.tokens == fresh_reply(engine, prompt, SERIAL).tokens
        prompt.append({"role": "assistant", "content": completion.text})

    sizes = {s["id"]: s for s in manager.list_sessions()}
    assert sizes[first]["turns"] == 4 and sizes[forked]["turns"] == 3 and sizes[forked]["bytes"] > 0
    shared = {i.saved_snapshot_id for i in infos[:2]}
    removed = manager.delete(first)
    assert removed and not set(removed) & shared
    left = {r["id"] for r in manager.list_snapshots()}
    assert shared <= left and all((manager.store.dir / f"{i}.safetensors").exists() for i in shared)
    branch.append(user(TINY_USERS[4]))
    completion, info = manager.reply(branch, SERIAL, forked)
    assert info.cached_tokens > 0 and completion.tokens == fresh_reply(engine, branch, SERIAL).tokens


# --- the real SmolLM2-135M --------------------------------------------------------------------


def source_excerpt(tokenizer, module: str, start: int, count: int) -> str:
    """`count` tokens of a stdlib module's source text, from token `start`."""
    text = Path(__import__(module).__file__).read_text()
    return tokenizer.decode(tokenizer.encode(text)[start : start + count])


def real_users(tokenizer) -> list[str]:
    """Five user turns: a module excerpt, three short questions, then a long excerpt (the plan
    crosses the 2048 chunk boundary in the last turn). Short early turns keep the fresh side cheap."""
    return [
        "Review this code:\n```python\n" + source_excerpt(tokenizer, "textwrap", 0, 120) + "\n```",
        "And this?\n```python\n" + source_excerpt(tokenizer, "fnmatch", 100, 30) + "\n```",
        "What about this?\n```python\n" + source_excerpt(tokenizer, "bisect", 60, 30) + "\n```",
        "One more:\n```python\n" + source_excerpt(tokenizer, "heapq", 300, 30) + "\n```",
        "Now the rest of textwrap:\n```python\n" + source_excerpt(tokenizer, "textwrap", 120, 2750) + "\n```",
    ]


RESTART_TURN = 3  # answered by a second process from the same home


def run_worker(home: Path, messages: list[dict], session_id: str, max_tokens: int) -> dict:
    job = json.dumps({"home": str(home), "messages": messages, "session_id": session_id, "max_tokens": max_tokens})
    done = subprocess.run([sys.executable, str(WORKER)], input=job, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_real_conversation_resumed_equals_fresh(smollm2_engine, tmp_path):
    """Five turns resumed from snapshots (turn 4 in a second process), then all five again with
    drafting on in a new session: each reply equals a fresh manager's."""
    engine = smollm2_engine
    max_tokens = 16
    serial = GenerationConfig(max_tokens=max_tokens, draft=False)
    drafted = GenerationConfig(max_tokens=max_tokens, draft=True)
    home = tmp_path / "home"
    manager = SessionManager(engine, home)
    messages = [SYSTEM]
    turns, references = [], []
    session = None
    for turn, text in enumerate(real_users(engine.tokenizer)):
        messages.append(user(text))
        fresh = fresh_reply(engine, messages, serial)
        references.append((list(messages), fresh.tokens))
        if turn == RESTART_TURN:
            answer = run_worker(home, messages, session, max_tokens)
            tokens, cached, used = answer["tokens"], answer["cached_tokens"], answer["snapshot_id"]
            assert used == turns[-1].saved_snapshot_id
            written = answer["saved_snapshot_id"]
        else:
            completion, info = manager.reply(messages, serial, session)
            session, tokens, cached, used = info.session_id, completion.tokens, info.cached_tokens, info.snapshot_id
            if turn == RESTART_TURN + 1:
                assert used == written  # restored what the other process wrote
            turns.append(info)
        assert tokens == fresh.tokens, turn
        if turn:
            assert cached > 0 and used is not None
        messages.append({"role": "assistant", "content": fresh.text})
    assert turns[-1].prompt_tokens >= 3000

    again, drafts = None, 0
    for turn, (prompt, expected) in enumerate(references):
        completion, info = manager.reply(prompt, drafted, again)
        again = info.session_id
        assert completion.tokens == expected, turn
        assert info.cached_tokens >= info.cuts[-1]  # the snapshot at the start of this very reply
        assert info.saved_snapshot_id == info.snapshot_id
        drafts += completion.stats.drafted
    assert drafts > 0
