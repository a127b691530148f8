"""A `generate`-only policy as a decode session (`backends/generate_session.py`), and the one scheduler running
it: contexts grow turn by turn, a row is cut to its own budget, the processor sees sequence keys, each step is
seeded seed + step index, and tool calls are drained after each step so seeded rollouts repeat."""

import pytest
import torch

from agentgrad.backends.base import Generation, SamplingParams
from agentgrad.backends.generate_session import GenerateSession, open_session
from agentgrad.rollout.loop import EpisodeLimits, SamplerSettings, run_episodes
from agentgrad.types import StopReason


class Recorder:
    """Answers each row with `reply(prompt)` and records every call: (prompts, sampling, processor rows)."""

    def __init__(self, reply):
        self.reply, self.calls = reply, []

    def generate(self, prompts, sampling, logits_processor=None):
        rows = []
        if logits_processor is not None:
            for r in range(len(prompts)):
                rows.append(int(logits_processor(r, [], torch.zeros(3)).argmax()))
        self.calls.append(([list(p) for p in prompts], sampling, rows))
        return [Generation(tuple(ids), (-0.5,) * len(ids), "stop") for ids in map(self.reply, prompts)]

    def load_weights(self, state):
        pass


def test_contexts_grow_rows_are_cut_to_their_budget_and_steps_are_seeded_in_turn():
    policy = Recorder(lambda prompt: [7, 8, 9])
    key_hot = lambda key, generated, logits: logits.index_fill(0, torch.tensor([key % 3]), 1.0)  # noqa: E731
    session = GenerateSession(policy, SamplingParams(max_new_tokens=3, seed=10), key_hot)
    session.submit(4, [1, 2], 3)
    session.submit(5, [3], 2)
    first = dict(session.step())
    assert not session.has_work
    assert first[4] == Generation((7, 8, 9), (-0.5,) * 3, "stop")
    assert first[5] == Generation((7, 8), (-0.5,) * 2, "length")  # its own budget, 2 of the 3 asked of all rows
    session.submit(5, [4], 3)  # the observation after its turn
    with pytest.raises(RuntimeError, match="still generating"):
        session.submit(5, [6], 3)
    session.step()
    (p1, s1, rows1), (p2, s2, rows2) = policy.calls
    assert p1 == [[1, 2], [3]] and p2 == [[3, 7, 8, 4]]  # the cut turn is the context, as the episode records it
    assert (s1.seed, s2.seed) == (10, 11) and s1.max_new_tokens == 3
    assert rows1 == [4 % 3, 5 % 3] and rows2 == [5 % 3]  # generate's row r reached the processor as its key
    session.release(5)
    with pytest.raises(ValueError, match="empty prompt"):
        session.submit(5, [], 3)


def test_a_generate_policy_cannot_pause_so_a_factored_head_needs_a_session():
    policy = Recorder(lambda prompt: [1])
    with pytest.raises(ValueError, match="incremental sessions"):
        open_session(policy, SamplingParams(), max_sequences=1, max_tokens=8, pause=lambda key, ids: False)
    policy.tool_head = object()
    with pytest.raises(ValueError, match="incremental sessions"):
        run_episodes(policy, None, [], [], sampling=SamplingParams(), limits=EpisodeLimits(),
                     sampler=SamplerSettings(action_head="factored"))


def test_the_scheduler_steps_a_generate_policy_in_rounds_of_every_episode_in_flight(arithmetic_suite, codec):
    """Three episodes, two slots: every step holds every episode in flight (tools drained after each step), the
    third joins when the first retires, ahead of the one resubmitted after its tool; one seed per step."""
    tasks = arithmetic_suite.sample_tasks(3, split="train", seed=0)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 1"}}\n</tool_call>'

    def reply(prompt):
        text = codec.tokenizer.decode(list(prompt))
        answers = tasks[0].prompt in text and "<tool_response>" in text
        return codec.encode(tasks[0].answer if answers else call) + [codec.eos_token_ids[0]]

    policy = Recorder(reply)
    limits = EpisodeLimits(max_turns=3, max_total_tokens=400, repeated_call_limit=0)
    trajs = run_episodes(policy, codec, [arithmetic_suite.make_env() for _ in tasks], tasks,
                         sampling=SamplingParams(seed=3), limits=limits,
                         sampler=SamplerSettings(max_concurrent_episodes=2, tool_name_mask="off"))
    assert [t.stop_reason for t in trajs] == [StopReason.ANSWERED, StopReason.MAX_TURNS, StopReason.MAX_TURNS]
    assert [len(t.turns) for t in trajs] == [2, 3, 3]
    assert [len(prompts) for prompts, _, _ in policy.calls] == [2, 2, 2, 1, 1]
    third = [codec.tokenizer.decode(p) for p in policy.calls[2][0]]
    assert tasks[2].prompt in third[0] and tasks[1].prompt in third[1]
    assert [s.seed for _, s, _ in policy.calls] == [3, 4, 5, 6, 7]
    assert {s.max_new_tokens for _, s, _ in policy.calls} == {limits.max_new_tokens_per_turn}
