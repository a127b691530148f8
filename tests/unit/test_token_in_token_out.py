"""Loss masks cover exactly the policy's own tokens across turns, and ids are never re-tokenised."""

from agentgrad.rollout.loop import EpisodeLimits, expert_trajectory
from agentgrad.types import FinalAnswer, Message, StopReason, ToolCall


def test_mask_covers_exactly_the_policy_turns(arithmetic_suite, codec):
    task = arithmetic_suite.sample_tasks(1, split="train", seed=3)[0]
    traj = expert_trajectory(arithmetic_suite.make_env(), task, arithmetic_suite.expert_actions(task), codec,
                             EpisodeLimits())
    assert traj.stop_reason is StopReason.ANSWERED and len(traj.turns) == 2
    masked_positions = [i for i, m in enumerate(traj.loss_mask) if m]
    turn_positions = [i for t in traj.turns for i in range(t.start, t.end)]
    assert masked_positions == turn_positions
    # Each turn's tokens are exactly the assistant message the template would render, ending in eos.
    call, answer = arithmetic_suite.expert_actions(task)
    assert list(traj.token_ids[traj.turns[0].start:traj.turns[0].end]) == codec.assistant_ids(
        Message("assistant", "", tool_calls=(call,)))
    assert list(traj.token_ids[traj.turns[1].start:traj.turns[1].end]) == codec.assistant_ids(
        Message("assistant", answer.text))
    for t in traj.turns:
        assert traj.token_ids[t.end - 1] in codec.eos_token_ids
    # The prompt and the tool observation are not trained on.
    assert not any(traj.loss_mask[:traj.prompt_length])
    assert sum(traj.loss_mask) == sum(t.end - t.start for t in traj.turns)


def test_no_drift_against_rendering_the_whole_chat(arithmetic_suite, codec):
    """Incremental ids equal a one-shot encoding of the rendered chat (true for this tokenizer's boundaries)."""
    for task in arithmetic_suite.sample_tasks(20, split="train", seed=5):
        env = arithmetic_suite.make_env()
        tools = env.reset(options={"task": task})[1]["tools"]
        traj = expert_trajectory(env, task, arithmetic_suite.expert_actions(task), codec, EpisodeLimits())
        # The template writes a newline after the final eos; the episode ends at the eos itself.
        full = codec.render(list(traj.messages), tools)
        assert codec.encode(full.removesuffix("\n")) == list(traj.token_ids)


def test_observation_ids_follow_the_template(codec):
    ids = codec.observation_ids([Message("tool", "408")])
    text = codec.tokenizer.decode(ids)
    assert text == "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_remembered_observation_ids_are_the_rendered_ones_and_a_fresh_list_each_time(codec):
    """observation_ids remembers ids per distinct observation: a repeat gives the rendered ids again (checked
    against the uncached rendering), the caller may change its list, and another observation gets its own."""
    first = codec.observation_ids([Message("tool", "408")])
    first.append(-1)
    again = codec.observation_ids([Message("tool", "408")])
    assert again == codec._render_observation([Message("tool", "408")]) == first[:-1]
    other = codec.observation_ids([Message("tool", "409")])
    assert codec.tokenizer.decode(other).count("409") == 1 and other != again
    two = codec.observation_ids([Message("tool", "408"), Message("tool", "409")])
    assert codec.tokenizer.decode(two).count("<tool_response>") == 2


def test_tool_tags_survive_skip_special_tokens(codec):
    ids = codec.assistant_ids(Message("assistant", "", tool_calls=(ToolCall("calculator", {"expression": "1"}),)))
    assert codec.decode(ids).startswith("<tool_call>")
    assert "<|im_end|>" not in codec.decode(ids)


def test_limits_stop_reasons(arithmetic_suite, codec):
    task = arithmetic_suite.sample_tasks(1, split="train", seed=1)[0]
    env = arithmetic_suite.make_env()
    call = ToolCall("calculator", {"expression": task.metadata["expression"]})
    repeated = expert_trajectory(env, task, [call, call, call, FinalAnswer("1")], codec,
                                 EpisodeLimits(repeated_call_limit=3, max_turns=10))
    assert repeated.stop_reason is StopReason.REPEATED_CALL
    turns = expert_trajectory(env, task, [call, ToolCall("calculator", {"expression": "1"}), FinalAnswer("1")],
                              codec, EpisodeLimits(max_turns=2))
    assert turns.stop_reason is StopReason.MAX_TURNS
    bad = ToolCall("calculator", {"expr": "1"})
    invalid = expert_trajectory(env, task, [bad, bad, FinalAnswer("1")], codec,
                                EpisodeLimits(max_invalid_calls=2, repeated_call_limit=0))
    assert invalid.stop_reason is StopReason.INVALID_CALLS and invalid.num_invalid_calls == 2


def test_remembered_prompt_ids_are_the_rendered_ones_per_prompt_and_tools(arithmetic_suite, codec, monkeypatch):
    """prompt_ids remembers the ids of recent prompts: a repeat gives the rendered ids again as a fresh list, other
    tools or another question get their own, and only the last PROMPT_CACHE prompts are kept."""
    import agentgrad.rollout.chat as chat

    task = arithmetic_suite.sample_tasks(1, split="train", seed=0)[0]
    tools = arithmetic_suite.make_env().reset(options={"task": task})[1]["tools"]
    chat_ = [Message("system", "s"), Message("user", "What is 6 * 7?")]

    def rendered(messages, tools=None):
        return codec.encode(codec.render(messages, tools, add_generation_prompt=True))

    first = codec.prompt_ids(chat_, tools)
    first.append(-1)
    assert codec.prompt_ids(chat_, tools) == rendered(chat_, tools) == first[:-1]
    assert codec.prompt_ids(chat_) == rendered(chat_) != rendered(chat_, tools)
    other = [Message("system", "s"), Message("user", "What is 6 * 8?")]
    assert codec.prompt_ids(other, tools) == rendered(other, tools)
    renders = []
    monkeypatch.setattr(codec, "render", lambda *a, **k: renders.append(a) or "")
    codec.prompt_ids(other, tools)  # a group's next sample: no render
    assert renders == []
    monkeypatch.undo()
    monkeypatch.setattr(chat, "PROMPT_CACHE", 2)
    for n in range(3):
        codec.prompt_ids([Message("user", f"q{n}")])
    assert len(codec._prompts) == 2 and (((("user", "q0"),), "null")) not in codec._prompts
