"""/v1/embeddings on the real engine. The oracle is transformers' own LlamaModel on the same weights (a tiny
random checkpoint, tests/model/families/tiny.py): its ``last_hidden_state`` is after the final norm, pooled
here with plain torch (last token, or mean) and L2-normalised. Also: batches of mixed lengths, token-id inputs,
base64 equal to the float list, the official `openai` client, the engine in its own process, and the 400s."""

from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest
import torch

from scratchlm.server import BackgroundServer, ServerConfig, create_app

inference = pytest.importorskip("scratchlm.inference")
pytest.importorskip("transformers")

MODEL = "tiny-llama"
MAX_LEN = 32
INPUTS = [[1, 5, 9, 33, 2], [7], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111],
          [3, 4, 5, 6, 7], list(range(10, 10 + MAX_LEN))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint dir, HF oracle model)."""
    from tests.model.families.tiny import save_tiny

    directory = tmp_path_factory.mktemp("tiny_llama")
    return directory, save_tiny("llama_tied", directory)


def oracle(hf, ids: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    with torch.no_grad():
        h = hf.model(torch.tensor([ids])).last_hidden_state[0].double()
    v = h[-1] if pooling == "last" else h.mean(dim=0)
    return v / torch.linalg.vector_norm(v) if normalize else v


def serve(engine_or_loop, server_config: ServerConfig | None = None) -> BackgroundServer:
    loop = engine_or_loop if hasattr(engine_or_loop, "submit") else None
    engine = loop.engine if loop is not None else engine_or_loop
    return BackgroundServer(create_app(engine, server_config or ServerConfig(), model_name=MODEL, engine_loop=loop),
                            start_timeout_s=60)


@pytest.fixture(scope="module")
def server(tiny):
    # a small token budget, so a request's inputs go to the engine in several chunks
    engine = inference.LLMEngine.from_pretrained(tiny[0], inference.EngineConfig(
        max_num_seqs=4, max_model_len=MAX_LEN, max_num_batched_tokens=MAX_LEN))
    with serve(engine) as srv:
        yield srv


def post(srv, body: dict) -> httpx.Response:
    return httpx.post(srv.url + "/v1/embeddings", json=body, timeout=60)


def vectors(reply: httpx.Response) -> list[torch.Tensor]:
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and body["model"] == MODEL
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    assert all(d["object"] == "embedding" for d in body["data"])
    return [torch.tensor(d["embedding"], dtype=torch.float64) for d in body["data"]]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_batch_equals_hf_hidden_states(server, tiny, pooling):
    reply = post(server, {"model": MODEL, "input": INPUTS, "pooling": pooling})
    got = vectors(reply)
    assert len(got) == len(INPUTS)
    for ids, v in zip(INPUTS, got):
        assert v.shape == (64,)
        torch.testing.assert_close(v, oracle(tiny[1], ids, pooling), atol=1e-5, rtol=0)
    n = sum(map(len, INPUTS))
    assert reply.json()["usage"] == {"prompt_tokens": n, "total_tokens": n}


def test_default_pooling_is_last_and_single_token_id_input(server, tiny):
    (v,) = vectors(post(server, {"input": INPUTS[0]}))  # a flat list of ids is one input
    torch.testing.assert_close(v, oracle(tiny[1], INPUTS[0], "last"), atol=1e-5, rtol=0)
    assert abs(float(v.norm()) - 1.0) < 1e-6


def test_normalize_false_is_the_raw_pooled_state(server, tiny):
    (v,) = vectors(post(server, {"input": [INPUTS[2]], "pooling": "mean", "normalize": False}))
    want = oracle(tiny[1], INPUTS[2], "mean", normalize=False)
    torch.testing.assert_close(v, want, atol=1e-5 * float(want.norm()), rtol=0)


def test_base64_is_the_float_list(server):
    floats = post(server, {"input": INPUTS[:3], "encoding_format": "float"}).json()["data"]
    encoded = post(server, {"input": INPUTS[:3], "encoding_format": "base64", "dimensions": 64}).json()["data"]
    for f, b in zip(floats, encoded):
        raw = base64.b64decode(b["embedding"])
        assert len(raw) == 4 * 64
        decoded = list(struct.unpack("<64f", raw))
        assert decoded == [struct.unpack("<f", struct.pack("<f", x))[0] for x in f["embedding"]]


def test_openai_client(server, tiny):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    reply = client.embeddings.create(model=MODEL, input=INPUTS[:2], user="someone")  # the client asks for base64
    assert [d.index for d in reply.data] == [0, 1]
    for ids, d in zip(INPUTS[:2], reply.data):
        torch.testing.assert_close(torch.tensor(d.embedding, dtype=torch.float64), oracle(tiny[1], ids, "last"),
                                   atol=1e-5, rtol=0)
    assert reply.usage.prompt_tokens == len(INPUTS[0]) + len(INPUTS[1])
    floats = client.embeddings.create(model=MODEL, input=INPUTS[0], encoding_format="float")
    assert len(floats.data[0].embedding) == 64


@pytest.mark.parametrize("body,param,words", [
    ({"input": [1, 2], "dimensions": 32}, "dimensions", ["dimensions", "64"]),
    ({"input": ""}, "input", ["empty"]),
    ({"input": []}, "input", ["empty"]),
    ({"input": [[1, 2], []]}, "input", ["input 1", "empty"]),
    ({"input": [[1, 2], list(range(MAX_LEN + 1))]}, "input", ["input 1", str(MAX_LEN + 1), str(MAX_LEN)]),
    ({"input": [[1, 2], [3, 160]]}, "input", ["input 1", "vocabulary", "160"]),
    ({"input": [[1, 2], [-1]]}, "input", ["input 1", "vocabulary"]),
    ({"input": "hello"}, "input", ["tokenizer"]),  # the tiny checkpoint has none
    ({"input": [1], "truncate_prompt_tokens": 4}, "truncate_prompt_tokens", ["truncate_prompt_tokens"]),
    ({"input": [1], "encoding_format": "int8"}, "encoding_format", ["encoding_format"]),
    ({"input": [1], "pooling": "cls"}, "pooling", ["pooling"]),
])
def test_400s_name_the_problem(server, body, param, words):
    r = post(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    for w in words:
        assert w in error["message"], error


def test_unknown_model_is_404(server):
    assert post(server, {"model": "gpt-99", "input": [1]}).status_code == 404


def test_server_default_pooling_and_text_with_a_tokenizer(data_dir):
    """stories260K (a tokenizer): text embeds as its /tokenize ids do; --embedding-pooling mean is the default."""
    path = data_dir / "models" / "stories260K" / "stories260K.bin"
    engine = inference.LLMEngine.from_pretrained(path, inference.EngineConfig(max_num_seqs=2))
    with serve(engine, ServerConfig(embedding_pooling="mean")) as srv:
        texts = ["Once upon a time", "The dog ran"]
        ids = [httpx.post(srv.url + "/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
        by_text = vectors(post(srv, {"input": texts}))
        by_ids = vectors(post(srv, {"input": ids, "pooling": "mean"}))
        by_last = vectors(post(srv, {"input": ids, "pooling": "last"}))
        for a, b, c in zip(by_text, by_ids, by_last):
            assert torch.equal(a, b) and not torch.allclose(a, c)


def test_engine_in_its_own_process(tiny):
    from scratchlm.server.engine_process import EngineProcessLoop

    loop = EngineProcessLoop(tiny[0], inference.EngineConfig(max_num_seqs=2, max_model_len=MAX_LEN), threads=1,
                             startup_timeout_s=300)
    with serve(loop) as srv:
        for pooling in ("last", "mean"):
            for ids, v in zip(INPUTS, vectors(post(srv, {"input": INPUTS, "pooling": pooling}))):
                torch.testing.assert_close(v, oracle(tiny[1], ids, pooling), atol=1e-5, rtol=0)
        r = post(srv, {"input": [list(range(MAX_LEN + 1))]})
        assert r.status_code == 400 and "input 0" in r.json()["error"]["message"]
        done = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3}, timeout=60)
        assert done.status_code == 200  # the engine still generates after the embed calls
