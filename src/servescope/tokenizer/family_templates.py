"""Chat templates of model families, for checkpoints that carry none of their own (config/families.py names
one per family; the loader falls back to it before the tokenizer's ChatML default).

"gemma": Gemma 2/3's turn format (text only): <start_of_turn>user / model, <end_of_turn> after each turn, a
system message folded into the first user turn, as the official template does.
"""

from __future__ import annotations

from typing import Optional

GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\\n' }}"
    "{%- endif -%}"
)

TEMPLATES = {"gemma": GEMMA_TEMPLATE}


def family_template(name: Optional[str]) -> Optional[str]:
    """The template a family's row names, None for none."""
    return TEMPLATES[name] if name else None
