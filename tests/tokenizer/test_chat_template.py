"""Chat templates: same output as transformers, message validation, sandbox."""

import pytest

from servescope.errors import InvalidParameterError, ModelLoadError
from servescope.tokenizer import Tokenizer, render_chat_template, validate_messages

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2? 🤔"},
    {"role": "assistant", "content": "4."},
]

# exercises tojson, namespace, loop controls, raise_exception, bos/eos tokens, whitespace control
RICH_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(n=0) %}
{% for m in messages %}
  {% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}
  {% if m['content'] == 'skip' %}{% continue %}{% endif %}
  {% set ns.n = ns.n + 1 %}
  [{{ ns.n }}] {{ m | tojson }}
{% endfor %}
{%- if add_generation_prompt %}>>{% endif %}{{ eos_token }}"""


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:]], ids=["with_system", "no_system"])
def test_smollm2_template_matches_transformers(tok, messages, add_generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = tok.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    if messages is CONVERSATION and add_generation_prompt:
        assert ours == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2? 🤔<|im_end|>\n"
                        "<|im_start|>assistant\n4.<|im_end|>\n<|im_start|>assistant\n")


def test_rich_template_matches_transformers(tok):
    msgs = CONVERSATION + [{"role": "user", "content": "skip"}, {"role": "user", "content": 'quote " and é'}]
    ours = render_chat_template(RICH_TEMPLATE, msgs, special_tokens=tok.special_tokens)
    theirs = tok.hf.apply_chat_template(msgs, chat_template=RICH_TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert '"quote \\" and é"' in ours and "[4]" in ours and ours.endswith(">><|im_end|>")


def test_template_raise_exception_is_invalid_parameter(tok):
    with pytest.raises(InvalidParameterError, match="no tools here") as e:
        render_chat_template(RICH_TEMPLATE, [{"role": "tool", "content": "x"}], special_tokens=tok.special_tokens)
    assert e.value.param == "messages"


@pytest.mark.parametrize("bad, why", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"role": "wizard", "content": "x"}], "role must be one of system, user, assistant, tool"),
    ([{"content": "x"}], "role must be one of"),
    ([{"role": "user", "content": 3}], r"messages\[0\].content must be a string"),
    ([{"role": "user"}], r"content must be a string"),
    ([{"role": "user", "content": "ok"}, "nope"], r"messages\[1\] must be an object"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text parts"),
])
def test_message_validation(tok, bad, why):
    with pytest.raises(InvalidParameterError, match=why) as e:
        tok.apply_chat_template(bad)
    assert e.value.param == "messages"


def test_text_parts_and_tool_calls_accepted():
    msgs = validate_messages([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
        {"role": "tool", "content": "42", "tool_call_id": "1"},
    ])
    assert [m["content"] for m in msgs] == ["ab", "", "42"]
    assert msgs[2]["tool_call_id"] == "1"


@pytest.mark.parametrize("template", [
    "{{ ''.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% set x = messages.append(1) %}{{ x }}",
    "{% set ns = namespace() %}{% set ns._private = 1 %}{{ ns._private }}",
    "{{ raise_exception.__globals__ }}",
])
def test_sandbox_blocks_escapes(template):
    with pytest.raises(InvalidParameterError, match="chat template") as e:
        render_chat_template(template, [{"role": "user", "content": "hi"}])
    assert e.value.param == "messages"


def test_messages_are_not_mutated_and_objects_are_plain():
    class Sneaky(str):
        def danger(self):  # pragma: no cover - must never be callable from a template
            raise AssertionError("called")

    msgs = [{"role": "user", "content": Sneaky("hi")}]
    with pytest.raises(InvalidParameterError):
        render_chat_template("{{ messages[0]['content'].danger() }}", msgs)
    assert render_chat_template("{{ messages[0]['content'] }}", msgs) == "hi"


def test_broken_template_is_a_load_error(tok):
    with pytest.raises(ModelLoadError, match="chat template does not compile"):
        Tokenizer(tok.hf, chat_template="{% for m in messages %}", name="broken")
