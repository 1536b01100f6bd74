"""Tool-call formats: how a model family writes a function call, how its reply is read back into OpenAI
``tool_calls``, and the llguidance Lark grammar that makes it write one.

======================  ==========================================================  ==============================
format                  the model writes                                            chosen when the template has
======================  ==========================================================  ==============================
``hermes``              ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`` ``<tool_call>`` (Qwen 2.5/3,
                        per call, ``\\n`` between calls                              Hermes)
``llama3_json``         ``{"name": N, "parameters": {...}}``, optionally after        ``<|python_tag|>`` or
                        ``<|python_tag|>``; ``; `` between calls                     ``ipython`` (Llama 3.1-3.3)
``mistral``             ``[TOOL_CALLS][{"name": N, "arguments": {...}, "id": ID9}]``  ``[TOOL_CALLS]`` (Mistral)
``generic``             one JSON object: ``{"tool_calls": [{"name", "arguments"}]}``  anything else (llama.cpp's
                        (``{"tool_call": {...}}`` when parallel calls are off) or     generic format: a system
                        ``{"response": "text"}``                                     message describes the tools)
======================  ==========================================================  ==============================

Parsing follows vLLM: a reply that does not parse as calls is content, never an error. Content is the text
around the calls (None when blank). ``arguments`` come back as JSON text (OpenAI's shape); ids are
``call_<24 hex>``, except Mistral's, which are 9 alphanumerics (its template refuses others; the model's own id is
kept when it has that shape).

Grammars (tool_choice ``required`` / a named function; ``auto`` too for ``generic``, as llama.cpp): exactly the
format's call syntax, the name a JSON ``const`` and the arguments the function's ``parameters`` schema (``%json``,
its local ``$ref``s re-rooted), with fixed separators (``", "``, ``": "``: no whitespace for a small model to
wander in) and no undeclared keys in objects that list their properties (`_closed`). A marker the tokenizer holds
as one token (``<tool_call>``, ``[TOOL_CALLS]``) is that token (``<[id]>``), so the model writes it the way it was
trained to.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

FORMATS = ("hermes", "llama3_json", "mistral", "generic")
JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
_DECODER = json.JSONDecoder()
_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ParsedCall:
    """One call read from the model's reply: OpenAI's ``{"id", "type": "function", "function": {...}}``."""

    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def detect_format(template: Any) -> str:
    """The format a chat template speaks, read off its text (named templates: all of them)."""
    if isinstance(template, dict):
        template = "\n".join(str(t) for t in template.values())
    elif isinstance(template, list):
        template = "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    text = template or ""
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or "ipython" in text:
        return "llama3_json"
    return "generic"


def new_call_id(fmt: str) -> str:
    if fmt == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


# ------------------------------------------------------------------------------------------ parsing


class _NotACall(ValueError):
    pass


def _arguments(value: Any) -> str:
    """A call's arguments as JSON text of an object (a JSON-text string is accepted as the model may write one)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise _NotACall("arguments are not JSON") from e
    if not isinstance(value, dict):
        raise _NotACall("arguments are not an object")
    return json.dumps(value, ensure_ascii=False)


def _call(obj: Any, fmt: str, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise _NotACall("not a {name, arguments} object")
    key = next((k for k in args_keys if k in obj), None)
    args = _arguments(obj[key]) if key is not None else "{}"
    given = obj.get("id")
    if fmt == "mistral" and isinstance(given, str) and len(given) == 9 and given.isalnum() and given.isascii():
        call_id = given
    else:
        call_id = new_call_id(fmt)
    return ParsedCall(call_id, obj["name"], args)


def _json_at(text: str, pos: int) -> tuple[Any, int]:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError as e:
        raise _NotACall("not JSON") from e


def _content(*parts: str) -> str | None:
    text = "".join(parts)
    return text if text.strip() else None


PYTHON_TAG = "<|python_tag|>"


def _parse_hermes(text: str) -> tuple[str | None, list[ParsedCall]]:
    """Each ``<tool_call>`` is followed by one JSON object (read as JSON, so a "</tool_call>" inside one of its
    strings is no end), then ``</tool_call>`` or the end of the reply; the text around the calls is content
    (blank text between and after them is not)."""
    pieces, calls, pos = [], [], 0
    while (start := text.find("<tool_call>", pos)) >= 0:
        if not calls or text[pos:start].strip():  # the text before the first call, and any but blank between them
            pieces.append(text[pos:start])
        obj, end = _json_at(text, start + len("<tool_call>"))
        calls.append(_call(obj, "hermes"))
        rest = text[end:].lstrip()
        if rest.startswith("</tool_call>"):
            end = len(text) - len(rest) + len("</tool_call>")
        elif rest:
            raise _NotACall("text after a call's JSON")
        pos = end if rest else len(text)
    if not calls:
        return _content(text), []
    return _content(*pieces, text[pos:] if text[pos:].strip() else ""), calls


def _parse_llama3(text: str) -> tuple[str | None, list[ParsedCall]]:
    pos = len(text) - len(text.lstrip())
    if text.startswith(PYTHON_TAG, pos):
        pos += len(PYTHON_TAG)
    if not text[pos:].lstrip().startswith("{"):
        return _content(text), []
    calls = []
    while True:
        obj, pos = _json_at(text, pos)
        calls.append(_call(obj, "llama3_json", ("parameters", "arguments")))
        rest = text[pos:].lstrip()
        if not rest.startswith(";"):
            break
        pos = len(text) - len(rest) + 1
    return _content(text[pos:]), calls


def _parse_mistral(text: str) -> tuple[str | None, list[ParsedCall]]:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return _content(text), []
    obj, end = _json_at(text, start + len("[TOOL_CALLS]"))
    items = obj if isinstance(obj, list) else [obj]
    if not items:
        raise _NotACall("no calls")
    return _content(text[:start], text[end:] if text[end:].strip() else ""), [_call(o, "mistral") for o in items]


def _parse_generic(text: str) -> tuple[str | None, list[ParsedCall]]:
    obj, end = _json_at(text, 0)
    if text[end:].strip() or not isinstance(obj, dict):
        raise _NotACall("not one JSON object")
    if isinstance(obj.get("tool_calls"), list) and obj["tool_calls"]:
        return None, [_call(o, "generic") for o in obj["tool_calls"]]
    if "tool_call" in obj:
        return None, [_call(obj["tool_call"], "generic")]
    if "response" in obj:
        response = obj["response"]
        return (response if isinstance(response, str) else json.dumps(response, ensure_ascii=False)), []
    raise _NotACall("no tool_call(s) or response")


_PARSERS: dict[str, Callable[[str], tuple[str | None, list[ParsedCall]]]] = {
    "hermes": _parse_hermes, "llama3_json": _parse_llama3, "mistral": _parse_mistral, "generic": _parse_generic}


def parse(fmt: str, text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a finished reply; a reply that does not parse as calls is all content (a generic
    ``{"response": "...`` cut by max_tokens: its text so far)."""
    try:
        return _PARSERS[fmt](text)
    except (_NotACall, RecursionError):  # RecursionError: JSON nested past Python's stack, not a call either
        cut = response_so_far(text) if fmt == "generic" else None
        return _content(text if cut is None else cut), []


def settled_content(fmt: str, text: str) -> str:
    """While streaming: the content that `text` so far surely begins with, whatever follows. Text from where a call
    may start is held back (until the reply ends); a generic ``{"response": "...`` gives its string so far."""
    if fmt == "generic":
        return response_so_far(text) or ""
    if fmt == "llama3_json":
        s = text.lstrip()
        end = 0 if not s or s.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(s) else len(text)
    else:
        marker = "<tool_call>" if fmt == "hermes" else "[TOOL_CALLS]"
        end = text.find(marker)
        if end < 0:
            end = len(text)
            for k in range(min(len(marker) - 1, len(text)), 0, -1):  # a tail that may grow into the marker
                if text.endswith(marker[:k]):
                    end = len(text) - k
                    break
    return text[:end] if text[:end].strip() else ""  # blank text may still be no content at all


_RESPONSE = re.compile(r'\s*\{\s*"response"\s*:\s*"')
_PARTIAL_ESCAPE = re.compile(r'(?<!\\)(\\\\)*\\(u[0-9a-fA-F]{0,3})?\Z')


def response_so_far(text: str) -> str | None:
    """The generic format's ``{"response": "...`` string decoded as far as it goes (a reply cut by max_tokens
    included), or None when `text` is not such a reply. An escape or a surrogate pair cut in half is left out."""
    m = _RESPONSE.match(text)
    if m is None:
        return None
    body, i = text[m.end():], 0
    while i < len(body) and body[i] != '"':
        i += 2 if body[i] == "\\" else 1
    body = body[:i] if i < len(body) else _PARTIAL_ESCAPE.sub(lambda e: e.group(1) or "", body)
    try:
        decoded = json.loads(f'"{body}"')
    except ValueError:
        return None
    return decoded[:-1] if decoded and "\ud800" <= decoded[-1] <= "\udbff" else decoded


# ------------------------------------------------------------------------------------------ grammars


def _rerooted(schema: Any, root: str) -> Any:
    """`schema` with every local ``$ref`` ("#...") pointing below ``#/$defs/<root>`` (where it is stored)."""
    if isinstance(schema, dict):
        out = {k: _rerooted(v, root) for k, v in schema.items()}
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = f"#/$defs/{root}{ref[1:]}"
        return out
    if isinstance(schema, list):
        return [_rerooted(v, root) for v in schema]
    return schema


_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def _closed(schema: Any) -> Any:
    """`schema` where an object schema that lists ``properties`` and says nothing of other keys gets
    ``additionalProperties: false`` (xgrammar's strict mode, vLLM's default; OpenAI's strict tools): a small model
    would otherwise invent keys until max_tokens. Every reply still validates against the original schema."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _closed(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(v) for v in out[key]]
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
    if "properties" in out and not any(k in out for k in ("additionalProperties", "patternProperties",
                                                          "unevaluatedProperties")):
        out["additionalProperties"] = False
    return out


def _has_ref(schema: Any) -> bool:
    if isinstance(schema, dict):
        return "$ref" in schema or any(_has_ref(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_has_ref(v) for v in schema)
    return False


def _call_schemas(functions: list[dict], args_key: str, defs: dict, with_id: bool = False) -> list[dict]:
    schemas = []
    for i, fn in enumerate(functions):
        params = _closed(fn.get("parameters") if fn.get("parameters") is not None else {"properties": {}})
        if "type" not in params:  # arguments are an object (OpenAI's rule): said where the schema does not
            params = {**params, "type": "object"}
        if _has_ref(params):  # stored under $defs so that its own "#/..." references still resolve
            defs[f"f{i}"] = _rerooted(params, f"f{i}")
            params = {"$ref": f"#/$defs/f{i}"}
        props = {"name": {"const": fn["name"]}, args_key: params}
        required = ["name", args_key]
        if with_id:
            props["id"] = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}
            required.append("id")
        schemas.append({"type": "object", "properties": props, "required": required, "additionalProperties": False})
    return schemas


def _one_of(schemas: list[dict]) -> dict:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _json(schema: dict, defs: dict) -> str:
    schema = {**schema, "x-guidance": JSON_STYLE}
    if defs:
        schema["$defs"] = defs
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _marker(text: str, token_of: Callable[[str], int | None]) -> str:
    tid = token_of(text)
    return f"<[{tid}]>" if tid is not None else json.dumps(text)


def generic_schema(functions: list[dict], parallel: bool, allow_response: bool, defs: dict) -> dict:
    """The generic format's reply schema (llama.cpp's, without its model-written ids)."""
    call = _one_of(_call_schemas(functions, "arguments", defs))
    if parallel:
        calls = {"type": "object", "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}},
                 "required": ["tool_calls"], "additionalProperties": False}
    else:
        calls = {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"],
                 "additionalProperties": False}
    if not allow_response:
        return calls
    response = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                "additionalProperties": False}
    return {"anyOf": [calls, response]}


def grammar(fmt: str, functions: list[dict], parallel: bool, token_of: Callable[[str], int | None],
            allow_text: bool = False) -> str:
    """The Lark grammar (llguidance's dialect) of a reply that is one call (or, with `parallel`, one or more) to
    one of `functions` ([{"name", "parameters"?}]) in format `fmt`. `allow_text` (generic only): a text reply
    (``{"response": ...}``) is allowed too (tool_choice auto)."""
    defs: dict = {}
    if fmt == "generic":
        return f"start: body\nbody: {_json(generic_schema(functions, parallel, allow_text, defs), defs)}\n"
    if allow_text:
        raise ValueError(f"the {fmt} format is not constrained under tool_choice auto")
    if fmt == "mistral":
        array = {"type": "array", "items": _one_of(_call_schemas(functions, "arguments", defs, with_id=True)),
                 "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        return f"start: {_marker('[TOOL_CALLS]', token_of)} body\nbody: {_json(array, defs)}\n"
    if fmt == "hermes":
        call_json = _json(_one_of(_call_schemas(functions, "arguments", defs)), defs)
        call = f'{_marker("<tool_call>", token_of)} "\\n" body "\\n" {_marker("</tool_call>", token_of)}'
        sep = '"\\n"'
    elif fmt == "llama3_json":
        call_json = _json(_one_of(_call_schemas(functions, "parameters", defs)), defs)
        call, sep = "body", '"; "'
    else:
        raise ValueError(f"unknown tool-call format {fmt!r} (expected one of {', '.join(FORMATS)})")
    start = f"call ({sep} call)*" if parallel else "call"
    return f"start: {start}\ncall: {call}\nbody: {call_json}\n"


# ------------------------------------------------------------------------------------------ generic prompt


def generic_system_prompt(tools: list[dict], parallel: bool, required: bool) -> str:
    """The system message that puts the tools and the JSON reply format in front of a model whose template has no
    tool syntax (as llama.cpp's generic format and minja's tool polyfill)."""
    functions = json.dumps([t["function"] for t in tools], ensure_ascii=False, indent=2)
    if parallel:
        call = '{"tool_calls": [{"name": "<function name>", "arguments": {<its arguments>}}]}'
    else:
        call = '{"tool_call": {"name": "<function name>", "arguments": {<its arguments>}}}'
    text = f"You can call the following functions to answer the user's request:\n{functions}\n\n"
    if required:
        return text + f"Respond in JSON format with a request to call functions:\n{call}"
    return (text + "Respond in JSON format, either with a request to call functions or with a reply to the "
                   f"user's request:\n{call}\nor\n" + '{"response": "<your reply>"}')


def generic_history(messages: list[dict]) -> list[dict]:
    """Tool turns as the generic format writes them: an assistant's calls become its JSON reply, a tool result a
    user message ``{"tool_response": {...}}`` (templates without tool syntax have no tool role)."""
    names: dict[str, str] = {}
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m.pop("tool_calls"):
                fn = c.get("function", {})
                calls.append({"name": fn.get("name"), "arguments": fn.get("arguments")})
                if c.get("id"):
                    names[c["id"]] = fn.get("name")
            reply = json.dumps({"tool_calls": calls}, ensure_ascii=False)
            text = m.get("content")
            m["content"] = f"{text}\n{reply}" if isinstance(text, str) and text.strip() else reply
        elif m.get("role") == "tool":
            response = {"content": m.get("content")}
            name = m.pop("name", None) or names.get(m.get("tool_call_id"))
            if name:
                response["name"] = name
            if m.get("tool_call_id"):
                response["tool_call_id"] = m.pop("tool_call_id")
            m = {**m, "role": "user", "content": json.dumps({"tool_response": response}, ensure_ascii=False)}
        out.append(m)
    return out
