"""Tokens per call on api-catalog: constrained decoding of the name vs the factored (category -> tool) head.

Counts, over the expert's calls of N tasks, with the tokenizer `agentgrad train env=api-catalog` builds:
- tokens the policy samples per call turn under constrained decoding (header, name, arguments, close, eos),
- how many of the name's tokens are real choices (more than one legal token) under the env's mask,
- tokens sampled per call with the factored head: the name is one head decision, its tokens are written in.
No training: success rates are not compared here (see docs/action-space.md).

    PYTHONPATH=src nice -n 19 python benchmarks/action_space_tokens.py [num_tasks]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from agentgrad.config import build_config
from agentgrad.envs import SUITES
from agentgrad.models.hf import load_model
from agentgrad.pipelines.components import build_tiny_model_dir, inference
from agentgrad.rollout.constrained import ToolNameDecoder, call_header
from agentgrad.rollout.parser import OPEN
from agentgrad.types import Message, ToolCall


def main(num_tasks: int = 300) -> None:
    config = build_config(overrides=["env=api-catalog"])
    suite = SUITES.get("api-catalog")(**config.env.options)
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(build_tiny_model_dir(config, suite, Path(tmp) / "model"))
    _, codec = inference(loaded)
    decoder = ToolNameDecoder(codec, call_header(codec))
    env = suite.make_env()
    turn_tokens, name_tokens, choices, calls = 0, 0, 0, 0
    for task in suite.sample_tasks(num_tasks, split="train", seed=0):
        env.reset(seed=0, options={"task": task})
        for action in suite.expert_actions(task):
            if isinstance(action, ToolCall):
                mask = env.legal_actions()
                ids = codec.assistant_ids(Message("assistant", "", tool_calls=(action,)))
                text = ""
                in_name = 0
                for i in ids:
                    rule = decoder.rule(mask, text)
                    name_started = text.startswith(OPEN + decoder.header)
                    if rule is not None and name_started:
                        in_name += 1
                        choices += len(rule[0]) > 1
                    text += decoder.strings[i]
                turn_tokens += len(ids)
                name_tokens += in_name
                calls += 1
            env.step(action)
    print(f"api-catalog, {calls} expert calls of {num_tasks} tasks, tokenizer vocab {len(loaded.tokenizer)}")
    print("| | tokens sampled per call | name decisions per call |")
    print("|---|---|---|")
    print(f"| constrained decoding | {turn_tokens / calls:.2f} | {name_tokens / calls:.2f} tokens "
          f"({choices / calls:.2f} with >1 legal token) |")
    print(f"| factored head | {(turn_tokens - name_tokens) / calls:.2f} (+1 head decision) | 1 (category, tool) |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
