"""`scratchlm serve`: one engine behind the OpenAI API, or D engine replicas behind the data-parallel router.

The single-engine server is `scratchlm.server.cli`; the replicas and the router are
`scratchlm.parallel.router`. This module sits above both and picks one, so that the server never
imports `parallel/` (dependencies point one way: parallel plugs in from above; docs/cluster.md).
A replica is itself a plain `scratchlm serve` process (possibly tensor/pipeline parallel).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from scratchlm.config import add_dataclass_arguments, dataclass_from_args
from scratchlm.server import cli as server_cli

log = logging.getLogger("scratchlm.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's flags, plus --data-parallel-size and the router's (--router-*)."""
    from scratchlm.parallel.router import RouterConfig

    server_cli.add_arguments(parser)
    parser.add_argument("--data-parallel-size", type=int, default=1, metavar="D",
                        help="run D engine replicas (each a `scratchlm serve` process on its own local port) behind "
                             "a router on --host/--port that balances by least outstanding tokens (docs/cluster.md)")
    add_dataclass_arguments(parser, RouterConfig, prefix="router_")


def run(args: argparse.Namespace) -> int:
    from scratchlm.parallel.router import RouterConfig

    try:
        router_config = dataclass_from_args(RouterConfig, args, prefix="router_")
        data_parallel_size = getattr(args, "data_parallel_size", 1)
        if data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size {data_parallel_size} (expected a positive integer)")
    except ValueError as e:
        print(f"scratchlm serve: {e}", file=sys.stderr)
        return 2
    if data_parallel_size == 1 and not router_config.replica_urls:
        return server_cli.run(args)
    return _run_data_parallel(args, data_parallel_size, router_config)


def _run_data_parallel(args: argparse.Namespace, data_parallel_size: int, router_config) -> int:
    from scratchlm.defaults import default_model_path
    from scratchlm.parallel.router import serve_data_parallel
    from scratchlm.threads import apply_threads

    try:
        server_config, engine_config = server_cli.configs_from_args(args)
    except ValueError as e:
        print(f"scratchlm serve: {e}", file=sys.stderr)
        return 2
    try:
        if not router_config.replica_urls:  # the engines run here: D replicas x their ranks share the cores
            ranks = server_cli.engine_ranks(engine_config)
            choice = apply_threads(args.threads, world_size=data_parallel_size * ranks, logger=log)
            args.threads = choice.threads  # handed down to the replicas, which must not each take every core
            if args.model is not None and not os.path.lexists(args.model):  # a symlink loop: load() says so
                raise FileNotFoundError(f"model not found: {args.model}")
            if args.model is None:
                default_model_path()
        server_cli.bind_port(server_config.host, server_config.port).close()  # a taken port fails before replicas
        return serve_data_parallel(args, data_parallel_size, server_config, router_config)
    except (FileNotFoundError, ValueError, RuntimeError, OSError) as e:
        print(f"scratchlm serve: {e}", file=sys.stderr)
        return 2
