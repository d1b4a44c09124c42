"""One prompt head for every conversation: the leading system messages (and the tools the template
renders with them) are a cut of the plan, their cache a snapshot any new conversation restores.

On the real SmolLM2: a second new conversation with the same system prompt restores the head (in
the same manager and after a restart), prefills only its own messages, and its reply is byte for
byte a fresh manager's with an empty store; a conversation with another system prompt restores
nothing; heads are evicted like any snapshot, least recently used first.
"""

from __future__ import annotations

import tempfile

import pytest

from agentfold.engine.decode import Completion, Engine, GenerationConfig
from agentfold.sessions import SessionManager
from agentfold.sessions.manager import HEAD_MIN_TOKENS, assistant_cuts, prompt_head

RULES = "\n".join(f"- Rule {i}: keep function {i} pure, typed and under {10 + i} lines." for i in range(30))
SYSTEM = {"role": "system", "content": "You are a careful Python reviewer. House rules:\n" + RULES}
CONFIG = GenerationConfig(max_tokens=10, draft=True)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def fresh_reply(engine: Engine, messages: list[dict], config: GenerationConfig = CONFIG) -> Completion:
    with tempfile.TemporaryDirectory() as home:
        completion, info = SessionManager(engine, home).reply(messages, config)
    assert info.cached_tokens == 0
    return completion


def encoder(engine: Engine):
    tokenizer = engine.tokenizer

    def encode(messages, generation_prompt=False):
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))

    return encode


def test_the_head_is_the_leading_system_messages_only(smollm2_engine):
    encode = encoder(smollm2_engine)
    messages = [SYSTEM, user("What does rule 3 ask?")]
    prompt = encode(messages, True)
    head = prompt_head(encode, messages, prompt)
    assert head == len(encode([SYSTEM])) >= HEAD_MIN_TOKENS
    assert head in assistant_cuts(encode, messages, prompt)  # a cut of the plan, fresh or resumed
    # no system message leads, a short one, or nothing after it: no head
    later = [user("hi"), SYSTEM, user("What does rule 3 ask?")]
    assert prompt_head(encode, later, encode(later, True)) == 0
    short = [{"role": "system", "content": "Be brief."}, user("hi")]
    assert prompt_head(encode, short, encode(short, True)) == 0
    assert prompt_head(encode, [SYSTEM], encode([SYSTEM], True)) == 0


def test_new_conversations_restore_the_shared_head_and_equal_fresh(smollm2_engine, tmp_path):
    manager = SessionManager(smollm2_engine, tmp_path)
    _, info = manager.reply([SYSTEM, user("What does rule 3 ask?")], CONFIG)
    head = prompt_head(encoder(smollm2_engine), [SYSTEM, user("x")], encoder(smollm2_engine)([SYSTEM, user("x")], True))
    assert info.cached_tokens == 0 and info.head_tokens == 0 and info.head_snapshot_id is not None
    head_id = info.head_snapshot_id

    questions = ["Which rule limits the length of function 7?", "Summarize rules 1 and 2 in one line."]
    for question in questions:
        messages = [SYSTEM, user(question)]
        completion, info = manager.reply(messages, CONFIG)  # a new session each time
        assert info.cached_tokens == info.head_tokens == head, info
        assert info.snapshot_id == head_id and info.head_snapshot_id is None
        assert completion.stats.prefilled_tokens == info.prompt_tokens - head
        reference = fresh_reply(smollm2_engine, messages)
        assert completion.tokens == reference.tokens and completion.token_sha == reference.token_sha

    # after a restart: the head is read back from its file
    restarted = SessionManager(smollm2_engine, tmp_path)
    messages = [SYSTEM, user("Does any rule mention classes?")]
    completion, info = restarted.reply(messages, CONFIG)
    assert info.head_tokens == head
    assert completion.token_sha == fresh_reply(smollm2_engine, messages).token_sha

    # another system prompt shares no head
    other = {"role": "system", "content": "You are a terse Go reviewer. House rules:\n" + RULES}
    _, info = restarted.reply([other, user("What does rule 3 ask?")], CONFIG)
    assert info.head_tokens == 0 and info.cached_tokens == 0


def test_a_resumed_turn_restores_its_own_snapshot_not_the_head(smollm2_engine, tmp_path):
    manager = SessionManager(smollm2_engine, tmp_path)
    turn1 = [SYSTEM, user("What does rule 3 ask?")]
    first, info1 = manager.reply(turn1, CONFIG, session_id="s-head")
    turn2 = [*turn1, {"role": "assistant", "content": first.text}, user("And rule 4?")]
    second, info2 = manager.reply(turn2, CONFIG, session_id="s-head")
    assert info2.cached_tokens > info1.prompt_tokens - 8 and info2.head_tokens == 0
    assert info2.head_snapshot_id is None  # the head was restored past, not prefilled
    assert second.token_sha == fresh_reply(smollm2_engine, turn2).token_sha


@pytest.mark.parametrize("budget_heads", [1])
def test_heads_are_evicted_least_recently_used_first(smollm2_engine, tmp_path, budget_heads):
    probe = SessionManager(smollm2_engine, tmp_path / "probe")
    _, info = probe.reply([SYSTEM, user("q")], GenerationConfig(max_tokens=2, draft=False))
    sizes = {row["id"]: row["bytes"] for row in probe.list_snapshots()}
    head_bytes = sizes[info.head_snapshot_id]
    # room for the newest turn's two snapshots and little more: older heads go first
    manager = SessionManager(smollm2_engine, tmp_path / "home", budget_bytes=int(2.5 * head_bytes))
    systems = [{"role": "system", "content": f"Project {name}. House rules:\n" + RULES} for name in "ABC"]
    heads = []
    for system in systems:
        _, info = manager.reply([system, user("q")], GenerationConfig(max_tokens=2, draft=False))
        heads.append(info.head_snapshot_id)
    kept = {row["id"] for row in manager.list_snapshots()}
    assert heads[-1] in kept and heads[0] not in kept
    assert manager.store.total_bytes() <= manager.store.budget_bytes
