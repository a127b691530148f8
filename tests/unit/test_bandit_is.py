"""Off-policy correction on a bandit: IS-weighted policy gradients from behaviour-policy samples match the
on-policy gradient in expectation; uncorrected ones are biased.

Pure torch, through the real code path: `importance_weights` (algos/off_policy.py) feeds `ppo_clip_loss`
(algos/losses.py) as the pipeline does for replayed samples, with `old_logprobs` = the current policy's own
(detached) logprobs, so the ratio is 1, nothing clips, and the loss gradient is -mean_i w_i r_i grad log pi(a_i).
"""

import torch

from agentgrad.algos.losses import ppo_clip_loss
from agentgrad.algos.off_policy import importance_weights

K = 5
REWARDS = torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0])  # (K,)
THETA = torch.tensor([0.5, -0.2, 0.1, -0.8, 0.3])  # pi's logits
BEHAVIOUR = torch.tensor([-0.5, 0.8, 0.0, 0.6, -0.4])  # mu's logits: puts mass where pi does not


def exact_gradient(theta: torch.Tensor, reward_of) -> torch.Tensor:
    """grad_theta E_{a ~ pi}[r(a)] = sum_a pi(a) r(a) grad log pi(a), with grad log pi(a) = e_a - pi (softmax)."""
    theta = theta.clone().requires_grad_(True)
    value = reward_of(torch.softmax(theta, -1))
    (grad,) = torch.autograd.grad(value, theta)
    return grad


def surrogate_gradient(actions: torch.Tensor, rewards: torch.Tensor, behaviour_logits: torch.Tensor,
                       *, level: str, correct: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient of the loss on N samples of T tokens each (actions (N, T), rewards (N,)), and the per-sample
    gradient contributions (N, K) for the Monte-Carlo standard error."""
    theta = THETA.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)[actions]  # (N, T)
    mu = torch.log_softmax(behaviour_logits, -1)[actions]  # (N, T)
    mask = torch.ones_like(logp)  # (N, T)
    adv = rewards[:, None].expand_as(logp)  # (N, T)
    w = importance_weights(logp, mu, mask, level=level, mode="truncate", bound=1e4).weights if correct else None
    loss = ppo_clip_loss(logp, logp.detach(), adv, mask, agg="seq-mean-token-mean", is_weights=w).loss
    (grad,) = torch.autograd.grad(-loss * actions.shape[1], theta)  # undo the mean over each sample's T tokens
    with torch.no_grad():
        pi = torch.softmax(THETA, -1)  # (K,)
        score = (torch.nn.functional.one_hot(actions, K).float() - pi).sum(1)  # (N, K): sum_t grad log pi(a_t)
        # one weight per sample: T == 1, or sequence level (every token carries the sequence's weight)
        weight = w[:, 0] if correct else torch.ones(len(actions))  # (N,)
        per_sample = weight[:, None] * rewards[:, None] * score  # (N, K)
    return grad, per_sample


def test_is_corrected_gradient_is_unbiased_and_uncorrected_is_biased():
    torch.manual_seed(0)
    N = 40_000
    actions = torch.multinomial(torch.softmax(BEHAVIOUR, -1), N, replacement=True)[:, None]  # (N, 1) from mu
    truth = exact_gradient(THETA, lambda pi: (pi * REWARDS).sum())  # (K,)

    corrected, per = surrogate_gradient(actions, REWARDS[actions[:, 0]], BEHAVIOUR, level="token", correct=True)
    se = per.std(0) / N**0.5  # (K,) Monte-Carlo standard error of each component
    assert torch.allclose(corrected, per.mean(0), atol=1e-4)  # the loss path computes the estimator we think
    assert ((corrected - truth).abs() < 4 * se).all(), (corrected, truth, se)

    naive, per_naive = surrogate_gradient(actions, REWARDS[actions[:, 0]], BEHAVIOUR, level="token", correct=False)
    se_naive = per_naive.std(0) / N**0.5
    assert ((naive - truth).abs() / se_naive).max() > 10, (naive, truth)


def test_sequence_level_weights_are_unbiased_for_sequence_rewards():
    """Two tokens, reward on the pair: r = R[a1] * R[a2] / 2. The sequence weight w = w1 * w2 is unbiased."""
    torch.manual_seed(1)
    N = 40_000
    actions = torch.multinomial(torch.softmax(BEHAVIOUR, -1), 2 * N, replacement=True).view(N, 2)  # (N, 2)
    rewards = REWARDS[actions[:, 0]] * REWARDS[actions[:, 1]] / 2  # (N,)
    truth = exact_gradient(THETA, lambda pi: ((pi * REWARDS).sum() ** 2) / 2)
    grad, per = surrogate_gradient(actions, rewards, BEHAVIOUR, level="sequence", correct=True)
    se = per.std(0) / N**0.5
    assert ((grad - truth).abs() < 4 * se).all(), (grad, truth, se)
    naive, per_naive = surrogate_gradient(actions, rewards, BEHAVIOUR, level="sequence", correct=False)
    assert ((naive - truth).abs() / (per_naive.std(0) / N**0.5)).max() > 10
