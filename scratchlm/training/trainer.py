"""The training loop: config -> model, data, AdamW, schedule -> steps with accumulation, all-reduce,
clipping, periodic evaluation, metrics, atomic checkpoints, bit-exact resume, samples at the end."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from scratchlm.atomic import remove_orphan_temps, write_text
from scratchlm.training.checkpoint import (
    FORMAT,
    VERSION,
    CheckpointError,
    atomic_torch_save,
    capture_rng_state,
    read_checkpoint,
    restore_rng_state,
)
from scratchlm.training.config import RESUME_INVARIANTS, TrainConfig, train_config_to_dict
from scratchlm.training.data import RandomWindowSampler, TokenFile, sequential_windows, windows_to_batch
from scratchlm.training.distributed import (
    DistContext,
    all_reduce_gradients,
    all_reduce_sum,
    broadcast_parameters,
    init_distributed,
)
from scratchlm.training.engines import resolve_engine
from scratchlm.training.loss import cross_entropy
from scratchlm.training.metrics import MetricsLog, measure_matmul_peak, plot_loss_curve
from scratchlm.training.optim import AdamW, get_lr_cosine_schedule, gradient_clipping, weight_decay_groups
from scratchlm.training.tokenizers import load_tokenizer, save_run_tokenizer, tokenizer_state

if TYPE_CHECKING:
    from scratchlm.training.progress import ProgressBar

log = logging.getLogger("scratchlm.training")

CHECKPOINT_NAME = "ckpt.pt"


@dataclass
class EvalResult:
    """Validation figures: mean loss (nats/token), perplexity, bits per byte (None without a byte count)."""

    loss: float
    perplexity: float
    bits_per_byte: float | None
    tokens: int


@dataclass
class TrainResult:
    """What a finished run returns: per-step train losses (this process's run), evals, paths."""

    losses: list[float] = field(default_factory=list)
    evals: list[tuple[int, EvalResult]] = field(default_factory=list)
    final_step: int = 0
    checkpoint: Path | None = None
    samples: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: TokenFile, context_length: int, batch_size: int,
             device: torch.device, max_tokens: int | None = None, ctx: DistContext | None = None,
             autocast: contextlib.AbstractContextManager | None = None) -> EvalResult:
    """Loss over windows that tile `data` (every token after the first predicted once; a final shorter
    window takes the tail). With `max_tokens`, only the first windows covering that many tokens."""
    ctx = ctx or DistContext()
    n = len(data)
    max_windows = None if max_tokens is None else max(1, max_tokens // context_length)
    starts = sequential_windows(n, context_length, max_windows)
    tail = None
    covered = len(starts) * context_length
    if (max_windows is None or len(starts) < max_windows) and n - 1 - covered > 0:
        tail = covered
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)  # (nats, tokens)
    my_starts = starts[ctx.rank::ctx.world_size]
    for i in range(0, len(my_starts), batch_size):
        x, y = windows_to_batch(data.tokens, my_starts[i:i + batch_size], context_length, device)
        with autocast or contextlib.nullcontext():
            logits = model(x)  # (B, T, V)
        total[0] += cross_entropy(logits.float(), y).double().cpu() * y.numel()
        total[1] += y.numel()
    if tail is not None and ctx.is_main:
        length = n - 1 - tail
        x, y = windows_to_batch(data.tokens, np.array([tail]), length, device)
        with autocast or contextlib.nullcontext():
            logits = model(x)
        total[0] += cross_entropy(logits.float(), y).double().cpu() * y.numel()
        total[1] += y.numel()
    total = all_reduce_sum(total, ctx)
    model.train(was_training)
    nats, count = float(total[0]), int(total[1])
    loss = nats / max(count, 1)
    bpt = data.bytes_per_token
    bpb = loss / math.log(2) / bpt if bpt else None
    return EvalResult(loss=loss, perplexity=math.exp(min(loss, 50.0)), bits_per_byte=bpb, tokens=count)


def _check_resume_compatible(ckpt: dict[str, Any], cfg: TrainConfig, model_config: dict[str, Any], where: str):
    problems = []
    saved_model = ckpt.get("model_config") or {}
    for k in sorted(set(saved_model) | set(model_config)):
        if saved_model.get(k) != model_config.get(k):
            problems.append(f"model.{k}: checkpoint {saved_model.get(k)!r} != now {model_config.get(k)!r}")
    saved_train = ckpt.get("train_config") or {}
    for k in RESUME_INVARIANTS:
        now = getattr(cfg, k)
        if k in saved_train and saved_train[k] != now:
            problems.append(f"{k}: checkpoint {saved_train[k]!r} != now {now!r}")
    if problems:
        raise ValueError(f"cannot resume from {where}: config mismatch: " + "; ".join(problems))


class Trainer:
    """One training run. ``Trainer(cfg, model_overrides).train()``.

    `model_overrides` are `ModelConfig` fields; `vocab_size` defaults to the tokenizer's (or the
    corpus sidecar's) vocabulary and `max_seq_len` to `context_length`. `tokenizer` (an object with
    the contracts.md tokenizer interface) takes precedence over `cfg.tokenizer`.
    """

    def __init__(self, cfg: TrainConfig, model_overrides: dict[str, Any] | None = None,
                 dist_ctx: DistContext | None = None, tokenizer: Any = None):
        from scratchlm.model import ModelConfig, TransformerLM

        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.ctx = dist_ctx or init_distributed(self.device.type)
        if self.ctx.enabled and self.device.type == "cuda":
            self.device = torch.device("cuda", self.ctx.local_rank)
        cfg.validate(self.ctx.world_size)
        if self.device.type == "cpu":  # the shared policy (scratchlm/threads.py): ranks on this machine share it
            from scratchlm.threads import apply_threads

            choice = apply_threads(cfg.threads, world_size=self.ctx.world_size, logger=log)  # torchrun: local ranks
            if not self.ctx.is_main:
                log.debug("rank %d: %s", self.ctx.rank, choice)
        self.out_dir = Path(cfg.out_dir)
        if self.ctx.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)

        # data
        self.train_data = TokenFile.open(cfg.train_data)
        self.train_data.check_fits(cfg.context_length)
        self.val_data = TokenFile.open(cfg.val_data) if cfg.val_data is not None else None
        if self.val_data is not None:
            self.val_data.check_fits(1)

        # tokenizer and model shape
        self.tokenizer = tokenizer
        if tokenizer is None:
            tok_path = cfg.tokenizer or self.train_data.meta.get("tokenizer")
            if tok_path and cfg.tokenizer is None and not Path(tok_path).exists():
                beside = Path(self.train_data.path).parent / tok_path  # sidecars before absolute paths were stored
                if not Path(tok_path).is_absolute() and beside.exists():
                    tok_path = str(beside)
                else:
                    log.warning("tokenizer %s named by %s.json not found (from %s or next to the token file); "
                                "training without one, so the checkpoint will not generate text: pass "
                                "--tokenizer PATH", tok_path, self.train_data.path, Path.cwd())
                    tok_path = None
            self.tokenizer = load_tokenizer(tok_path) if tok_path else None
        if self.tokenizer is not None and self.ctx.is_main:
            copied = save_run_tokenizer(self.tokenizer, self.out_dir)  # the run folder is self-contained
            if copied is not None:
                log.info("tokenizer copied to %s (the checkpoint stores it too)", copied)
        overrides = dict(model_overrides or {})
        data_vocab = self.train_data.vocab_size
        tok_vocab = self.tokenizer.vocab_size if self.tokenizer is not None else None
        vocab = overrides.pop("vocab_size", None) or tok_vocab or data_vocab
        if vocab is None:
            vocab = int(np.max(self.train_data.tokens)) + 1
        if tok_vocab is not None and tok_vocab > vocab:
            raise ValueError(f"the tokenizer has {tok_vocab} ids but the model's vocab_size is {vocab}: "
                             f"set model.vocab_size >= {tok_vocab}")
        for name, tf in (("training", self.train_data), ("validation", self.val_data)):
            if tf is None:
                continue
            top = tf.vocab_size if tf.vocab_size is not None else int(np.max(tf.tokens)) + 1
            if top > vocab:
                raise ValueError(f"the {name} file {tf.path} uses a vocabulary of {top} ids but the model's "
                                 f"vocab_size is {vocab}: set model.vocab_size >= {top}")
        overrides.setdefault("max_seq_len", cfg.context_length)
        self.model_config = ModelConfig(vocab_size=vocab, **overrides)
        if cfg.context_length > self.model_config.max_seq_len:
            raise ValueError(f"context_length={cfg.context_length} exceeds model.max_seq_len="
                             f"{self.model_config.max_seq_len}")

        # resume: read and check first, so that a bad checkpoint fails before any work
        self.resume_state = None
        if cfg.resume is not None:
            self.resume_state = read_checkpoint(cfg.resume, require=("model", "optimizer", "step", "data", "rng"))
            _check_resume_compatible(self.resume_state, cfg, self.model_config.to_dict(), str(cfg.resume))

        torch.manual_seed(cfg.seed)
        self.model = TransformerLM(self.model_config).to(self.device)
        broadcast_parameters(self.model, self.ctx)
        self.optimizer = AdamW(weight_decay_groups(self.model.named_parameters(), cfg.weight_decay), lr=cfg.lr,
                               betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
        self.sampler = RandomWindowSampler(self.train_data.tokens, cfg.context_length, seed=cfg.seed)
        self.step = 0
        self.elapsed_before = 0.0
        if self.resume_state is not None:
            self._restore(self.resume_state)
        self.forward_model = torch.compile(self.model) if cfg.compile else self.model
        self.engine = resolve_engine(cfg.engine)
        self.metrics = MetricsLog(self.out_dir / "metrics.jsonl", enabled=self.ctx.is_main)
        if self.ctx.is_main:
            self._recover_files()
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    def _recover_files(self) -> None:
        """After a crash (`kill -9`, power cut): remove the temp files of interrupted atomic writes of the
        checkpoint and the metrics log (only names of exactly their pattern, `scratchlm.atomic`), and on
        resume drop the metrics logged after the checkpoint's step, which this run is about to redo."""
        for target in (self.out_dir / CHECKPOINT_NAME, self.metrics.path):
            for orphan in remove_orphan_temps(target):
                log.warning("removed %s, left by an interrupted write of %s", orphan, target.name)
        if self.resume_state is not None:
            dropped = self.metrics.truncate_after(self.step)
            if dropped:
                log.info("%s: dropped %d record(s) after step %d (logged before the crash; this run redoes them)",
                         self.metrics.path, dropped, self.step)

    # --- state ---------------------------------------------------------------------------------------------

    def _restore(self, ckpt: dict[str, Any]) -> None:
        try:
            self.model.load_state_dict(ckpt["model"])
            self.optimizer.load_state_dict(ckpt["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise CheckpointError(f"{self.cfg.resume}: checkpoint does not fit this model/optimizer: {e}") from e
        self.sampler.load_state_dict(ckpt["data"])
        restore_rng_state(ckpt["rng"])
        self.step = int(ckpt["step"])
        self.elapsed_before = float(ckpt.get("elapsed_s", 0.0))
        log.info("resumed from %s at step %d", self.cfg.resume, self.step)

    def checkpoint_dict(self, elapsed_s: float) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION,
            "model_config": self.model_config.to_dict(),
            "model": self.model.state_dict(),
            "tokenizer": tokenizer_state(self.tokenizer) if self.tokenizer is not None else None,
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "rng": capture_rng_state(),
            "data": self.sampler.state_dict(),
            "train_config": train_config_to_dict(self.cfg),
            "elapsed_s": elapsed_s,
        }

    def save(self, elapsed_s: float, path: Path | None = None) -> Path | None:
        """Write the checkpoint atomically (main process only)."""
        if not self.ctx.is_main:
            return None
        path = path or self.out_dir / CHECKPOINT_NAME
        atomic_torch_save(self.checkpoint_dict(elapsed_s), path)
        return path

    # --- pieces of a step ----------------------------------------------------------------------------------

    def _autocast(self):
        if self.cfg.dtype == "bfloat16" and self.device.type == "cuda":
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def lr_at(self, step: int, elapsed_s: float) -> float:
        cfg = self.cfg
        if step < cfg.warmup_steps:
            return get_lr_cosine_schedule(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.max_steps)
        it = step
        if cfg.max_time_s is not None:
            # decay on whichever budget runs out first: map the time fraction onto the step axis
            frac = min(elapsed_s / cfg.max_time_s, 1.0)
            it = max(it, cfg.warmup_steps + frac * (cfg.max_steps - cfg.warmup_steps))
        return get_lr_cosine_schedule(it, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.max_steps)

    def train_step(self, lr: float) -> tuple[float, float]:
        """One optimizer step on one global batch; returns (mean loss over the global batch, grad norm)."""
        cfg, ctx = self.cfg, self.ctx
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        starts = self.sampler.next_starts(cfg.batch_size)  # the global batch, identical on every rank
        per_rank = cfg.batch_size // ctx.world_size
        mine = starts[ctx.rank * per_rank:(ctx.rank + 1) * per_rank]
        micro = per_rank // cfg.grad_accum_steps
        loss_sum = torch.zeros((), dtype=torch.float32)
        for a in range(cfg.grad_accum_steps):
            x, y = windows_to_batch(self.train_data.tokens, mine[a * micro:(a + 1) * micro], cfg.context_length,
                                    self.device)
            with self._autocast():
                loss = self.engine(self.forward_model, x, y, 1.0 / cfg.grad_accum_steps)
            loss_sum += loss.detach().float().cpu()
        all_reduce_gradients(self.params, ctx)
        if cfg.grad_clip is not None:
            norm = gradient_clipping(self.params, cfg.grad_clip)
        else:
            norm = torch.sqrt(sum(p.grad.float().pow(2).sum() for p in self.params if p.grad is not None))
        self.optimizer.step()
        mean_loss = all_reduce_sum(loss_sum / cfg.grad_accum_steps, ctx) / ctx.world_size
        return float(mean_loss), float(norm)

    def evaluate(self, full: bool = False) -> EvalResult | None:
        if self.val_data is None:
            return None
        return evaluate(self.forward_model, self.val_data, self.cfg.context_length, self.cfg.eval_batch_size,
                        self.device, None if full else self.cfg.eval_tokens, self.ctx, self._autocast())

    # --- the loop ------------------------------------------------------------------------------------------

    def train(self) -> TrainResult:
        """Run until max_steps, stop_at_step or max_time_s; evaluate, checkpoint, plot, sample."""
        from scratchlm.training.progress import ProgressBar

        cfg, ctx = self.cfg, self.ctx
        result = TrainResult()
        peak_dtype = torch.bfloat16 if (cfg.dtype == "bfloat16" and self.device.type == "cuda") else torch.float32
        peak = measure_matmul_peak(self.device, peak_dtype)
        flops_per_token = self.model_config.flops_per_token(cfg.context_length)
        n_params = sum(p.numel() for p in self.model.parameters())
        tokens_per_step = cfg.batch_size * cfg.context_length
        if ctx.is_main:
            log.info("model: %s parameters, %s", f"{n_params:,}", self.model_config)
            log.info("data: %s training tokens, %s tokens per step, device %s, %d process(es), "
                     "matmul peak %.1f GFLOP/s", f"{len(self.train_data):,}", f"{tokens_per_step:,}",
                     self.device, ctx.world_size, peak / 1e9)
        last = cfg.max_steps if cfg.stop_at_step is None else min(cfg.max_steps, cfg.stop_at_step)
        bar = ProgressBar(last, cfg.max_time_s, self.step, disable=not (cfg.progress and ctx.is_main))
        t_start = time.perf_counter()
        elapsed = self.elapsed_before
        self.forward_model.train()
        stopped_by_time = False
        while self.step < last:
            step = self.step + 1
            lr = self.lr_at(step, elapsed)
            t0 = time.perf_counter()
            loss, norm = self.train_step(lr)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            dt = time.perf_counter() - t0
            self.step = step
            elapsed = self.elapsed_before + (time.perf_counter() - t_start)
            if not math.isfinite(loss):
                raise FloatingPointError(f"training loss became {loss} at step {step} (lr {lr:.3g}); "
                                         "lower the learning rate or enable grad_clip")
            result.losses.append(loss)
            tok_s = tokens_per_step / dt
            mfu = flops_per_token * tok_s / peak
            bar.update(step, elapsed, time.perf_counter() - t_start, loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}",
                       mfu=f"{100 * mfu:.1f}%", lr=f"{lr:.2e}")
            if step % cfg.log_every == 0 or step == 1:
                self.metrics.write({"step": step, "loss": loss, "lr": lr, "grad_norm": norm, "tok_per_s": tok_s,
                                    "mfu": mfu, "elapsed_s": round(elapsed, 3),
                                    "tokens_seen": step * tokens_per_step})
            if cfg.max_time_s is not None and elapsed >= cfg.max_time_s:
                stopped_by_time = True
            done = self.step >= last or stopped_by_time
            if cfg.eval_every and step % cfg.eval_every == 0 and not done:
                self._eval_and_log(result, full=False, elapsed=elapsed, bar=bar)
                # on a shared machine the peak seen at start can be low: keep the best seen so far
                peak = max(peak, measure_matmul_peak(self.device, peak_dtype, repeats=3))
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and not done:
                self.save(elapsed)
            if stopped_by_time:
                log.info("wall-clock budget of %.0f s reached at step %d", cfg.max_time_s, step)
                break
        bar.close()
        result.final_step = self.step
        result.elapsed_s = elapsed
        self._eval_and_log(result, full=True, elapsed=elapsed, bar=bar)
        result.checkpoint = self.save(elapsed)
        if ctx.is_main:
            if result.checkpoint is not None:
                log.info("checkpoint: %s", result.checkpoint)
            png = plot_loss_curve(self.metrics.read(), self.out_dir / "loss_curve.png",
                                  title=f"{n_params / 1e6:.2f}M-parameter LM")
            if png is not None:
                log.info("loss curve: %s", png)
            result.samples = self.sample()
        return result

    def _eval_and_log(self, result: TrainResult, full: bool, elapsed: float, bar: ProgressBar) -> None:
        """Evaluate, append to metrics.jsonl, and print the result on the console (stdout, above the bar)."""
        ev = self.evaluate(full=full)
        if ev is None:
            return
        result.evals.append((self.step, ev))
        record = {"step": self.step, "val_loss": ev.loss, "val_ppl": ev.perplexity, "val_bpb": ev.bits_per_byte,
                  "val_tokens": ev.tokens, "elapsed_s": round(elapsed, 3), "final": full}
        self.metrics.write(record)
        if self.ctx.is_main:
            bpb = f"{ev.bits_per_byte:.4f}" if ev.bits_per_byte is not None else "n/a (no byte count in sidecar)"
            line = (f"step {self.step}: val loss {ev.loss:.4f}, perplexity {ev.perplexity:.2f}, bits/byte {bpb} "
                    f"({ev.tokens} tokens{', final' if full else ''})")
            bar.val_loss = ev.loss
            bar.write(line)
            log.debug(line)

    def sample(self) -> list[str]:
        """Sample continuations of the configured prompts; also written to out_dir/samples.txt."""
        cfg = self.cfg
        if self.tokenizer is None or cfg.sample_tokens == 0 or not cfg.sample_prompts:
            return []
        from scratchlm.model.generate import generate

        texts = []
        self.model.eval()
        for i, prompt in enumerate(cfg.sample_prompts):
            ids = self.tokenizer.encode(prompt)
            if getattr(self.tokenizer, "add_bos", False) and self.tokenizer.bos_id is not None:
                ids = [self.tokenizer.bos_id, *ids]
            budget = max(1, min(cfg.sample_tokens, self.model_config.max_seq_len - len(ids)))
            out = generate(self.model, ids, budget, temperature=cfg.sample_temperature, top_k=cfg.sample_top_k,
                           seed=cfg.seed + i)
            out = list(out)
            new = out[len(ids):] if out[:len(ids)] == ids else out
            texts.append(prompt + self.tokenizer.decode(new))
        self.model.train()
        path = self.out_dir / "samples.txt"
        write_text(path, "\n\n---\n\n".join(texts) + "\n")
        for t in texts:
            log.info("sample: %s", t.replace("\n", " "))
        return texts


def train(cfg: TrainConfig, model_overrides: dict[str, Any] | None = None) -> TrainResult:
    """Build a :class:`Trainer` and run it."""
    return Trainer(cfg, model_overrides).train()

