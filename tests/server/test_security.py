"""Connection-level and request-level guards (issue 16, defects 3, 4 and 6), on the fake engine: the Host check
against DNS rebinding, constant-time and case-insensitive Bearer keys, CORS headers on the guard's own replies,
408 for a request head that never completes, 431 for an oversized head, 400 (never 500, keep-alive kept) for
lone surrogates, and the stop-list bounds."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from scratchlm.server import ServerConfig
from tests.server.conftest import fake_server


def raw_request(sock: socket.socket, method: str, path: str, body: bytes = b"", headers: dict | None = None,
                host: str = "127.0.0.1") -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request on an open socket (keep-alive); returns (status, headers, body)."""
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    sock.sendall(head.encode() + b"\r\n" + body)
    return read_response(sock)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"connection closed; got {data[:200]!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    length = int(headers.get("content-length", 0))
    while len(rest) < length:
        rest += sock.recv(65536)
    return status, headers, rest[:length]


def connect(srv) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    return sock


@pytest.fixture(scope="module")
def guarded():
    config = ServerConfig(api_key="s3cret-key", cors_origins=["http://app.example"], max_body_bytes=4096,
                          header_timeout_s=0.5, max_header_bytes=8192)
    with fake_server(server_config=config) as (srv, _):
        yield srv


def test_host_header_checked_on_loopback(guarded):
    """DNS rebinding: a page on evil.example resolving to 127.0.0.1 sends `Host: evil.example`."""
    with connect(guarded) as sock:
        status, _, body = raw_request(sock, "GET", "/health", host="evil.example:8000")
        assert status == 403 and json.loads(body)["error"]["code"] == "host_not_allowed"
        assert "--allowed-hosts" in json.loads(body)["error"]["message"]
        for host in (f"127.0.0.1:{guarded.port}", "localhost", "[::1]:80", "app.localhost"):
            assert raw_request(sock, "GET", "/health", host=host)[0] == 200, host


def test_allowed_hosts_flag():
    with fake_server(server_config=ServerConfig(allowed_hosts=["api.example"])) as (srv, _), connect(srv) as sock:
        assert raw_request(sock, "GET", "/health", host="api.example:443")[0] == 200
        assert raw_request(sock, "GET", "/health", host="evil.example")[0] == 403
    with fake_server(server_config=ServerConfig(allowed_hosts=["*"])) as (srv, _), connect(srv) as sock:
        assert raw_request(sock, "GET", "/health", host="anything.example")[0] == 200
    assert ServerConfig(host="0.0.0.0").host_allowed("anything.example")  # not loopback: no default check


def test_bearer_scheme_case_insensitive_and_constant_time(guarded, monkeypatch):
    import hmac

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    url = guarded.url + "/v1/models"
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert httpx.get(url, headers={"Authorization": f"{scheme} s3cret-key"}).status_code == 200
    for bad in ("Bearer s3cret-ke", "Basic s3cret-key", "s3cret-key", "Bearer"):
        r = httpx.get(url, headers={"Authorization": bad})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", bad
    assert len(calls) >= 5 and all(isinstance(a, bytes) for a, _ in calls)


def test_guard_replies_carry_cors_headers(guarded):
    """Before, the guard sat outside the CORS middleware: an allowed origin could not read its 401/413."""
    origin = {"Origin": "http://app.example"}
    r = httpx.get(guarded.url + "/v1/models", headers=origin)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://app.example"
    r = httpx.post(guarded.url + "/v1/completions", content=b"x" * 5000,
                   headers={**origin, "Authorization": "Bearer s3cret-key"})
    assert r.status_code == 413 and r.headers["access-control-allow-origin"] == "http://app.example"
    r = httpx.get(guarded.url + "/v1/models", headers={**origin, "Host": "evil.example"})
    assert r.status_code == 403 and r.headers["access-control-allow-origin"] == "http://app.example"


def test_oversized_headers_get_431(guarded):
    with connect(guarded) as sock:  # the whole head in one piece: the guard measures it
        status, headers, body = raw_request(sock, "GET", "/health", headers={"X-Big": "a" * 10_000})
        assert status == 431 and json.loads(body)["error"]["code"] == "headers_too_large"
    with connect(guarded) as sock:  # a head that keeps growing past the limit: h11's incomplete-event bound
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        for _ in range(12):
            time.sleep(0.01)
            try:
                sock.sendall(b"X-Big: " + b"a" * 1000 + b"\r\n")
            except OSError:  # the server answered and closed
                break
        status, headers, body = read_response(sock)
        assert status == 431 and json.loads(body)["error"]["code"] == "headers_too_large"
    assert httpx.get(guarded.url + "/health").status_code == 200


def test_slow_request_head_times_out(guarded):
    """A client trickling a head (slowloris) used to hold its connection forever: uvicorn resets its keep-alive
    timer on every byte and has no head timeout."""
    with connect(guarded) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        t0 = time.monotonic()
        for _ in range(8):  # keep trickling header bytes: the limit counts from the connection, not the last byte
            time.sleep(0.1)
            try:
                sock.sendall(b"X-Slow: 1\r\n")
            except OSError:
                break
        status, _, body = read_response(sock)
        assert status == 408 and json.loads(body)["error"]["code"] == "header_timeout"
        assert time.monotonic() - t0 < 3
        assert sock.recv(1) == b""  # closed
    with connect(guarded) as sock:  # an idle connection that never sends a request is closed too
        sock.settimeout(5)
        assert sock.recv(1) == b""
    with connect(guarded) as sock:  # a prompt client is unaffected, also on a kept-alive connection
        for _ in range(3):
            assert raw_request(sock, "GET", "/health")[0] == 200
            time.sleep(0.3)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi \ud800", "max_tokens": 2}),
    ("/v1/completions", {"prompt": ["ok", "\udfff"], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud83d"}], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}),
    ("/v1/completions", {"stop": ["\ud800"], "prompt": "x", "max_tokens": 2}),
    ("/v1/completions", {"model": "\ud800", "prompt": "x"}),
    ("/tokenize", {"prompt": "\ud800"}),
    ("/tokenize", {"messages": [{"role": "user", "content": "\udc00"}]}),
])
def test_lone_surrogate_is_a_400_and_keeps_the_connection(fake, path, body):
    srv, _ = fake
    raw = json.dumps(body).encode()  # json.dumps escapes the surrogate: valid JSON, not valid Unicode
    assert b"\\ud" in raw
    with connect(srv) as sock:
        status, headers, reply = raw_request(sock, "POST", path, raw, {"Content-Type": "application/json"})
        error = json.loads(reply)["error"]
        assert status in (400, 404) and error["param"] == next(iter(body)), reply  # names the field
        assert headers.get("connection", "keep-alive") != "close"
        ok = json.dumps({"prompt": "fine", "max_tokens": 2}).encode()
        assert raw_request(sock, "POST", "/v1/completions", ok, {"Content-Type": "application/json"})[0] == 200


def test_stop_lists_are_bounded(fake):
    srv, _ = fake
    url = srv.url + "/v1/completions"
    r = httpx.post(url, json={"prompt": "x", "max_tokens": 2, "stop": [str(i) for i in range(10_000)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert "at most 16" in r.json()["error"]["message"]
    r = httpx.post(url, json={"prompt": "x", "max_tokens": 2, "stop": "s" * 257})
    assert r.status_code == 400 and "256" in r.json()["error"]["message"]
    r = httpx.post(url, json={"prompt": "x", "max_tokens": 2, "stop_token_ids": list(range(300))})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"
    assert httpx.post(url, json={"prompt": "x", "max_tokens": 2, "stop": ["s" * 256] * 16}).status_code == 200
