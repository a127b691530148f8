"""The agent loop with a scripted policy: malformed and unknown calls become error observations, are counted,
and never crash the rollout."""

from agentgrad.backends.base import Generation, SamplingParams
from agentgrad.pipelines.rl import rollout_metrics
from agentgrad.rewards.base import OutcomeReward, score
from agentgrad.rollout.loop import EpisodeLimits, run_episodes
from agentgrad.types import InvalidAction, StopReason, ToolCall, TrajectoryGroup


class ScriptedPolicy:
    """Plays fixed assistant texts, one per turn, for every episode of the batch."""

    def __init__(self, codec, turns):
        self.codec = codec
        self.turns = turns
        self.calls = 0

    def generate(self, prompts, sampling, logits_processor=None):
        text = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        ids = self.codec.encode(text) + [self.codec.eos_token_ids[0]]
        return [Generation(tuple(ids), (-0.1,) * len(ids), "stop") for _ in prompts]

    def load_weights(self, state):
        pass


def test_malformed_and_unknown_calls_are_error_observations(arithmetic_suite, codec):
    task = arithmetic_suite.sample_tasks(1, split="train", seed=0)[0]
    script = ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 +',  # truncated JSON
              '<tool_call>\n{"name": "teleport", "arguments": {}}\n</tool_call>',      # unknown tool
              '<tool_call>\n{"name": "calculator", "arguments": '
              f'{{"expression": "{task.metadata["expression"]}"}}}}\n</tool_call>',
              task.answer]
    policy = ScriptedPolicy(codec, script)
    [traj] = run_episodes(policy, codec, [arithmetic_suite.make_env()], [task], sampling=SamplingParams(),
                          limits=EpisodeLimits(max_turns=6, max_invalid_calls=3))
    assert traj.stop_reason is StopReason.ANSWERED
    assert isinstance(traj.turns[0].action, InvalidAction)
    assert traj.turns[0].observation.startswith("error (bad_arguments)")
    assert traj.turns[1].action == ToolCall("teleport", {}) and traj.turns[1].tool_error == "not_found"
    assert traj.turns[2].tool_ok and traj.num_invalid_calls == 2
    [scored] = score([traj], OutcomeReward(arithmetic_suite), arithmetic_suite)
    assert scored.success
    metrics = rollout_metrics([TrajectoryGroup(task, (scored,))])
    assert metrics["rollout/invalid_calls_per_episode"] == 2.0
    # Observations are in the token stream, with loss_mask 0.
    text = codec.tokenizer.decode(list(traj.token_ids))
    assert "error (not_found)" in text


def test_invalid_call_limit_and_token_limit_stop_episodes(arithmetic_suite, codec):
    task = arithmetic_suite.sample_tasks(1, split="train", seed=0)[0]
    policy = ScriptedPolicy(codec, ["<tool_call>{oops</tool_call>"])
    [traj] = run_episodes(policy, codec, [arithmetic_suite.make_env()], [task], sampling=SamplingParams(),
                          limits=EpisodeLimits(max_turns=10, max_invalid_calls=2))
    assert traj.stop_reason is StopReason.INVALID_CALLS and traj.num_invalid_calls == 2

    class Rambler(ScriptedPolicy):
        def generate(self, prompts, sampling, logits_processor=None):
            ids = self.codec.encode("1 " * sampling.max_new_tokens)[: sampling.max_new_tokens]
            return [Generation(tuple(ids), (-0.1,) * len(ids), "length") for _ in prompts]

    [cut] = run_episodes(Rambler(codec, []), codec, [arithmetic_suite.make_env()], [task],
                         sampling=SamplingParams(), limits=EpisodeLimits(max_new_tokens_per_turn=8))
    assert cut.stop_reason is StopReason.MAX_TOKENS and cut.final_answer is None
