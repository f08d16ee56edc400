"""A model's chat template, rendered as transformers' ``apply_chat_template`` renders it.

The template runs in Jinja's immutable sandbox with the environment transformers builds
(``trim_blocks``, ``lstrip_blocks``, loop controls, its ``tojson`` filter, ``raise_exception``,
``strftime_now``, a restricted ``dict`` and ``namespace``, the ``{% generation %}`` tag) and the
same variables (the tokenizer's named special tokens, ``messages``, ``tools``, ``documents``,
``add_generation_prompt``). Messages are normalised as transformers does: keys holding ``None``
are dropped and reasoning is aliased to ``reasoning_content`` and ``thinking``.

Which characters train: the spans of ``{% generation %}`` blocks when the template has them;
otherwise each assistant turn, found by rendering prefixes of the conversation (the text from the
end of ``messages[:i]`` with the generation prompt to the end of ``messages[:i+1]``, trailing
whitespace after the turn's closing token left out).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
Span = tuple[int, int]  # characters [start, end) of a rendered conversation


@dataclass(frozen=True)
class Rendered:
    """A rendered conversation and the character spans that train."""

    text: str
    spans: tuple[Span, ...]


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special tokens it sees."""

    source: str
    special_tokens: dict[str, str]

    @property
    def has_generation_blocks(self) -> bool:
        return bool(_GENERATION_TAG.search(self.source))

    @property
    def sha256(self) -> str:
        text = json.dumps([self.source, self.special_tokens], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def render(self, messages: list[dict], *, tools=None, add_generation_prompt: bool) -> str:
        """The conversation as ``apply_chat_template(..., tokenize=False)`` renders it."""
        return self._render(normalized(messages), tools, add_generation_prompt, None)

    def render_trained(self, messages: list[dict], *, tools=None, first: int = 0) -> Rendered:
        """The conversation and the spans that train: ``{% generation %}`` blocks, or the
        assistant turns found by prefix rendering; only spans after ``messages[:first]``
        (a prompt's messages) are kept."""
        messages = normalized(messages)
        if self.has_generation_blocks:
            generated: list[Span] = []
            text = self._render(messages, tools, False, generated)
            spans = tuple(generated)
        else:
            text = self._render(messages, tools, False, None)
            spans = tuple(self._turn_spans(messages, tools, text, first))
        if first:
            prompt = self._prefix(messages[:first], tools, False, text, "the prompt")
            spans = tuple(span for span in spans if span[0] >= len(prompt))
        return Rendered(text, spans)

    def _turn_spans(self, messages, tools, text: str, first: int) -> Iterator[Span]:
        for index, message in enumerate(messages):
            if message.get("role") != "assistant" or index < first:
                continue
            what = f"message {index} (assistant)"
            start = len(self._prefix(messages[:index], tools, True, text, what))
            last = index + 1 == len(messages)  # through the last message: the whole text
            end_text = (
                text if last else self._prefix(messages[: index + 1], tools, False, text, what)
            )
            yield (start, max(start, len(end_text.rstrip())))

    def _prefix(self, messages, tools, add_generation_prompt: bool, whole: str, what: str) -> str:
        """The rendering of a prefix of the conversation, which must begin the whole one."""
        prefix = self._render(messages, tools, add_generation_prompt, None)
        if not whole.startswith(prefix):
            raise ValueError(
                f"the chat template renders the conversation up to {what} differently from the "
                f"start of the whole conversation (prefix {prefix[-60:]!r} is not where the "
                "whole conversation begins), so its assistant tokens cannot be found by "
                "rendering prefixes; use a template with {% generation %} blocks "
                "(--chat-template FILE)"
            )
        return prefix

    def _render(self, messages, tools, add_generation_prompt: bool, spans: list | None) -> str:
        """``messages`` (already :func:`normalized`) through the template."""
        compiled = _compile(self.source)
        variables = {
            **self.special_tokens,
            "messages": messages,
            "tools": tools,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        blocks: list[str] = []
        try:
            if spans is None:  # no {% generation %} spans to record: the text alone
                return compiled.render(**variables)
            # The sandboxed environment this module builds has track_generation (see below).
            with compiled.environment.track_generation(blocks, spans):  # type: ignore[attr-defined]
                for block in compiled.generate(**variables):
                    blocks.append(block)
        except (jinja2.TemplateError, TypeError) as error:  # TypeError: e.g. text + a list
            raise ValueError(
                f"the chat template raised an error: {error}; fix the conversation or pass "
                "another template with --chat-template FILE"
            ) from None
        return "".join(blocks)


def normalized(messages: list[dict]) -> list[dict]:
    """Messages as transformers hands them to the template: ``None`` values dropped, reasoning
    aliased to ``reasoning_content`` and ``thinking``."""
    result = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        result.append(message)
    return result


@functools.cache
def _compile(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTracker, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    try:
        template = environment.from_string(source)
    except jinja2.TemplateError as error:
        raise ValueError(
            f"the chat template does not parse: {error}; fix it or pass another with "
            "--chat-template FILE"
        ) from None
    # The same globals as a plain dict: Jinja's ChainMap of them is copied into every render's
    # context, which took half the time of rendering a conversation.
    template.globals = dict(template.globals)
    return template


class _GenerationTracker(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: records the character span its body takes in
    the rendered text (transformers' ``AssistantTracker``)."""

    tags = {"generation"}  # noqa: RUF012 - Jinja's extension interface

    def __init__(self, environment: jinja2.Environment):
        super().__init__(environment)
        environment.extend(track_generation=self.track_generation)
        self._tracking: ContextVar = ContextVar("generation_tracking", default=None)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_generation", [], [])
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _generation(self, caller) -> str:
        text = caller()
        tracking = self._tracking.get()
        if tracking is not None and tracking[1] is not None:
            blocks, spans = tracking
            start = sum(map(len, blocks))
            spans.append((start, start + len(text)))
        return text

    @contextmanager
    def track_generation(self, blocks: list[str], spans: list | None) -> Iterator[None]:
        token = self._tracking.set((blocks, spans))
        try:
            yield
        finally:
            self._tracking.reset(token)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' ``tojson``: JSON without Jinja's HTML escaping."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` for templates, without attribute access to the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace refusing underscore names (no way to CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"got {name!r}"
            )
