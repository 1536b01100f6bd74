"""`python -m scratchlm.parallel.worker MODEL --tensor-parallel-size T [--pipeline-parallel-size P] ...`

A worker-only entry point for torchrun launches (on one host, `LLM(model, tensor_parallel_size=N)` and
`scratchlm serve --tensor-parallel-size N` start their ranks themselves, with this module's internal
`--spawned SPEC` mode: `scratchlm.parallel.launch`): every rank except 0 loads its shard and executes
rank 0's steps until rank 0 stops. Rank 0 must run the engine (`scratchlm serve`, `scratchlm generate`
or `LLMEngine.from_pretrained`) with the same model and flags; running `scratchlm serve ...` on every
node works too (non-zero ranks turn into workers inside it). Example, two hosts, TP=2 across them:

    # host A (rank 0: the server)
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr HOST_A --master-port 29500 \\
        -m scratchlm serve MODEL --tensor-parallel-size 2 --threads 4
    # host B (rank 1)
    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 1 --master-addr HOST_A --master-port 29500 \\
        -m scratchlm.parallel.worker MODEL --tensor-parallel-size 2 --threads 4
"""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--spawned"]:  # a rank started by MultiprocExecutor on this host (not for users)
        import json
        import signal

        from scratchlm.lifecycle import die_with_parent

        spec = json.loads(argv[1])
        die_with_parent(int(spec["parent_pid"]), signal.SIGKILL)  # first thing, before torch loads (seconds)
        from scratchlm.parallel.launch import spawned_worker_main

        spawned_worker_main(spec)
        return 0
    from scratchlm.config import add_dataclass_arguments, dataclass_from_args
    from scratchlm.inference import EngineConfig
    from scratchlm.parallel.layout import torchrun_world

    parser = argparse.ArgumentParser(prog="python -m scratchlm.parallel.worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None, help="model path (default: the default model)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads of this rank")
    add_dataclass_arguments(parser, EngineConfig)
    args = parser.parse_args(argv)
    world = torchrun_world()
    if world is None:
        print("scratchlm.parallel.worker: not started by torchrun (RANK/WORLD_SIZE/LOCAL_RANK unset); "
              "a single host needs no workers: LLMEngine/`scratchlm serve --tensor-parallel-size N` spawns them",
              file=sys.stderr)
        return 2
    if world[0] == 0:
        print("scratchlm.parallel.worker: this is rank 0, which runs the engine: start rank 0 with "
              "`scratchlm serve` (or generate) and the same flags", file=sys.stderr)
        return 2
    try:
        config = dataclass_from_args(EngineConfig, args)
    except ValueError as e:
        print(f"scratchlm.parallel.worker: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    from scratchlm.inference import LLMEngine

    try:
        LLMEngine.from_pretrained(args.model, config)  # a worker rank serves steps here, then exits
    except SystemExit as e:
        return int(e.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
