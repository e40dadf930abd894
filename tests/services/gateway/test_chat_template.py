"""The gateway renders chat templates exactly as transformers' apply_chat_template does."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.gateway.prompts import ChatTemplate, ChatTemplateError, ModelFiles

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "Ünïcödé 今日は 🚀"}],
    [{"role": "user", "content": "  leading and trailing spaces \n\n"}],
]

# A template in the style of real checkpoints: loop controls, namespace, tojson, raise_exception,
# bos/eos variables, trim_blocks/lstrip_blocks sensitive layout and a generation block.
RICH_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system='') %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {%- set ns.system = message['content'] %}
        {%- continue %}
    {%- endif %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('roles must be user or assistant, got ' + message['role']) }}
    {%- endif %}
{% if loop.first and ns.system %}[SYS {{ ns.system | tojson }}]
{% endif %}
    <{{ message['role'] }}>
    {% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}
    {{- eos_token }}
    {% else %}{{ message['content'] }}
    {% endif %}
{%- endfor %}
{%- if tools %}TOOLS {{ tools | tojson }}{% endif %}
{%- if add_generation_prompt %}<assistant>{% endif %}"""


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tiny_checkpoint_template_matches_transformers(tiny_model: Path, hf_tokenizer, messages,
                                                      add_generation_prompt: bool) -> None:
    files = ModelFiles(tiny_model)
    assert files.chat_template is not None
    ours = files.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    ids = hf_tokenizer.apply_chat_template(messages, tokenize=True,
                                           add_generation_prompt=add_generation_prompt)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert files.encode(ours, add_special_tokens=False) == list(ids)


def test_rich_template_matches_transformers(hf_tokenizer) -> None:
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    template = ChatTemplate(RICH_TEMPLATE, special)
    tools = [{"type": "function", "function": {"name": "f", "description": "naïve"}}]
    for messages in CONVERSATIONS:
        for use_tools in (None, tools):
            ours = template.render(messages, add_generation_prompt=True, tools=use_tools)
            theirs = hf_tokenizer.apply_chat_template(messages, chat_template=RICH_TEMPLATE, tokenize=False,
                                                      add_generation_prompt=True, tools=use_tools, **special)
            assert ours == theirs


def test_template_exception_becomes_chat_template_error() -> None:
    template = ChatTemplate(RICH_TEMPLATE, {"bos_token": "", "eos_token": ""})
    with pytest.raises(ChatTemplateError, match="roles must be user or assistant, got tool"):
        template.render([{"role": "tool", "content": "x"}])


def test_model_files_limits_and_token_text(tiny_model: Path) -> None:
    files = ModelFiles(tiny_model)
    assert files.context_length == 4096
    assert files.vocab_size == 4096
    assert files.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    ids = files.encode("hello world", add_special_tokens=True)
    assert "".join(files.token_text(i).text for i in ids) == "hello world"
    assert files.token_text(ids[0]).bytes == list(files.token_text(ids[0]).text.encode())
