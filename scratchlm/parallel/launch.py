"""Starting a TP x PP (or TP x CP) engine: spawned workers, or joining a torchrun launch (one host or many).

`LLMEngine.from_pretrained(path, EngineConfig(tensor_parallel_size=T, pipeline_parallel_size=P))`
(or `context_parallel_size=C`: `scratchlm.parallel.context`) calls `from_pretrained_parallel`:

1. read the model's config from the checkpoint header and check T x P x C against it and against the
   world size (`check_parallel_config`: one error naming every factor, before any weight loads);
2. outside torchrun: spawn ranks 1..T*P*C-1 (`torch.multiprocessing`, spawn context) on a free local
   port; under torchrun (RANK/WORLD_SIZE/MASTER_ADDR set, e.g. `--nnodes 2 --node-rank 1
   --master-addr HOST`): join the launch, rank 0 becomes the engine and every other rank a worker
   that never returns (it exits when rank 0 stops it);
3. every rank loads only its shard (safetensors: only its slices, read with `safe_open(...).get_slice`;
   GGUF / llama2.c / scratchlm checkpoints: the whole file is loaded, then sliced, then freed);
4. rank 0 builds the normal `LLMEngine` around a `ParallelRunner`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from scratchlm.inference.config import EngineConfig
from scratchlm.model.config import ModelConfig
from scratchlm.parallel.comm import Comm, backend_for, init_default_group
from scratchlm.parallel.layout import (
    check_parallel_config,
    parse_stage_layers,
    plan_layout,
    read_model_config,
    torchrun_world,
)
from scratchlm.parallel.runner import ParallelRunner
from scratchlm.parallel.tensor import ShardedLM, full_tensor_reader, shard_state

log = logging.getLogger(__name__)


def check_engine_config(config: EngineConfig, model_config: ModelConfig, world_size: int | None = None) -> list[int]:
    """Fail fast on a TP/PP/CP config that cannot work with this model; returns the explicit stage split or None."""
    tp, pp, cp = config.tensor_parallel_size, config.pipeline_parallel_size, config.context_parallel_size
    sizes = f"tensor_parallel_size={tp} / pipeline_parallel_size={pp} / context_parallel_size={cp}"
    if config.quantization not in (None, "none"):
        raise ValueError(f"quantization={config.quantization!r} is not supported with {sizes} "
                         f"(the sharded layers are float); drop one of them")
    if config.speculative not in (None, "none"):
        raise ValueError(f"speculative={config.speculative!r} is not supported with {sizes}; drop one of them")
    stage_layers = parse_stage_layers(config.pipeline_stage_layers)
    check_parallel_config(model_config, tp, pp, world_size, stage_layers, cp)
    if cp > 1 and config.context_parallel_threshold > config.max_num_batched_tokens:
        log.warning("context_parallel_threshold=%d > max_num_batched_tokens=%d: no prefill chunk can reach the "
                    "threshold, so every prefill runs replicated on the %d CP ranks (no ring attention)",
                    config.context_parallel_threshold, config.max_num_batched_tokens, cp)
    return stage_layers


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    dev = torch.device(config.device)
    if dev.type == "cuda":
        return torch.device("cuda", local_rank)
    return dev


def load_shard(path: Path, model_config: ModelConfig, layout, dtype: torch.dtype,
               device: torch.device, want_tokenizer: bool) -> tuple[dict[str, torch.Tensor], Any]:
    """This rank's tensors (scratchlm names) and, if asked, the tokenizer."""
    from scratchlm.model.loading import detect_format, load
    from scratchlm.model.loading.common import expected_shapes

    names = list(expected_shapes(model_config))
    if detect_format(path) == "hf":
        from safetensors import safe_open

        from scratchlm.model.loading.common import optional_tokenizer
        from scratchlm.model.loading.hf import _weight_files, hf_name_map

        files = _weight_files(path)
        theirs = hf_name_map(model_config)
        handles: dict[Path, Any] = {}

        def read(name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
            f = files[theirs[name]]
            if f not in handles:
                handles[f] = safe_open(f, framework="pt")
            sl = handles[f].get_slice(theirs[name])
            if dim is None:
                return sl[:]
            return sl[start:stop] if dim == 0 else sl[:, start:stop]  # reads only these rows / columns

        state = shard_state(names, model_config, layout, read, dtype, device)
        handles.clear()
        tokenizer = None
        if want_tokenizer and (path / "tokenizer.json").is_file():
            tokenizer = optional_tokenizer("formats.load_hf_dir", path)
        return state, tokenizer
    loaded = load(path, dtype=dtype, device="cpu")  # load then slice (GGUF blocks / llama2.c are whole tensors)
    full = loaded.model.state_dict()
    state = shard_state(names, model_config, layout, full_tensor_reader(full), dtype, device)
    tokenizer = loaded.tokenizer if want_tokenizer else None
    del full, loaded
    return state, tokenizer


def build_rank(path: Path, model_config: ModelConfig, config: EngineConfig, rank: int, local_rank: int,
               stage_layers: list[int] | None, procs: list = ()) -> tuple[ParallelRunner, Any]:
    """Groups, shard and runner of `rank` (the default process group must be initialised)."""
    tp, pp, cp = config.tensor_parallel_size, config.pipeline_parallel_size, config.context_parallel_size
    device = _rank_device(config, local_rank)
    layout = plan_layout(model_config, tp, pp, rank, stage_layers, cp)
    if cp > 1:
        from scratchlm.parallel.context import ContextParallelComm

        comm = ContextParallelComm(layout, config.parallel_timeout_s, backend_for(device), device)
    else:
        comm = Comm(layout, config.parallel_timeout_s, backend_for(device), device)
    state, tokenizer = load_shard(path, model_config, layout, config.torch_dtype, device, want_tokenizer=rank == 0)
    model = ShardedLM(model_config, layout, state, comm).eval()
    log.info("rank %d: cp rank %d, layers %s, kv heads %s, q heads %s, ff %s, vocab %s (%.1f M parameters)", rank,
             layout.cp_rank, layout.layers, layout.kv_heads, layout.q_heads, layout.ff, layout.vocab,
             sum(p.numel() for p in model.parameters()) / 1e6)
    if cp > 1:
        from scratchlm.parallel.context import ContextParallelRunner

        runner = ContextParallelRunner(model, comm, config.block_size, config.torch_dtype, device,
                                       config.context_parallel_threshold, procs)
    else:
        micro = config.pipeline_microbatches or pp
        runner = ParallelRunner(model, comm, config.block_size, config.torch_dtype, device, micro, procs)
    return runner, tokenizer


def _watch_parent(parent_pid: int) -> None:
    """Exit this worker if its parent (rank 0) disappears (killed without a stop command)."""
    import time

    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)


def worker_main(rank: int, world_size: int, init_method: str, path: str, config_json: str, threads: int,
                parent_pid: int) -> None:
    """Entry of a spawned worker rank: join, load the shard, run rank 0's steps until told to stop."""
    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 stops us
    logging.basicConfig(level=logging.WARNING)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    config = EngineConfig(**json.loads(config_json))
    model_config = read_model_config(path)
    stage_layers = parse_stage_layers(config.pipeline_stage_layers)
    device = _rank_device(config, rank)
    init_default_group(backend_for(device), rank, world_size, init_method, config.parallel_timeout_s)
    runner, _ = build_rank(Path(path), model_config, config, rank, rank, stage_layers)
    runner.serve_forever()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown (seconds with torch loaded); nothing is left to flush


def from_pretrained_parallel(engine_cls: type, path: str | Path, config: EngineConfig):
    """Rank 0: an `engine_cls` whose runner spans TP x PP ranks (spawned here, or joined from torchrun).

    Under torchrun, ranks other than 0 serve steps here and exit the process when rank 0 stops."""
    path = Path(path)
    model_config = read_model_config(path)
    joined = torchrun_world()
    tp, pp, cp = config.tensor_parallel_size, config.pipeline_parallel_size, config.context_parallel_size
    world = joined[2] if joined else tp * pp * cp
    stage_layers = check_engine_config(config, model_config, world)  # before any weight loads
    procs: list = []
    if joined:
        rank, local_rank, _ = joined
        init_default_group(backend_for(_rank_device(config, local_rank)), rank, world, None,
                           config.parallel_timeout_s)
    else:
        if torch.multiprocessing.current_process().daemon:
            raise ValueError(f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} x context_parallel_size={cp} "
                             f"needs to spawn worker "
                             f"processes, which a daemon process (e.g. `scratchlm serve --engine-process`) cannot; "
                             f"run without --engine-process, or launch the ranks with torchrun")
        if torch.distributed.is_initialized():
            raise ValueError("torch.distributed is already initialised in this process (another TP/PP engine?): "
                             "one spawned TP/PP engine per process; shut the other down first "
                             "(engine.runner.shutdown())")
        rank = local_rank = 0
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = torch.multiprocessing.get_context("spawn")
        cfg_json = json.dumps(asdict(config))
        for r in range(1, world):
            p = ctx.Process(target=worker_main, name=f"scratchlm-rank{r}", daemon=True,
                            args=(r, world, init_method, str(path), cfg_json, torch.get_num_threads(), os.getpid()))
            p.start()
            procs.append(p)
    try:
        if not joined:
            init_default_group(backend_for(_rank_device(config, 0)), 0, world, init_method, config.parallel_timeout_s)
        runner, tokenizer = build_rank(path, model_config, config, rank, local_rank, stage_layers, procs)
    except BaseException as e:
        dead = [(i + 1, p.exitcode) for i, p in enumerate(procs) if p.exitcode is not None]
        for p in procs:
            p.kill()
        if not joined and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if dead:
            who = ", ".join(f"rank {r} exited with code {c}" for r, c in dead)
            raise RuntimeError(f"tensor/pipeline-parallel start-up failed: {who} (its traceback is above); "
                               f"{type(e).__name__}: {e}") from e
        raise
    if rank != 0:
        runner.serve_forever()
        torch.distributed.destroy_process_group()
        raise SystemExit(0)
    return engine_cls(None, tokenizer, model_config, config, runner_factory=runner.start)
