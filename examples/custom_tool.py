"""A user-defined tool: typed arguments and a docstring are all `@tool` needs to build the JSON schema.

Run: python examples/custom_tool.py, or from the repository root (docs/your-own-tool.md):
    agentgrad tool run examples.custom_tool:convert --args '{"amount": 10, "source": "EUR", "target": "USD"}'
    agentgrad train env=jsonl env.options.path=examples/convert_tasks.jsonl
"""

from agentgrad.tools import ToolSet, tool
from agentgrad.types import ToolCall

EXCHANGE_RATES = {"EUR": 1.0, "USD": 1.08, "JPY": 162.4}


@tool(category="finance")
def convert(amount: float, source: str, target: str) -> str:
    """Convert money between currencies.

    Args:
        amount: how much money, in the source currency
        source: currency code such as EUR
        target: currency code such as USD
    """
    if source not in EXCHANGE_RATES or target not in EXCHANGE_RATES:
        raise ValueError(f"unknown currency; known: {sorted(EXCHANGE_RATES)}")  # becomes a `crashed` result
    return f"{amount / EXCHANGE_RATES[source] * EXCHANGE_RATES[target]:.2f} {target}"


if __name__ == "__main__":
    import json

    tools = ToolSet([convert])
    print("schema:", json.dumps(tools.schemas()[0]))  # what the model sees in its prompt
    for call in (ToolCall("convert", {"amount": 10, "source": "EUR", "target": "USD"}),
                 ToolCall("convert", {"amount": 10, "source": "EUR", "target": "GBP"}),  # raises: a typed error
                 ToolCall("convert", {"amount": "ten", "source": "EUR", "target": "USD"})):  # schema violation
        result = tools.call(call)
        kind = result.error_kind.value if result.error_kind else None
        print(f"{json.dumps(dict(call.arguments))} -> ok={result.ok} error_kind={kind} text={result.text!r}")
