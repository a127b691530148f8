"""Chat templates that render tool schemas and tool calls (Jinja, as Hugging Face tokenizers store them).

`TINY_TEMPLATE` follows Qwen2.5's format (`<tool_call>{json}</tool_call>`, tool results as `<tool_response>`
inside a user turn) with a compact system preamble and tools
rendered as one-line signatures (`calculator(expression: string): Evaluate ...`) instead of JSON schemas. HF renders
with trim_blocks, so a newline right after a block tag must be written as an expression: a tiny model pays for every
prompt token in BC.
"""

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
