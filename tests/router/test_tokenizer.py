"""The router's tokenizer gives transformers' ids, from the TokenizerSpec alone, without torch."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from tandem.router.tokenizer import ChatTemplateError, RouterTokenizer

TEXTS = [
    "Hello world",
    " leading space and trailing  ",
    "What is the capital of France?",
    "héllo wörld, 世界 🙂 — ünïcödé",
    "line one\n\nline two\ttabbed\r\n",
    "<|im_start|>user\nspecial tokens in plain text<|im_end|>",
    "def f(x):\n    return x ** 2  # code",
    "1234567890 3.14159 -42",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of Italy?"}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 🐍."},
    ],
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizer, router_tokenizer, text):
    assert router_tokenizer.encode(text) == tokenizer.encode(text)


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system", "multi-turn"])
def test_chat_template_matches_transformers(tokenizer, router_tokenizer, messages):
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if not isinstance(expected, list) else expected
    assert router_tokenizer.apply_chat_template(messages) == expected
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert router_tokenizer.render_chat(messages) == rendered


def test_decode_round_trips(router_tokenizer):
    text = "The capital of France is Paris."
    assert router_tokenizer.decode(router_tokenizer.encode(text)) == text


def test_add_bos_token_prepends_bos_once(router_tokenizer):
    spec = dataclasses.replace(router_tokenizer.spec, add_bos_token=True)
    with_bos = RouterTokenizer.from_spec(spec)
    ids = with_bos.encode("Hello world")
    assert ids == [with_bos.bos_token_id] + router_tokenizer.encode("Hello world")
    # The template writes its own BOS: the chat path must not add another.
    assert with_bos.apply_chat_template(CONVERSATIONS[0]) == router_tokenizer.apply_chat_template(CONVERSATIONS[0])


def test_template_sees_special_tokens_and_raise_exception(router_tokenizer):
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] | tojson }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    custom = RouterTokenizer.from_spec(dataclasses.replace(router_tokenizer.spec, chat_template=template))
    assert custom.render_chat([{"role": "user", "content": "é <b>"}]) == '<|im_start|>user: "é <b>"<|im_end|>assistant:'
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        custom.render_chat([{"role": "assistant", "content": "hi"}])


def test_template_is_sandboxed(router_tokenizer):
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    custom = RouterTokenizer.from_spec(dataclasses.replace(router_tokenizer.spec, chat_template=escape))
    with pytest.raises(ChatTemplateError):
        custom.render_chat([{"role": "user", "content": "hi"}])


def test_no_chat_template_is_a_clear_error(router_tokenizer):
    plain = RouterTokenizer.from_spec(dataclasses.replace(router_tokenizer.spec, chat_template=None))
    assert not plain.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        plain.apply_chat_template(CONVERSATIONS[0])


def test_router_imports_no_torch():
    code = (
        "import sys, tandem.router.server, tandem.router.client, tandem.router.validation\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
