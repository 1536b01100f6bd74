"""No field silently ignored (issue 28): every OpenAI request field the server does not implement, and every
unknown field, is a 400 naming it; the no-op fields OpenAI clients send are accepted and change nothing;
`logit_bias` works on the real engine (stories260K) against a plain-forward oracle (the model's own
forward over the whole sequence, the bias added by hand, argmax: no engine, no sampler); `/v1/models`
shows no local path.

The list of OpenAI's fields comes from the installed `openai` client's own request types, so a field a newer
client adds is checked too (it must be accepted on purpose, or be a 400)."""

from __future__ import annotations

import typing
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from openai.types import completion_create_params as completion_params
from openai.types.chat import ChatCompletionMessage
from openai.types.chat import completion_create_params as chat_params

from scratchlm.server import BackgroundServer, ServerConfig, create_app
from tests.server.fake_engine import FakeEngine, FakeSamplingParams, chat_prompt, expected_text

MODEL = "fake-echo"
CHAT = {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 5, "temperature": 0}
COMPLETION = {"prompt": "Hello", "max_tokens": 5, "temperature": 0}

# The fields this server implements or accepts as no-ops, written out here (not read from protocol.py).
CHAT_ACCEPTED = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
                 "seed", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "logit_bias",
                 "stream", "stream_options", "user", "metadata", "safety_identifier", "prompt_cache_key", "store",
                 "service_tier", "tools", "tool_choice", "parallel_tool_calls", "function_call", "response_format",
                 "modalities"}
COMPLETION_ACCEPTED = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
                       "presence_penalty", "frequency_penalty", "logprobs", "logit_bias", "stream", "stream_options",
                       "user", "echo", "suffix", "best_of"}
PROBE = {"probe": [1, "x"]}  # a value no implemented field takes as a no-op


def openai_fields(params_module) -> set[str]:
    return set(typing.get_type_hints(params_module.CompletionCreateParamsBase))


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=30)


def assert_unsupported(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert err["code"] == "unsupported_parameter" and f"`{param}`" in err["message"], err


@pytest.mark.parametrize("field", sorted(openai_fields(chat_params) - CHAT_ACCEPTED))
def test_every_unimplemented_openai_chat_field_is_a_400_naming_it(fake, field):
    assert_unsupported(post(fake[0], "/v1/chat/completions", {**CHAT, field: PROBE}), field)


def test_every_unimplemented_openai_completion_field_is_a_400_naming_it(fake):
    for field in sorted(openai_fields(completion_params) - COMPLETION_ACCEPTED):  # none in openai 2.x / 3.x so far
        assert_unsupported(post(fake[0], "/v1/completions", {**COMPLETION, field: PROBE}), field)


def test_the_accepted_lists_are_openai_fields_or_known_extensions():
    assert CHAT_ACCEPTED - openai_fields(chat_params) == {"stream"}
    assert COMPLETION_ACCEPTED - openai_fields(completion_params) == {"stream"}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {**CHAT, "function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "x": 1}}]},
     "tools.0.function.x"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "text", "extra": 1}}, "response_format.extra"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {}, "other": 1}}}, "response_format.json_schema.other"),
    ("/v1/chat/completions", {**CHAT, "store": True}, "store"),
    ("/v1/chat/completions", {**CHAT, "service_tier": "flex"}, "service_tier"),
    ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {**CHAT, "reasoning_effort": "low"}, "reasoning_effort"),
    ("/v1/chat/completions", {**CHAT, "echo": True}, "echo"),
    ("/v1/chat/completions", {**CHAT, "guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"regex": "a+", "structural_tag": "t"}},
     "structured_outputs.structural_tag"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "a+", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "a+", "guided_regex": "a"}},
     "structured_outputs.guided_regex"),
    ("/v1/chat/completions", {**CHAT, "temprature": 0.5}, "temprature"),  # a typo is not silently dropped
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True, "other": 1}},
     "stream_options.other"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "assistant", "function_call": {"name": "f"}}]},
     "messages.0.function_call"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x", "cache": True}]},
     "messages.0.cache"),
    ("/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]}]},
     "messages.0.content.0.cache_control"),
    ("/v1/completions", {**COMPLETION, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/completions", {**COMPLETION, "response_format": {"type": "text"}}, "response_format"),
    ("/v1/completions", {**COMPLETION, "unknown_field": None}, "unknown_field"),
    ("/tokenize", {"prompt": "x", "return_token_strs": True}, "return_token_strs"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice"),
    ("/detokenize", {"tokens": [1, 2], "skip_special_tokens": True}, "skip_special_tokens"),
])
def test_unimplemented_values_and_unknown_fields_are_400s_naming_them(fake, path, body, param):
    assert_unsupported(post(fake[0], path, body), param)


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/models/fake-echo"])
def test_unimplemented_routes_are_404s_with_the_openai_body(fake, path):
    r = post(fake[0], path, {"input": "x", "model": MODEL}) if "models" not in path else httpx.get(fake[0].url + path)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("extra", [
    {"user": "u-1"}, {"metadata": {"k": "v"}}, {"safety_identifier": "s"}, {"prompt_cache_key": "p"},
    {"store": False}, {"store": None}, {"service_tier": "auto"}, {"service_tier": "default"},
    {"tool_choice": "none"}, {"function_call": "none"}, {"response_format": {"type": "text"}},
    {"modalities": ["text"]}, {"tools": None, "tool_choice": None, "parallel_tool_calls": None, "functions": None,
                               "audio": None, "prediction": None, "reasoning_effort": None},
    {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True},  # no tools: nothing to call
    {"stream_options": {"include_usage": False}}, {"logit_bias": {}}, {"logit_bias": None},
])
def test_no_op_fields_are_accepted_and_change_nothing(fake, extra):
    srv, _ = fake
    r = post(srv, "/v1/chat/completions", {**CHAT, **extra})
    assert r.status_code == 200, r.text
    expected, _ = expected_text(chat_prompt(CHAT["messages"]), 5)
    assert r.json()["choices"][0]["message"]["content"] == expected


def test_a_reply_echoed_back_by_the_openai_client_is_accepted(fake):
    """`messages.append(reply.model_dump())` sends refusal/tool_calls/function_call/audio/annotations as null."""
    srv, _ = fake
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    first = c.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=5, temperature=0,
                                      user="u", metadata={"run": "1"}, store=False)
    echoed = first.choices[0].message.model_dump()
    assert isinstance(first.choices[0].message, ChatCompletionMessage) and "refusal" in echoed
    history = [*CHAT["messages"], echoed, {"role": "user", "content": "more"}]
    second = c.chat.completions.create(model=MODEL, messages=history, max_tokens=5, temperature=0)
    plain = [*CHAT["messages"], {"role": "assistant", "content": echoed["content"]},
             {"role": "user", "content": "more"}]
    assert second.choices[0].message.content == expected_text(chat_prompt(plain), 5)[0]


def test_the_openai_client_gets_a_bad_request_error_naming_the_field(fake):
    srv, _ = fake
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    functions = [{"name": "get_weather", "parameters": {"type": "object"}}]  # deprecated: tools replace them
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model=MODEL, messages=CHAT["messages"], functions=functions)
    assert info.value.body["param"] == "functions" and info.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model=MODEL, messages=CHAT["messages"],
                                  extra_body={"structured_outputs": {"regex": "a", "structural_tag": "t"}})
    assert info.value.body["param"] == "structured_outputs.structural_tag"
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model=MODEL, messages=CHAT["messages"], extra_body={"guided_regex": "a"})
    assert info.value.body["param"] == "guided_regex"


@pytest.mark.parametrize("bias, message_part", [
    ({"258": 1}, "258"), ({"99999999999": 1}, "99999999999"), ({"-1": 1}, "'-1'"), ({"abc": 1}, "'abc'"),
    ({"5": 100.5}, "logit_bias.5"), ({"5": -101}, "logit_bias.5"), ({"5": "high"}, "logit_bias.5"),
    ([1, 2], "logit_bias"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_invalid_logit_bias_is_a_400_naming_the_param_and_the_id(fake, bias, message_part, path):
    r = post(fake[0], path, {**(CHAT if "chat" in path else COMPLETION), "logit_bias": bias})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and err["type"] == "invalid_request_error"
    assert message_part in err["message"], err


def test_models_shows_the_name_not_the_local_path(tmp_path):
    local = tmp_path / "secret-dir" / "stories260K.bin"
    app = create_app(FakeEngine(), ServerConfig(), model_name="stories260K", model_root=str(local),
                     sampling_params_cls=FakeSamplingParams)
    with BackgroundServer(app, start_timeout_s=30) as srv:
        r = httpx.get(srv.url + "/v1/models", timeout=10)
        assert r.status_code == 200 and "secret-dir" not in r.text and str(tmp_path) not in r.text
        [card] = r.json()["data"]
        assert card["id"] == "stories260K" and card["root"] == "stories260K.bin"
        assert post(srv, "/v1/completions", {**COMPLETION, "model": card["id"]}).status_code == 200
        assert post(srv, "/v1/completions", {**COMPLETION, "model": str(local)}).status_code == 404


# ------------------------------------------------------------------------------ the real engine


inference = pytest.importorskip("scratchlm.inference")


@pytest.fixture(scope="module")
def real(data_dir):
    """`build_app` as `scratchlm serve` runs it (in-process engine) on stories260K, and the oracle's model."""
    from scratchlm.server.cli import build_app

    path = data_dir / "models" / "stories260K" / "stories260K.bin"
    app = build_app(str(path), ServerConfig(), inference.EngineConfig(max_num_seqs=16), engine_process=False)
    oracle = inference.LLM(str(path)).engine  # a separate engine: only its model and tokenizer are used
    with BackgroundServer(app, start_timeout_s=60) as srv:
        yield srv, path, oracle


@torch.no_grad()
def oracle_greedy(engine, prompt: str, n: int, bias: dict[int, float] | None = None) -> list[int]:
    """The whole sequence through the model's plain forward every token, the bias added, argmax."""
    tok = engine.tokenizer
    ids = [tok.bos_id, *tok.encode(prompt)]
    out = []
    for _ in range(n):
        logits = engine.runner.model(torch.tensor([ids]))[0, -1].float()
        for t, b in (bias or {}).items():
            logits[t] += b
        out.append(int(logits.argmax()))
        ids.append(out[-1])
    return out


def complete(srv, prompt: str, n: int, **extra) -> httpx.Response:
    body = {"model": "stories260K", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(srv.url + "/v1/completions", json=body, timeout=120)


def test_real_models_route_and_model_name(real):
    srv, path, _ = real
    r = httpx.get(srv.url + "/v1/models", timeout=10)
    assert str(path.parent) not in r.text
    assert r.json()["data"][0]["id"] == "stories260K"


def test_bias_minus_100_bans_the_greedy_token(real):
    srv, _, oracle = real
    prompt, n = "Once upon a time", 8
    plain = oracle_greedy(oracle, prompt, n)
    banned = {plain[0]: -100.0, plain[1]: -100.0}
    want = oracle_greedy(oracle, prompt, n, banned)
    assert not set(want) & set(banned)
    r = complete(srv, prompt, n, logit_bias={str(t): b for t, b in banned.items()})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == oracle.tokenizer.decode(want)
    assert r.json()["choices"][0]["text"] != oracle.tokenizer.decode(plain)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bias_plus_100_forces_a_token(real, temperature):
    srv, _, oracle = real
    forced = oracle.tokenizer.encode(" dog")[-1]
    r = complete(srv, "The sun was shining and", 6, logit_bias={forced: 100}, temperature=temperature, seed=3)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == oracle.tokenizer.decode([forced] * 6)


def test_mixed_batch_only_the_biased_request_changes(real):
    srv, _, oracle = real
    prompts = ["Once upon a time", "Lily and Tom went to the park.", "The dog", "One day, a little bird"]
    n = 12
    plain = [oracle_greedy(oracle, p, n) for p in prompts]
    bias = {plain[2][0]: -100.0, oracle.tokenizer.encode(" cat")[-1]: 5.0}
    seeded = {"temperature": 1.0, "seed": 11, "top_p": 0.9}
    alone = complete(srv, prompts[1], n, **seeded).json()["choices"][0]["text"]

    def send(i: int) -> httpx.Response:
        if i == 2:
            return complete(srv, prompts[2], n, logit_bias={str(t): b for t, b in bias.items()})
        if i == 4:
            return complete(srv, prompts[1], n, **seeded)
        return complete(srv, prompts[i % 4], n)

    with ThreadPoolExecutor(8) as pool:  # 8 concurrent requests share the engine's batches
        results = list(pool.map(send, range(8)))
    texts = [r.json()["choices"][0]["text"] for r in results]
    for i in (0, 1, 3, 5, 6, 7):
        assert texts[i] == oracle.tokenizer.decode(plain[i % 4]), i
    assert texts[2] == oracle.tokenizer.decode(oracle_greedy(oracle, prompts[2], n, bias))
    assert texts[4] == alone  # a seeded sample does not depend on a biased neighbour


@pytest.mark.parametrize("bias", [{"512": 1}, {"5": 101}, {"x": 1}])
def test_real_invalid_logit_bias_is_a_400(real, bias):
    r = complete(real[0], "The dog", 2, logit_bias=bias)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    assert list(bias)[0] in r.json()["error"]["message"]
