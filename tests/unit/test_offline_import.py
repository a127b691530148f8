"""Offline chat-log import: token-in/token-out identical to the rollout encoding, logprobs kept or rescored."""

import json

import pytest
import torch

from agentgrad.backends.scoring import token_logprobs
from agentgrad.config import build_config
from agentgrad.data.offline import LogFormatError, encode_episode, parse_line, read_log, to_chat_line
from agentgrad.data.store import TrajectoryStore
from agentgrad.pipelines.data import import_chat_log
from agentgrad.rollout.loop import EpisodeLimits, expert_trajectory
from agentgrad.types import Trajectory


@pytest.fixture()
def expert(arithmetic_suite, codec):
    task = arithmetic_suite.sample_tasks(1, split="train", seed=3)[0]
    env = arithmetic_suite.make_env()
    traj = expert_trajectory(env, task, arithmetic_suite.expert_actions(task), codec,
                             EpisodeLimits(max_total_tokens=400))
    fake = tuple(-0.01 * (i % 7) if m else 0.0 for i, m in enumerate(traj.loss_mask))  # distinct logged logprobs
    traj = Trajectory(**{**traj.__dict__, "logprobs": fake})
    _, info = env.reset(seed=0, options={"task": task})
    return traj, info["tools"]


def test_exported_log_reimports_to_the_same_tokens_masks_and_logprobs(expert, codec):
    traj, tools = expert
    line = json.loads(json.dumps(to_chat_line(traj, reward=1.0, success=True, tools=tools)))
    assert line["messages"][2]["tool_calls"][0]["function"]["arguments"].startswith("{")  # OpenAI: a JSON string
    got, complete = encode_episode(parse_line(line, 1), codec)
    assert complete
    assert got.token_ids == traj.token_ids and got.loss_mask == traj.loss_mask and got.logprobs == traj.logprobs
    assert got.prompt_length == traj.prompt_length and got.final_answer == traj.final_answer
    assert [(t.start, t.end) for t in got.turns] == [(t.start, t.end) for t in traj.turns]


def test_openai_logprob_objects_accepted_and_wrong_counts_fall_back(expert, codec):
    traj, tools = expert
    line = to_chat_line(traj, tools=tools)
    first = next(m for m in line["messages"] if m["role"] == "assistant")
    first["logprobs"] = {"content": [{"token": "?", "logprob": lp} for lp in first["logprobs"]]}
    assert encode_episode(parse_line(line, 1), codec)[1]
    first["logprobs"] = {"content": first["logprobs"]["content"][:-1]}  # another tokenizer: one token short
    got, complete = encode_episode(parse_line(line, 1), codec)
    assert not complete and got.token_ids == traj.token_ids


def test_bad_lines_are_reported_not_fatal():
    lines = ['{"messages": []}', "not json", json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
             json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})]
    out = list(read_log(lines))
    assert [isinstance(o, LogFormatError) for o in out] == [True, True, True, False]
    assert "line 2" in str(out[1])


def test_import_rescores_missing_logprobs_with_the_behaviour_model(expert, tiny_model_dir, loaded_tiny, tmp_path):
    traj, tools = expert
    with_lp = to_chat_line(traj, reward=1.0, tools=tools)
    without = to_chat_line(traj, tools=tools)  # no reward either: scored by the suite's verifier
    for m in without["messages"]:
        m.pop("logprobs", None)
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps(with_lp) + "\n" + "garbage\n" + json.dumps(without) + "\n")
    config = build_config(overrides=["run.threads=1", "rollout.temperature=0.7"])
    report = import_chat_log(config, log, tmp_path / "store", model_path=str(tiny_model_dir))
    assert (report.episodes, report.rescored, report.bad_lines) == (2, 1, 1)
    recs = list(TrajectoryStore(tmp_path / "store").records())
    assert recs[0].sample.trajectory.logprobs == traj.logprobs
    assert recs[1].sample.success and recs[1].group == f"import:{traj.task.task_id}"
    ids = torch.tensor([traj.token_ids])
    expect = token_logprobs(loaded_tiny.model.eval(), ids, torch.ones_like(ids), 0.7)[0]  # (T,)
    got = torch.tensor(recs[1].sample.trajectory.logprobs)
    mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
    assert torch.allclose(got[mask], expect[mask], atol=1e-5) and (got[~mask] == 0).all()
