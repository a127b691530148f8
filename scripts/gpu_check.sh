#!/usr/bin/env bash
# One-GPU check of the training path on a real-architecture model (docs/scale-out.md, "Training"): the preset
# qwen2.5-0.5b-gpu (Qwen2.5-0.5B's shape, built locally with the tiny tokenizer: no download), BC then GRPO steps
# with the FSDP2 learner and its weight sync into the generation copy; prints step time and tokens/s. The reward is
# scripts/gpu_check_reward.py's (every group has signal, so every step updates): a throughput check, not learning.
#
#   scripts/gpu_check.sh [--cpu] [--lora] [extra dotted overrides...]
#
# --cpu: the same path shrunk to run on CPU in about a minute (what CI runs): a 2-layer model of width 64, two
#        processes (learner.world_size=2, gloo), fewer steps and episodes.
# --lora: LoRA adapters (model.lora.r=8) with the single-process learner (LoRA does not run sharded yet).
# PYTHON selects the interpreter (default: python3); OUT the output directory (default: a temporary one).
#
# TODO(vLLM): rollouts through the vLLM backend (the generation issue's); this script uses the HF engine.
set -euo pipefail

PYTHON=${PYTHON:-python3}
cpu=0
overrides=()
for arg in "$@"; do
  case "$arg" in
    --cpu) cpu=1 ;;
    --lora) overrides+=(model.lora.r=8 learner.backend=torch algo.lr=1e-4) ;;
    *) overrides+=("$arg") ;;
  esac
done
if [[ $cpu == 1 ]]; then
  overrides=(model.device=cpu model.tiny.hidden_size=64 model.tiny.num_layers=2 model.tiny.num_heads=2
             model.tiny.num_kv_heads=1 model.tiny.intermediate_size=128 model.tiny.tokenizer_corpus_episodes=50
             model.tiny.max_positions=512 rollout.max_total_tokens=256 rollout.max_new_tokens_per_turn=32
             run.threads=1 learner.world_size=2 algo.steps=2 algo.tasks_per_step=2 algo.group_size=4
             algo.minibatch_size_episodes=4 bc.batch_size_episodes=8 bc.num_demos=16 eval.num_tasks=4
             "${overrides[@]}")
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
elif ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "error: no CUDA device visible to torch (run scripts/gpu_check.sh --cpu for the CPU dry run)" >&2
  exit 2
fi

OUT=${OUT:-$(mktemp -d)}
export HF_HUB_OFFLINE=1
export PYTHONPATH="$(cd "$(dirname "$0")" && pwd)${PYTHONPATH:+:$PYTHONPATH}"  # gpu_check_reward.py
"$PYTHON" -m agentgrad.cli train --preset qwen2.5-0.5b-gpu run.output_dir="$OUT" run.name=gpu-check \
  run.progress=false reward.name=gpu_check_reward:token_parity_reward "${overrides[@]}"

"$PYTHON" - "$OUT/gpu-check" <<'PY'
import json
import sys
from pathlib import Path

run = Path(sys.argv[1])
rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
rl = [r for r in rows if r["stage"] == "grpo" and "perf/step_s" in r]
if not rl or not all(r["train/updates"] > 0 for r in rl):
    sys.exit("error: the run logged no GRPO step, or a step without an update")
step_s = sum(r["perf/step_s"] for r in rl) / len(rl)
tokens = sum(r["rollout/generated_tokens"] for r in rl) / len(rl)
sync = [r["perf/weight_sync_s"] for r in rl if "perf/weight_sync_s" in r]
params = json.loads((run / "base-model" / "config.json").read_text())
print(f"gpu_check: model {params['num_hidden_layers']} layers x {params['hidden_size']}, "
      f"{len(rl)} GRPO steps (the first includes warm-up)")
print(f"gpu_check: step time {step_s:.2f} s (rollout {sum(r['perf/rollout_s'] for r in rl) / len(rl):.2f} s), "
      f"rollout tokens/s {sum(r['perf/tokens_per_s'] for r in rl) / len(rl):.0f}, "
      f"generated tokens/s over the whole step {tokens / step_s:.0f}"
      + (f", weight sync {sum(sync) / len(sync):.3f} s per update" if sync else ""))
PY
