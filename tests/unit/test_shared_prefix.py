"""The learner's shared-prefix forward (`backends.shared_prefix`) against the plain padded forward."""

import pytest
import torch

from agentgrad.backends.hf import TorchLearner
from agentgrad.backends.scoring import token_logprobs
from agentgrad.backends.shared_prefix import plan_shared_prefixes
from agentgrad.batch import collate
from agentgrad.types import StopReason, Task, TokenMask, Trajectory

VOCAB = 48


def _model(kind: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    common = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=True))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2,
                                                                     n_head=4, n_positions=128, resid_pdrop=0.0,
                                                                     embd_pdrop=0.0, attn_pdrop=0.0))
    with torch.no_grad():  # sharper than the default init, so that logprobs differ visibly between positions
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    return model.float()


def _traj(ids: list[int], prompt: int, masks: tuple[TokenMask, ...] = ()) -> Trajectory:
    n = len(ids)
    return Trajectory(task=Task("t", "p", "a"), token_ids=tuple(ids), loss_mask=(0,) * prompt + (1,) * (n - prompt),
                      logprobs=(0.0,) * n, prompt_length=prompt, turns=(), stop_reason=StopReason.MAX_TOKENS,
                      token_masks=masks)


def _grouped_batch(with_masks: bool = False):
    """16 rows in five groups: prompts of 4-12 tokens, continuations of 1-14 tokens (group 1's rows also agree
    on their first two generated tokens), one group of one row."""
    g = torch.Generator().manual_seed(1)

    def rand(n):
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()

    trajs, groups = [], []
    for gi, (prompt_len, conts) in enumerate([(9, [3, 14, 1, 7]), (5, [6, 2, 11]), (12, [4]), (7, [2, 9, 5, 13, 1]),
                                                  (4, [8, 3, 6])]):
        prompt = rand(prompt_len)
        common = rand(2) if gi == 1 else []
        for n in conts:
            ids = prompt + common + rand(n)
            masks = ()
            if with_masks:  # one allow-list and one deny-list position per row
                masks = (TokenMask(prompt_len, (ids[prompt_len], 5, 7), True),
                         TokenMask(len(ids) - 1, (3, 4), False))
            trajs.append(_traj(ids, prompt_len, masks))
            groups.append(gi)
    return collate(trajs, pad_token_id=0, group_index=groups)


def test_plan_shares_the_longest_common_prefix_of_each_group_and_leaves_ungrouped_batches_alone():
    batch = _grouped_batch()
    plan = plan_shared_prefixes(batch)
    # Each group's longest common prefix, counted directly; at least group 1's 5 prompt + 2 agreeing generated
    # tokens, and for group 2 (one row of 16 tokens) all but its last token.
    lengths = batch.attention_mask.sum(1)
    rows = [batch.input_ids[b, : int(lengths[b])].tolist() for b in range(batch.num_sequences)]
    expected = []
    for gi in range(5):
        members = [r for r, gr in zip(rows, batch.group_index.tolist()) if gr == gi]
        common = 0
        while all(common < len(r) and r[common] == members[0][common] for r in members):
            common += 1
        expected.append(min(common, min(len(r) for r in members) - 1))
    assert plan.prefix_len.tolist() == expected
    assert expected[1] >= 7 and expected[2] == 15
    assert plan.source.tolist() == batch.group_index.tolist()
    one_per_group = collate([_traj([1, 2, 3, 4], 2)] * 3, pad_token_id=0)  # identical rows, but no groups (BC)
    assert plan_shared_prefixes(one_per_group) is None


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("temperature,with_masks", [(1.0, False), (0.7, False), (0.7, True)])
def test_shared_prefix_logprobs_and_gradients_equal_the_plain_forward(kind, temperature, with_masks):
    model = _model(kind)
    batch = _grouped_batch(with_masks)
    learner = TorchLearner(model, lr=0.0, max_buckets=2)
    plan = plan_shared_prefixes(batch)
    assert learner.lean is not None and plan is not None
    assert len(learner.continuation_buckets(plan)) == 2  # continuations in 2 runs
    real = batch.attention_mask.bool()

    shared = learner.logprobs(batch, temperature=temperature)  # (B, T)
    (shared * batch.loss_mask).sum().backward()
    shared_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    plain = token_logprobs(model, batch.input_ids, batch.attention_mask, temperature, batch.logit_masks)
    (plain * batch.loss_mask).sum().backward()

    assert torch.allclose(shared[real], plain[real], atol=1e-5, rtol=0)
    assert (shared[~real] == 0).all()
    for p, g in zip(model.parameters(), shared_grads):
        assert torch.allclose(g, p.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_masks", [False, True])
def test_the_hidden_states_a_factored_head_reads_equal_the_plain_forwards(with_masks):
    """`logprobs_and_hidden` (BC of a factored head, and RL batches with head decisions) takes the shared-prefix
    forward when the batch has groups: its logprobs, hidden states and the gradients through them are the plain
    forward's."""
    from agentgrad.backends.scoring import token_logprobs_and_hidden

    model = _model("qwen2")
    batch = _grouped_batch(with_masks)
    learner = TorchLearner(model, lr=0.0, max_buckets=2, head_detached=False)
    assert learner.lean is not None
    real = batch.attention_mask.bool()
    weights = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(2))

    def loss(lp, hidden):  # something of both, so the gradients check the states' backward too
        return (lp * batch.loss_mask).sum() + (hidden[real] @ weights).square().mean()

    lp, hidden = learner.logprobs_and_hidden(batch, temperature=0.7)  # (B, T), (B, T, H)
    loss(lp, hidden).backward()
    shared_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    plain_lp, plain_hidden = token_logprobs_and_hidden(model, batch.input_ids, batch.attention_mask, 0.7,
                                                       batch.logit_masks)
    loss(plain_lp, plain_hidden).backward()
    assert plan_shared_prefixes(batch) is not None
    assert torch.allclose(lp[real], plain_lp[real], atol=1e-5, rtol=0) and (lp[~real] == 0).all()
    assert torch.allclose(hidden[real], plain_hidden[real], atol=1e-5, rtol=0)
    for p, g in zip(model.parameters(), shared_grads):
        assert torch.allclose(g, p.grad, atol=1e-5, rtol=1e-5)


def test_rows_with_different_prompts_in_one_group_and_other_architectures_still_score_exactly():
    # Group 0's rows share nothing (an empty prefix: each row runs whole), group 2 shares two tokens.
    trajs = [_traj([5, 6, 7, 8, 9], 2), _traj([9, 8, 7], 1), _traj([4, 4, 4, 4], 1), _traj([3, 3, 1, 2], 2),
             _traj([3, 3, 5], 2)]
    apart = collate(trajs, pad_token_id=0, group_index=[0, 0, 1, 2, 2])
    assert plan_shared_prefixes(apart).prefix_len.tolist() == [0, 3, 2]
    for kind in ("qwen2", "gpt2"):
        model = _model(kind)
        learner = TorchLearner(model, lr=0.0)
        assert (learner.lean is None) == (kind == "gpt2")
        for batch in (apart, _grouped_batch()):
            with torch.no_grad():
                got = learner.logprobs(batch)
                want = token_logprobs(model, batch.input_ids, batch.attention_mask)
            real = batch.attention_mask.bool()
            assert torch.allclose(got[real], want[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("critic_model", ["head", "separate"])
def test_policy_and_critic_updates_compose_with_the_shared_prefix_forward(critic_model):
    """PPO's step order: the policy's loss through the shared-prefix forward, then the critic's value loss
    through its own plain forward (on the policy's detached trunk, or a copy of it); both update."""
    from agentgrad.models.value import build_critic

    model = _model("qwen2")
    learner = TorchLearner(model, lr=1e-2)
    critic = build_critic(model, critic_model, lr=1e-2)
    batch = _grouped_batch()
    policy_before = [p.detach().clone() for p in model.parameters()]
    head_before = critic.model.head.weight.detach().clone()
    learner.step(-(learner.logprobs(batch) * batch.loss_mask).sum())
    values = critic.values(batch.input_ids, batch.attention_mask, batch.loss_mask)  # (B, T)
    metrics = critic.step(((values - 1.0) ** 2 * batch.loss_mask).sum())
    assert all(torch.isfinite(p).all() for p in model.parameters()) and metrics["train/critic_grad_norm"] > 0
    assert any(not torch.equal(a, p) for a, p in zip(policy_before, model.parameters()))
    assert not torch.equal(head_before, critic.model.head.weight)


def test_the_packed_forward_runs_only_real_positions_and_matches_the_padded_one():
    from agentgrad.backends.shared_prefix import LeanForward, _causal_mask

    forward = LeanForward(_model("qwen2"))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (3, 6), generator=g)  # (N, q)
    lengths = torch.tensor([6, 2, 4])
    real = torch.arange(6)[None] < lengths[:, None]  # (N, q)
    positions = torch.arange(6).expand(3, 6)
    allowed = _causal_mask(torch.zeros(3, dtype=torch.long), 6, 0)
    with torch.no_grad():
        packed, kv = forward(ids, positions, lengths, allowed, forward.weights())  # (R, H)
        padded, _ = forward(ids, positions, torch.full((3,), 6), allowed, forward.weights())  # (N*q, H)
        other_padding = ids.masked_fill(~real, 7)
        repacked, _ = forward(other_padding, positions, lengths, allowed, forward.weights())
        packed, padded, repacked = map(forward.logits, (packed, padded, repacked))  # (R | N*q, V)
    assert packed.shape == (12, VOCAB) and kv[0][0].shape == (3, 2, 6, 8)
    assert torch.allclose(packed, padded.view(3, 6, VOCAB)[real], atol=1e-5, rtol=0)
    assert torch.equal(packed, repacked)  # what sits in the padding never reaches a real position


def test_a_long_continuation_runs_alone_rather_than_padding_its_group_mates_to_its_length():
    # one group of 8 rows: 7 continuations of 2 tokens and one of 40. The continuation runs pad only the
    # attention (every per-token op runs on real tokens), so the long row runs alone: 7 x 2 + 40 slots plus one
    # more run's cost, against 8 x 40 in one run (the plain forward's 8-row minimum would force that)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(1, VOCAB, (6,), generator=g).tolist()
    trajs = [_traj(prompt + torch.randint(1, VOCAB, (n,), generator=g).tolist(), 6) for n in [2] * 7 + [40]]
    batch = collate(trajs, pad_token_id=0, group_index=[0] * 8)
    learner = TorchLearner(_model("qwen2"), lr=0.0)
    plan = plan_shared_prefixes(batch)
    assert sorted(len(rows) for rows in learner.continuation_buckets(plan)) == [1, 7]
    plain = token_logprobs(learner.model, batch.input_ids, batch.attention_mask)
    real = batch.attention_mask.bool()
    assert torch.allclose(learner.logprobs(batch)[real], plain[real], atol=1e-5, rtol=0)
