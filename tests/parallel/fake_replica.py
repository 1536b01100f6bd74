"""A stand-in replica for the router's process tests: a real HTTP server in its own process, stdlib only (it starts
in a fraction of a second, where a `scratchlm serve` takes seconds).

`python fake_replica.py [ignored ...] --host H --port P` (the arguments `launch_replicas` gives a replica) serves
GET /health (200), and POST /v1/completions: with ``"stream": true`` one SSE chunk every 50 ms, endlessly, until
the client goes away; otherwise one JSON answer. It never imports scratchlm, so it shares no code with the router.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        try:
            if self.path == "/health":
                self._json(200, {"status": "ok", "pid": os.getpid()})
            else:
                self._json(404, {"error": {"message": "not found"}})
        except (BrokenPipeError, ConnectionResetError):  # a health check that gave up waiting (SIGSTOP tests)
            pass

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        if not body.get("stream"):
            self._json(200, {"pid": os.getpid(), "choices": [{"text": "x"}]})
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        try:
            for i in range(10**9):
                event = f"data: {json.dumps({'pid': os.getpid(), 'i': i, 'choices': [{'text': 'x'}]})}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
                time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args()
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
