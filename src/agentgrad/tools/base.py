"""Tool protocol, the `@tool` decorator and `ToolSet`.

A tool is a typed callable with a JSON schema and a category. Calling it never raises into the agent loop:
every failure comes back as a `ToolResult` with `ok=False` and a typed `error_kind`. Tools never import torch.
"""

from __future__ import annotations

import enum
import inspect
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from agentgrad.registry import Registry
from agentgrad.types import ToolCall


class ToolErrorKind(str, enum.Enum):
    TIMEOUT = "timeout"
    BAD_ARGUMENTS = "bad_arguments"
    DENIED = "denied"
    CRASHED = "crashed"
    NOT_FOUND = "not_found"


@dataclass(frozen=True)
class ToolResult:
    """What a tool returns. `signals` holds verifiable facts (e.g. {"results": 3}, {"exit_code": 0}) that
    process rewards read; `text` is what the policy sees as the observation."""

    text: str
    ok: bool = True
    error_kind: ToolErrorKind | None = None
    signals: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def error(cls, kind: ToolErrorKind, message: str, **signals: Any) -> ToolResult:
        return cls(text=f"error ({kind.value}): {message}", ok=False, error_kind=kind, signals=signals)


@runtime_checkable
class Tool(Protocol):
    name: str
    category: str
    description: str
    parameters: Mapping[str, Any]  # JSON schema of the arguments object

    def __call__(self, **arguments: Any) -> ToolResult: ...


class ToolArgumentError(ValueError):
    """Arguments that do not match a tool's schema."""


_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _json_type(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation)
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    if origin in (list, tuple):
        args = typing.get_args(annotation)
        return {"type": "array", "items": _json_type(args[0]) if args else {}}
    if origin is dict:
        return {"type": "object"}
    if origin is typing.Literal:
        values = list(typing.get_args(annotation))
        return {**_json_type(type(values[0])), "enum": values}
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        non_none = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(non_none) == 1:
            return _json_type(non_none[0])
    raise TypeError(f"@tool cannot map type {annotation!r} to JSON schema; use str, int, float, bool, list, dict")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Google-style docstring -> (summary, {arg: description})."""
    doc = inspect.cleandoc(doc or "")
    summary_lines: list[str] = []
    params: dict[str, str] = {}
    in_args = False
    current: str | None = None
    for line in doc.splitlines():
        stripped = line.strip()
        if re.fullmatch(r"(Args|Arguments|Parameters):", stripped):
            in_args = True
            continue
        if in_args:
            if re.fullmatch(r"[A-Z][a-z]+:", stripped):  # next section (Returns:, Raises:)
                in_args = False
                continue
            m = re.match(r"(\w+)\s*(\([^)]*\))?:\s*(.*)", stripped)
            if m and line.startswith((" ", "\t")) and not line.startswith(("        ", "\t\t")):
                current = m.group(1)
                params[current] = m.group(3)
            elif current and stripped:
                params[current] += " " + stripped
        elif stripped or summary_lines:
            summary_lines.append(stripped)
    summary = " ".join(s for s in summary_lines if s).strip()
    return summary, params


def _check_value(name: str, value: Any, schema: Mapping[str, Any]) -> Any:
    kind = schema.get("type")
    if kind == "integer":
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ToolArgumentError(f"argument {name!r} must be an integer, got {type(value).__name__}")
    elif kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ToolArgumentError(f"argument {name!r} must be a number, got {type(value).__name__}")
    elif kind == "string":
        if not isinstance(value, str):
            raise ToolArgumentError(f"argument {name!r} must be a string, got {type(value).__name__}")
    elif kind == "boolean":
        if not isinstance(value, bool):
            raise ToolArgumentError(f"argument {name!r} must be a boolean, got {type(value).__name__}")
    elif kind == "array":
        if not isinstance(value, list):
            raise ToolArgumentError(f"argument {name!r} must be an array, got {type(value).__name__}")
    elif kind == "object":
        if not isinstance(value, dict):
            raise ToolArgumentError(f"argument {name!r} must be an object, got {type(value).__name__}")
    if "enum" in schema and value not in schema["enum"]:
        raise ToolArgumentError(f"argument {name!r} must be one of {schema['enum']}, got {value!r}")
    return value


def validate_arguments(parameters: Mapping[str, Any], arguments: Mapping[str, Any], *,
                       allow_extra: bool = False) -> dict[str, Any]:
    """Check `arguments` against a JSON-schema object (the subset `@tool` produces: properties, required, and
    each property's `type` and `enum`; other keywords pass). Raises ToolArgumentError. `allow_extra` lets
    names the schema does not list through unchecked (a schema with `additionalProperties`)."""
    if not isinstance(arguments, Mapping):
        raise ToolArgumentError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    props: Mapping[str, Any] = parameters.get("properties", {})
    unknown = sorted(set(arguments) - set(props))
    if unknown and not allow_extra:
        raise ToolArgumentError(f"unknown argument(s) {unknown}; valid: {sorted(props)}")
    missing = [r for r in parameters.get("required", []) if r not in arguments]
    if missing:
        raise ToolArgumentError(f"missing required argument(s) {missing}")
    return {k: _check_value(k, v, props[k]) if isinstance(props.get(k), Mapping) else v for k, v in arguments.items()}


class FunctionTool:
    """A Python function wrapped as a Tool. Built by `@tool`; arguments are validated before the call, and any
    exception the function raises comes back as a `crashed` result."""

    def __init__(self, fn: Callable[..., Any], *, name: str, category: str, description: str,
                 parameters: Mapping[str, Any]) -> None:
        self.fn = fn
        self.name = name
        self.category = category
        self.description = description
        self.parameters = parameters

    def __call__(self, **arguments: Any) -> ToolResult:
        try:
            args = validate_arguments(self.parameters, arguments)
        except ToolArgumentError as exc:
            return ToolResult.error(ToolErrorKind.BAD_ARGUMENTS, str(exc))
        try:
            out = self.fn(**args)
        except ToolArgumentError as exc:
            return ToolResult.error(ToolErrorKind.BAD_ARGUMENTS, str(exc))
        except Exception as exc:  # a tool must never raise into the agent loop
            return ToolResult.error(ToolErrorKind.CRASHED, f"{type(exc).__name__}: {exc}")
        return out if isinstance(out, ToolResult) else ToolResult(text=str(out))

    def schema(self) -> dict[str, Any]:
        return tool_schema(self)

    def __repr__(self) -> str:
        return f"FunctionTool({self.category}.{self.name})"


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, category: str = "general"):
    """Turn a typed, documented function into a Tool.

    The JSON schema comes from the type hints; descriptions come from the Google-style docstring
    (summary line and `Args:` section). The function may return a `ToolResult` or any value (stringified).

    >>> @tool(category="math")
    ... def add(a: int, b: int) -> int:
    ...     '''Add two integers.
    ...
    ...     Args:
    ...         a: first addend
    ...         b: second addend
    ...     '''
    ...     return a + b
    >>> add(a=2, b=3).text
    '5'
    >>> add.parameters["required"]
    ['a', 'b']
    """

    def wrap(f: Callable[..., Any]) -> FunctionTool:
        hints = typing.get_type_hints(f)
        summary, arg_docs = _parse_docstring(f.__doc__ or "")
        props: dict[str, Any] = {}
        required: list[str] = []
        for pname, param in inspect.signature(f).parameters.items():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"@tool function {f.__name__} cannot take *args/**kwargs")
            if pname not in hints:
                raise TypeError(f"@tool function {f.__name__}: parameter {pname!r} needs a type hint")
            prop = _json_type(hints[pname])
            if pname in arg_docs:
                prop["description"] = arg_docs[pname]
            if param.default is inspect.Parameter.empty:
                required.append(pname)
            props[pname] = prop
        parameters = {"type": "object", "properties": props, "required": required}
        return FunctionTool(f, name=name or f.__name__, category=category, description=summary,
                            parameters=parameters)

    return wrap(fn) if fn is not None else wrap


def tool_schema(t: Tool) -> dict[str, Any]:
    """The OpenAI/HF function-calling schema that chat templates render."""
    return {"type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": dict(t.parameters)}}


class ToolSet:
    """Tools grouped by category. `call` is total: unknown tools and bad arguments become error results."""

    def __init__(self, tools: list[Tool] | tuple[Tool, ...]) -> None:
        self._tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self._tools:
                raise ValueError(f"duplicate tool name {t.name!r}")
            self._tools[t.name] = t

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def categories(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for t in self._tools.values():
            out.setdefault(t.category, []).append(t.name)
        return out

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def schemas(self) -> list[dict[str, Any]]:
        return [tool_schema(t) for t in self._tools.values()]

    def overlaid(self, tools: Sequence[Tool]) -> ToolSet:
        """These tools with `tools` on top: one of the same name takes the other's place (so the prompt keeps
        its order), the rest come after."""
        served = {t.name: t for t in tools}
        return ToolSet([served.pop(t.name, t) for t in self._tools.values()] + list(served.values()))

    def call(self, call: ToolCall) -> ToolResult:
        t = self._tools.get(call.name)
        if t is None:
            return ToolResult.error(ToolErrorKind.NOT_FOUND,
                                    f"unknown tool {call.name!r}; available: {', '.join(self._tools)}")
        try:
            result = t(**dict(call.arguments))
        except TypeError as exc:  # a non-FunctionTool with a mismatched signature
            return ToolResult.error(ToolErrorKind.BAD_ARGUMENTS, str(exc))
        except Exception as exc:
            return ToolResult.error(ToolErrorKind.CRASHED, f"{type(exc).__name__}: {exc}")
        return result

    def __len__(self) -> int:
        return len(self._tools)

    def __iter__(self):
        return iter(self._tools.values())


# Factories, not instances: a factory may open resources (a corpus, a sandbox pool) per env. Names that are not
# registered resolve as import paths (`my_pkg.tools:convert`) or entry points of `agentgrad.tools`.
TOOLS: Registry[Callable[[], Tool]] = Registry("tool", plugins=True, entry_point_group="agentgrad.tools")


def make_tool(name: str) -> Tool:
    """The tool `name` names: a registered factory's product, or what an import path / entry point points at,
    which may be a `@tool` function (a Tool itself) or a zero-argument factory that returns one."""
    obj: Any = TOOLS.get(name)
    if not isinstance(obj, type) and isinstance(obj, Tool):
        return obj
    made = obj()
    if not isinstance(made, Tool):
        raise TypeError(f"tool {name!r} resolved to {type(obj).__name__}, which is neither a Tool (e.g. a @tool "
                        f"function) nor a factory returning one (it returned {type(made).__name__})")
    return made
