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
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# isort: split
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache

from agentfold.engine.cache_layout import CacheLayoutError
from agentfold.engine.decode import Completion, Engine, GenerationConfig
from agentfold.engine.factory import build_engine
from agentfold.kernels import attention
from agentfold.sessions import SessionManager
from agentfold.sessions.snapshots import SnapshotError, SnapshotStore
from tests.helpers.tiny_models import CORPUS, build_model, loaded_model, make_tokenizer, tiny_config

ROOT = Path(__file__).parents[2]
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


# --- snapshot files ---------------------------------------------------------------------------


def file_header(path: Path) -> dict:
    data = path.read_bytes()
    return json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])


def cast(cache, dtype):
    """`cache` with every array it holds cast to `dtype` (a storage round trip runs no forward pass)."""
    for layer in cache.layers:
        if isinstance(layer, ArraysCache):
            layer.cache = [None if a is None else a.astype(dtype) for a in layer.cache]
        elif layer.keys is not None:
            layer.keys, layer.values = layer.keys.astype(dtype), layer.values.astype(dtype)
    return cache


def held(cache) -> dict:
    """Every array an MLX cache holds (valid rows only), by snapshot name."""
    out = {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, ArraysCache):
            out.update({f"{i}.{j}": a for j, a in enumerate(layer.cache) if a is not None})
        elif layer.keys is not None:
            out[f"{i}.keys"], out[f"{i}.values"] = (x[..., : layer.offset, :] for x in (layer.keys, layer.values))
    return out


def bits(array: mx.array) -> np.ndarray:
    return np.array(array.view({2: mx.uint16, 4: mx.uint32}[array.itemsize]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_snapshot_files_round_trip_and_read_what_mlx_wrote(tiny, tmp_path, dtype):
    """A snapshot is a standard safetensors file written from numpy (bfloat16 tagged BF16) and read
    back bit for bit; the same snapshot written by `mx.save_safetensors`, as snapshots were before
    the store stopped importing MLX, restores the same cache."""
    backend = tiny["qwen3_next"].backend  # attention and recurrent layers
    cache = backend.new_cache()
    backend.prefill(list(range(40, 110)), cache)
    cache = cast(cache, getattr(mx, dtype))
    expected = held(cache)
    store = SnapshotStore(tmp_path / "home")
    row = store.row(store.save("k", cache, [], backend=backend))
    path = store.dir / row["file"]
    header = file_header(path)
    assert {header[name]["dtype"] for name in expected} == {{"float32": "F32", "bfloat16": "BF16"}[dtype]}
    assert header["tokens"]["dtype"] == "I32"

    def restores_the_same() -> None:
        restored = SnapshotStore(tmp_path / "home").load(store.row(row["id"]), backend)  # from disk: a new store
        assert restored.tokens == cache.tokens
        got = held(restored)
        assert set(got) == set(expected)
        for name, array in expected.items():
            assert got[name].dtype == array.dtype and np.array_equal(bits(got[name]), bits(array)), name

    restores_the_same()
    metadata = header["__metadata__"]  # now as MLX's writer made it: no bits notes, the BF16 tag says it
    metadata["layers"] = json.dumps([{k: v for k, v in spec.items() if k != "bits"}
                                     for spec in json.loads(metadata["layers"])])
    mx.save_safetensors(str(path), {"tokens": mx.array(np.asarray(cache.tokens, dtype=np.int32)), **expected},
                        metadata=metadata)
    data = path.read_bytes()
    with store.write() as db:
        db["snapshots"].update(row["id"], {"bytes": len(data), "checksum": hashlib.sha256(data).hexdigest()})
    restores_the_same()


def test_arrays_for_another_cache_are_refused(tiny, tmp_path):
    """Backends raise the engine's CacheLayoutError; the store reports it as a SnapshotError."""
    dense, hybrid = tiny["qwen3"].backend, tiny["qwen3_next"].backend
    cache = dense.new_cache()
    dense.prefill(list(range(40, 80)), cache)
    with pytest.raises(CacheLayoutError):
        hybrid.arrays_to_cache(*dense.cache_to_arrays(cache))
    arrays, layout = dense.cache_to_arrays(cache)
    del arrays["0.values"]
    with pytest.raises(CacheLayoutError, match="0.values"):
        dense.arrays_to_cache(arrays, layout)
    store = SnapshotStore(tmp_path / "home")
    row = store.row(store.save("k", cache, [], backend=dense))
    with pytest.raises(SnapshotError, match=f"snapshot {row['id']}: .*layer"):
        store.load(row, hybrid)
    assert dense.arrays_to_cache(*dense.cache_to_arrays(cache)).tokens == cache.tokens


def test_torch_bfloat16_snapshot_is_a_standard_file(tmp_path):
    """The torch backend stores bfloat16 through numpy too (no MLX detour); MLX reads the same bits."""
    torch = pytest.importorskip("torch")
    from agentfold.engine.torch.backend import TorchBackend
    from agentfold.engine.torch.loader import load_torch_model
    from tests.helpers.torch_tiny import write_folder

    backend = TorchBackend(load_torch_model(write_folder(tmp_path / "qwen3", "qwen3", seed=3), dtype="bfloat16",
                                            device="cpu"))
    cache = backend.new_cache()  # filled by hand: storage runs no forward pass
    generator = torch.Generator().manual_seed(5)
    for layer in cache.layers:
        kv_heads, _, head_dim = layer.keys.shape
        layer.write(0, *(torch.randn(kv_heads, 30, head_dim, generator=generator).bfloat16() for _ in range(2)))
    cache.tokens = list(range(30, 60))
    store = SnapshotStore(tmp_path / "home")
    row = store.row(store.save("k", cache, [], backend=backend))
    path = store.dir / row["file"]
    assert file_header(path)["0.keys"]["dtype"] == "BF16"
    restored = SnapshotStore(tmp_path / "home").load(row, backend)
    assert restored.tokens == cache.tokens
    for a, b in zip(cache.layers, restored.layers, strict=True):
        assert b.keys.dtype == torch.bfloat16
        assert torch.equal(a.read(30)[0], b.read(30)[0]) and torch.equal(a.read(30)[1], b.read(30)[1])
    from_mlx = mx.load(str(path))["0.keys"]
    assert from_mlx.dtype == mx.bfloat16
    assert np.array_equal(bits(from_mlx), cache.layers[0].read(30)[0].contiguous().view(torch.int16).numpy().view(np.uint16))


# --- the real SmolLM2-135M --------------------------------------------------------------------


def source_excerpt(tokenizer, module: str, start: int, count: int) -> str:
    """`count` tokens of a stdlib module's source text, from token `start`."""
    text = Path(__import__(module).__file__).read_text()
    return tokenizer.decode(tokenizer.encode(text)[start : start + count])


def real_users(tokenizer) -> list[str]:
    """Five user turns: a module excerpt, three short questions, then a long excerpt (the plan
    crosses several chunks of the grid in the last turn). Short early turns keep the fresh side cheap."""
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
    done = subprocess.run([sys.executable, "-m", "tests.helpers.session_worker"], input=job, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_real_conversation_resumed_equals_fresh(smollm2_engine, tmp_path):
    """Five turns resumed from snapshots (turn 4 in a second process), then all five again with
    drafting on in a new session: each reply equals a fresh manager's.

    An engine of its own over the shared backend: the shared engine's depth controller carries the
    pass costs earlier tests measured (on a busy machine drafting may not pay there, and a reply of
    16 tokens never probes), and this test needs drafts to run to prove anything."""
    shared = smollm2_engine
    engine = Engine(shared.backend, shared.tokenizer, shared.eos_token_ids, drafter=shared.drafter,
                    exactness=shared.exactness, chunk_size=shared.chunk_size)
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
    assert drafts > 0, f"nothing drafted (exactness up to {engine.exactness.max_width} rows)"


def test_snapshot_is_taken_at_the_reply_start_not_a_later_grid_point():
    """A chunk-grid point after the reply's start (inside a trailing instruction turn) is not where
    the next turn can resume: the snapshot goes to the last message cut on the plan."""
    from agentfold.sessions.manager import reply_start

    assert reply_start([512, 1006, 1024], [1006]) == 1006
    assert reply_start([512, 1024], []) == 1024  # raw prompts: the plan's last boundary
    assert reply_start([512, 1024], [1100]) == 1024  # a cut past the prefill is not on the plan
    assert reply_start([], []) == 0
