"""Fuzzing against the REAL engine (stories260K), which samples (the fake engine never did, which is why the
top_k overflow went unseen): schemathesis cases from the app's own /openapi.json, and a hypothesis property
that puts any JSON value in any field of the completion and chat bodies. Every answer is a 200 or a 4xx with an
OpenAI-shaped error body, never a 5xx or an in-band stream error, and a greedy "neighbour" stream that runs the
whole time always gets exactly its offline text.

Structured outputs (``response_format``, ``structured_outputs``) are in the OpenAPI schema with their types, so
schemathesis draws them; a third property draws random (mostly invalid, some pathological) JSON schemas, regexes,
Lark grammars and choices, on both routes, streamed or not, beside the neighbour: 200 or 400, never a 5xx.

Default suite: 300 schemathesis cases + 2 x 60 property examples + 50 structured-output examples, fixed seeds.
``--run-slow``: 6,600 schemathesis cases asked for, 5,000+ drawn (the figures in docs/server.md), 600 structured.
"""

from __future__ import annotations

import json
import threading
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from scratchlm.server import BackgroundServer, ServerConfig, create_app
from scratchlm.server.protocol import ChatCompletionRequest, CompletionRequest

inference = pytest.importorskip("scratchlm.inference")
LLM, LLMEngine, EngineConfig, SamplingParams = (inference.LLM, inference.LLMEngine, inference.EngineConfig,
                                                inference.SamplingParams)

MAX_MODEL_LEN = 64  # every generation is short, so hundreds of cases fit in seconds
NEIGHBOUR = "Once upon a time"


@pytest.fixture(scope="module")
def model_path(data_dir):
    return data_dir / "models" / "stories260K" / "stories260K.bin"


@pytest.fixture(scope="module")
def neighbour_text(model_path):
    llm = LLM(str(model_path), max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return llm.generate([NEIGHBOUR], params, use_tqdm=False)[0].outputs[0].text


@pytest.fixture(scope="module")
def real_server(model_path):
    engine = LLMEngine.from_pretrained(model_path, EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=16))
    app = create_app(engine, ServerConfig(max_n=4, max_queue=512), model_name="stories260K")
    with BackgroundServer(app, start_timeout_s=60) as srv:
        yield srv


class Neighbour:
    """A greedy completion in a loop in a thread, each answer compared with the offline text."""

    def __init__(self, url: str, want: str):
        self.url, self.want, self.done, self.wrong = url, want, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"prompt": NEIGHBOUR, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        with httpx.Client(timeout=120) as c:
            while not self._stop.is_set():
                try:
                    r = c.post(self.url + "/v1/completions", json=body)
                    text = r.json()["choices"][0]["text"] if r.status_code == 200 else f"HTTP {r.status_code}: {r.text}"
                except Exception as e:  # a neighbour that could not finish is a failed neighbour
                    text = f"{type(e).__name__}: {e}"
                if text != self.want:
                    self.wrong.append(text)
                self.done += 1

    def __enter__(self) -> Neighbour:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(120)
        assert self.done >= 1 and not self.wrong, (self.done, self.wrong[:3])


def check_answer(status: int, content_type: str, text: str, what: object) -> None:
    """200 (and no in-band error event in a stream) or a 4xx with {"error": {message, type, param, code}}."""
    if isinstance(content_type, list):  # schemathesis' headers are lists
        content_type = ";".join(content_type)
    assert status < 500, (status, what, text[:500])
    if status >= 400:
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], text[:300]
    elif content_type.startswith("text/event-stream"):
        assert '"error"' not in text, (what, text[:500])


def operations():
    engine = LLMEngine.from_pretrained(_stories(), EngineConfig(max_model_len=MAX_MODEL_LEN))
    schema = schemathesis.openapi.from_dict(create_app(engine, ServerConfig()).openapi())
    return [result.ok() for result in schema.get_all_operations()]


def _stories():
    from tests.conftest import shared_data_path

    return shared_data_path() / "models" / "stories260K" / "stories260K.bin"


def run_schemathesis(server, total: int, rng_seed: int) -> Counter:
    """`total` cases spread over every operation (POST bodies twice as many, half of them schema-violating)."""
    ops = operations()
    plan = [(op, mode) for op in ops for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
            if mode is GenerationMode.POSITIVE or op.method.upper() == "POST"]
    weights = [3 if op.method.upper() == "POST" else 1 for op, _ in plan]
    counts: Counter = Counter()
    for (op, mode), w in zip(plan, weights):
        examples = max(1, total * w // sum(weights))

        @seed(rng_seed)
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=op.as_strategy(generation_mode=mode))
        def check(case):
            response = case.call(base_url=server.url, timeout=60)
            counts[f"{response.status_code // 100}xx"] += 1
            counts["cases"] += 1
            if isinstance(case.body, dict) and ({"response_format", "structured_outputs"} & set(case.body)):
                counts["structured"] += 1  # the grammar fields are in the schema, so they are drawn too
            check_answer(response.status_code, response.headers.get("content-type", ""), response.text,
                         (case.method, case.path, case.body))

        check()
    return counts


def test_schemathesis_real_engine(real_server, neighbour_text):
    with Neighbour(real_server.url, neighbour_text):
        counts = run_schemathesis(real_server, 300, rng_seed=16)
    assert counts["cases"] >= 250 and counts["2xx"] > 0 and counts["4xx"] > 0 and counts["structured"] > 0, counts
    assert httpx.get(real_server.url + "/health", timeout=10).status_code == 200


@pytest.mark.slow
def test_schemathesis_real_engine_long(real_server, neighbour_text):
    with Neighbour(real_server.url, neighbour_text) as neighbour:
        counts = run_schemathesis(real_server, 6600, rng_seed=1616)  # ~20% are not drawn: small GET spaces
    print(f"\nschemathesis long run: {dict(counts)}; neighbour completions: {neighbour.done}")
    assert counts["cases"] >= 5000 and counts["5xx"] == 0 and counts["structured"] > 0, counts


# ------------------------------------------------------------------------------------ any JSON in any field

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.sampled_from([10**20, -(10**20), 2**63, 2**64, -1, 0, 1])
    | st.floats() | st.sampled_from([1e-39, 1e-300, 1e300, -0.0, 5e-324, float("nan"), float("inf")])
    | st.text(max_size=20) | st.sampled_from(["\ud800", "a\udfff", "", "x" * 300]),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def property_check(server, base: dict, fields: list[str], examples: int, rng_seed: int) -> Counter:
    counts: Counter = Counter()
    path = "/v1/chat/completions" if "messages" in base else "/v1/completions"

    @seed(rng_seed)
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(field=st.sampled_from(fields), value=json_values)
    def check(field, value):
        body = {**base, field: value}
        raw = json.dumps(body).encode()  # lone surrogates travel as \ud800 escapes; NaN/Infinity as Python's tokens
        r = httpx.post(server.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=60)
        counts[f"{r.status_code // 100}xx"] += 1
        check_answer(r.status_code, r.headers.get("content-type", ""), r.text, body)

    check()
    return counts


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_any_json_in_any_field(real_server, neighbour_text, kind):
    if kind == "completion":
        base, model = {"prompt": "Lily", "max_tokens": 4}, CompletionRequest
    else:
        base, model = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}, ChatCompletionRequest
    fields = sorted(model.model_fields) + ["unknown_field"]
    with Neighbour(real_server.url, neighbour_text):
        counts = property_check(real_server, base, fields, 60, rng_seed=16 if kind == "completion" else 61)
    assert counts["2xx"] > 0 and counts["4xx"] > 0, counts


# ------------------------------------------------------------------------------ random grammars, valid or not

SCHEMA_KEYS = ["type", "properties", "items", "enum", "const", "minLength", "maxLength", "minimum", "maximum",
               "pattern", "required", "additionalProperties", "anyOf", "oneOf", "allOf", "$ref", "format",
               "minItems", "maxItems", "prefixItems", "not", "$defs", "exclusiveMinimum", "multipleOf"]
TYPES = ["object", "array", "string", "integer", "number", "boolean", "null", "frobnicate"]
schemas = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(TYPES)}) | st.just({}) | st.booleans(),
    lambda inner: st.dictionaries(st.sampled_from(SCHEMA_KEYS), inner | json_values
                                  | st.sampled_from(TYPES) | st.integers(-3, 40)
                                  | st.sampled_from(["#/$defs/a", "#", "#/nope", "email", "date-time", "^a+$", "("])
                                  | st.lists(st.sampled_from(TYPES + ["a", "b"]), max_size=3)
                                  | st.dictionaries(st.text("abc", max_size=3), inner, max_size=3), max_size=5),
    max_leaves=10,
)
regexes = st.text(alphabet="ab0.()[]{}*+?|^$\\-,dws ", max_size=14)
grammars = st.lists(st.sampled_from(["start", ":", " ", "\n", '"a"', '"b"', "|", "/[a-z]+/", "/(/", "x", "X",
                                     "%json", "{", "}", '"type"', "*", "+", "?", "(", ")", "%ignore", "WS",
                                     "%import common.WS", "->", "~", "3"]), max_size=14).map("".join)
structured_specs = st.one_of(
    st.builds(lambda v: {"json": v}, schemas), st.builds(lambda v: {"json": json.dumps(v)}, schemas),
    st.builds(lambda v: {"regex": v}, regexes), st.builds(lambda v: {"grammar": "start: " + v}, grammars),
    st.builds(lambda v: {"grammar": v}, grammars), st.builds(lambda v: {"choice": v}, st.lists(st.text(max_size=6),
                                                                                                max_size=4)),
    st.just({"json_object": True}), st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar",
                                                                     "json_object", "structural_tag"]),
                                                    json_values, max_size=2),
)
response_formats = st.one_of(
    st.builds(lambda v, strict: {"type": "json_schema", "json_schema": {"name": "f", "schema": v, "strict": strict}},
              schemas, st.booleans() | st.none()),
    st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "bogus"}]),
    json_values,
)


def structured_check(server, examples: int, rng_seed: int) -> Counter:
    counts: Counter = Counter()

    @seed(rng_seed)
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(route=st.sampled_from(["completion", "chat", "chat-format"]), spec=structured_specs,
           fmt=response_formats, stream=st.booleans(), n=st.integers(1, 2))
    def check(route, spec, fmt, stream, n):
        body: dict = {"max_tokens": 6, "stream": stream, "n": n}
        if route == "completion":
            path, body = "/v1/completions", {**body, "prompt": "Lily", "structured_outputs": spec}
        else:
            path, body = "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "Hi"}]}
            body.update({"response_format": fmt} if route == "chat-format" else {"structured_outputs": spec})
        raw = json.dumps(body).encode()
        r = httpx.post(server.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=60)
        counts[f"{r.status_code // 100}xx"] += 1
        check_answer(r.status_code, r.headers.get("content-type", ""), r.text, body)

    check()
    return counts


def test_random_grammars_never_5xx_nor_harm_a_neighbour(real_server, neighbour_text):
    with Neighbour(real_server.url, neighbour_text):
        counts = structured_check(real_server, 50, rng_seed=28)
    assert counts["2xx"] > 0 and counts["4xx"] > 0, counts


@pytest.mark.slow
def test_random_grammars_long(real_server, neighbour_text):
    with Neighbour(real_server.url, neighbour_text) as neighbour:
        counts = structured_check(real_server, 600, rng_seed=2828)
    print(f"\nrandom grammars: {dict(counts)}; neighbour completions: {neighbour.done}")
    assert counts["5xx"] == 0, counts
