"""Prefill cuts from the memo equal cuts rendered from scratch, and a conversation's next turn
renders only its new prefix (agentfold.chat.cuts)."""

from __future__ import annotations

from agentfold.chat.cuts import PrefixMemo, message_cuts, tools_salt
from agentfold.chat.template import render_chat
from agentfold.sessions.manager import assistant_cuts, prompt_head

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


def conversation(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are a coding agent."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Step {i}: open file_{i}.py"})
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "read_file", "arguments": f'{{"path": "file_{i}.py"}}'}}]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"def f{i}():\n    return {i}\n"})
    messages.append({"role": "user", "content": "Now summarise."})
    return messages


def test_memo_cuts_equal_fresh_cuts_and_render_only_new_prefixes(smollm2_engine):
    tokenizer = smollm2_engine.tokenizer

    def encode_head(head, tools=TOOLS):
        return tokenizer.encode(render_chat(tokenizer, head, tools, add_generation_prompt=False), add_special_tokens=False)

    def prompt_of(messages, tools=TOOLS):
        return tokenizer.encode(render_chat(tokenizer, messages, tools), add_special_tokens=False)

    memo = PrefixMemo()
    for turns in (3, 4, 5):
        messages = conversation(turns)
        prompt = prompt_of(messages)
        before = memo.renders
        cuts, head = message_cuts(memo, encode_head, messages, prompt, tools_salt(TOOLS))
        assert cuts == assistant_cuts(encode_head, messages, prompt)
        assert head == prompt_head(encode_head, messages, prompt) > 0  # the system turn with the tools
        assert len(cuts) == turns + 2 and cuts[0] == head  # the head, every assistant start and the reply's
        if turns > 3:  # new: the prefix before the new assistant message, and this reply's start
            assert memo.renders - before == 2, memo.renders - before

    # other tools render differently: they are part of the key
    messages = conversation(3)
    before = memo.renders
    no_tools, _ = message_cuts(memo, lambda head: encode_head(head, None), messages, prompt_of(messages, None),
                            tools_salt(None))
    # rendered anew: the 3 assistant starts, the reply's start and the head (the system turn)
    assert memo.renders - before == 5 and no_tools == assistant_cuts(lambda h: encode_head(h, None), messages,
                                                                    prompt_of(messages, None))


def test_memo_forgets_the_least_recently_used():
    memo = PrefixMemo(entries=2)
    calls = []

    def encode_head(head):
        calls.append(len(head))
        return list(range(len(head) * 3))

    messages = [{"role": "user", "content": str(i)} for i in range(3)]
    encode = memo.encoder(encode_head, messages, "salt")
    for length in (1, 2, 1, 3, 2):
        assert encode(messages[:length]) == list(range(length * 3))
    assert calls == [1, 2, 3, 2]  # 2 was dropped when 3 came in (1 had been used more recently)
