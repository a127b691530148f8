"""The configuration reference, from the config's own help text (`agentgrad config`): written once, in config.py."""

from __future__ import annotations

from pydantic import BaseModel

from agentgrad.config import Config


def describe(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every field: the `--help` of `agentgrad config`."""
    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += describe(ann, f"{prefix}{name}.")
        else:
            default = field.get_default(call_default_factory=True)
            rows.append((f"{prefix}{name}", repr(default), field.description or ""))
    return rows
