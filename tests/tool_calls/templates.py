"""Chat templates that render tools, for tiny tokenizers and checkpoints: Qwen2.5's own
(Hermes format, ``tests/data``), and Llama-3-style and Mistral-style templates written
here in the shape of those families' templates (their call formats, ``ipython`` /
``[TOOL_RESULTS]`` results), short enough to read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

QWEN2_5 = (Path(__file__).resolve().parents[1] / "data" / "qwen2_5_chat_template.jinja").read_text()

LLAMA3_STYLE = (
    "{{- bos_token }}"
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "Given the following functions, respond with a JSON for a function call in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}.\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|eot_id|>"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- for call in message.tool_calls %}"
    '{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}'
    "{%- endfor %}<|eot_id|>"
    "{%- elif message.role == 'tool' %}"
    "<|start_header_id|>ipython<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{%- else %}"
    "<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)

MISTRAL_STYLE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{%- if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST]{{ message.content }}[/INST]"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "[TOOL_CALLS]["
    "{%- for call in message.tool_calls %}"
    "{%- if call.id | length != 9 %}{{ raise_exception('ids must be 9 characters') }}{% endif %}"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}, '
    '"id": "{{ call.id }}"}{{ ", " if not loop.last }}'
    "{%- endfor %}]{{ eos_token }}"
    "{%- elif message.role == 'tool' %}"
    '[TOOL_RESULTS]{"content": {{ message.content | tojson }}, '
    '"call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]'
    "{%- else %}{{ message.content }}{{ eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
)


def tiny_tokenizer(path: Path, template: str, special: tuple[str, ...] = ()) -> Any:
    """The byte-level tiny tokenizer with ``template`` (and ``special`` added as special
    tokens), saved at ``path``."""
    from pagedllm.testing import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer(path)
    if special:
        tokenizer.add_tokens(list(special), special_tokens=True)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    return tokenizer
