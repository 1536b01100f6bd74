"""Structured outputs through the HTTP API on the real engine and the default model (SmolLM2-135M-Instruct): OpenAI's
``response_format`` (json_object, json_schema) and vLLM's ``structured_outputs`` (json, regex, choice, grammar).

The prompts are uncoached ("Tell me about a cat.": nothing asks for JSON), so only the grammar makes the replies
valid. The oracles never share the server's code: `jsonschema` validates the replies, Python's `re` matches them,
and the real clients parse them (the official `openai` client's ``chat.completions.parse`` with a pydantic model,
`instructor` in JSON_SCHEMA mode, LangChain's ``with_structured_output(method="json_schema")``); a 400's message is
compared with llguidance's own validation of the same schema/regex. Every schema bounds its strings, numbers and
arrays, so no reply can be cut by ``max_tokens`` (each test checks ``finish_reason == "stop"`` apart from the
validation). One server for the module; the 20 replies of a test run as one batch (``n`` or concurrent requests).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import llguidance
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from scratchlm.server import BackgroundServer, ServerConfig, create_app

inference = pytest.importorskip("scratchlm.inference")

MODEL = "smollm2"
UNCOACHED = [{"role": "user", "content": "Tell me about a cat."}]
N = 20
CAT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "indoor": {"type": "boolean"},
        "colors": {"type": "array", "items": {"type": "string", "enum": ["black", "white", "orange", "grey"]},
                   "maxItems": 3},
    },
    "required": ["name", "age", "indoor", "colors"],
    "additionalProperties": False,
}


class Cat(BaseModel):
    """A cat (the pydantic model the clients parse into; its schema is sent as the response format). Extra keys are
    forbidden so that the schema says ``additionalProperties: false`` (instructor sends the schema as pydantic
    writes it; with extra keys allowed, a 135M model may add keys until max_tokens)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=30)
    indoor: bool


@pytest.fixture(scope="module")
def server(default_model_path):
    engine = inference.LLMEngine.from_pretrained(default_model_path, inference.EngineConfig(
        max_num_seqs=N, max_model_len=512))
    with BackgroundServer(create_app(engine, ServerConfig(max_n=N), model_name=MODEL), start_timeout_s=120) as srv:
        yield srv


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json={"model": MODEL, **body}, timeout=300)


def chat(srv, **body) -> list[dict]:
    r = post(srv, "/v1/chat/completions", {"messages": UNCOACHED, "max_tokens": 200, "seed": 1, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"]


def finished(choices: list[dict]) -> list[str]:
    """The replies' texts, after checking that none was cut by max_tokens (that would be a test setup error)."""
    texts = [c["message"]["content"] if "message" in c else c["text"] for c in choices]
    assert [c["finish_reason"] for c in choices] == ["stop"] * len(choices), texts
    return texts


def assert_400(r: httpx.Response, param: str, *in_message: str) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    for part in in_message:
        assert part in error["message"], (part, error)
    return error["message"]


# ----------------------------------------------------------------------------------------- response_format


def test_json_object_20_of_20_uncoached(server):
    """Any JSON object: nothing bounds it, so at temperature 1 a 135M model sometimes rambles in a key until
    max_tokens (2 of 20 measured); at 0.7 all 20 close their object (most as "{}": the model's own choice)."""
    texts = finished(chat(server, n=N, temperature=0.7, max_tokens=300, response_format={"type": "json_object"}))
    assert all(isinstance(json.loads(t), dict) for t in texts), texts
    assert any(t != "{}" for t in texts)


def test_json_schema_strict_20_of_20_validate(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT_SCHEMA, "strict": True}}
    texts = finished(chat(server, n=N, response_format=fmt))
    for t in texts:
        jsonschema.validate(json.loads(t), CAT_SCHEMA)
    assert len(set(texts)) > 1  # sampled (temperature 1), not one greedy reply repeated


def test_unconstrained_reply_is_not_json(server):
    """The control: the same prompt without a response format gives prose, so the 20/20 above is the grammar's."""
    [reply] = chat(server, temperature=0.0, max_tokens=24)
    assert not reply["message"]["content"].lstrip().startswith("{"), reply


def test_streaming_json_schema_concatenates_to_a_valid_reply(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT_SCHEMA, "strict": True}}
    stream = client(server).chat.completions.create(model=MODEL, messages=UNCOACHED, response_format=fmt, n=3,
                                                    seed=5, max_tokens=200, stream=True)
    parts: dict[int, list[str]] = {0: [], 1: [], 2: []}
    reasons = {}
    for chunk in stream:
        for c in chunk.choices:
            parts[c.index].append(c.delta.content or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert reasons == {0: "stop", 1: "stop", 2: "stop"}
    for pieces in parts.values():
        assert len([p for p in pieces if p]) > 3  # really streamed, token by token
        jsonschema.validate(json.loads("".join(pieces)), CAT_SCHEMA)


# -------------------------------------------------------------------------------------- structured_outputs


def completion(srv, **body) -> list[str]:
    r = post(srv, "/v1/completions", {"prompt": "Here is my answer:", "max_tokens": 64, "seed": 3, **body})
    assert r.status_code == 200, r.text
    return finished(r.json()["choices"])


def test_regex_on_completions(server):
    pattern = r"(yes|no), [0-9]{1,3} (cats|dogs)\."
    texts = completion(server, n=8, structured_outputs={"regex": pattern})
    assert all(re.fullmatch(pattern, t) for t in texts), texts


def test_choice_on_completions(server):
    choices = ["red", "green", "light blue"]
    texts = completion(server, n=8, structured_outputs={"choice": choices})
    assert set(texts) <= set(choices), texts


def test_lark_grammar_on_completions(server):
    grammar = 'start: "The cat is " AGE " years old and " MOOD "."\nAGE: /[1-9][0-9]?/\nMOOD: "happy" | "sleepy"'
    texts = completion(server, n=8, structured_outputs={"grammar": grammar})
    assert all(re.fullmatch(r"The cat is [1-9][0-9]? years old and (happy|sleepy)\.", t) for t in texts), texts


def test_every_other_json_spelling_on_both_routes(server):
    """``strict: false`` (enforced all the same), the extension's schema as a dict and as JSON text, on both routes,
    and its json_object: one batch of concurrent requests."""
    fmt = {"type": "json_schema", "json_schema": {"name": "cat", "description": "a cat", "schema": CAT_SCHEMA,
                                                  "strict": False}}
    jobs = [
        ("chat", {"response_format": fmt}, CAT_SCHEMA),
        ("chat", {"structured_outputs": {"json": json.dumps(CAT_SCHEMA)}}, CAT_SCHEMA),
        ("completion", {"structured_outputs": {"json": CAT_SCHEMA}, "max_tokens": 200}, CAT_SCHEMA),
        ("completion", {"structured_outputs": {"json": json.dumps(CAT_SCHEMA)}, "max_tokens": 200}, CAT_SCHEMA),
        ("chat", {"structured_outputs": {"json_object": True}, "temperature": 0.7, "max_tokens": 300},
         {"type": "object"}),
    ]

    def texts(route: str, body: dict) -> list[str]:
        return completion(server, n=4, **body) if route == "completion" else finished(chat(server, n=4, **body))

    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(lambda job: texts(job[0], job[1]), jobs))
    for (_, _, schema), got in zip(jobs, replies):
        for t in got:
            jsonschema.validate(json.loads(t), schema)


# ---------------------------------------------------------------------------------------------------- 400s


def llguidance_error(grammar: str) -> str:
    """llguidance's own verdict on a grammar (the library's message the server must carry)."""
    message = llguidance.LLMatcher.validate_grammar(grammar)
    assert message, "the library accepts it: not a bad input"
    return message.strip().splitlines()[0]


CHAT = {"messages": UNCOACHED, "max_tokens": 8}


def test_bogus_response_format_type(server):
    assert_400(post(server, "/v1/chat/completions", {**CHAT, "response_format": {"type": "bogus"}}),
               "response_format", "bogus", "json_schema")


@pytest.mark.parametrize("fmt, param", [
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format"),  # no schema
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format"),  # no name
    ({"type": "json_schema"}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format"),
    ({"type": "json_object", "json_schema": {"name": "x", "schema": {}}}, "response_format.json_schema"),
    ("json_object", "response_format"),
])
def test_malformed_response_format(server, fmt, param):
    assert_400(post(server, "/v1/chat/completions", {**CHAT, "response_format": fmt}), param)


def test_schema_the_library_cannot_compile_carries_its_message(server):
    schema = {"type": "object", "properties": {"a": {"type": "frobnicate"}}}
    want = llguidance_error(llguidance.LLMatcher.grammar_from_json_schema(schema))
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert_400(post(server, "/v1/chat/completions", {**CHAT, "response_format": fmt}), "response_format", want)
    r = post(server, "/v1/completions", {"prompt": "x", "structured_outputs": {"json": schema}})
    assert_400(r, "structured_outputs", want)


@pytest.mark.parametrize("spec", [{"regex": "(unclosed"}, {"regex": "a{5,2}"},
                                  {"grammar": "start: missing_rule"}, {"grammar": "start: \"a"}])
def test_bad_regex_or_grammar_carries_the_library_message(server, spec):
    grammar = (llguidance.LLMatcher.grammar_from_regex(spec["regex"]) if "regex" in spec
               else llguidance.LLMatcher.grammar_from_lark(spec["grammar"]))
    want = llguidance_error(grammar)
    assert_400(post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, "structured_outputs": spec}),
               "structured_outputs", want)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "disable_additional_properties": True}},
     "structured_outputs.disable_additional_properties"),
])
def test_conflicting_or_empty_structured_outputs(server, body, param):
    assert_400(post(server, "/v1/chat/completions", {**CHAT, **body}), param)


def test_text_format_with_the_extension_is_one_constraint(server):
    texts = finished(chat(server, n=2, max_tokens=8, response_format={"type": "text"},
                          structured_outputs={"choice": ["purr", "meow"]}))
    assert set(texts) <= {"purr", "meow"}


def test_a_bad_schema_never_harms_a_running_stream(server):
    """A greedy stream runs; bad schemas, regexes and grammars arrive meanwhile (400s); the stream ends normally
    with the same text it has alone."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    alone = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    bad = [{"json": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}, {"regex": "(("},
           {"grammar": "start: nothing_here"}, {"json": {"$ref": "#/definitions/missing"}}]
    with httpx.Client(timeout=300) as c, c.stream("POST", server.url + "/v1/completions",
                                                  json={**body, "stream": True}) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        for spec in bad:
            r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, "structured_outputs": spec})
            assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
        rest = [first, *(line for line in lines if line.startswith("data: "))]
    assert rest[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in rest[:-1]]
    assert "error" not in "".join(rest)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == alone
    assert events[-1]["choices"][0]["finish_reason"] == "length"


# ------------------------------------------------------------------------------------------- real clients


def test_openai_parse_with_a_pydantic_model_20_of_20(server):
    c = client(server)
    parse = c.chat.completions.parse if hasattr(c.chat.completions, "parse") else c.beta.chat.completions.parse
    res = parse(model=MODEL, messages=UNCOACHED, response_format=Cat, n=N, seed=7, max_tokens=200)
    assert [ch.finish_reason for ch in res.choices] == ["stop"] * N
    parsed = [ch.message.parsed for ch in res.choices]
    assert all(isinstance(p, Cat) for p in parsed), [ch.message.content for ch in res.choices]


def test_instructor_json_schema_mode_20_of_20(server):
    instructor = pytest.importorskip("instructor")
    ic = instructor.from_openai(client(server), mode=instructor.Mode.JSON_SCHEMA)

    def one(i: int) -> Cat:
        return ic.chat.completions.create(model=MODEL, messages=UNCOACHED, response_model=Cat, max_retries=0,
                                          max_tokens=200, seed=i)

    with ThreadPoolExecutor(N) as pool:
        cats = list(pool.map(one, range(N)))
    assert all(isinstance(cat, Cat) for cat in cats)


def test_langchain_with_structured_output_json_schema_20_of_20(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="none", model=MODEL, max_retries=0,
                                      max_tokens=200, timeout=300)
    structured = llm.with_structured_output(Cat, method="json_schema")
    cats = structured.batch([UNCOACHED[0]["content"]] * N, config={"max_concurrency": N})
    assert all(isinstance(cat, Cat) for cat in cats), cats


# ------------------------------------------------------------------------------- the engine in its own process


def test_process_engine_constrains_and_refuses_the_same(data_dir):
    """`scratchlm serve`'s default loop (the engine in a child process, stories260K: a llama2.c tokenizer): the
    same constraints hold, and a spec the library cannot compile is the same 400 (checked before admission)."""
    from scratchlm.server.engine_process import EngineProcessLoop

    model = data_dir / "models" / "stories260K" / "stories260K.bin"
    loop = EngineProcessLoop(model, inference.EngineConfig(max_num_seqs=8, max_model_len=128), threads=1,
                             startup_timeout_s=300)
    with BackgroundServer(create_app(loop.engine, ServerConfig(), model_name=MODEL, engine_loop=loop)) as srv:
        pattern = r"[a-z]{2,6}( [a-z]{2,6}){2}\."
        for t in completion(srv, n=4, prompt="Lily", structured_outputs={"regex": pattern}):
            assert re.fullmatch(pattern, t), t
        schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                  "required": ["n"], "additionalProperties": False}
        for t in completion(srv, n=4, prompt="Lily", structured_outputs={"json": schema}):
            jsonschema.validate(json.loads(t), schema)
        want = llguidance_error(llguidance.LLMatcher.grammar_from_regex("(unclosed"))
        r = post(srv, "/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "(unclosed"}})
        assert_400(r, "structured_outputs", want)
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
