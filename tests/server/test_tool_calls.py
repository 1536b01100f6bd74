"""Tool calling below the model: the reply parsers on golden strings, the grammars (llguidance on a byte-level toy
vocabulary: golden calls accepted, wrong ones refused, random walks through each grammar parse to calls whose
arguments validate with jsonschema), streaming equal to the whole reply, the prompt against HF transformers'
`apply_chat_template` on the families' own templates (through the server's /tokenize), and the 400s."""

from __future__ import annotations

import copy
import json
import random

import httpx
import pytest

from scratchlm.inference.chat_template import render_chat
from scratchlm.server import BackgroundServer, ServerConfig, create_app
from scratchlm.server.protocol import ChatMessage, NamedToolChoice, ToolDefinition
from scratchlm.server.tool_calls import ToolStream, plan, template_messages
from scratchlm.server.tool_parsers import detect_format, grammar, parse
from tests.inference.test_chat_template import FAMILIES, hf_tokenizer, template_text
from tests.server.fake_engine import ByteTokenizer, FakeEngine, FakeEngineConfig, FakeSamplingParams

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city"]}}
ADD = {"name": "add", "parameters": {"type": "object", "required": ["a", "b"], "additionalProperties": False,
                                     "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}
USER = {"name": "create_user", "parameters": {  # pydantic's shape: local $defs and $ref
    "$defs": {"Address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "integer"}},
                          "required": ["street", "zip"]}},
    "type": "object", "properties": {"name": {"type": "string"}, "address": {"$ref": "#/$defs/Address"}},
    "required": ["name", "address"]}}
PING = {"name": "ping"}  # no parameters at all
FUNCTIONS = [WEATHER, ADD, USER, PING]
TOOLS = [{"type": "function", "function": f} for f in FUNCTIONS]


def schema_of(name: str) -> dict:
    return next(f.get("parameters", {"type": "object"}) for f in FUNCTIONS if f["name"] == name)


# ------------------------------------------------------------------------------------------ parsers

def calls_of(fmt: str, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = parse(fmt, text)
    for c in calls:
        assert c.id.startswith("call_") and len(c.id) == 29 if fmt != "mistral" else len(c.id) == 9 and c.id.isalnum()
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_parser():
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert calls_of("hermes", one) == (None, [("get_weather", {"city": "Paris"})])
    two = f'Let me check.\n{one}\n<tool_call>\n{{"name": "add", "arguments": {{"a": 1, "b": 2}}}}\n</tool_call>'
    assert calls_of("hermes", two) == ("Let me check.\n", [("get_weather", {"city": "Paris"}),
                                                          ("add", {"a": 1, "b": 2})])
    # an unclosed last block still parses (the EOS cut it); arguments given as JSON text are accepted
    assert calls_of("hermes", '<tool_call>{"name": "ping", "arguments": "{}"}') == (None, [("ping", {})])
    for bad in ('<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>', "plain words",
                '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": "x", "arguments": [1]}</tool_call>'):
        assert parse("hermes", bad) == (bad, [])  # a failure is content, never an error
    assert parse("hermes", "  \n") == (None, [])


def test_llama3_parser():
    one = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    assert calls_of("llama3_json", one) == (None, [("add", {"a": 1, "b": 2})])
    assert calls_of("llama3_json", '<|python_tag|>{"name": "ping", "parameters": {}}; {"name": "add", "arguments": '
                                   '{"a": 3, "b": 4}}') == (None, [("ping", {}), ("add", {"a": 3, "b": 4})])
    assert calls_of("llama3_json", ' {"name": "ping", "parameters": {}} and more') == (" and more", [("ping", {})])
    for text in ('The answer is {"name": "ping"}', '{"name": "ping", "parameters": {}}; oops', '{"not": "a call"}'):
        assert parse("llama3_json", text) == (text, [])


def test_mistral_parser():
    content, calls = parse("mistral", 'Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}, "id": '
                                      '"abcDEF123"}, {"name": "ping", "arguments": {}, "id": "x"}]')
    assert content == "Sure." and [c.name for c in calls] == ["add", "ping"]
    assert calls[0].id == "abcDEF123" and len(calls[1].id) == 9 and calls[1].id.isalnum()  # a 9-char id is kept
    assert calls_of("mistral", '[TOOL_CALLS] {"name": "ping", "arguments": {}}') == (None, [("ping", {})])
    for text in ("no calls", "[TOOL_CALLS][]", "[TOOL_CALLS][{\"name\": \"add\", \"arguments\": {\"a\": }]"):
        assert parse("mistral", text) == (text, [])


def test_generic_parser():
    assert calls_of("generic", '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "ping", '
                               '"arguments": {}}]}') == (None, [("add", {"a": 1, "b": 2}), ("ping", {})])
    assert calls_of("generic", ' {"tool_call": {"name": "ping", "arguments": {}}}\n') == (None, [("ping", {})])
    assert parse("generic", '{"response": "Hello there"}') == ("Hello there", [])
    assert parse("generic", '{"response": {"a": 1}}') == ('{"a": 1}', [])
    assert parse("generic", '{"response": "cut by max_tok') == ("cut by max_tok", [])  # its text so far
    for text in ("Hello", '{"tool_calls": [{"name": "ping"}]} trailing', '{"something": "else"}', '[1, 2]'):
        assert parse("generic", text) == (text, [])


def test_detect_format_from_the_templates():
    expected = {"Qwen-Qwen2.5-7B-Instruct": "hermes", "Qwen-Qwen3-0.6B": "hermes",
                "meta-llama-Llama-3.2-3B-Instruct": "llama3_json", "meta-llama-Llama-3.3-70B-Instruct": "llama3_json",
                "mistralai-Mistral-Nemo-Instruct-2407": "mistral", "HuggingFaceTB-SmolLM2-135M-Instruct": "generic",
                "google-gemma-2-2b-it": "generic", "microsoft-Phi-3.5-mini-instruct": "generic"}
    for name, fmt in expected.items():
        assert detect_format(template_text(name)) == fmt, name
    assert detect_format(None) == "generic"
    assert detect_format({"default": "x", "tool_use": "{{ '<tool_call>' }}"}) == "hermes"


GOLDEN = {  # per format: a reply with one call to get_weather and one with two calls (add, ping)
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
               '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
               '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
                    '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "ping", "parameters": {}}'),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]',
                '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}, "id": "a1b2c3d4e"}, '
                '{"name": "ping", "arguments": {}, "id": "Z9Y8X7W6V"}]'),
    "generic": ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}',
                '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "ping", "arguments": {}}]}'),
}


@pytest.mark.parametrize("fmt", sorted(GOLDEN))
def test_streaming_assembles_to_the_whole_reply(fmt):
    """Text fed a character at a time: content deltas + the calls at the end equal the non-streamed parse."""
    responses = ('{"response": "Caf\\u00e9 \\"ok\\" \\ud83d\\ude00 done"}', '{"response": "cut \\u00e9 by max_to')
    for text in (*GOLDEN[fmt], "Just words, no call.", "Thinking first. " + GOLDEN[fmt][0], "<tool no", "  ",
                 *responses):
        stream, streamed = ToolStream(fmt), ""
        for i in range(1, len(text)):
            delta, calls = stream.step(text[:i], finished=False)
            assert calls == []
            streamed += delta
        delta, calls = stream.step(text, finished=True)
        content, expected = parse(fmt, text)
        assert streamed + delta == (content or "")
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in expected]
        if expected and fmt != "llama3_json":  # nothing of a call was sent as content
            assert "{" not in streamed
        if fmt == "generic" and text in responses:  # the reply's text is streamed as it is decoded
            assert content.startswith(("Café \"ok\" 😀", "cut é by max_to")) and len(streamed) >= len(content) - 1


# ------------------------------------------------------------------------------------------ grammars

MARKERS = {"<tool_call>": 257, "</tool_call>": 258, "[TOOL_CALLS]": 259}  # one token each; [TOOL_CALLS] special
EOS = 256


class ToyVocab:
    """256 byte tokens, EOS and the markers: what llguidance's TokenizerWrapper reads."""

    tokens = [bytes([i]) for i in range(256)] + [b"<|eos|>"] + [m.encode() for m in MARKERS]
    eos_token_id, bos_token_id, special_token_ids = EOS, None, [EOS, 259]

    def __call__(self, text) -> list[int]:
        return encode(text.decode() if isinstance(text, bytes) else text)


def encode(text: str) -> list[int]:
    out, i = [], 0
    while i < len(text):
        marker = next((m for m in MARKERS if text.startswith(m, i)), None)
        if marker:
            out.append(MARKERS[marker])
            i += len(marker)
        else:
            out += list(text[i].encode())
            i += 1
    return out


def decode(ids: list[int]) -> str:
    return b"".join(ToyVocab.tokens[i] for i in ids if i != EOS).decode()


@pytest.fixture(scope="module")
def toy():
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(ToyVocab()))


def matcher(toy, lark: str):
    m = llguidance.LLMatcher(toy, llguidance.grammar_from("grammar", lark), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def accepts(toy, lark: str, text: str) -> bool:
    m = matcher(toy, lark)
    return m.consume_tokens(encode(text)) and m.is_accepting()


def toy_grammar(fmt: str, functions: list[dict], parallel: bool = True, allow_text: bool = False) -> str:
    return grammar(fmt, functions, parallel, MARKERS.get, allow_text=allow_text)


@pytest.mark.parametrize("fmt", sorted(GOLDEN))
def test_grammar_accepts_the_format_and_nothing_else(toy, fmt):
    one, two = GOLDEN[fmt]
    every = toy_grammar(fmt, FUNCTIONS)
    assert accepts(toy, every, one) and accepts(toy, every, two)
    single = toy_grammar(fmt, FUNCTIONS, parallel=False)  # parallel_tool_calls: false
    assert not accepts(toy, single, two)
    if fmt == "generic":  # one call is {"tool_call": {...}} there
        assert not accepts(toy, single, one)
        assert accepts(toy, single, '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}')
    else:
        assert accepts(toy, single, one)
    named = toy_grammar(fmt, [ADD])  # tool_choice {"function": {"name": "add"}}
    assert not accepts(toy, named, one)
    wrong = [one.replace('"Paris"', "42"),  # the argument's type
             one.replace('{"city": "Paris"}', '{"unit": "celsius"}'),  # a required argument missing
             one.replace("get_weather", "get_wether"),  # an unknown function
             one.replace('"Paris"}', '"Paris", "unit": "kelvin"}'),  # outside the enum
             one.replace('"Paris"}', '"Paris", "country": "FR"}'),  # a key the schema does not list
             "Sure! " + one, one.replace(": ", ":")]  # text before the call; separators are fixed
    for text in wrong:
        assert not accepts(toy, every, text), text
    if fmt == "generic":
        assert not accepts(toy, every, '{"response": "hi"}')
        assert accepts(toy, toy_grammar(fmt, FUNCTIONS, allow_text=True), '{"response": "hi"}')
    else:
        with pytest.raises(ValueError):
            toy_grammar(fmt, FUNCTIONS, allow_text=True)


def test_grammar_markers_are_single_tokens(toy):
    """A marker the tokenizer holds as one token must be written as that token: spelled out in bytes, it is refused."""
    text = GOLDEN["hermes"][0]
    spelled = list(text.encode())
    m = matcher(toy, toy_grammar("hermes", FUNCTIONS))
    assert not m.consume_tokens(spelled)
    literal = grammar("hermes", FUNCTIONS, True, lambda t: None)  # a vocabulary without the marker: spelled out
    m = matcher(toy, literal)
    assert m.consume_tokens(spelled) and m.is_accepting()


PREFERRED = [ord(c) for c in '"}]0123456789'] + [EOS]


def random_walk(m, rng: random.Random, vocab: int, steps: int = 400) -> list[int] | None:
    """Tokens the grammar allows, drawn at random (closers preferred, so walks end); None when one runs out."""
    out = []
    for _ in range(steps):
        if m.is_stopped():
            return out
        mask = m.compute_bitmask()
        allowed = [i for i in range(vocab) if mask[i // 8] >> (i % 8) & 1]
        assert allowed, "the grammar left no token"
        preferred = [i for i in PREFERRED if i in allowed]
        token = rng.choice(preferred if preferred and rng.random() < 0.6 else allowed)
        if token == EOS:
            return out
        assert m.consume_token(token)
        out.append(token)
    return None


@pytest.mark.parametrize("fmt", sorted(GOLDEN))
def test_every_reply_the_grammar_allows_is_a_valid_call(toy, fmt):
    """Random replies drawn through the grammar's masks parse to calls whose arguments validate (jsonschema)."""
    rng = random.Random(fmt)
    lark = toy_grammar(fmt, FUNCTIONS)
    finished, names = 0, set()
    for _ in range(30):
        m = matcher(toy, lark)
        ids = random_walk(m, rng, toy.vocab_size)
        if ids is None:
            continue
        finished += 1
        content, calls = parse(fmt, decode(ids))
        assert calls and content is None, decode(ids)
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), schema_of(call.name))
            names.add(call.name)
    assert finished >= 20 and names == {f["name"] for f in FUNCTIONS}


# ------------------------------------------------------------------------------------------ prompts vs HF

OPENAI_TURNS = [  # as an OpenAI client sends them: arguments as JSON text, content parts, null content
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What's the weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call0abcd", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Zürich", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call0abcd", "content": '{"temperature": 21.5}'},
    {"role": "assistant", "content": "It is 21.5 °C."},
    {"role": "user", "content": [{"type": "text", "text": "Thanks! "}, {"type": "text", "text": "And <b>Paris</b>?"}]},
]
TEMPLATE_FAMILIES = ["Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "meta-llama-Llama-3.2-3B-Instruct",
                     "meta-llama-Llama-3.3-70B-Instruct", "mistralai-Mistral-Nemo-Instruct-2407"]


def hf_form(turns: list[dict], null_content: str | None) -> list[dict]:
    """The same conversation as HF's docs write it: arguments as dicts, text parts joined."""
    out = copy.deepcopy(turns)
    for m in out:
        if isinstance(m.get("content"), list):
            m["content"] = "".join(p["text"] for p in m["content"])
        if m.get("content") is None:
            m["content"] = null_content
        for call in m.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


class TemplateTokenizer(ByteTokenizer):
    """The fake engine's byte tokenizer carrying a family's chat template and special-token strings."""

    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None


class TemplateEngine(FakeEngine):
    def __init__(self):
        super().__init__(FakeEngineConfig(max_model_len=16384, num_blocks=8192))
        self.tokenizer = TemplateTokenizer()

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        return render_chat(self.tokenizer, messages, add_generation_prompt, **kwargs)


@pytest.fixture(scope="module")
def template_server():
    engine = TemplateEngine()
    app = create_app(engine, ServerConfig(), model_name="fake-template", sampling_params_cls=FakeSamplingParams)
    with BackgroundServer(app, start_timeout_s=30) as srv:
        yield srv, engine


def tokenize(srv, body: dict) -> httpx.Response:
    return httpx.post(srv.url + "/tokenize", json={"add_special_tokens": False, **body}, timeout=30)


@pytest.mark.parametrize("name", TEMPLATE_FAMILIES)
def test_prompt_with_tools_and_tool_turns_matches_hf(template_server, name):
    srv, engine = template_server
    bos, eos = FAMILIES[name]
    tok = engine.tokenizer
    tok.chat_template, tok.bos_token, tok.eos_token = template_text(name), bos, eos
    hf = hf_tokenizer(template_text(name), bos, eos)
    # Qwen3 reads every assistant turn's content: the server sends "" for null (vLLM's way), where HF would fail
    null = "" if name == "Qwen-Qwen3-0.6B" else None
    for turns, tools in ((OPENAI_TURNS, TOOLS), (OPENAI_TURNS[:2], TOOLS), (OPENAI_TURNS, None)):
        res = tokenize(srv, {"messages": turns, **({"tools": tools} if tools else {})})
        assert res.status_code == 200, res.text
        ours = bytes(res.json()["tokens"]).decode()
        # (Llama's date line is today's on both sides: strftime_now)
        theirs = hf.apply_chat_template(hf_form(turns, null), tools=tools, tokenize=False, add_generation_prompt=True)
        assert ours == theirs
        assert ("create_user" in ours) == (tools is not None)


def test_generic_tools_on_a_template_without_a_system_role(template_server):
    """Gemma 2 refuses a system message: the generic format's tool description goes into the first user turn (HF's
    rendering of that conversation), instead of a 400."""
    srv, engine = template_server
    name = "google-gemma-2-2b-it"
    bos, eos = FAMILIES[name]
    tok = engine.tokenizer
    tok.chat_template, tok.bos_token, tok.eos_token = template_text(name), bos, eos
    res = tokenize(srv, {"messages": OPENAI_TURNS[1:2], "tools": TOOLS})
    assert res.status_code == 200, res.text
    ours = bytes(res.json()["tokens"]).decode()
    system = next(m for m in plan([ChatMessage.model_validate(OPENAI_TURNS[1])],
                                  [ToolDefinition.model_validate(t) for t in TOOLS], None, None, None, "auto",
                                  MARKERS.get).messages if m["role"] == "system")["content"]
    user = {"role": "user", "content": f"{system}\n\n{OPENAI_TURNS[1]['content']}"}
    assert ours == hf_tokenizer(template_text(name), bos, eos).apply_chat_template(
        [user], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours.startswith("<bos><start_of_turn>user\nYou can call the following functions")


def test_tool_turns_reach_the_template_as_hf_expects():
    """template_messages: arguments parsed, ids, names and tool_call_id kept (the HF form, no server)."""
    msgs = template_messages([ChatMessage.model_validate(m) for m in OPENAI_TURNS])
    assert msgs[2]["tool_calls"] == [{"id": "call0abcd", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}}]
    assert msgs[2]["content"] == "" and msgs[3] == {"role": "tool", "content": '{"temperature": 21.5}',
                                                    "tool_call_id": "call0abcd"}
    assert msgs[5]["content"] == "Thanks! And <b>Paris</b>?"


def test_generic_prompt_describes_the_tools():
    """The default model's ChatML template has no tool syntax: a system message carries the tools and the JSON reply,
    the history's tool turns are written in that JSON, and tool_choice none leaves the prompt alone."""
    smol = template_text("HuggingFaceTB-SmolLM2-135M-Instruct")

    tools = [ToolDefinition.model_validate(t) for t in TOOLS]
    messages = [ChatMessage.model_validate(m) for m in OPENAI_TURNS]
    p = plan(messages, tools, None, None, smol, "auto", MARKERS.get)
    assert p.fmt == "generic" and p.grammar is not None
    system = p.messages[0]["content"]
    assert system.startswith("You are terse.\n\n") and '"name": "create_user"' in system and '"response"' in system
    assert json.loads(p.messages[2]["content"]) == {"tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}]}
    assert p.messages[3]["role"] == "user" and json.loads(p.messages[3]["content"]) == {"tool_response": {
        "content": '{"temperature": 21.5}', "name": "get_weather", "tool_call_id": "call0abcd"}}
    add = NamedToolChoice.model_validate({"type": "function", "function": {"name": "add"}})
    named = plan(messages[1:2], tools, add, False, smol, "auto", MARKERS.get)
    assert named.messages[0]["role"] == "system" and '"name": "add"' in named.messages[0]["content"]
    assert "get_weather" not in named.messages[0]["content"] and '"tool_call": {' in named.messages[0]["content"]
    none = plan(messages[1:2], tools, "none", None, smol, "auto", MARKERS.get)
    assert none.fmt is None and none.grammar is None and none.messages == template_messages(messages[1:2])
    # a template with tool syntax keeps its own prompt: no system message is added, auto is not constrained
    qwen = plan(messages[1:2], tools, "auto", None, template_text("Qwen-Qwen2.5-7B-Instruct"), "auto", MARKERS.get)
    assert qwen.fmt == "hermes" and qwen.grammar is None and len(qwen.messages) == 1
    forced = plan(messages[1:2], tools, "required", None, smol, "hermes", MARKERS.get)  # --tool-call-parser hermes
    assert forced.fmt == "hermes" and "<[257]>" in forced.grammar


# ------------------------------------------------------------------------------------------ 400s

DEEP: dict = {}
for _ in range(400):  # a schema nested past Python's stack (the grammar's walk over it)
    DEEP = {"type": "object", "properties": {"x": DEEP}}


def chat(srv, **body) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30)


@pytest.mark.parametrize("body, param, says", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "no `tools`"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "function.name"),
    ({"tools": [{"type": "retrieval", "function": WEATHER}]}, "tools", "type"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools", "function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]}, "tools", "parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools",
     'type "object"'),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools.1.function.name", "given twice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"functions": [WEATHER]}, "functions", "not supported"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]},
     "messages.1.tool_calls.0.function.arguments", "not JSON"),
    ({"tools": [{"type": "function", "function": {"name": "deep", "parameters": DEEP}}], "tool_choice": "required"},
     "tools", "nested too deeply"),
])
def test_bad_tool_requests_are_400s(template_server, body, param, says):
    srv, engine = template_server
    engine.tokenizer.chat_template = None
    res = chat(srv, **body)
    assert res.status_code == 400, res.text
    error = res.json()["error"]
    assert error["param"] == param and says in error["message"], error
