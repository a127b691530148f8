"""TrajectoryStore: typed round trip, torn-write repair, truncation to a checkpoint offset, segments."""

import dataclasses
import json

import pytest

from agentgrad.data.store import StoreCorruptError, TrajectoryStore, from_json, to_json
from agentgrad.rewards.testing import answer_turn, make_trajectory, tool_turn
from agentgrad.types import RewardBreakdown, ScoredTrajectory, Task, TokenMask


def sample(i: int, reward: float = 1.0) -> ScoredTrajectory:
    traj = make_trajectory([tool_turn("calculator", {"expression": f"{i} + 1", "xs": [1, 2]}, results=1),
                            answer_turn(str(i + 1))], task=Task(f"t{i}", f"{i} + 1?", str(i + 1), metadata={"k": [i]}))
    traj = type(traj)(**{**traj.__dict__, "logprobs": tuple(-0.1 * j for j in range(len(traj.token_ids))),
                         "policy_version": i})
    return ScoredTrajectory(traj, RewardBreakdown(reward, (0.0, 0.5)), success=reward > 0)


def test_record_round_trip_is_exact():
    s = sample(3)
    assert from_json(json.loads(json.dumps(to_json(s)))) == s


def test_constrained_decoding_masks_survive_the_round_trip():
    """Replayed samples are rescored over the legal sets they were sampled from: the store must keep them."""
    s = sample(4)
    masks = (TokenMask(position=2, token_ids=(5, 7)), TokenMask(position=3, token_ids=(9,), allow=False))
    s = ScoredTrajectory(dataclasses.replace(s.trajectory, token_masks=masks), s.reward, s.success)
    back = from_json(json.loads(json.dumps(to_json(s))))
    assert back == s and isinstance(back.trajectory.token_masks[0], TokenMask)


def test_append_read_back_typed_with_indices_and_groups(tmp_path):
    store = TrajectoryStore(tmp_path)
    assert store.append([sample(0), sample(1)], step=0, stage="rl", groups=["a", "a"]) == (0, 2)
    assert store.append([sample(2)], step=1, stage="rl") == (2, 3)
    recs = list(TrajectoryStore(tmp_path).records())
    assert [r.index for r in recs] == [0, 1, 2]
    assert [r.group for r in recs] == ["a", "a", "1:0"]
    assert [r.sample for r in recs] == [sample(0), sample(1), sample(2)]
    rows = list(store.rows())
    assert rows[2]["task_id"] == "t2" and rows[2]["policy_version"] == 2 and rows[2]["reward"] == 1.5


def test_torn_last_record_is_cut_on_open_and_earlier_ones_survive(tmp_path):
    store = TrajectoryStore(tmp_path)
    store.append([sample(0), sample(1)], step=0, stage="rl")
    seg = next(tmp_path.glob("segment-*.jsonl"))
    full = seg.read_bytes()
    with seg.open("ab") as fh:  # what a crash halfway through the next batch leaves behind
        fh.write(json.dumps({"index": 2, "sample": to_json(sample(2))}).encode()[:57])
    reopened = TrajectoryStore(tmp_path)
    assert reopened.repaired_bytes == 57
    assert seg.read_bytes() == full
    assert len(reopened) == 2
    reopened.append([sample(2)], step=1, stage="rl")
    assert [r.sample for r in TrajectoryStore(tmp_path).records()] == [sample(0), sample(1), sample(2)]


def test_truncate_to_checkpoint_offset_then_reappend_has_no_duplicates(tmp_path):
    store = TrajectoryStore(tmp_path, segment_max_records=2)
    for step in range(3):
        store.append([sample(2 * step), sample(2 * step + 1)], step=step, stage="rl")
    assert len(list(tmp_path.glob("segment-*.jsonl"))) == 3
    assert store.truncate(3) == 3  # checkpoint taken after 3 records: drops one segment and a half
    assert len(TrajectoryStore(tmp_path)) == 3
    store.append([sample(30), sample(31)], step=9, stage="rl")
    got = [(r.index, r.sample.trajectory.task.task_id) for r in TrajectoryStore(tmp_path).records()]
    assert got == [(0, "t0"), (1, "t1"), (2, "t2"), (3, "t30"), (4, "t31")]
    with pytest.raises(ValueError, match="lost"):
        store.truncate(99)


def test_a_corrupt_middle_record_is_an_error_not_silently_skipped(tmp_path):
    store = TrajectoryStore(tmp_path, segment_max_records=1)
    store.append([sample(0)], step=0, stage="rl")
    store.append([sample(1)], step=1, stage="rl")
    first = sorted(tmp_path.glob("segment-*.jsonl"))[0]
    first.unlink()
    with pytest.raises(StoreCorruptError):
        TrajectoryStore(tmp_path)
