"""Calculator tool: evaluates arithmetic by walking the AST (never `eval`)."""

from __future__ import annotations

import ast
import math
import operator
import threading
import warnings

from agentgrad.tools.base import TOOLS, ToolErrorKind, ToolResult, tool

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_ABS_VALUE = 10**30  # bounds the work a single call can do (e.g. 9**9**9)


class CalculatorError(ValueError):
    pass


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
            raise CalculatorError("exponent too large")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        if isinstance(value, complex) or abs(value) > MAX_ABS_VALUE:
            raise CalculatorError("result out of range")
        return value
    raise CalculatorError(f"unsupported syntax: {type(node).__name__}")


_PARSE_LOCK = threading.Lock()


def evaluate(expression: str) -> int | float:
    """Evaluate +, -, *, /, //, %, ** and parentheses over numbers. Raises CalculatorError on anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        # the policy's text, not ours: "1if" would print a SyntaxWarning per call. The filter is process-wide and
        # tools run in a thread pool, so one parse at a time keeps concurrent calls from restoring each other's
        # filters out of order.
        with _PARSE_LOCK, warnings.catch_warnings():
            warnings.simplefilter("error", SyntaxWarning)
            tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):  # ValueError: null bytes, lone surrogates
        raise CalculatorError("not a valid arithmetic expression") from None
    value = _eval(tree)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CalculatorError("result is not finite")
        if value.is_integer():
            return int(value)
        return round(value, 6)
    return value


@tool(category="math")
def calculator(expression: str) -> ToolResult:
    """Evaluate an arithmetic expression.

    Args:
        expression: arithmetic using + - * / and parentheses, e.g. "12 * (3 + 4)"
    """
    try:
        value = evaluate(expression)
    except CalculatorError as exc:
        return ToolResult.error(ToolErrorKind.BAD_ARGUMENTS, str(exc))
    return ToolResult(text=str(value), signals={"value": value})


TOOLS.add("calculator", lambda: calculator)
