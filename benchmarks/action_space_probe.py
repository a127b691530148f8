"""What can a factored head read at the call position? Probes on a BC'd LM's frozen final hidden states.

From a BC checkpoint of api-catalog (any `agentgrad train env=api-catalog` run's checkpoints/bc or final), the
expert demos' call decisions are encoded once; each probe is then fitted on the decisions of the first
`--train-demos` demos and scored (right tool, NLL) on the rest's:
- call-state linear: one linear layer on the call position's state (the head's layout before 2026-12-06);
- call-state MLP:    a 256-wide hidden layer on the same state;
- context head:      `models.factored_head.FactoredToolHead`, which also attends over the context's states;
and, for reference, the LM itself writing the name greedily under the tool-name mask (as constrained decoding
does at temperature 0), on the same held-out decisions. "Right category": the category of the tool named is the
expert's (what `rollout.action_head=category` asks of the head).

    PYTHONPATH=src nice -n 19 python benchmarks/action_space_probe.py --model-path RUN/checkpoints/bc [--seed 0]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from action_space_diagnosis import MODEL
from torch import nn

from agentgrad.backends.scoring import token_logprobs_and_hidden
from agentgrad.batch import collate, collate_head
from agentgrad.config import build_config
from agentgrad.models.factored_head import FactoredToolHead
from agentgrad.pipelines.components import build_components
from agentgrad.pipelines.demos import expert_demos


class CallState(nn.Module):
    """A probe of the call position's state alone (linear, or with one hidden layer)."""

    def __init__(self, hidden_size: int, num_tools: int, width: int = 0) -> None:
        super().__init__()
        self.net = (nn.Sequential(nn.Linear(hidden_size, width), nn.GELU(), nn.Linear(width, num_tools)) if width
                    else nn.Linear(hidden_size, num_tools))

    def forward(self, states, row, position, legal):
        return self.net(states[row, position]).masked_fill(~legal, float("-inf")).log_softmax(-1)  # (D, N)


def encode(c, demos, chunk: int = 50):
    """The demos' final hidden states and decisions, chunk by chunk: [(states (b, T, H), HeadBatch)]."""
    out = []
    with torch.no_grad():
        for i in range(0, len(demos), chunk):
            part = demos[i:i + chunk]
            batch = collate(part, pad_token_id=c.pad_token_id)
            _, states = token_logprobs_and_hidden(c.loaded.model.eval(), batch.input_ids, batch.attention_mask)
            out.append((states, collate_head(part, c.tool_head.tool_names)))
    return out


@torch.no_grad()
def lm_names(c, demos) -> tuple[float, float]:
    """Right tool when the LM writes the name: greedy over the tokens that continue a legal name (or, once a
    legal name is complete, the token the demo closes it with), one token at a time."""
    model = c.loaded.model.eval()
    right = right_category = total = 0
    category = c.tool_head.category_of
    for demo in demos:
        for d in demo.head_decisions:
            names = {n: c.codec.encode(n) for n in d.legal}
            close = demo.token_ids[d.end]
            ids, written = list(demo.token_ids[:d.position + 1]), []
            while True:
                options = {v[len(written)] for v in names.values() if v[:len(written)] == written and
                           len(v) > len(written)} | ({close} if written in names.values() else set())
                logits = model(input_ids=torch.tensor([ids + written])).logits[0, -1]  # (V,)
                pick = max(options, key=lambda i: float(logits[i]))
                if pick == close and written in names.values():
                    break
                written.append(pick)
            named = next(n for n, v in names.items() if v == written)
            right += named == d.choice
            right_category += category[named] == category[d.choice]
            total += 1
    return right / total, right_category / total


def fit(probe: nn.Module, train, test, epochs: int, lr: float, seed: int, tool_category: torch.Tensor
        ) -> dict[str, float]:
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(probe.parameters(), lr=lr, weight_decay=1e-2)
    for _ in range(epochs):
        for k in torch.randperm(len(train)).tolist():
            states, d = train[k]
            loss = -probe(states, d.row, d.position, d.legal).gather(-1, d.choice[:, None]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        logp = [(probe(s, d.row, d.position, d.legal), d.choice) for s, d in test]
    right = sum(int((lp.argmax(-1) == t).sum()) for lp, t in logp)
    right_category = sum(int((tool_category[lp.argmax(-1)] == tool_category[t]).sum()) for lp, t in logp)
    n = sum(len(t) for _, t in logp)
    nll = -sum(float(lp.gather(-1, t[:, None]).sum()) for lp, t in logp) / n
    return {"right_tool": right / n, "right_category": right_category / n, "nll": nll, "decisions": n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="a BC checkpoint of api-catalog (tiny model of MODEL)")
    p.add_argument("--train-demos", type=int, default=1000)
    p.add_argument("--test-demos", type=int, default=400)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        config = build_config(overrides=["env=api-catalog", *MODEL, f"model.path={args.model_path}",
                                         "rollout.action_head=factored", "run.threads=1", "run.progress=false",
                                         f"run.seed={args.seed}"])
        c = build_components(config, Path(tmp))
        demos = expert_demos(c, args.train_demos + args.test_demos, seed=args.seed + 1)
    chunks = encode(c, demos)
    cut = args.train_demos // 50
    train, test = chunks[:cut], chunks[cut:]
    H, tools = c.loaded.model.config.hidden_size, c.tool_head.tool_names
    probes = {"call-state linear": CallState(H, len(tools)), "call-state MLP": CallState(H, len(tools), 256),
              "context head": FactoredToolHead(H, [(n, c.tool_head.categories[int(k)])
                                                   for n, k in zip(tools, c.tool_head.tool_category)])}
    print(f"api-catalog, {args.model_path}, seed {args.seed}: {len(tools)} tools, probes fitted on the decisions of "
          f"{args.train_demos} demos ({args.epochs} epochs), scored on {args.test_demos} others'")
    print("| probe | right tool | right category | NLL | decisions | fit s |\n|---|---|---|---|---|---|")
    for name, probe in probes.items():
        t0 = time.perf_counter()
        r = fit(probe, train, test, args.epochs, args.lr, args.seed, c.tool_head.tool_category)
        print(f"| {name} | {r['right_tool']:.1%} | {r['right_category']:.1%} | {r['nll']:.3f} | {r['decisions']} | "
              f"{time.perf_counter() - t0:.0f} |", flush=True)
    t0 = time.perf_counter()
    tool, category = lm_names(c, demos[args.train_demos:])
    print(f"| the LM writes the name (greedy, name mask) | {tool:.1%} | {category:.1%} | - | - | "
          f"{time.perf_counter() - t0:.0f} |")


if __name__ == "__main__":
    main()
