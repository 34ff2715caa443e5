"""The API process renders chat templates as transformers does (jinja2 without transformers):
each case is rendered by transformers' own apply_chat_template on the same tokenizer folder."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from tapserve.api.tokenizer import ChatTemplateError, TextTokenizer
from tapserve.model.demo import ensure_demo_checkpoint

QWEN_STYLE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if "
    "add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TRIMMING = "{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}\n{% endfor %}"
GENERATION_BLOCK = (
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
    "A: {{ m.content }}{% set x = 1 %}{% endgeneration %}{% else %}U: "
    "{{ m.content }}{% endif %}|{% endfor %}{{ x is defined }}"
)
TOOLS_DOCUMENTS = (
    "{% if tools is not none %}TOOLS{% endif %}{% if documents is not none %}"
    "DOCS{% endif %}{{ tools is defined }}{{ messages[0].content }}"
)


@pytest.fixture
def folder(tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_demo_checkpoint() / name, tmp_path / name)
    return tmp_path


def _both(folder, template, messages, **kwargs):
    ours = TextTokenizer.from_dir(folder, template).apply_chat_template(
        messages,
        kwargs.get("add_generation_prompt", True),
        None,
        kwargs.get("continue_final_message", False),
    )
    theirs = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, chat_template=template, tokenize=False, **kwargs
    )
    return ours, theirs


@pytest.mark.parametrize("template", [QWEN_STYLE, TRIMMING], ids=["qwen", "trimming"])
@pytest.mark.parametrize("final", ["m", "\n", "<|im_end|>", "Sure, ", "", "two  spaces  "])
def test_continue_final_message_cuts_where_transformers_does(folder, template, final):
    """The continued text ends where the final message's content does. Cutting at the
    content's last occurrence in the render (the code before) ended "m" inside the closing
    "<|im_end|>" and refused content a template trims ("Sure, ")."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": final}]
    ours, theirs = _both(
        folder, template, messages, add_generation_prompt=False, continue_final_message=True
    )
    assert ours == theirs


def test_a_template_that_drops_the_final_message_is_refused(folder):
    template = "{% for m in messages[:-1] %}{{ m.content }}{% endfor %}"
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    with pytest.raises(ChatTemplateError, match="does not appear"):
        TextTokenizer.from_dir(folder, template).apply_chat_template(messages, False, None, True)


def test_generation_blocks_tools_and_documents_render_as_in_transformers(folder):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    ours, theirs = _both(folder, GENERATION_BLOCK, messages)
    assert ours == theirs == "U: Hi|A: Yo|False"  # the block's body, in its own scope
    ours, theirs = _both(folder, TOOLS_DOCUMENTS, messages)
    assert ours == theirs == "TrueHi"  # tools and documents are None, not undefined


def test_chat_template_sees_the_special_tokens_transformers_passes(tmp_path):
    """The server renders a template with the tokenizer's named special tokens, as
    transformers does (pad_token was missing); one the tokenizer leaves unset is undefined
    (bos_token was "" and so `is defined`). Checked against transformers on the demo
    tokenizer, with unk_token added to its config."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_demo_checkpoint() / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["unk_token"] = "<|endoftext|>"
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}|{{ eos_token }}|"
        "{{ pad_token }}|{{ unk_token }}|{{ bos_token is defined }}|"
        "{{ sep_token is defined }}"
    )
    messages = [{"role": "user", "content": "Hi"}]
    ours = TextTokenizer.from_dir(tmp_path, template).apply_chat_template(messages)
    theirs = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs == "Hi|<|im_end|>|<|endoftext|>|<|endoftext|>|False|False"
    # the legacy layout: no added_tokens_decoder, special_tokens_map.json over the config
    config.pop("added_tokens_decoder", None)
    config.pop("pad_token")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps(
            {"eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "unk_token": "<|im_end|>"}
        )
    )
    ours = TextTokenizer.from_dir(tmp_path, template).apply_chat_template(messages)
    theirs = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs == "Hi|<|im_end|>|<|im_end|>|<|im_end|>|False|False"


@pytest.mark.parametrize(
    "template,kwargs",
    [
        ("{% for i in range(shots) %}x{% endfor %}", {"shots": 10**6}),  # OverflowError
        ("{{ 1 / zero }}", {"zero": 0}),  # ZeroDivisionError
        ("{{ items | dictsort }}", {"items": [1, 2]}),  # AttributeError
        ("{{ 'a b' | wordwrap(width) }}", {"width": 0}),  # ValueError
    ],
)
def test_a_render_the_client_variables_break_is_a_chat_template_error(folder, template, kwargs):
    """Whatever jinja raises for the client's chat_template_kwargs is the client's 605 (the
    API answers ChatTemplateError so); only TemplateError and TypeError were, and the rest
    became a plain-text 500."""
    tokenizer = TextTokenizer.from_dir(folder, template)
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], True, kwargs)


def test_developer_is_system_unless_the_template_names_it(folder):
    from tapserve.api.openai_schemas import ChatMessage, ChatTemplateFields

    messages = [
        ChatMessage(role="developer", content="Be brief."),
        ChatMessage(role="user", content="Hi"),
    ]
    knows = "{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}[{{ m.role }}]{% endfor %}"
    assert (
        ChatTemplateFields().render(TextTokenizer.from_dir(folder, knows), messages)
        == "D[developer][user]"
    )
    assert (
        ChatTemplateFields()
        .render(TextTokenizer.from_dir(folder, QWEN_STYLE), messages)
        .startswith("<|im_start|>system\nBe brief.")
    )
