"""Fuzz: random, truncated and mutated tool-call strings through `parse_turn` and then `env.step`.

Seeds are the experts' real call strings (arithmetic and api-catalog); mutations truncate, flip, insert and delete
characters, nest and drop tags, splice in random unicode, huge numbers, deep JSON nesting, wrong types, other tool
names, too many calls. Invariant: nothing raises, and every failure is typed: an InvalidAction from the parser
(which the env turns into an `error (bad_arguments)` observation) or a tool error observation `error (<kind>): ...`.
"""

from __future__ import annotations

import json
import random
import time

import pytest

from agentgrad.envs import SUITES
from agentgrad.envs.tasks.api_catalog import ApiCatalogSuite, catalog
from agentgrad.rollout.parser import CLOSE, OPEN, parse_turn
from agentgrad.tools.base import ToolErrorKind
from agentgrad.types import FinalAnswer, InvalidAction, ToolCall

N_PER_ENV = 10_000  # per env: 20,000 strings in all
ERROR_KINDS = {k.value for k in ToolErrorKind}
JSON_CHARS = '{}[]":,\\ntfue0123456789.-+ '
UNICODE = "éßøΩЖ漢字🙂\u200b\u202e\ufeff\x00\x07\ud800\U0010ffff<>/"


def render(call: ToolCall) -> str:
    return f"{OPEN}\n{json.dumps({'name': call.name, 'arguments': dict(call.arguments)}, ensure_ascii=False)}\n{CLOSE}"


def _random_text(rng: random.Random, k: int) -> str:
    pools = (JSON_CHARS, UNICODE, "abcdefghijklmnopqrstuvwxyz_.", OPEN + CLOSE)
    return "".join(rng.choice(rng.choice(pools)) for _ in range(k))


def _huge_number(rng: random.Random) -> str:
    # at most 4000 digits: Python's int-from-string limit (4300) is a known parser gap, tested separately below
    return rng.choice(["9" * rng.randint(20, 4000), "1e999", "-1e999", "NaN", "Infinity", "-0", "1e-400",
                       str(2 ** 200), "9**9**9", "0.%s" % ("3" * 500)])


def _deep(rng: random.Random) -> str:
    d = rng.choice([10, 500, 5_000, 50_000])
    opener, closer = rng.choice([("[", "]"), ('{"a":', "}")])
    return opener * d + "1" + closer * d * rng.choice([1, 1, 0])


def _value(rng: random.Random, names: list[str]) -> object:
    return rng.choice([None, True, 0, -1, 1.5, [], {}, [1, [2, [3]]], {"x": {"y": 1}}, "", " " * 3, "x" * 300,
                       _random_text(rng, 8), rng.choice(names), "1/0", "2**64**64", "((((1))))", "A-1234"])


def mutate(s: str, rng: random.Random, names: list[str]) -> str:
    op = rng.randrange(16)
    n = len(s)
    pos = rng.randint(0, n)
    if op == 0:  # truncate
        return s[:pos]
    if op == 1 and n:  # flip a character
        i = rng.randrange(n)
        return s[:i] + _random_text(rng, 1) + s[i + 1:]
    if op == 2:  # insert characters
        return s[:pos] + _random_text(rng, rng.randint(1, 6)) + s[pos:]
    if op == 3 and n:  # delete a span
        j = min(n, pos + rng.randint(1, 8))
        return s[:pos] + s[j:]
    if op == 4:  # nest or stray tags
        return s[:pos] + rng.choice([OPEN, CLOSE, OPEN + OPEN, CLOSE + OPEN]) + s[pos:]
    if op == 5:  # wrap in another call
        return OPEN + s + CLOSE
    if op == 6:  # random unicode
        return s[:pos] + "".join(rng.choice(UNICODE) for _ in range(rng.randint(1, 10))) + s[pos:]
    if op == 7:  # a huge number somewhere
        return s[:pos] + _huge_number(rng) + s[pos:]
    if op == 8:  # deep JSON nesting as the arguments (inside the call body)
        return f'{OPEN}{{"name": {json.dumps(rng.choice(names))}, "arguments": {_deep(rng)}}}{CLOSE}'
    if op == 9:  # right shape, wrong values
        args = {rng.choice(["expression", "city", "account", "user", "pin", "query", "", "x" * 50]): _value(rng, names)
                for _ in range(rng.randint(0, 3))}
        return render(ToolCall(rng.choice(names), args))
    if op == 10:  # name of the wrong type / missing
        obj = rng.choice([{"name": _value(rng, names), "arguments": {}}, {"arguments": {}}, [], "call", 3, None,
                          {"name": rng.choice(names), "arguments": _value(rng, names)}])
        return f"{OPEN}{json.dumps(obj)}{CLOSE}"
    if op == 11:  # OpenAI-style arguments as a string, valid or not
        inner = rng.choice(['{"expression": "1+2"}', '{"city": "Vel"}', "{not json", "", "[]", '"str"'])
        return f'{OPEN}{{"name": {json.dumps(rng.choice(names))}, "arguments": {json.dumps(inner)}}}{CLOSE}'
    if op == 12:  # many calls in one turn
        return s * rng.randint(2, 12)
    if op == 13:  # surrounding prose
        return _random_text(rng, rng.randint(0, 20)) + s + _random_text(rng, rng.randint(0, 20))
    if op == 14:  # pure garbage
        return _random_text(rng, rng.randint(0, 80))
    return s  # unchanged: real calls must keep working


def _fuzz_strings(seeds: list[str], names: list[str], n: int, rng: random.Random) -> list[str]:
    out = []
    for _ in range(n):
        s = rng.choice(seeds)
        for _ in range(rng.choice([1, 1, 2, 3])):
            s = mutate(s, rng, names)
        out.append(s)
    return out


def _run(env, tasks, strings) -> dict[str, int]:
    counts = {"invalid": 0, "tool_ok": 0, "tool_error": 0, "final": 0}
    for k, text in enumerate(strings):
        task = tasks[k % len(tasks)]
        try:
            env.reset(seed=k, options={"task": task})
            actions = parse_turn(text)
            assert actions, "parse_turn returned no action"
            for action in actions:
                obs, reward, terminated, truncated, info = env.step(action)
                assert isinstance(obs, str) and isinstance(terminated, bool) and not truncated
                if isinstance(action, InvalidAction):
                    assert obs.startswith("error (bad_arguments)") and info["tool_error"] == "bad_arguments"
                    counts["invalid"] += 1
                elif isinstance(action, ToolCall):
                    if info["tool_ok"]:
                        counts["tool_ok"] += 1
                    else:
                        assert obs.startswith("error (") and info["tool_error"] in ERROR_KINDS, obs[:200]
                        counts["tool_error"] += 1
                        counts[info["tool_error"]] = counts.get(info["tool_error"], 0) + 1
                else:
                    assert isinstance(action, FinalAnswer) and terminated and reward in (0.0, 1.0)
                    counts["final"] += 1
                if terminated:
                    break
        except Exception as exc:  # report the offending string, not just the exception
            pytest.fail(f"{type(exc).__name__}: {str(exc)[:200]} on input {text[:300]!r}")
    return counts


@pytest.mark.parametrize("name", ["arithmetic", "api-catalog"])
def test_fuzzed_tool_calls_never_crash(name):
    t0 = time.monotonic()
    rng = random.Random(20240517 if name == "arithmetic" else 7)
    suite = SUITES.get(name)() if name == "arithmetic" else ApiCatalogSuite()
    tasks = suite.sample_tasks(20, split="train", seed=0)
    seeds = [render(a) for t in tasks for a in suite.expert_actions(t) if isinstance(a, ToolCall)]
    seeds += [f"{render(a)}\nThe answer is 12." for t in tasks[:3] for a in suite.expert_actions(t)[:1]]
    seeds += [t.answer for t in tasks[:3]]
    names = ([s.name for s in catalog()] if name == "api-catalog" else []) + ["calculator", "python", "", "x" * 200]
    strings = _fuzz_strings(seeds, names, N_PER_ENV, rng)
    counts = _run(suite.make_env(), tasks, strings)
    # the fuzzer reaches every outcome: parser errors, tool errors, successful calls, answers
    assert all(counts[k] > 50 for k in ("invalid", "tool_ok", "tool_error", "final")), counts
    if name == "api-catalog":
        assert counts.get("denied", 0) > 0 and counts.get("not_found", 0) > 0, counts
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("text", [
    OPEN + '{"name": "calculator", "arguments": {"expression": ' + "1" * 5000 + "}}" + CLOSE,
    OPEN + json.dumps({"name": "calculator", "arguments": '{"expression": ' + "1" * 5000 + "}"}) + CLOSE,
    OPEN + json.dumps({"name": "calculator", "arguments": "[" * 100_000}) + CLOSE,
], ids=["huge-int-body", "huge-int-string-arguments", "deep-string-arguments"])
def test_pathological_json_is_an_invalid_action(text):
    actions = parse_turn(text)
    assert len(actions) == 1 and isinstance(actions[0], InvalidAction)
