"""The multi-process executor: a TP x PP (or TP x CP) engine's ranks, spawned here or joined from torchrun.

`LLMEngine.from_pretrained(path, EngineConfig(tensor_parallel_size=T, pipeline_parallel_size=P))` (or
`context_parallel_size=C`: `scratchlm.parallel.context`), and so `LLM(path, tensor_parallel_size=T)`, is
given a `MultiprocExecutor` (the top-level package wires it: `scratchlm.MULTIPROCESS_EXECUTOR`;
inference/ only knows the `Executor` interface). `MultiprocExecutor.from_pretrained`:

1. reads the model's config from the checkpoint header and checks T x P x C against it and against the
   world size (`check_engine_config`: one error naming every factor, before any weight loads or any
   process starts);
2. outside torchrun: starts ranks 1..T*P*C-1 as fresh interpreters,
   `python -m scratchlm.parallel.worker --spawned SPEC` (SPEC: JSON with the rank, the world size, the
   rendezvous store's address, the model path and the engine config). They never import the caller's
   `__main__`, so a script without an `if __name__ == "__main__":` guard, `python - < script.py`,
   `python -c` and notebooks all work. Each worker's output is forwarded to this process's stderr
   prefixed `(rank N)`, and its last lines are kept for error messages;
3. every rank loads only its shard (safetensors: only its slices, read with `safe_open(...).get_slice`;
   GGUF / llama2.c / scratchlm checkpoints: the whole file is loaded, then sliced, then freed), and
   *then* joins: a worker marks itself loaded in rank 0's `TCPStore`, rank 0 polls for those marks and
   for exited workers every 50 ms (also between the tensors of its own load), so a rank that dies
   while starting (an import error, a bad file, out of memory) is reported with its exit code and
   traceback at once, instead of after the rendezvous timeout; only when every rank has loaded do
   they create the process groups (which then cannot wait on a dead peer);
4. under torchrun (RANK/WORLD_SIZE/MASTER_ADDR set, e.g. `--nnodes 2 --node-rank 1 --master-addr HOST`):
   the ranks join torchrun's rendezvous (torchrun watches its processes), rank 0 becomes the engine
   and every other rank a worker that never returns (it exits when rank 0 stops it);
5. rank 0's engine steps a `ParallelRunner` (or `ContextParallelRunner`), which the executor's `start`
   hands it once the KV pool is sized.

Lifecycle of spawned ranks: each one calls `lifecycle.die_with_parent(rank 0's pid, SIGKILL)` first thing
(`scratchlm.parallel.worker`), so it dies with rank 0 however rank 0 ends (SIGKILL also ends a stopped rank);
`_watch_parent` stays as the fallback where the kernel offers no such request. Each spawned rank beats into
rank 0's store (`runner.beat_forever`) and rank 0 watches the beats (`ParallelRunner.watch_ranks`), so the
server's /health sees a stopped rank within its heartbeat timeout (server/health.py). Ranks joined through
torchrun are watched by torchrun's agent instead.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scratchlm.inference.config import EngineConfig
from scratchlm.inference.cpp_extensions import prepare_kernels
from scratchlm.model.config import ModelConfig
from scratchlm.model.loading import detect_format, load
from scratchlm.model.loading.common import CheckpointError, optional_tokenizer
from scratchlm.model.loading.guard import check_finite
from scratchlm.model.loading.hf import checked_rules
from scratchlm.parallel.comm import (
    IDLE_TIMEOUT,
    RENDEZVOUS_TIMEOUT,
    STARTUP_TIMEOUT,
    Comm,
    backend_for,
    init_default_group,
)
from scratchlm.parallel.layout import (
    check_cp_features,
    check_parallel_config,
    parse_stage_layers,
    plan_layout,
    read_model_config,
    torchrun_world,
)
from scratchlm.parallel.runner import ParallelRunner, beat_forever
from scratchlm.parallel.tensor import Shard, ShardedLM, check_shardable, shard_plan, take_shard

log = logging.getLogger(__name__)


def check_engine_config(config: EngineConfig, model_config: ModelConfig, world_size: int | None = None) -> list[int]:
    """Fail fast on a TP/PP/CP config that cannot work with this model; returns the explicit stage split or None."""
    tp, pp, cp = config.tensor_parallel_size, config.pipeline_parallel_size, config.context_parallel_size
    ep = config.expert_parallel_size
    sizes = f"tensor_parallel_size={tp} / pipeline_parallel_size={pp} / context_parallel_size={cp}"
    if ep > 1:
        sizes += f" / expert_parallel_size={ep}"
    if config.quantization not in (None, "none"):
        raise ValueError(f"quantization={config.quantization!r} is not supported with {sizes} "
                         f"(the sharded layers are float); drop one of them")
    if config.speculative not in (None, "none"):
        raise ValueError(f"speculative={config.speculative!r} is not supported with {sizes}; drop one of them")
    stage_layers = parse_stage_layers(config.pipeline_stage_layers)
    check_parallel_config(model_config, tp, pp, world_size, stage_layers, cp, ep)
    if cp > 1:
        check_cp_features(model_config)
    if tp > 1 or pp > 1 or cp > 1 or ep > 1:
        check_shardable(model_config, tp, ep)
    if cp > 1 and config.context_parallel_threshold > config.max_num_batched_tokens:
        log.warning("context_parallel_threshold=%d > max_num_batched_tokens=%d: no prefill chunk can reach the "
                    "threshold, so every prefill runs replicated on the %d CP ranks (no ring attention)",
                    config.context_parallel_threshold, config.max_num_batched_tokens, cp)
    return stage_layers


def _rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    dev = torch.device(config.device)
    if dev.type == "cuda":
        return torch.device("cuda", local_rank)
    return dev


def load_shard(path: Path, model_config: ModelConfig, layout, dtype: torch.dtype,
               device: torch.device, want_tokenizer: bool,
               check: Callable[[], None] | None = None) -> tuple[dict[str, torch.Tensor], Any]:
    """This rank's tensors (scratchlm names, sliced as `shard_plan` says) and, if asked, the tokenizer. `check` is
    called between tensors (rank 0: raise if a worker died meanwhile)."""
    check = check or (lambda: None)
    plan = shard_plan(model_config, layout)
    if detect_format(path) == "hf":
        state = _read_hf_shard(path, model_config, plan, check)
        tokenizer = None
        if want_tokenizer and (path / "tokenizer.json").is_file():
            tokenizer = optional_tokenizer("formats.load_hf_dir", path)
    else:
        check()
        loaded = load(path, dtype=dtype, device="cpu")  # load then slice (GGUF blocks / llama2.c are whole tensors)
        check()
        full = loaded.model.state_dict()
        state = {name: take_shard(full[name], shard) for name, shard in plan.items()}
        tokenizer = loaded.tokenizer if want_tokenizer else None
        del full, loaded
    return {n: t.to(device=device, dtype=dtype).contiguous() for n, t in state.items()}, tokenizer


def _read_hf_shard(path: Path, model_config: ModelConfig, plan: dict[str, Shard],
                   check: Callable[[], None]) -> dict[str, torch.Tensor]:
    """The planned slices of an HF checkpoint, through its family's tensor rules: a plain rename reads only the
    rank's rows / columns from the file (`safe_open(...).get_slice`); a transformed tensor (a fused qkv or gate/up
    split, a transposed Conv1D weight, a norm offset) is read whole, transformed, then sliced."""
    from safetensors import safe_open

    cfg_path = path / "config.json"
    rules, files = checked_rules(path, json.loads(cfg_path.read_text()), model_config, str(cfg_path))
    handles: dict[Path, Any] = {}
    state: dict[str, torch.Tensor] = {}
    for rule in rules:
        if not any(n in plan for n in rule.ours):
            continue  # another pipeline stage's tensor
        check()
        f = files[rule.theirs]
        if f not in handles:
            handles[f] = safe_open(f, framework="pt")
        if rule.load is None:  # a plain rename: read only this rank's slice
            (name,) = rule.ours
            dim, start, stop = plan[name]
            sl = handles[f].get_slice(rule.theirs)
            state[name] = sl[:] if dim is None else sl[start:stop] if dim == 0 else sl[:, start:stop]
            part = "" if dim is None else f"[{start}:{stop}]" if dim == 0 else f"[:, {start}:{stop}]"
            check_finite(state[name], rule.theirs + part, f)  # each rank its slice: NaN/Inf refused by name
        else:
            whole = handles[f].get_tensor(rule.theirs)
            check_finite(whole, rule.theirs, f)
            for name, t in rule.to_ours(whole):
                if name in plan:
                    state[name] = take_shard(t, plan[name]).contiguous()
    handles.clear()
    absent = sorted(set(plan) - set(state))
    if absent:
        raise CheckpointError(f"{path}: no tensor rule gives {absent[:8]}")
    return state


def load_rank_shard(path: Path, model_config: ModelConfig, config: EngineConfig, rank: int, local_rank: int,
                    stage_layers: list[int] | None, check: Callable[[], None] | None = None):
    """(tensors, tokenizer) of `rank`'s shard; no process group needed."""
    tp, pp, cp = config.tensor_parallel_size, config.pipeline_parallel_size, config.context_parallel_size
    layout = plan_layout(model_config, tp, pp, rank, stage_layers, cp, config.expert_parallel_size)
    return load_shard(path, model_config, layout, config.torch_dtype, _rank_device(config, local_rank),
                      want_tokenizer=rank == 0, check=check)


def build_rank(path: Path, model_config: ModelConfig, config: EngineConfig, rank: int, local_rank: int,
               stage_layers: list[int] | None, procs: list = (), state: dict[str, torch.Tensor] | None = None,
               tokenizer: Any = None) -> tuple[ParallelRunner, Any]:
    """Groups, shard (loaded here unless `state` is given) and runner of `rank` (the default process group must
    be initialised)."""
    tp, pp, cp = config.tensor_parallel_size, config.pipeline_parallel_size, config.context_parallel_size
    ep = config.expert_parallel_size
    device = _rank_device(config, local_rank)
    layout = plan_layout(model_config, tp, pp, rank, stage_layers, cp, ep)
    if state is None:
        state, tokenizer = load_rank_shard(path, model_config, config, rank, local_rank, stage_layers)
    if cp > 1:
        from scratchlm.parallel.context import ContextParallelComm

        comm = ContextParallelComm(layout, config.parallel_timeout_s, backend_for(device), device)
    else:
        comm = Comm(layout, config.parallel_timeout_s, backend_for(device), device)
    model = ShardedLM(model_config, layout, state, comm).eval()
    log.info("rank %d: cp rank %d, ep rank %d, layers %s, kv heads %s, q heads %s, ff %s, vocab %s, experts %s "
             "(%.1f M parameters)", rank, layout.cp_rank, layout.ep_rank, layout.layers, layout.kv_heads,
             layout.q_heads, layout.ff, layout.vocab, layout.experts, sum(p.numel() for p in model.parameters()) / 1e6)
    if cp > 1:
        from scratchlm.parallel.context import ContextParallelRunner

        runner = ContextParallelRunner(model, comm, config.block_size, config.torch_dtype, device,
                                       config.context_parallel_threshold, procs)
    elif ep > 1:
        from scratchlm.parallel.expert import ExpertParallelRunner

        runner = ExpertParallelRunner(model, comm, config.block_size, config.torch_dtype, device, 1, procs)
    else:
        micro = config.pipeline_microbatches or pp
        runner = ParallelRunner(model, comm, config.block_size, config.torch_dtype, device, micro, procs)
    return runner, tokenizer


# --- spawned workers ---------------------------------------------------------------------------------------

_LOADED_KEY = "scratchlm/loaded/"  # a worker sets `_LOADED_KEY + str(rank)` in rank 0's store once its shard is in
_POLL_S = 0.05


class WorkerStartupError(RuntimeError):
    """A spawned rank exited (or never loaded) while the engine was starting; the message carries its output."""


class WorkerProcess:
    """A spawned rank: `python -m scratchlm.parallel.worker --spawned SPEC` in a fresh interpreter.

    Its stdout and stderr are read by a thread that forwards them to this process's stderr, each line
    prefixed `(rank N pid P)`, and keeps the last lines for error messages. It offers the
    `multiprocessing.Process` methods the runner uses (pid, exitcode, is_alive, join, terminate, kill)."""

    TAIL_LINES = 60

    def __init__(self, rank: int, spec: dict[str, Any]):
        import scratchlm

        self.rank = rank
        root = str(Path(scratchlm.__file__).resolve().parent.parent)  # the same scratchlm as this process
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        env["PYTHONUNBUFFERED"] = "1"  # a traceback right before a crash still arrives
        for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):  # not a torchrun launch
            env.pop(var, None)
        # -P: no current folder on sys.path, so a `scratchlm` or a user module there cannot shadow ours
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "scratchlm.parallel.worker", "--spawned", json.dumps(spec)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        self.pid = self.proc.pid
        self.name = f"scratchlm-rank{rank}"
        self._tail: collections.deque[str] = collections.deque(maxlen=self.TAIL_LINES)
        self._reader = threading.Thread(target=self._pump, name=f"{self.name}-output", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        prefix = f"(rank {self.rank} pid {self.pid}) "
        for raw in self.proc.stdout:  # until the worker (and so its end of the pipe) is gone
            line = raw.decode("utf-8", errors="replace")
            self._tail.append(line)
            with contextlib.suppress(Exception):  # our stderr may be closed or swapped (pytest); keep draining
                sys.stderr.write(prefix + line)
                sys.stderr.flush()
        self.proc.stdout.close()

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def output_tail(self, lines: int = 30) -> str:
        """The last `lines` lines the worker printed (after it exited: all of them up to its end)."""
        if self.proc.poll() is not None:
            self._reader.join(1.0)  # the pipe is at EOF once the worker is gone
        return "".join(list(self._tail)[-lines:])

    def describe_exit(self) -> str:
        """'rank N (pid P) exited with code C', plus the end of its output (its traceback), indented."""
        text = f"rank {self.rank} (pid {self.pid}) exited with code {self.exitcode}"
        tail = self.output_tail().rstrip()
        if tail:
            text += "; its output ends with:\n" + "\n".join("    " + line for line in tail.splitlines())
        return text


def _raise_if_dead(procs: list[WorkerProcess], stage: str) -> None:
    dead = [p for p in procs if p.exitcode is not None]
    if dead:
        raise WorkerStartupError("tensor/pipeline-parallel start-up failed " + stage + ": "
                                 + "\n".join(p.describe_exit() for p in dead))


def _wait_until_loaded(store: dist.TCPStore, procs: list[WorkerProcess], timeout_s: float) -> None:
    """Rank 0: poll until every worker marked its shard loaded; raise at once when one has exited."""
    keys = [_LOADED_KEY + str(p.rank) for p in procs]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        _raise_if_dead(procs, "while the workers loaded their shards")
        if time.monotonic() > deadline:
            missing = [p.rank for p, k in zip(procs, keys) if not store.check([k])]
            raise WorkerStartupError(f"tensor/pipeline-parallel start-up failed: ranks {missing} did not load their "
                                     f"shards within {timeout_s:.0f} s (alive but stuck?)")
        time.sleep(_POLL_S)
    _raise_if_dead(procs, "while the workers loaded their shards")


def _watch_parent(parent_pid: int) -> None:
    """Exit this worker if its parent (rank 0) disappears (killed without a stop command)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)


def spawned_worker_main(spec: dict[str, Any]) -> None:
    """A spawned worker rank (`python -m scratchlm.parallel.worker --spawned SPEC`): load the shard, tell rank 0,
    join the groups, run rank 0's steps until told to stop, exit."""
    rank, world = int(spec["rank"]), int(spec["world_size"])
    torch.set_num_threads(int(spec["threads"]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 stops us
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    threading.Thread(target=_watch_parent, args=(int(spec["parent_pid"]),), daemon=True).start()  # a fallback
    config = EngineConfig(**spec["config"])
    path = Path(spec["path"])
    model_config = read_model_config(path)
    stage_layers = parse_stage_layers(config.pipeline_stage_layers)
    host, port = spec["store"]
    store = dist.TCPStore(host, int(port), world, is_master=False, timeout=IDLE_TIMEOUT)
    threading.Thread(target=beat_forever, args=(host, int(port), rank), name="scratchlm-heartbeat",
                     daemon=True).start()
    code = 0
    try:
        state, _ = load_rank_shard(path, model_config, config, rank, rank, stage_layers)
        store.set(_LOADED_KEY + str(rank), "1")
        init_default_group(backend_for(_rank_device(config, rank)), rank, world,
                           timeout_s=config.parallel_timeout_s, store=store)
        runner, _ = build_rank(path, model_config, config, rank, rank, stage_layers, state=state)
        runner.serve_forever()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 -- reported to rank 0 through this output and the exit status
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # skip the interpreter's teardown (seconds with torch loaded; and with the heartbeat thread inside a
    # TCPStore call, tearing down aborts the process: "terminate called without an active exception")
    os._exit(code)


# --- the executor ------------------------------------------------------------------------------------------

class MultiprocExecutor:
    """Rank 0's handle on a TP x PP x CP engine (see the module docstring); the engine steps `start()`'s runner."""

    def __init__(self, model_config: ModelConfig, tokenizer: Any, runner: ParallelRunner, store: Any = None):
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.runner = runner
        self._store = store  # rank 0's TCPStore serves the rendezvous: it lives as long as the process group

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig) -> MultiprocExecutor:
        """Start (or join) the ranks and load every shard. Under torchrun, ranks other than 0 serve steps here and
        leave with SystemExit(0) when rank 0 stops."""
        path = Path(path).absolute()
        model_config = read_model_config(path)
        joined = torchrun_world()
        world = joined[2] if joined else config.world_size
        stage_layers = check_engine_config(config, model_config, world)  # before any weight loads
        if _rank_device(config, 0).type == "cpu":  # no rank compiles while its peers wait on a collective
            prepare_kernels(quantized=config.quantization is not None)
        if joined:
            rank, local_rank, _ = joined
            init_default_group(backend_for(_rank_device(config, local_rank)), rank, world, None,
                               config.parallel_timeout_s)
            runner, tokenizer = build_rank(path, model_config, config, rank, local_rank, stage_layers)
            if rank != 0:
                runner.serve_forever()
                dist.destroy_process_group()
                raise SystemExit(0)
            return cls(model_config, tokenizer, runner)
        if dist.is_initialized():
            raise ValueError("torch.distributed is already initialised in this process (another TP/PP engine?): "
                             "one spawned TP/PP engine per process; shut the other down first (engine.shutdown())")
        return cls._spawn(path, model_config, config, world, stage_layers)

    @classmethod
    def _spawn(cls, path: Path, model_config: ModelConfig, config: EngineConfig, world: int,
               stage_layers: list[int] | None) -> MultiprocExecutor:
        timeout = max(RENDEZVOUS_TIMEOUT, timedelta(seconds=config.parallel_timeout_s))
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        spec = {"world_size": world, "store": ["127.0.0.1", store.port], "path": str(path), "config": asdict(config),
                "threads": torch.get_num_threads(), "parent_pid": os.getpid()}
        procs: list[WorkerProcess] = []
        try:
            for r in range(1, world):
                procs.append(WorkerProcess(r, {**spec, "rank": r}))
            state, tokenizer = load_rank_shard(path, model_config, config, 0, 0, stage_layers,
                                               check=lambda: _raise_if_dead(procs, "while rank 0 loaded its shard"))
            _wait_until_loaded(store, procs, STARTUP_TIMEOUT.total_seconds())
            init_default_group(backend_for(_rank_device(config, 0)), 0, world, timeout_s=config.parallel_timeout_s,
                               store=store)
            runner, _ = build_rank(path, model_config, config, 0, 0, stage_layers, procs, state=state)
            runner.watch_ranks("127.0.0.1", store.port)
        except BaseException as e:
            for p in procs:
                p.kill()
            for p in procs:
                p.join(5.0)
            if dist.is_initialized():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
            if isinstance(e, WorkerStartupError):
                raise
            dead = [p for p in procs if p.exitcode not in (None, -signal.SIGKILL)]
            if dead:
                raise WorkerStartupError("tensor/pipeline-parallel start-up failed: "
                                         + "\n".join(p.describe_exit() for p in dead)
                                         + f"\nrank 0: {type(e).__name__}: {e}") from e
            raise
        return cls(model_config, tokenizer, runner, store)

    def start(self, num_blocks: int) -> ParallelRunner:
        """Tell every rank the KV pool size the engine chose; each allocates its cache shard."""
        return self.runner.start(num_blocks)

    def shutdown(self) -> None:
        """Stop the workers and leave the process group (also run at exit)."""
        self.runner.shutdown()
