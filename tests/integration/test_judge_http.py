"""The LLM judge against a real HTTP server speaking the OpenAI chat-completions API (stdlib, 127.0.0.1).

Each "model" on the server is a scripted judge: it reads the example id from the prompt ("example 17: ...")
and replies with a fixed verdict. 100 labelled examples: ids 0-59 are acceptable (label 1), 60-99 are not.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from agentgrad.rewards import (
    REWARDS,
    Judge,
    JudgeNotCalibratedError,
    JudgeReward,
    OpenAIChatBackend,
    calibrate,
    calibrate_cli,
    judge_reward,
    read_report,
    require_calibrated,
    reward_metrics,
    score,
    write_report,
)
from agentgrad.rewards.testing import answer_turn, make_trajectory
from agentgrad.types import Task

N, N_POS = 100, 60


def label(i: int) -> int:
    return int(i < N_POS)


def good_verdict(i: int) -> int:
    # disagrees on 6 positives (54-59: false negatives) and 9 negatives (60-68: false positives) -> 85/100
    return 0 if 54 <= i <= 59 else 1 if 60 <= i <= 68 else label(i)


def weak_verdict(i: int) -> int:
    # disagrees on 10 positives (50-59) and 15 negatives (60-74) -> 75/100
    return 0 if 50 <= i <= 59 else 1 if 60 <= i <= 74 else label(i)


def as_reply(i: int, verdict: int) -> str:
    # two reply styles, both parseable: a VERDICT line (even ids) and a JSON score (odd ids)
    if i % 2 == 0:
        return (f"The answer {'matches' if verdict else 'does not match'} the task.\n"
                f"VERDICT: {'PASS' if verdict else 'FAIL'}")
    return f'Checked the steps.\n{{"score": {verdict}}}'


SCRIPTS = {
    "good-judge": lambda i: as_reply(i, good_verdict(i)),
    "weak-judge": lambda i: as_reply(i, weak_verdict(i)),
    "mumbler": lambda i: "Honestly, it could go either way.",
}


class ChatServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), ChatHandler)
        self.requests: list[dict] = []
        self.lock = threading.Lock()

    def count(self, model: str) -> int:
        with self.lock:
            return sum(r["body"]["model"] == model for r in self.requests)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class ChatHandler(BaseHTTPRequestHandler):
    server: ChatServer

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests.append({"path": self.path, "body": body,
                                         "auth": self.headers.get("Authorization")})
        if self.path != "/v1/chat/completions":
            return self._send(404, {"error": {"message": f"no route {self.path}"}})
        model = body["model"]
        if model == "overloaded":
            return self._send(503, {"error": {"message": "try later"}})
        if model not in SCRIPTS:
            return self._send(400, {"error": {"message": f"unknown model {model}"}})
        i = int(re.search(r"example (\d+):", body["messages"][-1]["content"]).group(1))
        self._send(200, {"id": f"chatcmpl-{i}", "object": "chat.completion", "model": model,
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": SCRIPTS[model](i)}}],
                         "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}})


@pytest.fixture(scope="module")
def server():
    srv = ChatServer()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=5)


@pytest.fixture(scope="module")
def labels(tmp_path_factory):
    path = tmp_path_factory.mktemp("labels") / "labels.jsonl"
    with path.open("w") as fh:
        for i in range(N):
            fh.write(json.dumps({"prompt": f"example {i}: what is {i} + {i}?", "response": str(2 * i),
                                 "label": label(i)}) + "\n")
    return path


def backend(server, model, **kw):
    return OpenAIChatBackend(server.base_url, model, timeout_s=5, **kw)


def test_calibration_numbers_and_threshold_gate(server, labels, tmp_path):
    good = Judge(backend(server, "good-judge"))
    weak = Judge(backend(server, "weak-judge"))
    g = calibrate(good, labels)
    w = calibrate(weak, labels)
    assert server.count("good-judge") == N and server.count("weak-judge") == N

    # good judge: tp = 60 - 6 = 54, fn = 6, fp = 9, tn = 40 - 9 = 31
    #   accuracy = (54 + 31) / 100 = 0.85
    #   precision(pass) = 54 / (54 + 9) = 54/63 = 0.857142..., recall(pass) = 54 / 60 = 0.9
    #   precision(fail) = 31 / (31 + 6) = 31/37 = 0.837837..., recall(fail) = 31 / 40 = 0.775
    #   chance agreement p_e = P(h=1)P(j=1) + P(h=0)P(j=0) = 0.60 * 0.63 + 0.40 * 0.37 = 0.378 + 0.148 = 0.526
    #   kappa = (0.85 - 0.526) / (1 - 0.526) = 0.324 / 0.474 = 0.683544...
    assert g.n == 100 and g.n_unparsed == 0
    assert g.confusion == ((31, 9), (6, 54))
    assert g.accuracy == pytest.approx(0.85)
    assert g.precision["1"] == pytest.approx(54 / 63) and g.recall["1"] == pytest.approx(0.9)
    assert g.precision["0"] == pytest.approx(31 / 37) and g.recall["0"] == pytest.approx(0.775)
    assert g.kappa == pytest.approx(0.324 / 0.474) and g.kappa == pytest.approx(0.683544, abs=1e-6)

    # weak judge: tp = 50, fn = 10, fp = 15, tn = 25
    #   accuracy = 75 / 100 = 0.75
    #   precision(pass) = 50 / 65 = 0.769230..., recall(pass) = 50 / 60 = 0.833333...
    #   precision(fail) = 25 / 35 = 0.714285..., recall(fail) = 25 / 40 = 0.625
    #   p_e = 0.60 * 0.65 + 0.40 * 0.35 = 0.39 + 0.14 = 0.53; kappa = (0.75 - 0.53) / 0.47 = 0.468085...
    assert w.confusion == ((25, 15), (10, 50))
    assert w.accuracy == pytest.approx(0.75)
    assert w.precision["1"] == pytest.approx(50 / 65) and w.recall["1"] == pytest.approx(50 / 60)
    assert w.precision["0"] == pytest.approx(25 / 35) and w.recall["0"] == pytest.approx(0.625)
    assert w.kappa == pytest.approx(0.22 / 0.47) and w.kappa == pytest.approx(0.468085, abs=1e-6)

    good_path = write_report(g, tmp_path / "good.json")
    weak_path = write_report(w, tmp_path / "weak.json")
    assert require_calibrated(good.judge_id, good_path, threshold=0.80).accuracy == pytest.approx(0.85)
    with pytest.raises(JudgeNotCalibratedError,
                       match="accuracy 0.750 on 100 examples is below the threshold 0.80") as e:
        require_calibrated(weak.judge_id, weak_path, threshold=0.80)
    assert e.value.accuracy == pytest.approx(0.75) and e.value.threshold == 0.80
    with pytest.warns(UserWarning, match="overridden"):
        assert require_calibrated(weak.judge_id, weak_path, threshold=0.80, override=True) is not None

    # the registered factory: the same endpoint and model, gated by the stored report
    ok = judge_reward(base_url=server.base_url, model="good-judge", calibration_report=good_path)
    assert isinstance(ok, JudgeReward) and ok.judge.judge_id == good.judge_id
    with pytest.raises(JudgeNotCalibratedError):
        judge_reward(base_url=server.base_url, model="weak-judge", calibration_report=weak_path)
    # and through the registry, with YAML-style options: REWARDS.get("judge")(suite, **options)
    suite = SimpleNamespace(verify=lambda task, answer: True)  # unused by the judge
    via_registry = REWARDS.get("judge")(suite, base_url=server.base_url, model="good-judge",
                                        calibration_report=str(good_path), threshold=0.8, override=False)
    assert isinstance(via_registry, JudgeReward) and via_registry.judge.judge_id == good.judge_id
    with pytest.raises(JudgeNotCalibratedError, match="below the threshold"):
        REWARDS.get("judge")(suite, base_url=server.base_url, model="weak-judge",
                             calibration_report=str(weak_path), threshold=0.8, override=False)


def test_calibrate_cli(server, labels, tmp_path, capsys):
    out = tmp_path / "reports" / "judge.json"
    assert calibrate_cli(labels, server.base_url, "good-judge", out, 0.80) == 0
    assert read_report(out).accuracy == pytest.approx(0.85)
    assert "ACCEPTED" in capsys.readouterr().out
    assert calibrate_cli(labels, server.base_url, "good-judge", out, 0.90) == 1  # report still written
    assert "REFUSED" in capsys.readouterr().err
    assert calibrate_cli(tmp_path / "missing.jsonl", server.base_url, "good-judge", out, 0.80) == 2
    assert calibrate_cli(labels, server.base_url, "good-judge", out, 0.80, min_examples=101) == 2


def test_cache_hit_avoids_a_second_request(server, tmp_path):
    traj = make_trajectory([answer_turn("6")], task=Task("e3", "example 3: what is 3 + 3?", "6"))
    cache = tmp_path / "verdicts.jsonl"
    reward = JudgeReward(Judge(backend(server, "good-judge", api_key="test-key"), cache=cache))
    before = server.count("good-judge")
    first = reward(traj)
    assert first.outcome == 1.0 and not first.masked
    assert server.count("good-judge") == before + 1
    req = server.requests[-1]
    assert req["path"] == "/v1/chat/completions" and req["auth"] == "Bearer test-key"
    assert req["body"]["temperature"] == 0.0 and req["body"]["messages"][0]["role"] == "system"
    assert reward(traj) == first
    assert server.count("good-judge") == before + 1  # served from the in-memory cache
    fresh = JudgeReward(Judge(backend(server, "good-judge"), cache=cache))  # a new process, same cache file
    assert fresh(traj) == first and fresh.judge.requests == 0
    assert server.count("good-judge") == before + 1
    assert OpenAIChatBackend(server.base_url + "/v1/", "m").url == server.base_url + "/v1/chat/completions"


def test_unparseable_verdict_masks(server):
    traj = make_trajectory([answer_turn("4")], task=Task("e2", "example 2: what is 2 + 2?", "4"))

    class Suite:
        def verify(self, task, answer):
            return answer == task.answer

    scored = score([traj], JudgeReward(Judge(backend(server, "mumbler"))), Suite())
    assert scored[0].reward.masked and "unparseable verdict" in scored[0].reward.reason
    assert scored[0].success  # the suite's verdict is unaffected
    assert reward_metrics(scored)["reward/masked/judge"] == 1.0


def test_http_errors_mask_after_bounded_retries(server):
    traj = make_trajectory([answer_turn("4")], task=Task("e2", "example 2: what is 2 + 2?", "4"))
    flaky = JudgeReward(Judge(backend(server, "overloaded", max_retries=1, retry_backoff_s=0.01)))
    r = flaky(traj)
    assert r.masked and "HTTP 503" in r.reason and server.count("overloaded") == 2  # retried once
    unknown = JudgeReward(Judge(backend(server, "no-such-model", max_retries=3, retry_backoff_s=0.01)))
    r = unknown(traj)
    assert r.masked and "HTTP 400" in r.reason and server.count("no-such-model") == 1  # a 4xx is not retried
    srv_closed = OpenAIChatBackend("http://127.0.0.1:9", "m", timeout_s=1, max_retries=0)
    assert JudgeReward(Judge(srv_closed))(traj).masked
