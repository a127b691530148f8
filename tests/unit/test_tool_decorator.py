from typing import Literal

import pytest

from agentgrad.tools.base import ToolErrorKind, ToolSet, tool
from agentgrad.types import ToolCall


@tool(category="weather")
def forecast(city: str, days: int = 1, unit: Literal["c", "f"] = "c", detailed: bool | None = None) -> str:
    """Forecast the weather.

    Args:
        city: city name
        days: how many days
            ahead (1-7)
        unit: temperature unit
    """
    if days > 7:
        raise ValueError("too far ahead")
    return f"{city}: sunny for {days} day(s)"


def test_schema_from_hints_and_docstring():
    assert forecast.name == "forecast" and forecast.category == "weather"
    assert forecast.description == "Forecast the weather."
    props = forecast.parameters["properties"]
    assert props["city"] == {"type": "string", "description": "city name"}
    assert props["days"] == {"type": "integer", "description": "how many days ahead (1-7)"}
    assert props["unit"]["enum"] == ["c", "f"]
    assert props["detailed"] == {"type": "boolean"}
    assert forecast.parameters["required"] == ["city"]


def test_calls_validate_and_never_raise():
    assert forecast(city="Oslo", days=2).text == "Oslo: sunny for 2 day(s)"
    assert forecast(city="Oslo", days="2").error_kind is ToolErrorKind.BAD_ARGUMENTS
    assert forecast(city="Oslo", unit="k").error_kind is ToolErrorKind.BAD_ARGUMENTS
    assert forecast(city="Oslo", bogus=1).error_kind is ToolErrorKind.BAD_ARGUMENTS
    crashed = forecast(city="Oslo", days=9)
    assert crashed.error_kind is ToolErrorKind.CRASHED and "too far ahead" in crashed.text


def test_toolset_categories_and_unknown_tool():
    ts = ToolSet([forecast])
    assert ts.categories() == {"weather": ["forecast"]}
    assert ts.call(ToolCall("nope", {})).error_kind is ToolErrorKind.NOT_FOUND
    with pytest.raises(ValueError):
        ToolSet([forecast, forecast])


def test_untyped_parameter_is_rejected_at_definition():
    with pytest.raises(TypeError):
        @tool
        def bad(x):
            return x
