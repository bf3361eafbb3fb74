"""Chat templates (Jinja, as Hugging Face renders them): the synthetic tokenizers' and the one the
embedded Gemma 3 checkpoint is given (its GGUF carries none).

They reproduce each family's turn markup for plain text conversations: system, user and
assistant turns, string content or a list of text parts. Tools and images are out of scope.
"""

from __future__ import annotations

# ChatML, as Qwen3 and Qwen3.5 mark turns. `enable_thinking=false` pre-fills an empty think
# block, the documented way to switch Qwen3's reasoning off.
CHATML = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content if part['type'] == 'text' -%}{{- part['text'] -}}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + text(message['content']) + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

# Gemma 4 turns: <|turn>ROLE\n ... <turn|>\n, the assistant's role spelled `model`, one BOS first.
GEMMA4 = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{- content | trim -}}"
    "{%- else -%}{%- for part in content if part['type'] == 'text' -%}{{- part['text'] | trim -}}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<|turn>' + role + '\\n' + text(message['content']) + '<turn|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}{%- endif -%}"
)

# Gemma 3 turns: <start_of_turn>ROLE\n ... <end_of_turn>\n, the assistant's role spelled `model`,
# one BOS first. Gemma 3 has no system role: a system message's text opens the first user turn,
# followed by a blank line.
GEMMA3 = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{- content | trim -}}"
    "{%- else -%}{%- for part in content if part['type'] == 'text' -%}{{- part['text'] | trim -}}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{{- bos_token -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set preamble = text(messages[0]['content']) + '\\n\\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- else -%}"
    "{%- set preamble = '' -%}"
    "{%- set turns = messages -%}"
    "{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<start_of_turn>' + role + '\\n' + (preamble if loop.first else '') + text(message['content'])"
    " + '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)
