"""Load a causal LM and its tokenizer from a local directory or hub id (no downloads happen in our tests)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentgrad.models.chat_templates import TOOL_TAG_TOKENS
from agentgrad.models.tiny import AS_TRAINED


class ModelLoadError(RuntimeError):
    pass


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    pad_token_id: int


def _check_template(tokenizer: Any, path: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError(f"{path}: the tokenizer has no chat template; agentgrad needs one that renders "
                             "tools and tool calls (e.g. Qwen2.5's)")
    probe_tool = {"type": "function", "function": {"name": "probe_tool", "description": "d",
                                                   "parameters": {"type": "object", "properties": {}}}}
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe_tool], tokenize=False,
                                         add_generation_prompt=True)
    if "probe_tool" not in text:
        raise ModelLoadError(f"{path}: the chat template does not render tool schemas")


def _loads_as_trained(path: str) -> bool:
    """A tiny model's tokenizer (marked `AS_TRAINED`; always a local directory): it loads with its own
    pre-tokenizer, not the one transformers gives its model family."""
    config = Path(path) / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text(encoding="utf-8")).get(AS_TRAINED))


def load_model(path: str | Path, *, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """Load with AutoModelForCausalLM/AutoTokenizer, check the template renders tools, and resolve stop ids.

    Stop ids: the tokenizer's eos plus `<|im_end|>` when the vocabulary has it (Qwen's chat end-of-turn).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    path = str(path)
    try:
        tokenizer = (PreTrainedTokenizerFast if _loads_as_trained(path) else AutoTokenizer).from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    except OSError as exc:
        raise ModelLoadError(f"could not load a model from {path!r}: {exc}") from exc
    model.to(device)
    _check_template(tokenizer, path)
    vocab = tokenizer.get_vocab()
    missing = [t for t in TOOL_TAG_TOKENS[:2] if t not in vocab]
    if missing and TOOL_TAG_TOKENS[0] in tokenizer.chat_template:  # a <tool_call> format (not Llama 3's JSON)
        # Not fatal: the parser works on text, but tags split over several tokens make calls harder to learn.
        import warnings

        warnings.warn(f"{path}: tool tags {missing} are not single tokens in this vocabulary", stacklevel=2)
    eos_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    if "<|im_end|>" in vocab:
        eos_ids.add(vocab["<|im_end|>"])
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        eos_ids.add(gen_eos)
    elif isinstance(gen_eos, (list, tuple)):
        eos_ids.update(gen_eos)
    if not eos_ids:
        raise ModelLoadError(f"{path}: cannot tell which token ends a turn (no eos token)")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    return LoadedModel(model=model, tokenizer=tokenizer, eos_token_ids=tuple(sorted(eos_ids)), pad_token_id=pad)


def model_parts(model: Any) -> tuple[Any, Any]:
    """(decoder stack returning hidden states, lm head) of an HF causal LM."""
    body = getattr(model, model.base_model_prefix, None)
    head = model.get_output_embeddings()
    if body is None or head is None:
        raise TypeError(f"{type(model).__name__}: cannot find the decoder and lm head")
    return body, head


def hidden_states(body: Any, input_ids: Any, attention_mask: Any) -> Any:
    """The final-norm hidden states (B, T, H) of a decoder stack over right-padded input: what the lm head, an
    action head and a value head all read."""
    return body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
