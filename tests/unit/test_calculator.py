import warnings

import pytest

from agentgrad.tools.base import ToolErrorKind
from agentgrad.tools.calculator import CalculatorError, calculator, evaluate


@pytest.mark.parametrize("expr,value", [("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("7 / 2", 3.5), ("-4 - -4", 0),
                                        ("2 ** 10", 1024), ("17 // 5", 3), ("17 % 5", 2), ("6 / 3", 2)])
def test_evaluates_arithmetic(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os').system('true')", "open('/etc/passwd')", "x + 1", "(1).real",
                                  "[1, 2]", "lambda: 1", "1 if 1 else 2", "'a' * 3", "9 ** 9 ** 9", "1 / 0", "",
                                  "1" * 300, "True + 1"])
def test_rejects_anything_but_arithmetic(expr):
    with pytest.raises(CalculatorError):
        evaluate(expr)


def test_tool_returns_typed_errors_and_signals():
    ok = calculator(expression="12 * 34")
    assert ok.ok and ok.text == "408" and ok.signals == {"value": 408}
    bad = calculator(expression="import os")
    assert not bad.ok and bad.error_kind is ToolErrorKind.BAD_ARGUMENTS
    wrong_type = calculator(expression=5)
    assert wrong_type.error_kind is ToolErrorKind.BAD_ARGUMENTS
    missing = calculator()
    assert missing.error_kind is ToolErrorKind.BAD_ARGUMENTS and "missing" in missing.text


@pytest.mark.parametrize("expr", ["2doc_id 1", "1if 1 else 2", "0x1for"])
def test_text_python_warns_about_is_rejected_without_a_warning(expr):
    """Python's parser prints a SyntaxWarning for these (a number run into a name); a policy that writes them
    must get an error observation, not a line on the trainer's stderr per call."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CalculatorError, match="not a valid arithmetic expression"):
            evaluate(expr)
    assert caught == []
