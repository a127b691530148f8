"""RL step time (rollout + update): agentgrad's GRPO step against TRL's `GRPOTrainer`, same everything we can.

Same: the default tiny model (after a short BC warm-up, so it calls the calculator), its tokenizer and chat
template; the arithmetic tasks, system prompt and calculator tool (TRL gets it through `environment_factory`, a
class whose method is the tool, so the rendered prompts are byte-identical); 16 tasks x 8 samples per step;
temperature 0.7, no top-k/top-p; clipped token-level loss (clip 0.2 / 0.28), group-normalised rewards, no KL;
4 passes over each batch in minibatches of 64 episodes (TRL: num_iterations=4, steps_per_generation=2,
per_device_train_batch_size=64); AdamW at lr 1e-4, grad clip 1.0; CPU; one torch thread (--threads).
Reward on both sides: closeness of the answer's number to the truth (signal at 0% success, so both really
update). Differs (TRL's design, not settings): TRL bounds a whole completion with max_completion_length (set to 96,
about two of our 48-token turns) instead of per turn; TRL's tool loop stops at max_tool_calling_iterations=3.
One "RL step" of TRL is one generation plus its 8 optimizer steps: `trainer.train()` time / steps.

    nice -n 19 python benchmarks/rl_step_vs_trl.py [--steps 1] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bc_model_dir, bench_config, median, set_threads, table

TASKS_PER_STEP, GROUP, EPOCHS, MINIBATCH, LR, TEMPERATURE = 16, 8, 4, 64, 1e-4, 0.7


def closeness(answer: str | None, truth: str) -> float:
    """A reward with signal even at 0% success (the short-BC model rarely answers right), so that both sides
    really run their 8 optimizer steps: agentgrad skips updates when every group is zero-signal."""
    from agentgrad.envs.tasks.arithmetic import extract_number

    got = extract_number(answer)
    if got is None:
        return 0.0
    return 1.0 / (1.0 + abs(float(got) - float(truth)) / max(1.0, abs(float(truth))))


def closeness_reward(trajectory):
    from agentgrad.types import RewardBreakdown

    return RewardBreakdown(outcome=closeness(trajectory.final_answer, trajectory.task.answer))


def agentgrad_config(model_dir: Path):
    return bench_config([f"model.path={model_dir}", f"algo.tasks_per_step={TASKS_PER_STEP}",
                         f"algo.group_size={GROUP}", f"algo.epochs_per_step={EPOCHS}",
                         f"algo.minibatch_size_episodes={MINIBATCH}", f"algo.lr={LR}",
                         f"rollout.temperature={TEMPERATURE}", "reward.name=rl_step_vs_trl:closeness_reward",
                         # all 8 updates on all groups, as TRL makes them (the default run stops at a KL bound
                         # and resamples zero-signal groups)
                         "algo.target_kl=null", "algo.zero_signal=keep"])


def agentgrad_steps(model_dir: Path, steps: int) -> tuple[list[float], list[float]]:
    """(step seconds, rollout seconds) of `steps` GRPO steps after one warm-up step."""
    from agentgrad.pipelines.components import build_components
    from agentgrad.pipelines.rl import rl_step, start_rl

    with tempfile.TemporaryDirectory() as tmp:
        c = build_components(agentgrad_config(model_dir), Path(tmp))
        c.learner.set_lr(LR)
        state = start_rl(c)
        times, rollouts = [], []
        for step in range(steps + 1):
            m = rl_step(c, step, state, None)
            if m["train/updates"] != EPOCHS * (TASKS_PER_STEP * GROUP // MINIBATCH):
                raise RuntimeError(f"agentgrad made {m['train/updates']} updates (a no-signal step?)")
            if step:
                times.append(m["perf/step_s"])
                rollouts.append(m["perf/rollout_s"])
    return times, rollouts


def shared_vs_plain_updates(model_dir: Path, steps: int) -> dict[str, list[float]]:
    """Update seconds (step minus rollout; and CPU seconds of `policy_update`, less sensitive to other jobs) of
    the same GRPO steps run twice from the same weights: with the learner's shared-prefix forward and with the
    plain padded forward (the learner's `lean` unset)."""
    import copy

    from agentgrad.pipelines import rl
    from agentgrad.pipelines.components import build_components
    from agentgrad.pipelines.rl import rl_step, start_rl

    out: dict[str, list[float]] = {"shared prefix": [], "plain": [], "shared prefix cpu": [], "plain cpu": []}
    update, cpu = rl.policy_update, []

    def timed_update(*args, **kwargs):
        t0 = time.process_time()
        metrics = update(*args, **kwargs)
        cpu.append(time.process_time() - t0)
        return metrics

    rl.policy_update = timed_update
    with tempfile.TemporaryDirectory() as tmp:
        c = build_components(agentgrad_config(model_dir), Path(tmp))
        c.learner.set_lr(LR)
        state, lean = start_rl(c), c.learner.lean
        for step in range(steps + 1):
            before = copy.deepcopy(c.learner.state_dict())
            for name in (("shared prefix", "plain") if step % 2 else ("plain", "shared prefix")):
                c.learner.load_state_dict(before)
                c.learner.lean = lean if name == "shared prefix" else None
                m = rl_step(c, step, state, None)
                if m["train/updates"] != EPOCHS * (TASKS_PER_STEP * GROUP // MINIBATCH):
                    raise RuntimeError(f"agentgrad made {m['train/updates']} updates (a no-signal step?)")
                if step:
                    out[name].append(m["perf/step_s"] - m["perf/rollout_s"])
                    out[f"{name} cpu"].append(cpu[-1])
    rl.policy_update = update
    return out


def trl_steps(model_dir: Path, steps: int, threads: int) -> list[float]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_schema, qwen3_template

    from agentgrad.envs import SUITES
    from agentgrad.envs.tasks.arithmetic import SYSTEM_PROMPT
    from agentgrad.tools.calculator import calculator

    suite = SUITES.get("arithmetic")()
    tasks = suite.sample_tasks(TASKS_PER_STEP * steps, split="train", seed=1_000_003)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # Our template writes tool calls in Qwen2.5's exact format; tell TRL's parser so (it only recognises the
    # chat templates of known checkpoints by string equality).
    if hasattr(tokenizer, "response_template"):
        tokenizer.response_template = qwen3_template
    else:
        tokenizer.response_schema = qwen3_schema
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    class CalculatorEnv:
        def reset(self, **kwargs) -> None:
            return None

        def calculator(self, expression: str) -> str:
            """Evaluate an arithmetic expression.

            Args:
                expression: arithmetic using + - * / and parentheses, e.g. "12 * (3 + 4)"
            """
            return calculator(expression=expression).text

    def close(completions, task_index, **kwargs) -> list[float]:
        out = []
        for messages, i in zip(completions, task_index):
            final = next((m.get("content") for m in reversed(messages) if m.get("role") == "assistant"), None)
            out.append(closeness(final, tasks[i].answer))
        return out

    data = Dataset.from_dict({
        "prompt": [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": t.prompt}]
                   for t in tasks],
        "task_index": list(range(len(tasks))),
    })
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(output_dir=tmp, use_cpu=True, bf16=False, num_generations=GROUP,
                          per_device_train_batch_size=MINIBATCH,
                          steps_per_generation=TASKS_PER_STEP * GROUP // MINIBATCH,
                          num_iterations=EPOCHS, max_steps=steps * EPOCHS * (TASKS_PER_STEP * GROUP // MINIBATCH),
                          learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
                          temperature=TEMPERATURE, top_k=0, top_p=1.0, beta=0.0, loss_type="dapo", epsilon=0.2,
                          epsilon_high=0.28, scale_rewards="group", max_completion_length=96,
                          max_tool_calling_iterations=3, logging_steps=10_000, save_strategy="no", report_to="none",
                          disable_tqdm=True, shuffle_dataset=False, seed=0, dataloader_num_workers=0)
        trainer = GRPOTrainer(model=model, reward_funcs=close, args=args, train_dataset=data,
                              processing_class=tokenizer, environment_factory=CalculatorEnv)
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        trainer.train()
        total = time.perf_counter() - t0
    per_step = EPOCHS * (TASKS_PER_STEP * GROUP // MINIBATCH)
    if trainer.state.global_step != steps * per_step:
        raise RuntimeError(f"TRL made {trainer.state.global_step} optimizer steps, expected {steps * per_step}")
    # TRL compiles nothing, so its first step needs no warm-up (and each step costs minutes here).
    return [total / steps] * steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1, help="timed RL steps per side (agentgrad: after a warm-up "
                    "step, before and after TRL's)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bc-steps", type=int, default=150)
    ap.add_argument("--shared-vs-plain", action="store_true", help="no TRL: agentgrad's update with and without "
                    "the shared-prefix forward, on the same steps from the same weights, alternating")
    args = ap.parse_args()
    import os
    import warnings

    from agentgrad.pipelines.components import quiet_hf

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    warnings.filterwarnings("ignore")
    quiet_hf()
    set_threads(args.threads)
    model_dir = bc_model_dir(args.bc_steps)
    if args.shared_vs_plain:
        times = shared_vs_plain_updates(model_dir, args.steps)
        rows = []
        for kind in ("wall", "cpu"):
            suffix = " cpu" if kind == "cpu" else ""
            shared, plain = median(times["shared prefix" + suffix]), median(times["plain" + suffix])
            rows.append((kind, f"{shared:.2f}", f"{plain:.2f}", f"{plain / shared:.2f}x"))
        print(f"\nGRPO update seconds per step, median over {args.steps} steps, threads={args.threads}")
        print(table(rows, ("seconds", "shared prefix", "plain forward", "speed-up")))
        return
    ours_a, roll_a = agentgrad_steps(model_dir, args.steps)
    theirs = trl_steps(model_dir, args.steps, args.threads)
    set_threads(args.threads)
    ours_b, roll_b = agentgrad_steps(model_dir, args.steps)  # before and after TRL: load drift hits both
    ours, rollouts = ours_a + ours_b, roll_a + roll_b
    a, t = median(ours), median(theirs)
    print(f"\nGRPO step ({TASKS_PER_STEP} tasks x {GROUP} samples, {EPOCHS} epochs, minibatch {MINIBATCH}), "
          f"threads={args.threads}, median over {len(ours)} / {len(theirs)} steps")
    print(table([(f"{a:.2f}", f"{median(rollouts):.2f}", f"{t:.2f}", f"{t / a:.2f}x")],
                ("agentgrad s/step", "of which rollout s", "TRL GRPOTrainer s/step", "speed-up (target >= 3x)")))


if __name__ == "__main__":
    main()
