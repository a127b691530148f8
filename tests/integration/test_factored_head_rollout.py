"""The factored (category -> tool) head wired into the real loop: the real tiny model, api-catalog, the engine."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch

from agentgrad.backends.base import SamplingParams
from agentgrad.backends.hf import HFPolicy, TorchLearner
from agentgrad.batch import collate
from agentgrad.data.store import from_json, to_json
from agentgrad.envs.tasks.api_catalog import ApiCatalogSuite, catalog
from agentgrad.models.factored_head import FactoredToolHead
from agentgrad.rollout.factored import NameWriter
from agentgrad.rollout.loop import EpisodeLimits, SamplerSettings, expert_trajectory, run_episodes
from agentgrad.rollout.parser import OPEN

PUBLIC = frozenset(s.name for s in catalog() if not s.auth)
LIMITS = EpisodeLimits(max_turns=1, max_new_tokens_per_turn=40, max_total_tokens=400)
FACTORED = SamplerSettings(action_head="factored")
CATEGORY = SamplerSettings(action_head="category")


def _force_open(open_id):
    def force(row, generated, logits):
        if not generated:  # an untrained model rarely opens a call by itself
            return torch.full_like(logits, float("-inf")).index_fill(0, torch.tensor([open_id]), 0.0)
        return logits
    return force


def _setup(loaded_tiny, codec):
    torch.manual_seed(0)
    head = FactoredToolHead(loaded_tiny.model.config.hidden_size, [(s.name, s.category) for s in catalog()])
    policy = HFPolicy(loaded_tiny.model, eos_token_ids=loaded_tiny.eos_token_ids, pad_token_id=loaded_tiny.pad_token_id,
                      tool_head=head)
    suite = ApiCatalogSuite(kinds=["auth_single"], schemas="none")
    open_id = loaded_tiny.tokenizer.convert_tokens_to_ids(OPEN)
    return head, policy, suite, _force_open(open_id)


def test_head_picks_only_legal_tools_and_its_logprob_is_recomputable(loaded_tiny, codec):
    """Acceptance: api-catalog before login (only public APIs legal), real rollouts through the continuous
    engine. Every name the head chose is legal and written in with loss_mask 0 and logprob 0; the recorded
    logprob equals log p(category) + log p(tool | category) recomputed afterwards from the model's hidden states
    up to the decision position; decisions round-trip through the store's JSON."""
    head, policy, suite, force = _setup(loaded_tiny, codec)
    tasks = suite.sample_tasks(12, split="train", seed=0)
    trajs = run_episodes(policy, codec, [suite.make_env() for _ in tasks], tasks, limits=LIMITS, sampler=FACTORED,
                         sampling=SamplingParams(temperature=1.0, seed=0), logits_processor=force)
    decisions = [(t, d) for t in trajs for d in t.head_decisions]
    assert len(decisions) >= len(trajs)
    assert {d.choice for _, d in decisions} <= PUBLIC
    assert len({d.choice for _, d in decisions}) > 6  # the untrained head is near uniform over the legal tools
    for t, d in decisions:
        assert set(d.legal) == PUBLIC
        assert list(t.token_ids[d.position + 1:d.end]) == codec.encode(d.choice)
        assert set(t.loss_mask[d.position + 1:d.end]) == {0} and set(t.logprobs[d.position + 1:d.end]) == {0.0}
        assert t.loss_mask[d.position] == 1  # the header's last token was sampled by the LM
        assert codec.decode(t.token_ids[:d.end]).endswith('{"name": "' + d.choice)
        assert t.turns[0].text.find(f'"{d.choice}"') > 0  # the LM closed the name the head chose, as it was

    body = loaded_tiny.model.model
    with torch.no_grad():
        for t, d in decisions:
            states = body(input_ids=torch.tensor([t.token_ids[:d.position + 1]])).last_hidden_state  # (1, L, H)
            f = head.features(states, torch.tensor([0]), torch.tensor([d.position]))[0]  # (W,)
            legal = head.legal_mask([frozenset(d.legal)])  # (1, N)
            cat_logits, tool_logits = head.category_head(f), head.tool_head(f)
            k = head.tool_names.index(d.choice)
            c = int(head.tool_category[k])
            legal_cats = sorted({int(head.tool_category[i]) for i in legal[0].nonzero().squeeze(-1).tolist()})
            log_p_cat = torch.log_softmax(cat_logits[legal_cats], -1)[legal_cats.index(c)]
            in_cat = [i for i in range(len(head.tool_names)) if legal[0, i] and int(head.tool_category[i]) == c]
            log_p_tool = torch.log_softmax(tool_logits[in_cat], -1)[in_cat.index(k)]
            assert abs((log_p_cat + log_p_tool).item() - d.logprob) < 1e-4
    assert all(from_json(to_json(t)) == t for t in trajs)

    # RL: the learner scores each decision as one more action (at the name's first token) with the head
    batch = collate(trajs, pad_token_id=loaded_tiny.pad_token_id, head_choices=head.choices)
    learner = TorchLearner(copy.deepcopy(loaded_tiny.model), lr=1e-2, tool_head=head)  # the fixture stays as is
    lp = learner.logprobs(batch, temperature=1.0)  # (B, T)
    at = (batch.head.row, batch.head.score_position)
    assert batch.loss_mask[at].eq(1).all()
    torch.testing.assert_close(lp[at], batch.old_logprobs[at], atol=1e-4, rtol=0)
    torch.testing.assert_close(batch.old_logprobs[at], torch.tensor([d.logprob for _, d in decisions]))
    forced = torch.zeros_like(batch.loss_mask)
    forced[torch.arange(len(trajs)), [t.prompt_length for t in trajs]] = 1  # the forced <tool_call> token
    assert ((lp - batch.old_logprobs) * batch.loss_mask * (1 - forced)).abs().max() < 1e-4  # exact ratios
    before = head.tool_head.weight.detach().clone()
    learner.step(-(lp * batch.loss_mask).sum())  # a policy-gradient step reaches the head
    assert not torch.equal(before, head.tool_head.weight)


def test_greedy_head_takes_the_argmax_and_seeded_rollouts_repeat(loaded_tiny, codec):
    head, policy, suite, force = _setup(loaded_tiny, codec)
    tasks = suite.sample_tasks(4, split="train", seed=1)

    def run(temperature):
        return run_episodes(policy, codec, [suite.make_env() for _ in tasks], tasks, limits=LIMITS, sampler=FACTORED,
                            sampling=SamplingParams(temperature=temperature, seed=3), logits_processor=force)

    a, b = run(1.0), run(1.0)
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    assert [t.head_decisions for t in a] == [t.head_decisions for t in b]
    with torch.no_grad():
        for t in run(0.0):
            for d in t.head_decisions:
                states = loaded_tiny.model.model(input_ids=torch.tensor([t.token_ids[:d.position + 1]])
                                                 ).last_hidden_state  # (1, L, H)
                logp = head(states, torch.tensor([0]), torch.tensor([d.position]), head.legal_mask([PUBLIC]))[0]
                assert head.tool_names[int(logp.argmax())] == d.choice


def test_expert_demos_mark_names_as_head_decisions(loaded_tiny, codec):
    """BC data for the head: each expert call's name is a decision (the login-gated call after the login sees
    the full catalog as legal) and its tokens leave the LM's loss."""
    suite = ApiCatalogSuite(kinds=["auth_single"], schemas="none")
    task = suite.sample_tasks(1, split="train", seed=0)[0]
    limits = EpisodeLimits(max_turns=5, max_new_tokens_per_turn=60, max_total_tokens=1000)
    plain = expert_trajectory(suite.make_env(), task, suite.expert_actions(task), codec, limits)
    head = FactoredToolHead(loaded_tiny.model.config.hidden_size, [(s.name, s.category) for s in catalog()])
    demo = expert_trajectory(suite.make_env(), task, suite.expert_actions(task), codec, limits,
                             writer=NameWriter(head, codec))
    calls = [a.name for a in suite.expert_actions(task) if hasattr(a, "name")]
    assert [d.choice for d in demo.head_decisions] == calls
    assert demo.token_ids == plain.token_ids and not plain.head_decisions
    named = sum(d.end - d.position - 1 for d in demo.head_decisions)
    assert sum(plain.loss_mask) - sum(demo.loss_mask) == named > 0
    assert set(demo.head_decisions[0].legal) == PUBLIC and len(demo.head_decisions[-1].legal) == len(catalog())


def test_bc_trains_the_head_and_checkpoints_carry_it(tmp_path):
    """`agentgrad train env=api-catalog rollout.action_head=factored`: BC moves the head's weights (its loss is
    beside the LM's), the checkpoint holds them (tool_head.pt), and a run built from it loads them."""
    from agentgrad.config import build_config
    from agentgrad.pipelines.components import build_components
    from agentgrad.pipelines.train import train

    config = build_config(overrides=[
        "env=api-catalog", "rollout.action_head=factored", "model.tiny.hidden_size=32", "model.tiny.num_layers=1",
        "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "model.tiny.intermediate_size=64",
        "model.tiny.tokenizer_corpus_episodes=50", "bc.steps=3", "bc.batch_size_episodes=4", "bc.num_demos=8",
        "bc.stop_at_success=null", "algo.steps=1", "algo.tasks_per_step=2", "algo.group_size=2",
        "algo.epochs_per_step=1", "eval.num_tasks=2", "run.progress=false", "run.threads=1",
        "run.checkpoint_every=1", f"run.output_dir={tmp_path}", "run.name=run"])
    summary = train(config)
    run_dir = tmp_path / "run"
    rows = [__import__("json").loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("loss/bc_head" in r for r in rows if r["stage"] == "bc")
    fresh = build_components(config, tmp_path / "fresh")
    saved = build_components(config, tmp_path / "x", model_path=run_dir / "checkpoints" / "bc")
    assert (run_dir / "checkpoints" / "final" / "tool_head.pt").exists()
    assert saved.tool_head is not None and saved.policy.tool_head is saved.tool_head
    assert not torch.equal(saved.tool_head.tool_head.weight, fresh.tool_head.tool_head.weight)
    assert summary["bc_steps"] == 3
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "LATEST").read_text().strip()
    assert (latest / "tool_head.pt").exists()
    resumed = build_components(config, tmp_path / "y", model_path=latest)  # what --resume builds
    final = build_components(config, tmp_path / "z", model_path=run_dir / "checkpoints" / "final")
    assert torch.equal(resumed.tool_head.tool_head.weight, final.tool_head.tool_head.weight)

    # a tool_head.pt of the layout before the context read-out: `agentgrad eval` says so in one error line
    import subprocess
    import sys

    from test_cli_bad_inputs import assert_one_error_line

    blob = torch.load(run_dir / "checkpoints" / "final" / "tool_head.pt", weights_only=True)
    del blob["layout"]
    torch.save(blob, run_dir / "checkpoints" / "final" / "tool_head.pt")
    out = subprocess.run([sys.executable, "-m", "agentgrad.cli", "eval", str(run_dir), "--num-tasks", "2"],
                         capture_output=True, text=True, timeout=600)
    assert_one_error_line(out, "another layout", "train the head again")


def test_a_category_head_writes_its_categorys_shared_start_and_the_lm_names_the_tool(loaded_tiny, codec):
    """rollout.action_head=category, real rollouts through the engine before login: each decision picks a legal
    category and writes in the tokens its legal tools' names share (loss_mask 0); the LM writes the rest of the
    name, sampled under the mask narrowed to that category; the recorded logprob is log p(category) recomputed
    from the model's hidden states, and the learner scores it the same; expert demos mark the same spans."""
    torch.manual_seed(0)
    head = FactoredToolHead(loaded_tiny.model.config.hidden_size, [(s.name, s.category) for s in catalog()],
                            decides="category")
    policy = HFPolicy(loaded_tiny.model, eos_token_ids=loaded_tiny.eos_token_ids, pad_token_id=loaded_tiny.pad_token_id,
                      tool_head=head)
    suite = ApiCatalogSuite(kinds=["auth_single"], schemas="none")
    force = _force_open(loaded_tiny.tokenizer.convert_tokens_to_ids(OPEN))
    tasks = suite.sample_tasks(12, split="train", seed=0)
    trajs = run_episodes(policy, codec, [suite.make_env() for _ in tasks], tasks, limits=LIMITS, sampler=CATEGORY,
                         sampling=SamplingParams(temperature=1.0, seed=0), logits_processor=force)
    writer = NameWriter(head, codec)
    public = head.legal_choices(PUBLIC)
    decisions = [(t, d) for t in trajs for d in t.head_decisions]
    assert len(decisions) >= len(trajs) and len({d.choice for _, d in decisions}) > 3
    named = 0
    for t, d in decisions:
        assert set(d.legal) == public and d.choice in public
        names = sorted(n for n in PUBLIC if head.category_of[n] == d.choice)
        written = list(t.token_ids[d.position + 1:d.end])
        assert written == writer.common_ids(names) and written == codec.encode(names[0])[:len(written)]
        assert set(t.loss_mask[d.position + 1:d.end]) == {0} and t.loss_mask[d.end] == 1  # the LM goes on
        closed = re.match(r'([^"]*)"', codec.decode(t.token_ids[d.position + 1:]))
        if closed:
            assert closed.group(1) in names  # the LM completed a legal name of the chosen category
            named += 1
    assert named >= len(decisions) // 2

    body = loaded_tiny.model.model
    with torch.no_grad():
        for t, d in decisions:
            states = body(input_ids=torch.tensor([t.token_ids[:d.position + 1]])).last_hidden_state  # (1, L, H)
            logits = head.category_head(head.features(states, torch.tensor([0]), torch.tensor([d.position]))[0])
            legal = [head.categories.index(c) for c in d.legal]
            expected = torch.log_softmax(logits[legal], -1)[legal.index(head.categories.index(d.choice))]
            assert abs(expected.item() - d.logprob) < 1e-4
    assert all(from_json(to_json(t)) == t for t in trajs)
    batch = collate(trajs, pad_token_id=loaded_tiny.pad_token_id, head_choices=head.choices)
    learner = TorchLearner(copy.deepcopy(loaded_tiny.model), lr=1e-2, tool_head=head)
    lp = learner.logprobs(batch, temperature=1.0)  # (B, T)
    at = (batch.head.row, batch.head.score_position)
    torch.testing.assert_close(lp[at], batch.old_logprobs[at], atol=1e-4, rtol=0)
    forced = torch.zeros_like(batch.loss_mask)
    forced[torch.arange(len(trajs)), [t.prompt_length for t in trajs]] = 1  # the forced <tool_call> token
    assert ((lp - batch.old_logprobs) * batch.loss_mask * (1 - forced)).abs().max() < 1e-4  # exact ratios

    task = ApiCatalogSuite(kinds=["auth_single"], schemas="none").sample_tasks(1, split="train", seed=0)[0]
    limits = EpisodeLimits(max_turns=5, max_new_tokens_per_turn=60, max_total_tokens=1000)
    plain = expert_trajectory(suite.make_env(), task, suite.expert_actions(task), codec, limits)
    demo = expert_trajectory(suite.make_env(), task, suite.expert_actions(task), codec, limits, writer=writer)
    calls = [a.name for a in suite.expert_actions(task) if hasattr(a, "name")]
    assert [d.choice for d in demo.head_decisions] == [head.category_of[n] for n in calls]
    assert demo.token_ids == plain.token_ids
    assert sum(plain.loss_mask) - sum(demo.loss_mask) == sum(d.end - d.position - 1 for d in demo.head_decisions)


def test_a_category_head_needs_names_that_share_a_start_per_category():
    head = FactoredToolHead(8, [("lookup", "x"), ("fetch", "x")], decides="category")

    class Codec:
        def encode(self, text):
            return [ord(ch) + 1000 for ch in text]  # whole words as one token each: nothing shared

    with pytest.raises(ValueError, match="share no whole token.*rollout.action_head=factored"):
        NameWriter(head, Codec())
    assert NameWriter(FactoredToolHead(8, [("lookup", "x"), ("fetch", "x")]), Codec())  # deciding tools: fine


def test_a_category_run_trains_its_head_and_another_mode_refuses_its_checkpoint(tmp_path):
    """`agentgrad train env=api-catalog rollout.action_head=category`: BC moves the category head, its checkpoint
    says what it decides, and a factored run built from that checkpoint fails with a clear error."""
    from agentgrad.config import build_config
    from agentgrad.models.hf import ModelLoadError
    from agentgrad.pipelines.components import build_components
    from agentgrad.pipelines.train import train

    small = ["env=api-catalog", "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
             "model.tiny.num_kv_heads=1", "model.tiny.intermediate_size=64", "model.tiny.tokenizer_corpus_episodes=50",
             "run.progress=false", "run.threads=1"]
    config = build_config(overrides=[
        *small, "rollout.action_head=category", "bc.steps=3", "bc.batch_size_episodes=4", "bc.num_demos=8",
        "bc.stop_at_success=null", "algo.steps=1", "algo.tasks_per_step=2", "algo.group_size=2",
        "algo.epochs_per_step=1", "eval.num_tasks=2", f"run.output_dir={tmp_path}", "run.name=run"])
    train(config)
    run_dir = tmp_path / "run"
    rows = [__import__("json").loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("loss/bc_head" in r for r in rows if r["stage"] == "bc")
    fresh = build_components(config, tmp_path / "fresh")
    final = build_components(config, tmp_path / "x", model_path=run_dir / "checkpoints" / "final")
    assert final.tool_head.decides == "category" and final.tool_head.tool_head is None
    assert not torch.equal(final.tool_head.category_head.weight, fresh.tool_head.category_head.weight)
    factored = build_config(overrides=[*small, "rollout.action_head=factored"])
    with pytest.raises(ModelLoadError, match="decides a category.*needs one that decides a tool"):
        build_components(factored, tmp_path / "y", model_path=run_dir / "checkpoints" / "final")


def _bc_beside_head(loaded_tiny, codec, *, head_loss: bool, detached: bool, steps: int = 6):
    """BC of a copy of the tiny model on api-catalog demos with the LM's targets of the tokens arm (names
    included), beside a factored head; returns (LM weights, the head's NLL before and after)."""
    from agentgrad.algos.losses import sft_loss
    from agentgrad.batch import collate_head

    suite = ApiCatalogSuite(kinds=["single", "auth_single"], schemas="none")
    limits = EpisodeLimits(max_turns=5, max_new_tokens_per_turn=60, max_total_tokens=1000)
    demos = []
    torch.manual_seed(0)
    model = copy.deepcopy(loaded_tiny.model)
    head = FactoredToolHead(model.config.hidden_size, [(s.name, s.category) for s in catalog()])
    for task in suite.sample_tasks(8, split="train", seed=0):
        plain = expert_trajectory(suite.make_env(), task, suite.expert_actions(task), codec, limits)
        demo = expert_trajectory(suite.make_env(), task, suite.expert_actions(task), codec, limits,
                                 writer=NameWriter(head, codec))
        demos.append(dataclasses.replace(demo, loss_mask=plain.loss_mask))  # the LM still learns the names
    learner = TorchLearner(model, lr=1e-2, tool_head=head, head_detached=detached)
    batch = collate(demos, pad_token_id=loaded_tiny.pad_token_id)
    decisions = collate_head(demos, head.choices)
    nll = []
    for _ in range(steps):
        logprobs, hidden = learner.logprobs_and_hidden(batch)
        head_nll = head.bc_loss(hidden, decisions.row, decisions.position, decisions.legal, decisions.choice)
        nll.append(head_nll.item())
        learner.step(sft_loss(logprobs, batch.loss_mask) + (head_nll if head_loss else 0.0))
    return [p.detach().clone() for p in model.parameters()], nll[0], nll[-1]


def test_a_detached_head_learns_without_changing_the_lms_bc(loaded_tiny, codec):
    """The cause of the LM damage (docs/action-space.md): the head's NLL, attached, sent the LM a gradient
    2.7x its own token loss's. Detached (bc.head_grad=detached, the default) and clipped on its own, adding the
    head's loss leaves the LM's BC exactly as without it, while the head learns; attached, the LM's weights
    move elsewhere (the path kept for comparison)."""
    without, *_ = _bc_beside_head(loaded_tiny, codec, head_loss=False, detached=True)
    detached, first, last = _bc_beside_head(loaded_tiny, codec, head_loss=True, detached=True)
    attached, *_ = _bc_beside_head(loaded_tiny, codec, head_loss=True, detached=False)
    assert all(torch.equal(a, b) for a, b in zip(without, detached))
    assert max(float((a - b).abs().max()) for a, b in zip(without, attached)) > 1e-3
    assert last < first - 0.5  # the head's NLL of the expert's tool falls (from ~log 150 = 5.0 at the start)


def test_the_kl_term_scores_head_decisions_with_a_frozen_reference_head(loaded_tiny, codec):
    """With algo.kl_coef > 0, RL freezes the head beside the reference model as the stage starts; each decision's
    reference logprob is that head's log p(category) + log p(tool | category) on the reference's hidden state.
    At the start it equals the behaviour logprob the rollout recorded; after the policy's head moves, the
    reference's stays while the learner's changes (before: the behaviour logprob stood in for the reference)."""
    from types import SimpleNamespace

    from agentgrad.config import build_config
    from agentgrad.pipelines.rl import add_reference, start_rl

    head, policy, suite, force = _setup(loaded_tiny, codec)
    tasks = suite.sample_tasks(6, split="train", seed=2)
    trajs = run_episodes(policy, codec, [suite.make_env() for _ in tasks], tasks, limits=LIMITS, sampler=FACTORED,
                         sampling=SamplingParams(temperature=1.0, seed=0), logits_processor=force)
    model = copy.deepcopy(loaded_tiny.model)
    head = copy.deepcopy(head)
    c = SimpleNamespace(config=build_config(overrides=["algo.kl_coef=0.1", "rollout.action_head=factored",
                                                     "rollout.temperature=1.0"]),
                        tool_head=head, loaded=SimpleNamespace(model=model),
                        frozen_reference=lambda: copy.deepcopy(model).eval().requires_grad_(False))
    state = start_rl(c)
    assert state.reference_head is not None and state.reference_head is not head
    batch = collate(trajs, pad_token_id=loaded_tiny.pad_token_id, head_choices=head.choices)
    at = (batch.head.row, batch.head.score_position)
    ref = add_reference(c, state, batch).ref_logprobs  # (B, T)
    torch.testing.assert_close(ref[at], batch.old_logprobs[at], atol=1e-4, rtol=0)
    learner = TorchLearner(model, lr=5e-2, tool_head=head)
    for _ in range(3):  # raise the sampled decisions' logprobs: the policy's head moves away from the reference
        learner.step(-learner.logprobs(batch)[at].sum())  # (scored at the rollout temperature, 1)
    moved = learner.logprobs(batch)[at].detach()
    after = add_reference(c, state, batch).ref_logprobs[at]
    torch.testing.assert_close(after, ref[at], atol=1e-4, rtol=0)
    assert (moved - after).abs().min() > 0.1  # the KL term now sees the head's drift at every decision
    assert state.state_dict()["reference_head"] is not None
