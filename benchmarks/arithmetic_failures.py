"""Why arithmetic episodes fail: counts a run's stored rollouts by failure kind, over a range of RL steps.

Kinds: `ok`; `call_wrong` (the calculator got a different expression than the task's); `answer_first_digit`
(right call, answer wrong only in its first digit); `answer_other`. docs/design-notes.md uses it to explain
why RL moves one BC stop point and not another.

    python benchmarks/arithmetic_failures.py RUN_DIR [--steps 0 2]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def failure_kind(trajectory: dict) -> str:
    task, turns = trajectory["task"], trajectory["turns"]
    expression, answer = task["metadata"]["expression"], task["answer"]
    first = turns[0]["action"] if turns else {}
    if first.get("arguments", {}).get("expression") != expression:
        return "call_wrong"
    final = (turns[-1]["action"].get("text") or "").strip()
    if final == answer:
        return "ok"
    return "answer_first_digit" if len(final) == len(answer) and final[1:] == answer[1:] else "answer_other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--steps", type=int, nargs=2, default=(0, 2), metavar=("FIRST", "LAST"))
    args = parser.parse_args()
    counts: Counter = Counter()
    for segment in sorted((args.run_dir / "trajectories").glob("segment-*.jsonl")):
        for line in segment.read_text().splitlines():
            record = json.loads(line)
            if record["stage"] == "rl" and args.steps[0] <= record["step"] <= args.steps[1]:
                counts[failure_kind(record["sample"]["trajectory"])] += 1
    total = sum(counts.values())
    print(f"{total} episodes, RL steps {args.steps[0]}-{args.steps[1]}")
    for kind, n in counts.most_common():
        print(f"  {kind:20s} {n / total:6.1%}")


if __name__ == "__main__":
    main()
