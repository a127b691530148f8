"""Chat templates that render tool schemas and tool calls (Jinja, as Hugging Face tokenizers store them).

`TINY_TEMPLATE` follows Qwen2.5's format (`<tool_call>{json}</tool_call>`, tool results as `<tool_response>`
inside a user turn) with a compact system preamble and tools
rendered as one-line signatures (`calculator(expression: string): Evaluate ...`) instead of JSON schemas. HF renders
with trim_blocks, so a newline right after a block tag must be written as an expression: a tiny model pays for every
prompt token in BC.

`TEMPLATE_FAMILIES` are the families `model.chat_template` names (tiny, qwen2.5, qwen3, llama3): a template and
the tokens the tiny model's tokenizer gets for it. The qwen3 and llama3 templates are files in templates/
(docs/chat-templates.md says how each relates to the model maker's own, which tests/data/chat_templates holds).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agentgrad.registry import Registry

TINY_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "<tools>\n"
    "{% for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}"
    "{{ f.name }}("
    "{% for pname, p in (f.parameters.properties if f.parameters is defined else {}).items() %}"
    "{{ pname }}: {{ p.type }}{% if not loop.last %}, {% endif %}{% endfor %}"
    "): {{ f.description }}\n{% endfor %}"
    "</tools><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' %}"
    "<|im_start|>user\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ message.content if message.content else '' }}"
    "{% for tc in (message.tool_calls or []) %}"
    "{% set f = tc.function if tc.function is defined else tc %}"
    "<tool_call>\n{\"name\": \"{{ f.name }}\", \"arguments\": "
    "{{ f.arguments if f.arguments is string else f.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' }}{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Tokens shared by the tiny tokenizer and Qwen2.5's vocabulary.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added but *not* special: decoding with skip_special_tokens=True must keep them, or tool calls vanish.
TOOL_TAG_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# The Qwen2.5-Instruct tool-calling format (a default system prompt, JSON schemas in a "# Tools" section,
# `<tool_call>` blocks, consecutive tool results grouped in one user turn), written out for tests and for
# tokenizers that lack a template. A real Qwen checkpoint brings its own template; this one renders the same text.
QWEN25_STYLE_TEMPLATE = (
    "{% set default_system = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}"
    "{% if tools %}"
    "<|im_start|>system\n{{ messages[0].content if messages[0].role == 'system' else default_system }}"
    "{{ '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '"
    " '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": '"
    " '<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% else %}"
    "<|im_start|>system\n{{ default_system }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant{% if message.content %}{{ '\\n' + message.content }}{% endif %}"
    "{% for tc in (message.tool_calls or []) %}{% set f = tc.function if tc.function is defined else tc %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{{ f.arguments if f.arguments is string else f.arguments | tojson }}{{ '}\\n</tool_call>' }}"
    "{% endfor %}{% if not message.tool_calls and not message.content %}{{ '\\n' }}{% endif %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _shipped(name: str) -> str:
    return (Path(__file__).parent / "templates" / name).read_text()


@dataclass(frozen=True)
class TemplateFamily:
    """A chat-template family agentgrad ships: its template, and the tokens the tiny model's tokenizer gets for it
    (a real checkpoint's vocabulary must already hold `required`). `tool_format` names its parser
    (rollout/formats.py)."""

    name: str
    template: str
    tool_format: str
    special_tokens: tuple[str, ...]  # trained into the tiny BPE first, in this order (ids 0, 1, ...)
    additional_special: tuple[str, ...]  # of those, the ones the HF tokenizer lists as additional special tokens
    added_tokens: tuple[str, ...]  # added but not special: decoding with skip_special_tokens keeps them
    eos_token: str
    pad_token: str
    bos_token: str | None = None
    description: str = ""

    @property
    def required(self) -> tuple[str, ...]:
        return self.special_tokens + self.added_tokens


_QWEN_SPECIAL = tuple(SPECIAL_TOKENS)
LLAMA3_SPECIAL = ("<|end_of_text|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>")
THINK_TOKENS = ("<think>", "</think>")

TEMPLATE_FAMILIES: Registry[TemplateFamily] = Registry("chat-template family")
TEMPLATE_FAMILIES.add("tiny", TemplateFamily(
    "tiny", TINY_TEMPLATE, "hermes", _QWEN_SPECIAL, ("<|im_start|>", "<|im_end|>"), tuple(TOOL_TAG_TOKENS),
    "<|im_end|>", "<|endoftext|>", description="the default: Qwen2.5's format with a compact tool preamble"))
TEMPLATE_FAMILIES.add("qwen2.5", TemplateFamily(
    "qwen2.5", QWEN25_STYLE_TEMPLATE, "hermes", _QWEN_SPECIAL, ("<|im_start|>", "<|im_end|>"),
    tuple(TOOL_TAG_TOKENS), "<|im_end|>", "<|endoftext|>", description="Qwen2.5-Instruct's tool-calling template"))
TEMPLATE_FAMILIES.add("qwen3", TemplateFamily(
    "qwen3", _shipped("qwen3_incremental.jinja"), "qwen3", _QWEN_SPECIAL, ("<|im_start|>", "<|im_end|>"),
    (*TOOL_TAG_TOKENS, *THINK_TOKENS), "<|im_end|>", "<|endoftext|>",
    description="Qwen3's template, made incremental (past think blocks kept); model.enable_thinking picks the mode"))
TEMPLATE_FAMILIES.add("llama3", TemplateFamily(
    "llama3", _shipped("llama3_json.jinja"), "llama3_json", LLAMA3_SPECIAL, LLAMA3_SPECIAL[1:], (),
    "<|eot_id|>", "<|end_of_text|>", "<|begin_of_text|>",
    description="Llama 3.1 / 3.3 Instruct's JSON tool calling"))


def is_qwen3_template(template: str | None) -> bool:
    """Whether a template is (a version of) Qwen3's: ChatML turns, <tool_call> blocks and think blocks."""
    return bool(template) and all(t in template for t in ("<|im_start|>", "<tool_call>", "<think>", "</think>"))


def chat_template_text(choice: str) -> str:
    """The template that `model.chat_template` names: a family's (`TEMPLATE_FAMILIES`) or a .jinja file's text."""
    if choice in TEMPLATE_FAMILIES:
        return TEMPLATE_FAMILIES.get(choice).template
    path = Path(choice).expanduser()
    if path.suffix == ".jinja" and path.is_file():
        return path.read_text()
    raise ValueError(f"model.chat_template={choice!r}: not a template family ({', '.join(TEMPLATE_FAMILIES)}), "
                     "'auto', or an existing .jinja file")
