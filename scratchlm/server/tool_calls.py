"""Tool calling on /v1/chat/completions: from the request's ``tools`` / ``tool_choice`` to the prompt, the grammar
and the parsed reply (the formats themselves are in tool_parsers.py).

Policy:

- The conversation reaches the model's own chat template with HF ``apply_chat_template(messages, tools=...)``
  semantics: OpenAI messages become template dicts (text parts joined; null content is "" as in vLLM, since
  Qwen3's template reads every assistant turn's content; an assistant's ``tool_calls`` keep their id and type, their
  ``function.arguments`` JSON text parsed into a dict as HF templates and vLLM expect; a ``tool`` message keeps
  ``tool_call_id`` and ``name``), and ``tools`` are passed as the client sent them.
- The reply format (its parser and grammar) comes from the template's text (`tool_parsers.detect_format`), unless
  the server's ``--tool-call-parser`` names one. The ``generic`` format (templates with no tool syntax, such as the
  default model's ChatML) adds a system message describing the tools and the JSON reply (folded into the first
  user turn when the template refuses a system role), and writes the history's tool turns in that JSON
  (`generic_history`), as llama.cpp does.
- ``tool_choice``: absent = ``auto`` with tools, ``none`` without. ``none``: the model must not call: replies are
  not parsed nor constrained (a template with tool syntax still sees the tools; the generic format's system message
  is left out, as it asks for JSON). ``auto``: replies are parsed; only the generic format is constrained (a call
  or ``{"response": text}``). ``required`` / a named function: a grammar forces a call (to that function), its
  arguments valid against the function's ``parameters``; ``parallel_tool_calls`` (default true) allows one or more
  calls, false exactly one. ``required`` or a named function without ``tools``, an unknown name, or a tool
  constraint together with ``response_format`` / ``structured_outputs`` are 400s.
- Streaming (`ToolStream`): text that cannot be the start of a call is streamed as content (the generic format:
  the ``{"response": "...`` string as it is decoded); from where a call may begin it is held until the reply ends,
  then parsed once, so the deltas assemble to the non-streamed reply.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scratchlm.server import tool_parsers
from scratchlm.server.tool_parsers import ParsedCall


class ToolRequestError(ValueError):
    """A request whose tools / tool_choice / tool turns cannot be served: a 400 naming `param`."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class ToolPlan:
    """What the chat route does with one request's tools."""

    messages: list[dict]  # ready for the chat template
    tools: list[dict] | None  # passed to the template
    fmt: str | None  # the reply parser; None: replies are plain content
    grammar: str | None  # the Lark grammar forcing the reply's shape, or None
    no_system: list[dict] | None = None  # `messages` with the generic system text in the first user turn instead,
    # for templates that refuse a system role (Gemma 2), as minja's polyfill


def template_messages(messages: list[Any]) -> list[dict]:
    """OpenAI chat messages (protocol.ChatMessage) as chat-template dicts (see the module's policy)."""
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                args = c.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except (ValueError, RecursionError) as e:
                        raise ToolRequestError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON text: "
                                               f"{e}", f"messages.{i}.tool_calls.{j}.function.arguments") from None
                call = {"type": c.type, "function": {"name": c.function.name, "arguments": args}}
                if c.id is not None:
                    call = {"id": c.id, **call}
                calls.append(call)
            d["tool_calls"] = calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def _with_system(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0]["role"] in ("system", "developer") and isinstance(messages[0].get("content"), str):
        first = messages[0]
        joined = f"{first['content']}\n\n{text}" if first["content"].strip() else text
        return [{**first, "content": joined}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _system_in_user(messages: list[dict]) -> list[dict]:
    """A leading system message folded into the first user message (for templates without a system role)."""
    system, rest = messages[0]["content"], messages[1:]
    at = next((i for i, m in enumerate(rest) if m["role"] == "user" and isinstance(m.get("content"), str)), None)
    if at is None:
        return [{"role": "user", "content": system}, *rest]
    return [*rest[:at], {**rest[at], "content": f"{system}\n\n{rest[at]['content']}"}, *rest[at + 1:]]


def choose_format(template: Any, parser: str) -> str:
    """The reply format: the server's ``--tool-call-parser`` value, or (``auto``) the one the template speaks."""
    return tool_parsers.detect_format(template) if parser == "auto" else parser


def plan(messages: list[Any], tools: list[Any] | None, tool_choice: Any, parallel: bool | None, template: Any,
         parser: str, token_of: Callable[[str], int | None]) -> ToolPlan:
    """The prompt's messages and tools, the reply parser and the grammar for one chat request (the module's
    policy). `tools` and `tool_choice` are protocol models; `token_of(text)` is the id of a text the tokenizer
    holds as one token, else None. Raises `ToolRequestError`."""
    msgs = template_messages(messages)
    defs = [t.model_dump(exclude_unset=True) for t in tools] if tools else None
    choice = tool_choice if tool_choice is not None else ("auto" if defs else "none")
    if defs is None:
        if choice not in ("none", "auto"):
            raise ToolRequestError("`tool_choice` requires a call but no `tools` are given.", "tool_choice")
        has_calls = any(m.get("tool_calls") or m["role"] == "tool" for m in msgs)
        fmt = choose_format(template, parser)
        return ToolPlan(tool_parsers.generic_history(msgs) if has_calls and fmt == "generic" else msgs,
                        None, None, None)
    names = [t["function"]["name"] for t in defs]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ToolRequestError(f"tools[{i}]: the function name {name!r} is given twice.",
                                   f"tools.{i}.function.name")
    fmt = choose_format(template, parser)
    if choice == "none":
        return ToolPlan(tool_parsers.generic_history(msgs) if fmt == "generic" else msgs, defs, None, None)
    functions = [t["function"] for t in defs]
    if not isinstance(choice, str):  # a named function
        wanted = choice.function.name
        if wanted not in names:
            raise ToolRequestError(f"`tool_choice` names the function {wanted!r}, which is not in `tools` "
                                   f"({', '.join(names)}).", "tool_choice")
        functions = [f for f in functions if f["name"] == wanted]
    forced = choice != "auto"
    parallel = True if parallel is None else parallel
    if fmt == "generic":
        msgs = tool_parsers.generic_history(msgs)
        msgs = _with_system(msgs, tool_parsers.generic_system_prompt(
            [{"function": f} for f in functions], parallel, required=forced))
        grammar = tool_parsers.grammar(fmt, functions, parallel, token_of, allow_text=not forced)
        return ToolPlan(msgs, defs, fmt, grammar, _system_in_user(msgs))
    return ToolPlan(msgs, defs, fmt, tool_parsers.grammar(fmt, functions, parallel, token_of) if forced else None)


def single_token(tokenizer: Any) -> Callable[[str], int | None]:
    """`token_of` for `plan`: the id `tokenizer` encodes `text` to when it is one token that decodes back to it."""

    def token_of(text: str) -> int | None:
        try:
            ids = list(tokenizer.encode(text))
            bos = getattr(tokenizer, "bos_id", None)
            if len(ids) > 1 and ids[0] == bos:
                ids = ids[1:]
            return ids[0] if len(ids) == 1 and tokenizer.decode(ids) == text else None
        except Exception:  # a tokenizer that cannot encode it alone: the grammar spells the text out
            return None

    return token_of


class ToolStream:
    """One streamed choice: content deltas as far as the text is surely content; the calls once the reply ends."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.sent = ""  # the content sent so far

    def step(self, text: str, finished: bool) -> tuple[str, list[ParsedCall]]:
        """(content delta, calls) for the cumulative `text`; calls only when `finished`."""
        if finished:
            content, calls = tool_parsers.parse(self.fmt, text)
        else:
            content, calls = tool_parsers.settled_content(self.fmt, text), []
        content = content or ""
        if not content.startswith(self.sent):  # cannot happen: what was settled stays (tests/server/test_tool_calls)
            raise AssertionError(f"streamed content {self.sent!r} is not a prefix of {content!r}")
        delta, self.sent = content[len(self.sent):], content
        return delta, calls
