"""`scratchlm chat`: a terminal chat that streams the reply token by token.

Two back ends, same conversation loop:
- ``--url http://127.0.0.1:8000``: a running `scratchlm serve` (or any OpenAI-compatible server),
  streamed over server-sent events with the standard library only;
- otherwise an in-process :class:`LLMEngine` on MODEL (default: SmolLM2-135M-Instruct).

Commands at the ``you>`` prompt: ``/help``, ``/reset`` (start over), ``/exit`` or ``/quit`` (also Ctrl-D
or Ctrl-C); any other ``/word`` is refused rather than sent to the model (start a message with ``//`` to
send a literal ``/``). Ctrl-C during a reply stops that reply. ``--prompt TEXT`` asks one question and
exits (scripts, tests).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO


@dataclass
class ChatOptions:
    temperature: float = 0.7
    top_p: float = 0.95
    max_tokens: int = 256
    seed: int | None = None
    system: str | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="model for the in-process engine (HF dir, .gguf, llama2.c .bin, .pt); "
                             "default: SmolLM2-135M-Instruct. Ignored with --url")
    parser.add_argument("--url", default=None,
                        help="base URL of a running OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None, help="Bearer key for --url (or $SCRATCHLM_API_KEY)")
    parser.add_argument("--model-name", default=None,
                        help="model name to ask the server for (default: the first in its /v1/models)")
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass")
    parser.add_argument("--max-tokens", type=int, default=256, help="longest reply in tokens")
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    parser.add_argument("--prompt", default=None, help="ask this one question, print the reply, and exit")
    parser.add_argument("--device", default="cpu", help="torch device of the in-process engine")
    parser.add_argument("--quantization", default=None, metavar="KIND",
                        help="weight quantization of the in-process engine, as `scratchlm serve --quantization`: "
                             "gguf | int8 | int4[...] (docs/quantization.md)")
    parser.add_argument("--speculative", default=None,
                        help="speculative decoding in the in-process engine: ngram | draft:PATH | layers:K")
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="tokenizer for an in-process model that has none (or to replace its own)")
    from scratchlm.threads import add_threads_argument

    add_threads_argument(parser, "of the in-process engine")


# ------------------------------------------------------------------------------------------ back ends


class ServerBackend:
    """Streams /v1/chat/completions from a server over SSE (standard library only)."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None, timeout_s: float = 600):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.model = model or self._first_model()

    def _request(self, path: str, body: dict | None = None) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method="POST" if data else "GET")
        try:
            return urllib.request.urlopen(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as e:
            try:
                message = json.loads(e.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = str(e)
            raise RuntimeError(f"server answered {e.code}: {message}") from None
        except urllib.error.URLError as e:
            raise RuntimeError(f"cannot reach {self.url}: {e.reason} (is `scratchlm serve` running?)") from None

    def _first_model(self) -> str:
        with self._request("/v1/models") as r:
            return json.loads(r.read())["data"][0]["id"]

    def stream(self, messages: list[dict], opts: ChatOptions) -> Iterator[str]:
        body = {"model": self.model, "messages": messages, "stream": True, "temperature": opts.temperature,
                "top_p": opts.top_p, "max_tokens": opts.max_tokens}
        if opts.seed is not None:
            body["seed"] = opts.seed
        with self._request("/v1/chat/completions", body) as r:
            for raw in r:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                for choice in chunk["choices"]:
                    if choice["delta"].get("content"):
                        yield choice["delta"]["content"]


@dataclass
class EngineBackend:
    """Runs an in-process LLMEngine and streams the text deltas of each step."""

    engine: Any
    _ids: Iterator[int] = field(default_factory=lambda: iter(range(10**12)))

    @classmethod
    def load(cls, model: str | None, device: str, speculative: str | None = None, threads: int | None = None,
             tokenizer: str | None = None, quantization: str | None = None) -> EngineBackend:
        from scratchlm.inference import EngineConfig, LLMEngine
        from scratchlm.inference.cli_generate import warn_without_chat_template
        from scratchlm.threads import apply_threads

        config = EngineConfig(device=device, max_num_seqs=1, speculative=speculative, tokenizer=tokenizer,
                              quantization=quantization)
        choice = apply_threads(threads)
        print(f"loading {model or 'the default model (SmolLM2-135M-Instruct)'} with {choice} ...", file=sys.stderr)
        engine = LLMEngine.from_pretrained(model, config)
        if engine.tokenizer is None:
            raise ValueError(f"{model} has no tokenizer, so chat messages cannot be encoded: pass --tokenizer PATH")
        warn_without_chat_template(engine, model)  # once: the engine is loaded once per session
        return cls(engine)

    def stream(self, messages: list[dict], opts: ChatOptions) -> Iterator[str]:
        from scratchlm.inference import SamplingParams

        prompt = self.engine.apply_chat_template(messages, add_generation_prompt=True)
        params = SamplingParams(temperature=opts.temperature, top_p=opts.top_p, max_tokens=opts.max_tokens,
                                seed=opts.seed)
        request_id = f"chat-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        self.engine.add_request(request_id, prompt, params)
        sent = 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id != request_id:
                        continue
                    text = out.outputs[0].text
                    if len(text) > sent:
                        yield text[sent:]
                        sent = len(text)
                    if out.finished:
                        return
        finally:
            self.engine.abort_request(request_id)  # no-op when finished; frees blocks on Ctrl-C


# ------------------------------------------------------------------------------------------ the loop

HELP = """commands:
  /help          this list
  /reset         forget the conversation and start over
  /exit, /quit   leave (also Ctrl-D, or Ctrl-C at the prompt)
  //text         send "/text" as a message
Ctrl-C while a reply streams stops that reply."""
GOODBYE = "bye."


def chat_turn(backend: Any, messages: list[dict], opts: ChatOptions, out: TextIO) -> str:
    """Stream one reply to `out`, returning its full text."""
    pieces = []
    for piece in backend.stream(messages, opts):
        pieces.append(piece)
        out.write(piece)
        out.flush()
    out.write("\n")
    return "".join(pieces)


def run(args: argparse.Namespace) -> int:
    import os

    opts = ChatOptions(args.temperature, args.top_p, args.max_tokens, args.seed, args.system)
    try:
        if args.url:
            backend: Any = ServerBackend(args.url, args.api_key or os.environ.get("SCRATCHLM_API_KEY"),
                                         args.model_name)
        else:
            backend = EngineBackend.load(args.model, args.device, getattr(args, "speculative", None),
                                         getattr(args, "threads", None), getattr(args, "tokenizer", None),
                                         getattr(args, "quantization", None))
    except (RuntimeError, FileNotFoundError, ValueError) as e:
        print(f"scratchlm chat: {e}", file=sys.stderr)
        return 2
    base = [{"role": "system", "content": opts.system}] if opts.system else []
    history: list[dict] = []
    if args.prompt is not None:
        try:
            chat_turn(backend, [*base, {"role": "user", "content": args.prompt}], opts, sys.stdout)
        except RuntimeError as e:
            print(f"scratchlm chat: {e}", file=sys.stderr)
            return 1
        return 0
    interactive = sys.stdin.isatty()
    if interactive:
        print("scratchlm chat: type a message; /help lists the commands, /exit or Ctrl-D leaves.", file=sys.stderr)
    while True:
        try:
            text = input("you> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            print("\n" + GOODBYE, file=sys.stderr)
            return 0
        text = text.strip()
        if not text:
            continue
        if text.startswith("//"):
            text = text[1:]  # an escaped leading slash: a message, not a command
        elif text.startswith("/"):
            command = text.split()[0].lower()
            if command in ("/exit", "/quit"):
                print(GOODBYE, file=sys.stderr)
                return 0
            if command == "/reset":
                history.clear()
                print("(conversation cleared)", file=sys.stderr)
            elif command == "/help":
                print(HELP, file=sys.stderr)
            else:
                print(f"unknown command {command!r} (not sent to the model); /help lists the commands, "
                      "and // at the start sends a literal /", file=sys.stderr)
            continue
        history.append({"role": "user", "content": text})
        if interactive:
            sys.stdout.write("assistant> ")
        try:
            reply = chat_turn(backend, [*base, *history], opts, sys.stdout)
        except KeyboardInterrupt:
            print("\n(interrupted)", file=sys.stderr)
            history.pop()
            continue
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        history.append({"role": "assistant", "content": reply})
