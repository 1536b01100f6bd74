"""Rendering a conversation with the model's Jinja chat template, as HF transformers' `apply_chat_template` does.

The environment is the one transformers builds (`transformers/utils/chat_template_utils.py`,
`_compile_jinja_template`): an `ImmutableSandboxedEnvironment` with trim_blocks/lstrip_blocks, the `loopcontrols`
extension and the `{% generation %}` tag (rendered as its body: we never need the assistant mask), the `tojson`
filter that does not HTML-escape and takes ensure_ascii/indent/separators/sort_keys, and the globals
`raise_exception`, `strftime_now`, `dict` and an underscore-refusing `namespace`. The variables are HF's too:
`messages`, `tools`, `documents`, `add_generation_prompt`, the tokenizer's special-token strings (`bos_token`,
`eos_token`, `unk_token`, `pad_token`, ... only those it has) and any extra keyword (`enable_thinking`,
`date_string`, ...). Messages get HF's normalisation first: keys whose value is None are dropped, objects become
plain JSON data, and a `thinking`/`reasoning` field is also offered as `reasoning_content`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import numpy as np
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

# HF's SPECIAL_TOKENS_ATTRIBUTES: each `<name>_token` the tokenizer has is a template variable.
SPECIAL_TOKEN_NAMES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
# Names a message's reasoning is passed under; the first is the one templates read (HF `_REASONING_FIELDS`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes (<, >, &, ') and sorts keys; the templates are written against HF's.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` in a template, without handing it the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(Namespace):
    """`namespace(...)` refusing underscore names, as HF's (no reaching CPython internals through it)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's Namespace signature: `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot store underscore-prefixed attributes on a namespace: {name!r}")


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (HF's AssistantTracker): marks the assistant's tokens for a
    training mask. Prompt rendering only needs the body, so the tag renders to its contents."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@lru_cache(maxsize=32)
def _compile(template: str) -> Any:
    try:
        return _environment().from_string(template)
    except TemplateError as e:
        raise ValueError(f"the model's chat template is not valid Jinja: {e}") from e


def _plain(value: Any) -> Any:
    """JSON-like data only (HF `_plain_template_data`): the sandbox sees no methods of rich objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _as_dict(message: Any) -> Any:
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        return {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    if callable(getattr(message, "model_dump", None)):
        return message.model_dump()
    return message


def _normalize(messages: Any) -> list[dict]:
    """Messages as the template sees them; ValueError for anything that is not a conversation."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of message dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    out = []
    for i, message in enumerate(messages):
        message = _as_dict(message)
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        content = message.get("content")
        if not (content is None or isinstance(content, (str, list, tuple, Mapping))
                or _as_dict(content) is not content):  # a dataclass / pydantic part
            raise ValueError(f'messages[{i}]["content"] must be a string, a list of parts or null, '
                             f"got {type(content).__name__}")
        # HF drops None values (OpenAI clients send content=None, tool_calls=None): templates test for presence.
        message = {k: v for k, v in _plain(message).items() if v is not None}
        if not isinstance(message.get("role"), str):
            raise ValueError(f'messages[{i}] needs a string "role"')
        content = message.get("content")
        if isinstance(content, (list, tuple)) and not all(isinstance(p, Mapping) for p in content):
            raise ValueError(f'messages[{i}]["content"] parts must be dicts like {{"type": "text", "text": ...}}')
        calls = message.get("tool_calls")
        if calls is not None and not (isinstance(calls, (list, tuple)) and all(isinstance(c, Mapping) for c in calls)):
            raise ValueError(f'messages[{i}]["tool_calls"] must be a list of dicts')
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:  # HF `_alias_reasoning_fields`
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        return "".join(p["text"] for p in content if isinstance(p.get("text"), str))
    return ""


def _special_tokens(tokenizer: Any) -> dict[str, str]:
    """`bos_token`, `eos_token`, ...: the tokenizer's string attribute, else its `<name>_id` decoded."""
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        text = getattr(tokenizer, f"{name}_token", None)
        if text is None:
            tid = getattr(tokenizer, f"{name}_id", None)
            if isinstance(tid, int) and callable(getattr(tokenizer, "decode", None)):
                text = tokenizer.decode([tid])
        if text is not None:
            out[f"{name}_token"] = str(text)
    return out


def _select(template: Any, tools: Any, name: str | None) -> str | None:
    """A tokenizer may carry named templates (dict or HF's [{"name", "template"}] list): HF's choice among them."""
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
    if isinstance(template, Mapping):
        if name is None:
            name = "tool_use" if tools is not None and "tool_use" in template else "default"
        if name not in template:
            raise ValueError(f"the tokenizer has no chat template named {name!r} (it has {sorted(template)})")
        return template[name]
    if name is not None:
        raise ValueError(f"the tokenizer has a single chat template, not one named {name!r}")
    return template


def render_chat(tokenizer: Any, messages: list[dict], add_generation_prompt: bool | None = None, *,
                tools: list[dict] | None = None, documents: list[dict] | None = None,
                continue_final_message: bool | str = False, chat_template: str | None = None,
                template_name: str | None = None, **template_kwargs: Any) -> str:
    """The prompt text for `messages`, as `tokenizer.apply_chat_template(messages, tokenize=False, ...)` renders it.

    add_generation_prompt: open the assistant's turn; default True unless `continue_final_message`.
    tools, documents: JSON-schema dicts / {"title", "text"} dicts, passed to the template.
    continue_final_message: leave the last message open for the model to continue (True: its "content"; a str: that
        field, e.g. "reasoning_content").
    chat_template / template_name: override the tokenizer's template, or pick one of its named ones.
    template_kwargs: more template variables (`enable_thinking=False`, `date_string="26 Jul 2024"`, ...); they
        override the special tokens.

    Without a template (e.g. llama2.c models) the contents' text is joined by newlines. Malformed messages, data
    nested too deeply to walk, and conversations the template rejects (`raise_exception`, or a type error inside
    it), raise ValueError.
    """
    try:
        return _render_chat(tokenizer, messages, add_generation_prompt, tools=tools, documents=documents,
                            continue_final_message=continue_final_message, chat_template=chat_template,
                            template_name=template_name, **template_kwargs)
    except RecursionError:  # data nested past Python's stack (a JSON schema in `tools`, say): not a conversation
        raise ValueError("the messages, tools or documents are nested too deeply to render") from None


def _render_chat(tokenizer: Any, messages: list[dict], add_generation_prompt: bool | None = None, *,
                 tools: list[dict] | None = None, documents: list[dict] | None = None,
                 continue_final_message: bool | str = False, chat_template: str | None = None,
                 template_name: str | None = None, **template_kwargs: Any) -> str:
    """`render_chat` without its RecursionError guard."""
    chat = _normalize(messages)
    if add_generation_prompt is None:
        add_generation_prompt = not continue_final_message
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
    template = _select(chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None),
                       tools, template_name)
    if not template:
        return "\n".join(_text(m.get("content")) for m in chat)
    if tools is not None and not (isinstance(tools, (list, tuple)) and all(isinstance(t, Mapping) for t in tools)):
        raise ValueError("tools must be a list of JSON-schema dicts")
    if documents is not None and not (
            isinstance(documents, (list, tuple)) and all(isinstance(d, Mapping) for d in documents)):
        raise ValueError('documents must be a list of {"title", "text"} dicts')

    final = None
    if continue_final_message:
        chat, final = _tag_final_message(chat, template, continue_final_message)
    compiled = _compile(template)
    variables = _plain({**_special_tokens(tokenizer), **template_kwargs})
    try:
        text = compiled.render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                               add_generation_prompt=bool(add_generation_prompt), **variables)
    except (TemplateError, TypeError) as e:
        raise ValueError(f"the model's chat template rejected the messages: {e}") from e
    if final is not None:
        text = _cut_at_tag(text, final)
    return text


def _tag_final_message(chat: list[dict], template: str, field: bool | str) -> tuple[list[dict], str]:
    """HF's continue_final_message: append a tag to the last message's text, render, cut the prompt at the tag."""
    field = field if isinstance(field, str) else "content"
    last = dict(chat[-1])
    final = last.get(field)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue')
    fields = [field]
    if field in _REASONING_FIELDS:
        fields = [f for f in _REASONING_FIELDS if last.get(f) == final]
    if not any(f in template for f in fields):
        raise ValueError(f'continue_final_message is set to "{field}" but the chat template does not read that field')
    if isinstance(final, (list, tuple)):
        parts = [dict(p) for p in final]
        for part in reversed(parts):
            if "text" in part:
                final = part["text"]
                part["text"] = part["text"] + _CONTINUE_TAG
                break
        else:
            raise ValueError("continue_final_message is set but the final message has no text to continue")
        last[field] = parts
    else:
        for f in fields:
            last[f] = last[f] + _CONTINUE_TAG
    return [*chat[:-1], last], final


def _cut_at_tag(text: str, final: str) -> str:
    if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise ValueError("continue_final_message is set but the chat template drops part of the final message")
    loc = text.rindex(_CONTINUE_TAG.strip())
    if text[loc:loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:loc]
    return text[:loc].rstrip()  # the template trimmed the message's trailing space
