"""The tool-call formats behind TOOL_FORMATS: one signature, total parsers (malformed calls are InvalidActions,
never exceptions), and the format read off each chat template."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from agentgrad.models.chat_templates import TEMPLATE_FAMILIES
from agentgrad.rollout.formats import TOOL_FORMATS, detect_tool_format
from agentgrad.types import FinalAnswer, InvalidAction, ToolCall

DATA = Path(__file__).resolve().parent.parent / "data" / "chat_templates"
CALC = ToolCall("calculator", {"expression": "1+2"})


def parse(fmt: str, text: str):
    return TOOL_FORMATS.get(fmt).parse(text)


def test_every_template_names_its_format():
    assert {f: detect_tool_format(TEMPLATE_FAMILIES.get(f).template) for f in TEMPLATE_FAMILIES} == {
        "tiny": "hermes", "qwen2.5": "hermes", "qwen3": "qwen3", "llama3": "llama3_json"}
    assert detect_tool_format((DATA / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()) == "hermes"
    assert detect_tool_format((DATA / "Qwen-Qwen3-0.6B.jinja").read_text()) == "qwen3"
    assert detect_tool_format((DATA / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()) == "llama3_json"


def test_qwen3_reads_calls_after_the_think_block_only():
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>'
    assert parse("qwen3", f"<think>\nI will add.\n</think>\n\n{call}") == [CALC]
    assert parse("qwen3", call) == [CALC]  # thinking off: no block at all
    assert parse("qwen3", f"<think>\n{call}\n</think>\n\n3") == [FinalAnswer("3")]  # a call in a thought is a thought
    [bad] = parse("qwen3", "<think>\nstill thinking")
    assert isinstance(bad, InvalidAction) and "unterminated think block" in bad.error
    [broken] = parse("qwen3", '<think>\n\n</think>\n\n<tool_call>\n{"name": "calculator", "argu\n</tool_call>')
    assert isinstance(broken, InvalidAction) and "not valid JSON" in broken.error


def test_llama3_json_reads_one_call_or_an_answer():
    assert parse("llama3_json", '{"name": "calculator", "parameters": {"expression": "1+2"}}') == [CALC]
    assert parse("llama3_json", '<|python_tag|>{"name": "calculator", "arguments": {"expression": "1+2"}}') == [CALC]
    assert parse("llama3_json", " The answer is 3. ") == [FinalAnswer("The answer is 3.")]
    cases = {'{"name": "calculator", "parameters": {"expression": "1+': "not valid JSON",
             '{"parameters": {}}': "name",
             '{"name": "calculator", "parameters": [1]}': "arguments",
             '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}': "one tool call per turn",
             '{"name": "a", "parameters": {}} and then some': "text after"}
    for text, reason in cases.items():
        [a] = parse("llama3_json", text)
        assert isinstance(a, InvalidAction) and reason in a.error, (text, a)


@pytest.mark.parametrize("fmt", ["hermes", "qwen3", "llama3_json"])
def test_parsers_are_total_on_garbage(fmt):
    """Random splices of call syntax never raise; every action is one of the three kinds."""
    pieces = ["<tool_call>", "</tool_call>", "<think>", "</think>", "{", "}", '"name"', ": ", '"calculator"', ",",
              '"parameters"', '"arguments"', "[", "]", "1" * 5000, "\n", ";", "<|python_tag|>", "\\", '"', "x"]
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        for action in parse(fmt, text):
            assert isinstance(action, (ToolCall, FinalAnswer, InvalidAction))
    deep = "{" + '"a": [' * 100000
    text = deep if fmt == "llama3_json" else f"<tool_call>{deep}</tool_call>"
    assert all(isinstance(a, InvalidAction) for a in parse(fmt, text))
