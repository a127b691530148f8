"""Why does BC beside the factored head damage the LM? BC arms with identical LM targets, compared on the LM.

Every arm clones the same expert demos (api-catalog), from the same base model, with the same minibatches, and
trains the LM on exactly the tokens arm's targets (the names too), so the LM's loss is the same function in
every arm; they differ only in what else is trained:
- tokens:    plain BC, no head (the constrained-decoding arm);
- attached:  + bc.head_loss_coef x the head's NLL, its gradient flowing into the LM's hidden states (as shipped
             before the fix);
- detached:  + the head's NLL on detached hidden states (a linear probe: no gradient into the LM).
Reported per arm every --every steps: the LM's token NLL on held-out demos (the arm's own targets), the head's
tool accuracy on them, and at the end greedy held-out success with the LM writing the names itself.

    PYTHONPATH=src nice -n 19 python benchmarks/action_space_diagnosis.py --steps 600 --arms tokens,attached,detached
    PYTHONPATH=src python benchmarks/action_space_diagnosis.py --grad-scale --arms ""   (the gradient scale only)
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import tempfile
import time
from pathlib import Path

import torch

from agentgrad.algos.losses import sft_loss
from agentgrad.backends.base import SamplingParams
from agentgrad.batch import collate, collate_head
from agentgrad.config import build_config
from agentgrad.pipelines.bc import bc_lr, expert_demos
from agentgrad.pipelines.components import build_components, build_tiny_model_dir, make_suite
from agentgrad.rollout.loop import run_episodes

MODEL = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.num_heads=4", "model.tiny.num_kv_heads=2",
         "model.tiny.intermediate_size=192", "model.tiny.tokenizer_corpus_episodes=200"]


def components(args, model_dir, run_dir, head: str):
    config = build_config(overrides=[
        "env=api-catalog", *MODEL, f"model.path={model_dir}", f"rollout.action_head={head}",
        f"bc.steps={args.steps}", f"bc.lr={args.lr}", "run.threads=1", "run.progress=false", f"run.seed={args.seed}",
        *([f"bc.head_grad={args.head_grad}"] if head == "factored" and args.head_grad else [])])
    return build_components(config, run_dir)


@torch.no_grad()
def measure(c, held, plain_masks) -> tuple[float, float]:
    batch = collate(held, pad_token_id=c.pad_token_id)
    mask = torch.zeros_like(batch.loss_mask)
    for i, m in enumerate(plain_masks):
        mask[i, :len(m)] = torch.tensor(m)
    if c.tool_head is None:
        lp = c.learner.logprobs(batch)
        return float(sft_loss(lp, mask)), float("nan")
    d = collate_head(held, c.tool_head.tool_names)
    lp, hidden = c.learner.logprobs_and_hidden(batch)
    acc = (c.tool_head(hidden, d.row, d.position, d.legal).argmax(-1) == d.tool).float().mean()
    return float(sft_loss(lp, mask)), float(acc)


def gradient_scale(args, model_dir: Path, run_dir: Path) -> None:
    """At the start of BC, on one minibatch: the norm of the gradient the LM's weights get from the token loss
    and from the head's loss (attached), over all of them and for the embeddings and the final norm."""
    c = components(args, model_dir, run_dir, "factored")
    picked = expert_demos(c, args.batch, seed=args.seed + 1)
    batch = collate(picked, pad_token_id=c.pad_token_id)
    d = collate_head(picked, c.tool_head.tool_names)
    c.learner.head_detached = False
    names, params = zip(*c.loaded.model.named_parameters())
    lp, hidden = c.learner.logprobs_and_hidden(batch)
    token = torch.autograd.grad(sft_loss(lp, batch.loss_mask), params, retain_graph=True, allow_unused=True)
    head = torch.autograd.grad(c.tool_head.bc_loss(hidden, d.row, d.position, d.legal, d.tool), params,
                               allow_unused=True)

    def final(name: str) -> bool:
        return name.endswith("model.norm.weight")

    def norm(grads, keep=lambda n: True):
        return float(sum((g.float() ** 2).sum() for n, g in zip(names, grads) if g is not None and keep(n)) ** 0.5)

    print(f"gradient scale at the start ({int(batch.loss_mask.sum())} LM tokens in the loss, {len(d.row)} head "
          f"decisions): |grad| of the LM's weights from the token loss {norm(token):.3f}, from the head's loss "
          f"{norm(head):.3f}; embeddings {norm(token, lambda n: 'embed' in n):.3f} vs "
          f"{norm(head, lambda n: 'embed' in n):.3f}; final norm {norm(token, final):.3f} vs {norm(head, final):.3f}",
          flush=True)


def arm(mode: str, args, model_dir: Path, run_dir: Path) -> dict:
    c = components(args, model_dir, run_dir, "tokens" if mode == "tokens" else "factored")
    demos = expert_demos(c, args.demos + 64, seed=args.seed + 1)
    plain = demos if mode == "tokens" else expert_demos(
        dataclasses.replace(c, sampler=dataclasses.replace(c.sampler, action_head="tokens")), args.demos + 64,
        seed=args.seed + 1)
    assert all(d.token_ids == p.token_ids for d, p in zip(demos, plain))  # same tokens in both encodings
    demos = [dataclasses.replace(d, loss_mask=p.loss_mask) for d, p in zip(demos, plain)]
    train, held = demos[:args.demos], demos[args.demos:]
    held_masks = [p.loss_mask for p in plain[args.demos:]]
    rng = random.Random(args.seed)
    t0, rows = time.perf_counter(), []
    for step in range(args.steps):
        c.learner.set_lr(bc_lr(step, peak=args.lr, warmup=c.config.bc.warmup_steps, total=args.steps,
                               schedule=c.config.bc.lr_schedule))
        picked = rng.sample(train, args.batch)
        batch = collate(picked, pad_token_id=c.pad_token_id)
        if c.tool_head is None:
            c.learner.step(sft_loss(c.learner.logprobs(batch), batch.loss_mask))
        else:
            from agentgrad.pipelines.bc import bc_losses_with_head
            token_loss, head_loss = bc_losses_with_head(c, picked, batch)
            c.learner.step(token_loss + args.head_loss_coef * head_loss)
        if (step + 1) % args.every == 0:
            nll, acc = measure(c, held, held_masks)
            rows.append((step + 1, nll, acc))
            print(f"{mode} step {step + 1}: held-out LM NLL {nll:.4f}, head tool accuracy {acc:.3f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
    tasks = c.suite.sample_tasks(args.eval_tasks, split="heldout", seed=args.seed)
    success = {}
    for head in ["tokens"] + ([] if mode == "tokens" else ["factored"]):
        trajs = run_episodes(c.policy, c.codec, [c.suite.make_env() for _ in tasks], tasks, limits=c.limits,
                             sampler=dataclasses.replace(c.sampler, action_head=head),
                             sampling=SamplingParams(temperature=0.0, seed=args.seed), seeds=[args.seed] * len(tasks))
        success[head] = sum(c.suite.verify(t.task, t.final_answer) for t in trajs) / len(trajs)
    print(f"{mode}: greedy held-out success, names by the LM {success['tokens']:.1%}"
          + (f", by the head {success['factored']:.1%}" if "factored" in success else ""), flush=True)
    return {"mode": mode, "rows": rows, "success": success}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--demos", type=int, default=1000)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--head-loss-coef", type=float, default=1.0)
    p.add_argument("--head-grad", default="", help="bc.head_grad of the factored arms (attached | detached)")
    p.add_argument("--eval-tasks", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", default="tokens,attached,detached")
    p.add_argument("--grad-scale", action="store_true", help="first print the two losses' gradient norms")
    p.add_argument("--model-dir", default="", help="reuse a base model dir (built here if empty)")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model_dir) if args.model_dir else None
        if model_dir is None or not model_dir.exists():
            base = build_config(overrides=["env=api-catalog", *MODEL, f"run.seed={args.seed}"])
            model_dir = build_tiny_model_dir(base, make_suite(base), model_dir or Path(tmp) / "base")
        if args.grad_scale:
            gradient_scale(args, model_dir, Path(tmp) / "grad")
        for mode in filter(None, args.arms.split(",")):
            args.head_grad = {"attached": "attached", "detached": "detached"}.get(mode, "")
            arm(mode, args, model_dir, Path(tmp) / mode)


if __name__ == "__main__":
    main()
