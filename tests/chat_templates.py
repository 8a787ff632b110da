"""Chat templates written for the audit tests, and a tokenizer to put them on.

``QWEN3_LIKE`` reproduces, in a few lines of our own, the three behaviours of Qwen3's
template (Qwen/Qwen3-0.6B) that the spec reports, without downloading it:

* an assistant turn keeps its reasoning (``<think>...</think>``) only while it comes after
  the last user message; a user-role observation makes it history, and the reasoning goes;
* the final assistant turn always opens with a think block, an empty ``<think>\\n\\n</think>``
  when the turn has no reasoning, which the same turn as history leaves out;
* tool-call arguments given as an object are written with ``tojson`` (spaces after ``:`` and
  ``,``), so compact JSON the model wrote comes back reformatted; a string is written as is.

``APPEND_ONLY`` writes every turn the same way as history and as the final turn (reasoning
whenever there is some, no empty blocks, object arguments as compact JSON), so every shape
must merge. ``NO_TOOLS`` raises on a tool message, as templates of models without tool use do.
"""

from __future__ import annotations

from dew_pipe.data.tokenizer import build_tokenizer, chat_samples

_TOOLS_BLOCK = """\
{%- if tools -%}
    {{- '<|im_start|>system\\n# Tools\\n<tools>' -}}
    {%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\\n</tools><|im_end|>\\n' -}}
{%- endif -%}
"""

_CALLS = """\
{%- for call in message.tool_calls or [] -%}
    {%- set fn = call.function -%}
    {{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' -}}
    {%- if fn.arguments is string -%}{{- fn.arguments -}}
    {%- else -%}{{- fn.arguments | tojson@ARGS@ -}}
    {%- endif -%}
    {{- '}\\n</tool_call>' -}}
{%- endfor -%}
"""

QWEN3_LIKE = (
    """\
{%- set ns = namespace(last_query=-1) -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}
{%- endfor -%}
"""
    + _TOOLS_BLOCK
    + """\
{%- for message in messages -%}
    {%- if message.role == 'assistant' -%}
        {%- set reasoning = message.reasoning_content or '' -%}
        {{- '<|im_start|>assistant\\n' -}}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}
            {{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' -}}
        {%- endif -%}
        {{- message.content or '' -}}
"""
    + _CALLS.replace("@ARGS@", "")
    + """\
        {{- '<|im_end|>\\n' -}}
    {%- elif message.role == 'tool' -%}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""
)

APPEND_ONLY = (
    _TOOLS_BLOCK
    + """\
{%- for message in messages -%}
    {%- if message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\\n' -}}
        {%- if message.reasoning_content -%}
            {{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' -}}
        {%- endif -%}
        {{- message.content or '' -}}
"""
    + _CALLS.replace("@ARGS@", "(separators=(',', ':'))")
    + """\
        {{- '<|im_end|>\\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""
)

NO_TOOLS = """\
{%- for message in messages -%}
    {%- if message.role == 'tool' -%}
        {{- raise_exception('this model has no tool role') -}}
    {%- endif -%}
    {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""


def tokenizer_with(template: str):
    """A small BPE tokenizer (the project's builder) carrying ``template``."""
    texts = chat_samples() + ["What is the weather in Paris right now? <think> </think>"] * 8
    tokenizer = build_tokenizer(texts, vocab_size=400)
    tokenizer.chat_template = template
    return tokenizer
