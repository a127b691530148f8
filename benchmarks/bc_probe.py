"""BC's learning curve, cheaply: teacher-forced token accuracy of the call turn and the answer turn on
validation demos, plus greedy validation success, every `--every` steps.

    python benchmarks/bc_probe.py --steps 600 --every 25 -- run.seed=1 bc.lr=1e-3

The answer turn's accuracy is the copy signal: the policy must copy the tool's result, and the plateau this
probe was written for is a policy that estimates the answer from the expression instead.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from agentgrad.batch import collate
from agentgrad.config import build_config
from agentgrad.pipelines.bc import bc_step, expert_demos, validation_success
from agentgrad.pipelines.components import build_components


def turn_accuracy(c, demos) -> tuple[float, float]:
    """Teacher-forced argmax accuracy of (first turn's tokens, last turn's tokens), all demos at once."""
    batch = collate(demos, pad_token_id=c.pad_token_id)
    model = c.loaded.model
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # (B, T, V)
    pred = logits[:, :-1].argmax(-1)  # (B, T-1) predicts token t+1
    hit = pred == batch.input_ids[:, 1:]  # (B, T-1)
    first, last = [], []
    for b, d in enumerate(demos):
        turns = [t for t in d.turns if t.end > t.start]
        for turn, out in ((turns[0], first), (turns[-1], last)):
            out.append(hit[b, turn.start - 1:turn.end - 1].float().mean().item())
    return sum(first) / len(first), sum(last) / len(last)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--val-demos", type=int, default=128)
    ap.add_argument("--success-every", type=int, default=1, help="greedy success every N probes (0: never)")
    ap.add_argument("--out", default=None, help="JSONL of the curve")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    config = build_config(overrides=["run.progress=false", "bc.stop_at_success=null", *args.overrides])
    with tempfile.TemporaryDirectory() as tmp:
        c = build_components(config, Path(tmp))
        demos = expert_demos(c, config.bc.num_demos, seed=config.run.seed + 1)
        val = expert_demos(c, args.val_demos, seed=config.run.seed + 99991)
        rng = random.Random(config.run.seed)
        out = open(args.out, "w") if args.out else None
        t0 = time.perf_counter()
        for step in range(args.steps):
            m = bc_step(c, demos, rng, step)
            if (step + 1) % args.every == 0:
                call_acc, answer_acc = turn_accuracy(c, val)
                probe = (step + 1) // args.every
                succ = (validation_success(c) if args.success_every and probe % args.success_every == 0
                        else float("nan"))
                row = {"step": step + 1, "loss": round(m["loss/bc"], 4), "call_acc": round(call_acc, 3),
                       "answer_acc": round(answer_acc, 3), "val_success": succ,
                       "wall_s": round(time.perf_counter() - t0, 1)}
                print(json.dumps(row), flush=True)
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()


if __name__ == "__main__":
    sys.exit(main())
