from agentgrad.rollout.parser import parse_turn
from agentgrad.types import FinalAnswer, InvalidAction, ToolCall


def call(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_valid_call():
    [a] = parse_turn(call('{"name": "calculator", "arguments": {"expression": "1 + 2"}}'))
    assert a == ToolCall("calculator", {"expression": "1 + 2"})


def test_no_call_is_final_answer():
    assert parse_turn("  The answer is 42. ") == [FinalAnswer("The answer is 42.")]


def test_truncated_json_is_invalid():
    [a] = parse_turn(call('{"name": "calculator", "arguments": {"expression": "1 +'))
    assert isinstance(a, InvalidAction) and "not valid JSON" in a.error


def test_unterminated_tag_is_invalid():
    [a] = parse_turn('<tool_call>\n{"name": "calculator", "arguments": {}}')
    assert isinstance(a, InvalidAction) and "unterminated" in a.error


def test_unknown_tool_parses_and_is_left_to_the_env():
    [a] = parse_turn(call('{"name": "teleport", "arguments": {}}'))
    assert a == ToolCall("teleport", {})


def test_nested_tags_are_invalid():
    [a] = parse_turn("<tool_call><tool_call>{}</tool_call>")
    assert isinstance(a, InvalidAction) and "nested" in a.error


def test_stray_close_tag_is_invalid():
    actions = parse_turn("oops </tool_call>")
    assert len(actions) == 1 and isinstance(actions[0], InvalidAction)


def test_missing_name_and_bad_arguments():
    [a] = parse_turn(call('{"arguments": {}}'))
    assert isinstance(a, InvalidAction) and "name" in a.error
    [b] = parse_turn(call('{"name": "calculator", "arguments": [1, 2]}'))
    assert isinstance(b, InvalidAction) and "arguments" in b.error
    [c] = parse_turn(call("[1, 2]"))
    assert isinstance(c, InvalidAction)


def test_openai_style_string_arguments():
    [a] = parse_turn(call('{"name": "calculator", "arguments": "{\\"expression\\": \\"3*3\\"}"}'))
    assert a == ToolCall("calculator", {"expression": "3*3"})


def test_several_calls_in_one_turn_keep_order():
    text = call('{"name": "a", "arguments": {}}') + "\n" + call('{"name": "b", "arguments": {"x": 1}}')
    assert parse_turn(text) == [ToolCall("a", {}), ToolCall("b", {"x": 1})]


def test_deeply_nested_json_does_not_crash():
    body = '{"name": "a", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}"
    [a] = parse_turn(call(body))
    assert isinstance(a, InvalidAction)
