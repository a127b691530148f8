"""LLM-as-judge with a local callable backend: verdict parsing, rubrics, cache, masking, calibration gate."""

from __future__ import annotations

import json
import math
import re
import threading
import time
import warnings

import pytest

from agentgrad.rewards import (
    CalibrationError,
    CombinedReward,
    Judge,
    JudgeNotCalibratedError,
    JudgeReward,
    Rubric,
    VerdictCache,
    agreement_report,
    calibrate,
    judge_input,
    judge_reward,
    labelled_trajectory,
    load_labels,
    load_reward,
    parse_verdict,
    read_report,
    render_transcript,
    require_calibrated,
    reward_metrics,
    score,
    write_report,
)
from agentgrad.rewards.testing import answer_turn, make_trajectory, tool_turn
from agentgrad.types import Message, Task


class ExactSuite:
    name = "exact"

    def verify(self, task, answer):
        return answer is not None and answer.strip() == task.answer


TASK = Task("t0", "What is 6 * 7?", "42")
TRAJ = make_trajectory([tool_turn("calculator", {"expression": "6 * 7"}, observation="42"), answer_turn("42")],
                       task=TASK)


class Scripted:
    """A local judge: replies by looking at the final answer in the rendered prompt."""

    name = "scripted"

    def __init__(self, reply=lambda answer: "VERDICT: PASS" if answer == "42" else "VERDICT: FAIL"):
        self.reply = reply
        self.calls: list[list[dict]] = []

    def complete(self, messages):
        self.calls.append(messages)
        answer = re.search(r"## Agent's final answer\n(.*)", messages[-1]["content"]).group(1).strip()
        return self.reply(answer)


@pytest.mark.parametrize("reply,expected", [
    ("The agent multiplied correctly.\nVERDICT: PASS", 1.0),
    ("verdict: fail", 0.0),
    ("Could argue VERDICT: PASS, but the units are missing.\nVERDICT: FAIL", 0.0),  # the last one wins
    ("VERDICT: **PASS**", 1.0),
    ('Reasoning...\n```json\n{"score": 0.8}\n```', 0.8),
    ('{"score": 1}', 1.0),
    ('{"score": "0.25"}', 0.25),
    ('{"verdict": "fail"}', 0.0),
    ('{"score": true}', 1.0),
    ('{"note": "x"} then {"score": 0.4}', 0.4),
    ('{"score": 1.5}', None),
    ('{"score": -0.1}', None),
    ('{"score": NaN}', None),
    ("It looks fine to me.", None),
    ("", None),
    (None, None),
])
def test_parse_verdict(reply, expected):
    assert parse_verdict(reply) == expected


def test_parse_verdict_score_scale():
    assert parse_verdict('{"score": 8}', score_max=10) == 0.8
    assert parse_verdict('{"score": 11}', score_max=10) is None


def test_rubric_renders_all_context():
    msgs = Judge(Scripted()).messages(judge_input(TRAJ))
    assert [m["role"] for m in msgs] == ["system", "user"]
    user = msgs[1]["content"]
    for part in ("## Task\nWhat is 6 * 7?", "## Reference answer\n42", "## Agent transcript",
                 '[call calculator {"expression": "6 * 7"}]', "tool: 42", "## Agent's final answer\n42",
                 "VERDICT: PASS"):
        assert part in user
    bare = Judge(Scripted(), include_reference=False, include_transcript=False).messages(judge_input(
        TRAJ, include_reference=False, include_transcript=False))
    assert "Reference" not in bare[1]["content"] and "transcript" not in bare[1]["content"]
    custom = Rubric("mine", user="Q: {{ prompt }} A: {{ response }} {{ criteria }}")
    assert custom.render(prompt="p", response="r", criteria="be kind") == [
        {"role": "user", "content": "Q: p A: r be kind"}]


def test_judge_reward_scores_and_caches_in_memory():
    backend = Scripted()
    reward = JudgeReward(Judge(backend))
    wrong = make_trajectory([answer_turn("41")], task=TASK)
    assert reward(TRAJ).outcome == 1.0 and reward(TRAJ).process == (0.0, 0.0)
    assert reward(wrong).outcome == 0.0
    assert reward(TRAJ).outcome == 1.0
    assert len(backend.calls) == 2  # the repeated TRAJ came from the cache
    assert reward.judge.cache.hits == 2 and reward.judge.requests == 2
    no_cache = Judge(backend, cache=False)
    no_cache.judge(TRAJ), no_cache.judge(TRAJ)
    assert len(backend.calls) == 4


def test_cache_key_covers_the_judge_and_the_content():
    a, b = Judge(Scripted()), Judge(Scripted(), criteria="Be strict.")
    assert a.judge_id != b.judge_id
    m = a.messages(judge_input(TRAJ))
    assert a.cache_key(m) == Judge(Scripted()).cache_key(m)
    assert a.cache_key(m) != b.cache_key(m)
    assert a.cache_key(m) != a.cache_key(a.messages(judge_input(make_trajectory([answer_turn("41")], task=TASK))))


def test_disk_cache_is_reused_and_tolerates_corrupt_lines(tmp_path):
    path = tmp_path / "judge" / "cache.jsonl"
    first = Scripted()
    Judge(first, cache=path).judge(TRAJ)
    with path.open("a") as fh:
        fh.write("{not json\n")
        fh.write(json.dumps({"key": "k", "score": 3.0}) + "\n")  # out of range: ignored
    second = Scripted()
    cache = VerdictCache(path)
    assert len(cache) == 1 and cache.bad_lines == 2
    v = Judge(second, cache=cache).judge(TRAJ)
    assert v.cached and v.score == 1.0 and second.calls == []


def test_unparseable_verdict_masks_and_is_not_cached():
    backend = Scripted(reply=lambda answer: "Hmm, hard to say.")
    reward = JudgeReward(Judge(backend))
    [s] = score([TRAJ], reward, ExactSuite())
    assert s.reward.masked and "unparseable verdict" in s.reward.reason
    score([TRAJ], reward, ExactSuite())
    assert len(backend.calls) == 2  # failures are retried, not cached
    assert reward_metrics([s])["reward/masked/judge"] == 1


def test_backend_failure_masks():
    def down(messages):
        raise ConnectionError("refused")

    [s] = score([TRAJ], JudgeReward(Judge(down)), ExactSuite())
    assert s.reward.masked and "backend failed: ConnectionError: refused" in s.reward.reason
    [s] = score([TRAJ], JudgeReward(Judge(lambda m: 42)), ExactSuite())
    assert s.reward.masked and "not str" in s.reward.reason


def test_pass_threshold_and_partial_scores():
    backend = Scripted(reply=lambda answer: '{"score": 0.6}')
    assert JudgeReward(Judge(backend, "score"))(TRAJ).outcome == 0.6
    assert JudgeReward(Judge(backend, "score"), pass_threshold=0.7)(TRAJ).outcome == 0.0
    assert JudgeReward(Judge(backend, "score"), pass_threshold=0.5)(TRAJ).outcome == 1.0


class Gate(Scripted):
    """A scripted judge whose calls wait (up to 5 s) until `width` of them are in flight: with a pool of `width`
    threads the peak in flight is then exactly `width`; asked one after another it would be 1."""

    def __init__(self, width):
        super().__init__()
        self.barrier = threading.Barrier(width, timeout=5)
        self.lock = threading.Lock()
        self.in_flight = self.peak = 0

    def complete(self, messages):
        with self.lock:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            pass
        time.sleep(0.01)  # the others of this wave are still in flight when one returns
        with self.lock:
            self.in_flight -= 1
            return super().complete(messages)


def test_scoring_judges_a_batch_concurrently_and_bounded():
    # 6 trajectories, at most 3 requests in flight: two waves of 3 through the gate; only "42" passes.
    gate = Gate(3)
    reward = JudgeReward(Judge(gate), max_workers=3)
    trajs = [make_trajectory([answer_turn(str(40 + i))], task=TASK) for i in range(6)]
    assert [s.reward.outcome for s in score(trajs, reward, ExactSuite())] == [0, 0, 1, 0, 0, 0]
    assert gate.peak == 3 and len(gate.calls) == 6
    assert [s.reward.outcome for s in score(trajs, reward, ExactSuite())] == [0, 0, 1, 0, 0, 0]
    assert len(gate.calls) == 6  # the second pass is served from the cache


def test_a_combined_reward_batches_its_judge():
    gate = Gate(2)
    combined = CombinedReward([(JudgeReward(Judge(gate), max_workers=2), 0.5), (lambda t: 1.0, 1.0)])
    trajs = [make_trajectory([answer_turn(a)], task=TASK) for a in ("42", "41")]
    assert [s.reward.outcome for s in score(trajs, combined, ExactSuite())] == [1.5, 1.0]  # 0.5 * 1 + 1, 0.5 * 0 + 1
    assert gate.peak == 2


def test_labelled_records_become_trajectories_the_judge_reads():
    store_record = {"step": 3, "stage": "rl", "trajectory": {
        "task": {"prompt": "Capital of France?", "answer": "Paris"},
        "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "Capital of France?"},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"name": "search", "arguments": {"query": "france"}, "__type__": "ToolCall"}]},
                     {"role": "tool", "content": "Paris is the capital."},
                     {"role": "assistant", "content": "Paris"}],
        "turns": [{"action": {"name": "search", "arguments": {}, "__type__": "ToolCall"}},
                  {"action": {"text": "Paris", "__type__": "FinalAnswer"}}]}}
    inp = judge_input(labelled_trajectory({"trajectory": store_record}))
    assert (inp.prompt, inp.response, inp.reference) == ("Capital of France?", "Paris", "Paris")
    assert inp.transcript.splitlines() == ["user: Capital of France?", 'assistant: [call search {"query": "france"}]',
                                           "tool: Paris is the capital.", "assistant: Paris"]
    openai_call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "search", "arguments": '{"query": "france"}'}}]}
    assert judge_input(labelled_trajectory({"trajectory": {"messages": [openai_call]}, "response": "Paris"})
                       ).transcript == 'assistant: [call search {"query": "france"}]'
    inp2 = judge_input(labelled_trajectory({"prompt": "p", "response": "r"}))
    assert (inp2.prompt, inp2.response, inp2.reference, inp2.transcript) == ("p", "r", None, None)
    transcript = "user: hi\nthere\nassistant: yo"  # a line without a role continues the message before it
    inp3 = judge_input(labelled_trajectory({"trajectory": transcript, "prompt": "hi", "response": "yo"}))
    assert inp3.transcript == transcript and (inp3.prompt, inp3.response) == ("hi", "yo")
    with pytest.raises(ValueError):
        labelled_trajectory({"prompt": "p"})
    with pytest.raises(TypeError):
        labelled_trajectory({"trajectory": 3})
    long = render_transcript([Message("user", "x" * 100)], max_chars=20)
    assert long.startswith("[...]") and len(long) == 26


def test_agreement_report_by_hand():
    # labels  1 1 1 1 0 0 0 0 0 0 ; verdicts 1 1 1 0 0 0 0 0 1 None (None counts as the wrong answer: 1)
    # tp=3 fn=1 tn=4 fp=2 -> accuracy 7/10; precision(1)=3/5 recall(1)=3/4 precision(0)=4/5 recall(0)=4/6
    # p_e = P(h=0)P(j=0) + P(h=1)P(j=1) = 0.6*0.5 + 0.4*0.5 = 0.5 -> kappa = (0.7-0.5)/(1-0.5) = 0.4
    r = agreement_report("j", [1, 1, 1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0, 1, None])
    assert r.confusion == ((4, 2), (1, 3)) and r.n == 10 and r.n_unparsed == 1
    assert r.accuracy == pytest.approx(0.7) and r.kappa == pytest.approx(0.4)
    assert r.precision == pytest.approx({"0": 0.8, "1": 0.6})
    assert r.recall == pytest.approx({"0": 4 / 6, "1": 0.75})
    perfect = agreement_report("j", [0, 1], [0, 1])
    assert perfect.kappa == 1.0 and perfect.accuracy == 1.0
    always_pass = agreement_report("j", [1] * 9 + [0], [1] * 10)
    assert always_pass.accuracy == 0.9 and always_pass.kappa == 0.0 and always_pass.precision["0"] == 0.0


def _labels(tmp_path, rows):
    path = tmp_path / "labels.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_calibrate_with_a_local_judge_and_the_gate(tmp_path):
    # 120 examples: answer "42" is right. The scripted judge passes exactly "42": it agrees on all of them.
    rows = [{"prompt": "What is 6 * 7?", "response": "42" if i % 3 else str(1000 + i), "label": int(i % 3 != 0)}
            for i in range(120)]
    judge = Judge(Scripted())
    report = calibrate(judge, _labels(tmp_path, rows), max_workers=1)
    assert report.accuracy == 1.0 and report.n == 120 and report.confusion == ((40, 0), (0, 80))
    out = write_report(report, tmp_path / "reports" / "judge.json")
    assert read_report(out) == report
    assert require_calibrated(judge.judge_id, out) == report
    with pytest.raises(JudgeNotCalibratedError, match="different judge"):
        require_calibrated("other|pass_fail@x", out)
    with pytest.raises(JudgeNotCalibratedError, match="kappa"):
        require_calibrated(judge.judge_id, out, min_kappa=1.01)
    with pytest.raises(JudgeNotCalibratedError, match="no calibration report at"):
        require_calibrated(judge.judge_id, tmp_path / "missing.json")
    with pytest.raises(JudgeNotCalibratedError, match="no calibration report given"):
        require_calibrated(judge.judge_id, None)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(JudgeNotCalibratedError, match="unreadable"):
        require_calibrated(judge.judge_id, tmp_path / "broken.json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert require_calibrated(judge.judge_id, None, override=True) is None
    assert "overridden" in str(caught[0].message)
    # the registered factory applies the same gate
    assert isinstance(judge_reward(backend=Scripted(), calibration_report=out), JudgeReward)
    gated = load_reward("judge", ExactSuite(), backend=Scripted(), calibration_report=str(out))
    assert isinstance(gated, JudgeReward)
    with pytest.raises(JudgeNotCalibratedError, match="below the threshold"):
        load_reward("judge", ExactSuite(), backend=Scripted(), calibration_report=str(out), threshold=1.01)
    with pytest.raises(JudgeNotCalibratedError):
        judge_reward(backend=Scripted())
    with pytest.raises(JudgeNotCalibratedError):
        judge_reward(backend=Scripted(), criteria="changed rubric", calibration_report=out)


def test_calibration_needs_enough_examples_and_both_classes(tmp_path):
    judge = Judge(Scripted())
    with pytest.raises(CalibrationError, match="99 labelled examples; calibration needs at least 100"):
        calibrate(judge, _labels(tmp_path, [{"prompt": "p", "response": "42", "label": i % 2} for i in range(99)]))
    with pytest.raises(CalibrationError, match="both classes"):
        calibrate(judge, _labels(tmp_path, [{"prompt": "p", "response": "42", "label": 1}] * 100))
    assert calibrate(judge, _labels(tmp_path, [{"prompt": "p", "response": "42", "label": i % 2}
                                               for i in range(10)]), min_examples=10).accuracy == 0.5


def test_load_labels_errors_name_the_line(tmp_path):
    path = tmp_path / "l.jsonl"
    path.write_text('{"prompt": "p", "response": "r", "label": 1}\n\n{"prompt": "p", "response": "r", "label": 2}\n')
    with pytest.raises(CalibrationError, match=r"l.jsonl:3: label must be 0 or 1"):
        load_labels(path)
    path.write_text('{"prompt": "p", "label": 1}\n')
    with pytest.raises(CalibrationError, match=r":1: a judge record needs"):
        load_labels(path)
    path.write_text('nope\n')
    with pytest.raises(CalibrationError, match=r":1: not JSON"):
        load_labels(path)
    with pytest.raises(CalibrationError, match="does not exist"):
        load_labels(tmp_path / "none.jsonl")
    path.write_text('{"prompt": "p", "response": "r", "label": "pass"}\n'
                    '{"prompt": "p", "response": "r", "label": false}\n')
    assert [e.label for e in load_labels(path)] == [1, 0]


def test_report_json_is_plain(tmp_path):
    r = agreement_report("j", [1, 0], [1, 1])
    data = json.loads(write_report(r, tmp_path / "r.json").read_text())
    assert data["confusion"] == [[0, 1], [0, 1]] and data["judge_id"] == "j"
    assert all(math.isfinite(data[k]) for k in ("accuracy", "kappa"))


def test_nested_json_reply():
    assert parse_verdict('{"score": 0.9, "details": {"units": "ok"}}') == 0.9
    assert parse_verdict('{"details": {"units": "ok"}}') is None


def test_local_hf_judge_decodes_greedily_through_the_models_chat_template(tiny_model_dir, loaded_tiny):
    """The local-model backend must render with the model's own template and decode greedily: its reply equals
    our own greedy sampler's continuation of the same rendered prompt."""
    from agentgrad.backends.base import SamplingParams
    from agentgrad.pipelines.components import inference
    from agentgrad.rewards.judge_backends import HFChatBackend

    messages = Judge(Scripted()).messages(judge_input(TRAJ))
    backend = HFChatBackend(str(tiny_model_dir), max_new_tokens=12)
    reply = backend.complete(messages)

    policy, _ = inference(loaded_tiny)
    tok = loaded_tiny.tokenizer
    prompt = tok.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    gen = policy.generate([list(prompt)], SamplingParams(max_new_tokens=12, temperature=0.0))[0]
    assert reply == tok.decode(list(gen.token_ids), skip_special_tokens=True)
    assert backend.complete(messages) == reply  # greedy: the cache key is a faithful stand-in for the verdict

    # An untrained model writes no verdict: the sample is masked with the reason, never scored 0.
    breakdown = JudgeReward(Judge(backend, "pass_fail", cache=False))(TRAJ)
    assert breakdown.masked and "unparseable verdict" in breakdown.reason
