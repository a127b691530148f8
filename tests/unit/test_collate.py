import torch

from agentgrad.batch import collate
from agentgrad.types import FinalAnswer, RewardBreakdown, ScoredTrajectory, StopReason, Task, ToolCall, Trajectory, Turn


def _traj(n_prompt=3):
    # prompt(3) | turn 0 (2 tokens) | observation (2) | turn 1 (3 tokens)
    ids = tuple(range(1, 11))
    mask = (0, 0, 0, 1, 1, 0, 0, 1, 1, 1)
    lps = tuple(-0.5 if m else 0.0 for m in mask)
    turns = (Turn(3, 5, "c", ToolCall("calculator", {}), "obs"), Turn(7, 10, "42", FinalAnswer("42"), None))
    return Trajectory(Task("t", "p", "42"), ids, mask, lps, n_prompt, turns, StopReason.ANSWERED)


def test_shapes_padding_and_reward_placement():
    short = Trajectory(Task("s", "p", "1"), (1, 2, 3), (0, 1, 1), (0.0, -1.0, -1.0), 1,
                       (Turn(1, 3, "1", FinalAnswer("1"), None),), StopReason.ANSWERED)
    samples = [ScoredTrajectory(_traj(), RewardBreakdown(1.0, (0.1, 0.2)), True),
               ScoredTrajectory(short, RewardBreakdown(0.0, (0.0,)), False)]
    b = collate(samples, pad_token_id=0, group_index=[0, 0])
    assert b.input_ids.shape == (2, 10)
    assert b.attention_mask[1].tolist() == [1, 1, 1] + [0] * 7
    assert b.loss_mask[0].tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    assert b.loss_mask[1, 3:].sum() == 0
    # process reward of turn 0 on its last token (index 4); turn 1's process + outcome on index 9
    expected = torch.zeros(10)
    expected[4], expected[9] = 0.1, 0.2 + 1.0
    assert torch.allclose(b.token_rewards[0], expected)
    assert b.old_logprobs[0, 3].item() == -0.5 and b.num_policy_tokens == 7
    assert b.group_index.tolist() == [0, 0]


def test_masked_samples_cost_no_gradient():
    s = ScoredTrajectory(_traj(), RewardBreakdown(0.0, masked=True, reason="judge down"), False)
    b = collate([s], pad_token_id=0)
    assert b.loss_mask.sum() == 0 and b.token_rewards.sum() == 0


def test_select_trims_padding():
    short = Trajectory(Task("s", "p", "1"), (1, 2), (0, 1), (0.0, -1.0), 1, (), StopReason.MAX_TOKENS)
    b = collate([_traj(), short], pad_token_id=0)
    assert b.select(torch.tensor([1])).input_ids.shape == (1, 2)


def test_components_collate_puts_the_batch_where_the_model_is():
    # the meta device stands in for a GPU: a batch left on the CPU here is what broke BC's first step on CUDA
    from agentgrad.models.hf import LoadedModel
    from agentgrad.pipelines.components import Components

    model = torch.nn.Linear(2, 2, device="meta")
    fields = dict.fromkeys(("config", "suite", "codec", "policy", "learner", "reward_fn", "limits", "sampler"))
    c = Components(loaded=LoadedModel(model, None, (2,), 0), **fields)
    batch = c.collate([ScoredTrajectory(_traj(), RewardBreakdown(1.0, (0.1, 0.2)), True)], group_index=[0])
    tensors = [batch.input_ids, batch.attention_mask, batch.loss_mask, batch.old_logprobs, batch.token_rewards,
               batch.group_index]
    assert c.device.type == "meta" and all(t.device.type == "meta" for t in tensors)
    assert batch.input_ids.shape == (1, 10)
