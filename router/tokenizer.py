"""The router's tokenizer: the model's fast tokenizer and chat template, without transformers or torch.

The workers describe their tokenizer once as a ``TokenizerSpec`` (plain strings, so it
crosses the Ray boundary cheaply); the router rebuilds it here with ``tokenizers`` and a
sandboxed jinja2. Both methods give the same ids as transformers' ``encode(text)`` and
``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from tandem.worker.api import TokenizerSpec


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (its ``raise_exception``) or failed to render."""


class RouterTokenizer:
    """Encodes prompts and renders conversations for one model."""

    def __init__(self, tokenizer: Tokenizer, spec: TokenizerSpec) -> None:
        self._tokenizer = tokenizer
        self.spec = spec
        self._template = _compile_chat_template(spec.chat_template) if spec.chat_template else None
        self.bos_token_id = tokenizer.token_to_id(spec.bos_token) if spec.bos_token else None

    @classmethod
    def from_spec(cls, spec: TokenizerSpec) -> RouterTokenizer:
        return cls(Tokenizer.from_str(spec.tokenizer_json), spec)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary (token ids must be below it): may exceed the tokenizer's."""
        return self.spec.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.spec.max_model_len

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text`` -> ids with the model's special tokens, as transformers' ``tokenizer.encode(text)``
        (without them: the text's own tokens alone)."""
        if not add_special_tokens:
            return self._tokenizer.encode(text, add_special_tokens=False).ids
        # The JSON's post-processor already adds BOS when the model wants it (transformers
        # keeps it in step with add_bos_token); only a tokenizer.json without that
        # post-processor needs the BOS prepended here.
        ids = self._tokenizer.encode(text, add_special_tokens=True).ids
        if self.spec.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def render_chat(self, messages: Sequence[Mapping[str, str]],
                    template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The conversation as the chat template writes it, ending with the assistant's header;
        template_kwargs: more variables for the template (vLLM's chat_template_kwargs), which
        never replace the ones set here."""
        if self._template is None:
            raise ChatTemplateError(f"model {self.spec.model_name} has no chat template: send prompt or token_ids")
        plain = [{str(k): str(v) for k, v in m.items()} for m in messages]
        try:
            return self._template.render(**{
                **(template_kwargs or {}), "messages": plain, "add_generation_prompt": True, "tools": None,
                "documents": None, "bos_token": self.spec.bos_token, "eos_token": self.spec.eos_token,
            })
        except jinja2.TemplateError as e:
            # Templates call raise_exception for conversations they do not accept
            # (e.g. roles that do not alternate): the caller's input, not a server fault.
            raise ChatTemplateError(f"the chat template refused the conversation: {e}") from e

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                            template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Conversation -> prompt ids, as transformers' ``apply_chat_template(messages,
        add_generation_prompt=True, tokenize=True)`` (the template writes any BOS itself)."""
        return self._tokenizer.encode(self.render_chat(messages, template_kwargs), add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # As transformers: jinja's own tojson escapes HTML characters, which changes prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks):
    rendered as its body, so templates that use it still parse."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _compile_chat_template(source: str) -> jinja2.Template:
    # Chat templates come with model files: untrusted code, hence the immutable sandbox.
    # The settings match transformers' (trim_blocks, lstrip_blocks, loop controls) so the
    # same text comes out.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
