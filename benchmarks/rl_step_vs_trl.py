"""RL step time (rollout + update): agentgrad's GRPO step against TRL's `GRPOTrainer`, interleaved in one process.

Same: the default tiny model (after a short BC warm-up, so it calls the calculator), its tokenizer and chat
template; the arithmetic tasks, system prompt and calculator tool (TRL gets it through `environment_factory`, a
class whose method is the tool, so the rendered prompts are byte-identical); 16 tasks x 8 samples per step;
temperature 0.7, no top-k/top-p; clipped token-level loss (clip 0.2 / 0.28), group-normalised rewards, no KL;
4 passes over each batch in minibatches of 64 episodes (TRL: num_iterations=4, steps_per_generation=2,
per_device_train_batch_size=64); AdamW at lr 1e-4, grad clip 1.0; CPU; one torch thread (--threads).
TRL as its users would run it on CPU: gradient checkpointing off (its default is on).
Reward on both sides: closeness of the answer's number to the truth (signal at 0% success, so both really
update). Differs (TRL's design, not settings): TRL bounds a whole completion with max_completion_length (set to 96,
about two of our 48-token turns) instead of per turn; TRL's tool loop stops at max_tool_calling_iterations=3;
TRL runs one extra forward per batch for the old logprobs and every row's whole sequence, where agentgrad takes
the rollout's logprobs and runs each group's common prefix once (the table of what each side computes says how
much). Fair timing: each TRL RL step (one generation and its 8 optimizer steps) is followed by one agentgrad
step, in one process; the first step of each side is a warm-up and not counted; wall and CPU time
(`time.process_time`), medians with their range over the pairs. `--bf16`: both sides under bf16 autocast over
fp32 weights (TRL `bf16=True`, agentgrad `model.compute_dtype=bf16`), for CPUs with avx512_bf16 or AMX.

    nice -n 19 python benchmarks/rl_step_vs_trl.py [--steps 5] [--threads 1] [--bf16]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bc_model_dir, bench_config, median, set_threads, spread, table

TASKS_PER_STEP, GROUP, EPOCHS, MINIBATCH, LR, TEMPERATURE = 16, 8, 4, 64, 1e-4, 0.7
UPDATES_PER_STEP = EPOCHS * (TASKS_PER_STEP * GROUP // MINIBATCH)  # 8 optimizer steps per RL step


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


def agentgrad_config(model_dir: Path, bf16: bool = False):
    return bench_config([f"model.compute_dtype={'bf16' if bf16 else 'fp32'}", f"model.path={model_dir}",
                         f"algo.tasks_per_step={TASKS_PER_STEP}",
                         f"algo.group_size={GROUP}", f"algo.epochs_per_step={EPOCHS}",
                         f"algo.minibatch_size_episodes={MINIBATCH}", f"algo.lr={LR}",
                         f"rollout.temperature={TEMPERATURE}", "reward.name=rl_step_vs_trl:closeness_reward",
                         # all 8 updates on all groups, as TRL makes them (the default run stops at a KL bound
                         # and resamples zero-signal groups)
                         "algo.target_kl=null", "algo.zero_signal=keep"])


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
                    raise RuntimeError(f"agentgrad made {m['train/updates']} updates (a no-signal step?): {m}")
                if step:
                    out[name].append(m["perf/step_s"] - m["perf/rollout_s"])
                    out[f"{name} cpu"].append(cpu[-1])
    rl.policy_update = update
    return out


def trl_trainer(model_dir: Path, steps: int, out_dir: str, callbacks: list, bf16: bool = False):
    """TRL's GRPOTrainer set up as its users would on CPU for this model (gradient checkpointing off: TRL turns
    it on by default, and nobody needs it for 0.84M parameters)."""
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
    # the field's name changed across TRL / transformers releases
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    no_checkpointing = {next(k for k in ("activation_checkpointing", "gradient_checkpointing") if k in fields): False}
    args = GRPOConfig(output_dir=out_dir, use_cpu=True, bf16=bf16, num_generations=GROUP,
                      per_device_train_batch_size=MINIBATCH, **no_checkpointing,
                      steps_per_generation=UPDATES_PER_STEP // EPOCHS,
                      num_iterations=EPOCHS, max_steps=steps * UPDATES_PER_STEP,
                      learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
                      temperature=TEMPERATURE, top_k=0, top_p=1.0, beta=0.0, loss_type="dapo", epsilon=0.2,
                      epsilon_high=0.28, scale_rewards="group", max_completion_length=96,
                      max_tool_calling_iterations=3, logging_steps=10_000, save_strategy="no", report_to="none",
                      disable_tqdm=True, shuffle_dataset=False, seed=0, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=close, args=args, train_dataset=data,
                          processing_class=tokenizer, environment_factory=CalculatorEnv, callbacks=callbacks)
    if getattr(trainer.model, "is_gradient_checkpointing", False):
        raise RuntimeError("TRL's model still has gradient checkpointing on")
    return trainer


class ForwardCounter:
    """Counts a model's forward calls and tokens by kind: with gradients (the update), without gradients and
    without a KV cache (scoring, e.g. TRL's old-logprob pass), and generation (calls with a cache)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.counts = {k: [0, 0, 0] for k in ("update", "scoring", "generation")}  # calls, real tokens, run tokens
        model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        mask = kwargs.get("attention_mask")
        kind = ("update" if torch.is_grad_enabled() else
                "generation" if kwargs.get("past_key_values") is not None or kwargs.get("use_cache") else "scoring")
        c = self.counts[kind]
        c[0] += 1
        c[2] += ids.numel()
        c[1] += int(mask.sum()) if mask is not None and mask.dim() == 2 else ids.numel()


class PlanCounter:
    """agentgrad's learner: tokens of the minibatches it scores (real) and the tokens its forward runs (each
    group's shared prefix once, then each row's continuation: backends/shared_prefix.py)."""

    def __init__(self) -> None:
        from agentgrad.backends import hf

        self.calls, self.real, self.run = 0, 0, 0
        plan_fn = hf.plan_shared_prefixes

        def counted(batch):
            plan = plan_fn(batch)
            lengths = batch.attention_mask.sum(1)
            self.calls += 1
            self.real += int(lengths.sum())
            self.run += int(lengths.sum()) if plan is None else int(
                plan.prefix_len.sum() + (lengths - plan.prefix_len[plan.source]).sum())
            return plan

        hf.plan_shared_prefixes = counted


def interleaved(model_dir: Path, pairs: int, threads: int, bf16: bool = False) -> dict:
    """`pairs` + 1 RL steps of each side in one process, alternating: each TRL step (one generation and its 8
    optimizer steps, cut at the callback after its 8th) then one agentgrad step. The first step of each side is
    the warm-up, excluded. Wall and CPU (process) seconds per step."""
    from transformers import TrainerCallback

    from agentgrad.pipelines.components import build_components
    from agentgrad.pipelines.rl import rl_step, start_rl

    out = {k: [] for k in ("trl wall", "trl cpu", "ag wall", "ag cpu", "ag rollout")}
    with tempfile.TemporaryDirectory() as tmp:
        c = build_components(agentgrad_config(model_dir, bf16), Path(tmp) / "ag")
        c.learner.set_lr(LR)
        state = start_rl(c)
        plans = PlanCounter()
        mark = [time.perf_counter(), time.process_time()]

        class Alternate(TrainerCallback):
            def on_train_begin(self, args, st, control, **kw):
                mark[:] = [time.perf_counter(), time.process_time()]

            def on_step_end(self, args, st, control, **kw):
                if st.global_step % UPDATES_PER_STEP:
                    return
                step = st.global_step // UPDATES_PER_STEP - 1
                wall, cpu = time.perf_counter() - mark[0], time.process_time() - mark[1]
                if step == 0:  # TRL's warm-up step: its counts start after it
                    counter.counts = {k: [0, 0, 0] for k in counter.counts}
                if step:
                    out["trl wall"].append(wall)
                    out["trl cpu"].append(cpu)
                set_threads(threads)
                c0 = time.process_time()
                m = rl_step(c, step, state, None)
                if m["train/updates"] != UPDATES_PER_STEP:
                    raise RuntimeError(f"agentgrad made {m['train/updates']} updates (a no-signal step?): {m}")
                if step == 0:  # agentgrad's warm-up step: its counts start after it
                    plans.calls = plans.real = plans.run = 0
                if step:
                    out["ag wall"].append(m["perf/step_s"])
                    out["ag cpu"].append(time.process_time() - c0)
                    out["ag rollout"].append(m["perf/rollout_s"])
                set_threads(threads)
                mark[:] = [time.perf_counter(), time.process_time()]

        trainer = trl_trainer(model_dir, pairs + 1, str(Path(tmp) / "trl"), [Alternate()], bf16)
        counter = ForwardCounter(trainer.model)
        set_threads(threads)
        trainer.train()
        if trainer.state.global_step != (pairs + 1) * UPDATES_PER_STEP:
            raise RuntimeError(f"TRL made {trainer.state.global_step} optimizer steps")
    out["trl counts"] = {k: [x / pairs for x in v] for k, v in counter.counts.items()}
    out["ag counts"] = [plans.calls / pairs, plans.real / pairs, plans.run / pairs]
    return out


def print_interleaved(res: dict, pairs: int, threads: int, bf16: bool = False) -> None:
    def cell(xs: list[float]) -> str:
        return spread(xs, "{:.2f}")

    ratio_wall = [t / a for t, a in zip(res["trl wall"], res["ag wall"])]
    ratio_cpu = [t / a for t, a in zip(res["trl cpu"], res["ag cpu"])]
    print(f"\nGRPO step ({TASKS_PER_STEP} tasks x {GROUP} samples, {EPOCHS} epochs, minibatch {MINIBATCH}), "
          f"threads={threads}, {'bf16 autocast' if bf16 else 'fp32'}, "
          f"{pairs} interleaved pairs after one warm-up step each; median (min-max)")
    print(table([("wall s/step", cell(res["ag wall"]), cell(res["trl wall"]), cell(ratio_wall)),
                 ("CPU s/step", cell(res["ag cpu"]), cell(res["trl cpu"]), cell(ratio_cpu)),
                 ("of which rollout, wall s", cell(res["ag rollout"]), "", "")],
                ("", "agentgrad", "TRL GRPOTrainer", "TRL / agentgrad (target >= 3x in CPU time)")))
    tc, ag = res["trl counts"], res["ag counts"]
    print("\nWhat each side computes per RL step (mean over the timed steps):")
    print(table([("optimizer updates", f"{UPDATES_PER_STEP}", f"{UPDATES_PER_STEP}"),
                 ("forwards with gradients (update)", f"{ag[0]:.1f}", f"{tc['update'][0]:.1f}"),
                 ("their tokens: real / run", f"{ag[1]:.0f} / {ag[2]:.0f} (group prefix once)",
                  f"{tc['update'][1]:.0f} / {tc['update'][2]:.0f} (padded)"),
                 ("forwards without gradients (old logprobs)", "0 (rollout logprobs)",
                  f"{tc['scoring'][0]:.0f}: {tc['scoring'][1]:.0f} / {tc['scoring'][2]:.0f} tokens"),
                 ("generation", "KV kept across turns, continuous batching",
                  f"{tc['generation'][0]:.0f} cached forward calls (HF generate per tool round)")],
                ("", "agentgrad", "TRL")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5, help="timed RL steps per side, interleaved (each after "
                    "one warm-up step)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bc-steps", type=int, default=60, help="BC steps of the starting model: at 60 it calls the "
                    "calculator and answers close to right (closeness reward ~0.67, 2%% exact); from ~80 it solves "
                    "nearly all and groups carry no signal")
    ap.add_argument("--bf16", action="store_true", help="both sides under bf16 autocast (fp32 weights)")
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
    pairs = args.steps
    print_interleaved(interleaved(model_dir, pairs, args.threads, args.bf16), pairs, args.threads, args.bf16)


if __name__ == "__main__":
    main()
