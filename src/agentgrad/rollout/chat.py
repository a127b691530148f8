"""Token-in/token-out chat encoding.

Training ids are never re-tokenised from a rendered chat: the prompt is encoded once, the policy's sampled ids
are kept as they were sampled, and each observation is encoded as the *suffix* the chat template adds after
the policy's end-of-turn token. The same codec encodes expert turns for BC, so demonstrations and RL rollouts
are byte-identical in format.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentgrad.types import Message


class ChatTemplateError(ValueError):
    pass


class ChatCodec:
    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self._eos_texts = [tokenizer.convert_ids_to_tokens(i) for i in self.eos_token_ids]

    def render(self, messages: Sequence[Message], tools: Sequence[dict] | None = None, *,
               add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template([m.to_chat() for m in messages], tools=list(tools) if tools else None,
                                                  tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated ids. Tool tags are added-but-not-special tokens, so they survive skip_special."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[dict] | None = None) -> list[int]:
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def _after_eos(self, text: str) -> str:
        """What the template writes after the last end-of-turn token (e.g. Qwen's trailing newline)."""
        cut = max((text.rfind(e), e) for e in self._eos_texts)
        if cut[0] < 0:
            raise ChatTemplateError("the chat template does not end assistant turns with the eos token")
        return text[cut[0] + len(cut[1]):]

    def observation_ids(self, tool_messages: Sequence[Message]) -> list[int]:
        """Ids to append after a policy turn that ended with eos: the observation plus the next generation
        prompt, exactly as the template renders them."""
        base = [Message("user", "u"), Message("assistant", "a")]
        base_text = self.render(base)
        full_text = self.render([*base, *tool_messages], add_generation_prompt=True)
        if not full_text.startswith(base_text):
            raise ChatTemplateError("the chat template is not incremental: appending messages changed earlier text")
        return self.encode(self._after_eos(base_text) + full_text[len(base_text):])

    def assistant_ids(self, message: Message) -> list[int]:
        """Ids of one assistant turn, ending with its eos token, as the policy would have to generate them."""
        base = [Message("user", "u")]
        base_text = self.render(base, add_generation_prompt=True)
        full_text = self.render([*base, message])
        if not full_text.startswith(base_text):
            raise ChatTemplateError("the chat template is not incremental for assistant turns")
        turn = full_text[len(base_text):]
        tail = self._after_eos(turn)
        return self.encode(turn[: len(turn) - len(tail)] if tail else turn)
