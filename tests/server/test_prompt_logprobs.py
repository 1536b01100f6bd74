"""Prompt log-probabilities over HTTP: OpenAI's legacy `echo` + `logprobs` (with `max_tokens: 0`, token-id prompts,
batches, n > 1, streaming) and vLLM's `prompt_logprobs` on both routes, through the official `openai` client and
raw JSON, on the real engine (a tiny random Llama with GPT-2's tokenizer, chunked prefill of 8 tokens over blocks of
4). The oracle is transformers' model on the same token ids (tests/server/scoring_model.py)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from scratchlm.server import BackgroundServer, ServerConfig, create_app
from tests.server.scoring_model import hf_logprobs, save_scoring_model

inference = pytest.importorskip("scratchlm.inference")
pytest.importorskip("transformers")

MODEL = "tiny-gpt2-llama"
ATOL = 1e-4
IDS = [464, 3139, 286, 4881, 318, 6342, 13, 383, 3139, 286, 4486, 318, 11307, 13]  # "The capital of France is ..."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, data_dir):
    """(checkpoint dir, HF oracle model)."""
    directory = tmp_path_factory.mktemp("scoring_model")
    return directory, save_scoring_model(directory, data_dir / "tokenizers" / "gpt2")


@pytest.fixture(scope="module")
def server(tiny):
    engine = inference.LLMEngine.from_pretrained(tiny[0], inference.EngineConfig(
        max_num_seqs=8, max_model_len=64, max_num_batched_tokens=8, block_size=4))
    with BackgroundServer(create_app(engine, ServerConfig(), model_name=MODEL), start_timeout_s=60) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(tiny):
    """The checkpoint's tokenizer through HF AutoTokenizer (the token texts of the oracle)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny[0])


def check_echo(logprobs, ids: list[int], ref, top_n: int, tok) -> None:
    """The prompt's part of the legacy logprobs: tokens, logprobs (first null), top_logprobs, offsets."""
    tokens = [tok.decode([i]) for i in ids]
    assert logprobs.tokens[: len(ids)] == tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    offsets = [sum(len(t) for t in tokens[:j]) for j in range(len(ids))]
    assert logprobs.text_offset[: len(ids)] == offsets
    for j in range(1, len(ids)):
        row = ref[j - 1]
        assert abs(logprobs.token_logprobs[j] - float(row[ids[j]])) < ATOL, j
        top = logprobs.top_logprobs[j]
        want = {tok.decode([i]): float(row[i]) for i in row.topk(top_n).indices.tolist()} if top_n else {}
        want[tokens[j]] = float(row[ids[j]])
        assert top.keys() == want.keys(), (j, top, want)
        for k, v in want.items():
            assert abs(top[k] - v) < ATOL


def test_openai_echo_max_tokens_zero_equals_hf(client, tiny, tok):
    reply = client.completions.create(model=MODEL, prompt=IDS, echo=True, logprobs=3, max_tokens=0)
    (choice,) = reply.choices
    assert choice.text == tok.decode(IDS) and choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == len(IDS) and reply.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == len(IDS)
    check_echo(choice.logprobs, IDS, hf_logprobs(tiny[1], IDS), 3, tok)


def test_echo_with_a_completion_text_prompt(client, server, tiny, tok):
    """A text prompt: echo's text is the prompt as sent, then the greedy completion; the completion's logprobs follow
    the prompt's (offsets past the prompt's text), all equal to HF on prompt + completion."""
    prompt = "The capital of France is"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"]
    reply = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=3,
                                      temperature=0)
    (choice,) = reply.choices
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and len(lp.tokens) == len(ids) + 3
    ref = hf_logprobs(tiny[1], ids)
    completion = [int(ref[-1].argmax())]
    for _ in range(2):
        completion.append(int(hf_logprobs(tiny[1], ids + completion)[-1].argmax()))
    full = ids + completion
    check_echo(lp, full, hf_logprobs(tiny[1], full), 2, tok)
    assert choice.text == prompt + tok.decode(completion)
    assert lp.text_offset[len(ids)] == len(prompt)


def test_lm_eval_style_batch_of_token_id_prompts(client, tiny, tok):
    """What lm-evaluation-harness sends for loglikelihood: token-id prompts in one request, echo, logprobs 1,
    max_tokens 1, temperature 0; it sums token_logprobs[ctxlen:-1]."""
    prompts = [IDS[:6], IDS, IDS[3:9] + [11, 290]]
    reply = client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0,
                                      seed=1234)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for ids, choice in zip(prompts, reply.choices):
        ref = hf_logprobs(tiny[1], ids)
        ctxlen = 2
        got = sum(choice.logprobs.token_logprobs[ctxlen:-1])
        want = sum(float(ref[j - 1, ids[j]]) for j in range(ctxlen, len(ids)))
        assert abs(got - want) < ATOL * len(ids)
        assert len(choice.logprobs.tokens) == len(ids) + 1
        assert choice.logprobs.tokens[-1] == tok.decode([int(ref[-1].argmax())])


def test_echo_n_samples_and_without_logprobs(client, tiny, tok):
    reply = client.completions.create(model=MODEL, prompt=IDS[:5], echo=True, max_tokens=2, n=2, temperature=1.0,
                                      seed=3)
    assert [c.index for c in reply.choices] == [0, 1]
    for c in reply.choices:
        assert c.text.startswith(tok.decode(IDS[:5])) and c.logprobs is None
    zero = client.completions.create(model=MODEL, prompt=IDS[:5], echo=True, max_tokens=0)
    assert zero.choices[0].text == tok.decode(IDS[:5]) and zero.choices[0].logprobs is None


def test_streaming_echo_sends_the_prompt_first(server, client, tiny, tok):
    body = {"model": MODEL, "prompt": IDS[:7], "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0,
            "stream": True}
    chunks = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"][0])
    first = chunks[0]
    assert first["text"].startswith(tok.decode(IDS[:7]))
    assert first["logprobs"]["tokens"][:7] == [tok.decode([i]) for i in IDS[:7]]
    assert first["logprobs"]["token_logprobs"][0] is None
    whole = client.completions.create(model=MODEL, prompt=IDS[:7], echo=True, logprobs=1, max_tokens=4,
                                      temperature=0).choices[0]
    assert "".join(c["text"] for c in chunks) == whole.text
    streamed = [x for c in chunks if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
    assert streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-6)
    offsets = [x for c in chunks if c["logprobs"] for x in c["logprobs"]["text_offset"]]
    assert offsets == whole.logprobs.text_offset
    # max_tokens 0: one chunk, the prompt, finished
    (only,) = [c.choices[0] for c in client.completions.create(model=MODEL, prompt=IDS[:7], echo=True, logprobs=1,
                                                                max_tokens=0, stream=True)]
    assert only.text == tok.decode(IDS[:7]) and only.finish_reason == "length"
    assert only.logprobs.token_logprobs[1:] == pytest.approx(whole.logprobs.token_logprobs[1:7], abs=1e-6)


def check_vllm_prompt_logprobs(got: list, ids: list[int], ref, n: int, tok) -> None:
    """vLLM's shape: null, then {token id: {logprob, rank, decoded_token}} (the token + the top n)."""
    assert len(got) == len(ids) and got[0] is None
    for j in range(1, len(ids)):
        row = ref[j - 1]
        want = {ids[j], *row.topk(n).indices.tolist()} if n else {ids[j]}
        assert set(got[j]) == {str(t) for t in want}
        for t in want:
            entry = got[j][str(t)]
            assert set(entry) == {"logprob", "rank", "decoded_token"}
            assert abs(entry["logprob"] - float(row[t])) < ATOL
            assert entry["rank"] == int((row > row[t]).sum()) + 1
            assert entry["decoded_token"] == tok.decode([t])


def test_vllm_prompt_logprobs_on_completions(server, tiny, tok):
    body = {"model": MODEL, "prompt": [IDS, IDS[:4]], "prompt_logprobs": 2, "max_tokens": 1, "n": 2}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c in choices:
        ids = IDS if c["index"] < 2 else IDS[:4]
        check_vllm_prompt_logprobs(c["prompt_logprobs"], ids, hf_logprobs(tiny[1], ids), 2, tok)
        assert c["logprobs"] is None and len(c["text"]) > 0
    zero = httpx.post(server.url + "/v1/completions", json={"prompt": IDS, "prompt_logprobs": 0, "max_tokens": 0},
                      timeout=60).json()["choices"][0]
    assert zero["text"] == "" and zero["finish_reason"] == "length"
    check_vllm_prompt_logprobs(zero["prompt_logprobs"], IDS, hf_logprobs(tiny[1], IDS), 0, tok)
    plain = httpx.post(server.url + "/v1/completions", json={"prompt": IDS, "max_tokens": 1}, timeout=60).json()
    assert plain["choices"][0]["prompt_logprobs"] is None


def test_vllm_prompt_logprobs_on_chat(server, tiny, tok):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": messages, "prompt_logprobs": 1, "max_tokens": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["message"]["content"] == ""
    check_vllm_prompt_logprobs(body["prompt_logprobs"], ids, hf_logprobs(tiny[1], ids), 1, tok)


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", {"prompt": IDS, "max_tokens": 0}, "max_tokens", ["echo", "prompt_logprobs"]),
    ("/v1/completions", {"prompt": IDS, "max_tokens": 0, "logprobs": 1}, "max_tokens", ["echo"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens",
     ["prompt_logprobs"]),
    ("/v1/completions", {"prompt": IDS, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", ["stream"]),
    ("/v1/completions", {"prompt": IDS, "prompt_logprobs": 21}, "prompt_logprobs", ["20"]),
    ("/v1/completions", {"prompt": IDS, "prompt_logprobs": -1}, "prompt_logprobs", ["0"]),
    ("/v1/completions", {"prompt": list(range(65)), "max_tokens": 0, "echo": True}, "prompt", ["64"]),
])
def test_bad_scoring_requests_are_400s_naming_the_field(server, path, body, param, words):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err


def test_a_prompt_of_max_model_len_tokens_is_scored(client, tiny, tok):
    ids = (IDS * 5)[:64]
    reply = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=0, max_tokens=0)
    check_echo(reply.choices[0].logprobs, ids, hf_logprobs(tiny[1], ids), 0, tok)
