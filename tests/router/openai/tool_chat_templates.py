"""Minimal chat templates in the three tool-calling families' formats, for the demo model (whose own
template knows no tools): each renders `tools`, an assistant's `tool_calls` and a tool's result the
way its family does, and the model's calls come back in the format its `--tool-call-parser` reads.

    llama3_json   Llama 3.1: tools as JSON in the system turn, calls {"name", "parameters"}, results
                  in an "ipython" turn
    hermes        Hermes / Qwen 2.5: <tools></tools> in the system turn, <tool_call> ... </tool_call>,
                  <tool_response> in a user turn
    mistral       Mistral v3: [AVAILABLE_TOOLS] before the last user turn, [TOOL_CALLS][...],
                  [TOOL_RESULTS] ... [/TOOL_RESULTS]

`with_template(demo_dir, out_dir, parser)` writes a copy of the demo model with that template.
"""

from __future__ import annotations

import shutil
from pathlib import Path

LLAMA3_JSON = """{{- bos_token -}}
{%- if tools -%}
<|start_header_id|>system<|end_header_id|>

Environment: ipython
Respond to a function call with JSON {"name": function name, "parameters": its arguments}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' and message.tool_calls -%}
<|start_header_id|>assistant<|end_header_id|>

{% for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}{% endfor %}<|eom_id|>
{%- elif message.role == 'tool' -%}
<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else -%}
<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|start_header_id|>assistant<|end_header_id|>

{% endif -%}
"""

HERMES = """{{- bos_token -}}
{%- if tools -%}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}You may call functions. Their signatures are within <tools></tools>:
<tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools>
For each call, return {"name": <function-name>, "arguments": <args-json-object>} within <tool_call></tool_call>.<|im_end|>
{% elif messages[0].role == 'system' -%}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
{%- elif message.role == 'assistant' -%}
<|im_start|>assistant
{{ message.content }}{% for tc in message.tool_calls or [] %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""

MISTRAL = """{{- bos_token -}}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages %}{% if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor -%}
{%- for message in messages -%}
{%- if message.role == 'user' or message.role == 'system' -%}
{%- if tools and loop.index0 == ns.last_user %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif -%}
[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls -%}
[TOOL_CALLS][{% for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}, "id": "{{ tc.id }}"}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}
{%- elif message.role == 'tool' -%}
[TOOL_RESULTS]{"content": {{ message.content | tojson }}, "call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]
{%- else -%}
{{ message.content }}{{ eos_token }}
{%- endif -%}
{%- endfor -%}
"""

TEMPLATES = {"llama3_json": LLAMA3_JSON, "hermes": HERMES, "mistral": MISTRAL}


def with_template(demo_dir: Path, out_dir: Path, parser: str) -> Path:
    """A copy of the demo model whose tokenizer carries the `parser` family's chat template."""
    from transformers import AutoTokenizer

    out_dir = Path(out_dir)
    shutil.copytree(demo_dir, out_dir, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    tok.chat_template = TEMPLATES[parser]
    tok.save_pretrained(str(out_dir))
    return out_dir
