"""`TrainConfig`: every knob of a training run, as a typed dataclass (TOML file + CLI flags).

A run's TOML file holds the TrainConfig fields at the top level and the model's shape in a
``[model]`` table whose keys are `scratchlm.model.ModelConfig` fields (``vocab_size`` defaults to
the tokenizer's / corpus's vocabulary)::

    train_data = "data/train.bin"
    val_data = "data/valid.bin"
    batch_size = 32
    [model]
    d_model = 256
    n_layers = 4
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from scratchlm.config import from_dict, read_config_file


def _f(default, help_text: str, **kw):
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help_text, **kw})
    return field(default=default, metadata={"help": help_text, **kw})


@dataclass
class TrainConfig:
    """One training run: data, optimisation, schedule, evaluation, logging, checkpoints, hardware."""

    # data
    train_data: Path | None = _f(None, "training token file (.bin with its .bin.json sidecar from "
                                       "`scratchlm tokenizer encode`)")
    val_data: Path | None = _f(None, "validation token file (.bin); None = no evaluation")
    tokenizer: Path | None = _f(None, "tokenizer to store in the checkpoint and use for samples; None = the "
                                      "'tokenizer' path in the training file's sidecar, if any")
    out_dir: Path = _f(Path("runs/train"), "folder for checkpoints, metrics.jsonl, loss_curve.png, samples.txt")
    # batch
    batch_size: int = _f(32, "sequences per optimizer step, summed over gradient accumulation and processes")
    grad_accum_steps: int = _f(1, "micro-batches per optimizer step (per process)")
    context_length: int = _f(256, "tokens per training sequence")
    # optimisation
    lr: float = _f(1e-3, "peak learning rate (after warm-up)")
    min_lr: float = _f(1e-4, "learning rate at the end of the cosine decay")
    warmup_steps: int = _f(100, "linear warm-up steps")
    max_steps: int = _f(1000, "optimizer steps of the whole schedule (the cosine ends here)")
    max_time_s: float | None = _f(None, "wall-clock budget in seconds: the cosine decays on whichever of steps or "
                                        "time runs out first, and training stops there (makes the run "
                                        "time-dependent: resume is bit-exact only without it)")
    stop_at_step: int | None = _f(None, "stop (with a checkpoint) after this step without changing the schedule")
    weight_decay: float = _f(0.1, "AdamW decoupled weight decay (tensors of rank >= 2 only)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    grad_clip: float | None = _f(1.0, "clip the global gradient L2 norm to this; None = no clipping")
    engine: str = _f("torch", "gradient engine: 'torch' (autograd), another registered name, or "
                              "'package.module:function' with the loss_and_grads signature")
    seed: int = _f(1337, "seed of the model init and the data sampler")
    # evaluation and logging
    eval_every: int = _f(200, "evaluate on val_data every N steps (and at the end); 0 = only at the end")
    eval_tokens: int | None = _f(None, "validation tokens per periodic evaluation; None = the whole file "
                                       "(the final evaluation always uses the whole file)")
    eval_batch_size: int = _f(16, "sequences per evaluation forward pass")
    log_every: int = _f(10, "write a metrics line every N steps")
    checkpoint_every: int = _f(500, "write out_dir/ckpt.pt every N steps (and at the end); 0 = only at the end")
    resume: Path | None = _f(None, "checkpoint to resume from (bit-exact continuation)")
    sample_prompts: list[str] = _f(["once upon a time"], "prompts for the sample generations at the end")
    sample_tokens: int = _f(100, "tokens per sample generation (0 = no samples)")
    sample_temperature: float = _f(0.8, "temperature of the sample generations")
    sample_top_k: int | None = _f(50, "top-k of the sample generations")
    progress: bool = _f(True, "show a tqdm progress bar")
    # hardware
    device: str = _f("auto", "'auto' (cuda if available, else cpu), 'cpu', 'cuda' or 'cuda:N'")
    dtype: Literal["float32", "bfloat16"] = _f("float32", "compute dtype: bfloat16 = autocast on CUDA "
                                                           "(weights and optimizer stay float32)")
    compile: bool = _f(False, "torch.compile the model")
    threads: int | None = _f(None, "torch CPU threads per rank; None = the shared policy: $OMP_NUM_THREADS, else "
                                  "the physical cores not busy by the load average over the local ranks (logged)")

    def validate(self, world_size: int = 1) -> None:
        """Raise ValueError naming every inconsistent setting."""
        problems = []
        for name in ("batch_size", "grad_accum_steps", "context_length", "max_steps", "eval_batch_size", "log_every"):
            if getattr(self, name) <= 0:
                problems.append(f"{name}={getattr(self, name)} must be > 0")
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "sample_tokens"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} must be >= 0")
        if not problems and self.batch_size % (self.grad_accum_steps * world_size):
            problems.append(
                f"batch_size={self.batch_size} is not divisible by grad_accum_steps={self.grad_accum_steps} "
                f"* world_size={world_size}"
            )
        if self.lr < 0 or self.min_lr < 0:
            problems.append(f"lr={self.lr} and min_lr={self.min_lr} must be >= 0")
        if self.train_data is None:
            problems.append("train_data is not set (give --train-data or train_data in the config file)")
        if self.max_time_s is not None and self.max_time_s <= 0:
            problems.append(f"max_time_s={self.max_time_s} must be > 0")
        if problems:
            raise ValueError("invalid TrainConfig: " + "; ".join(problems))


def load_run_config(path: str | Path) -> tuple[TrainConfig, dict[str, Any]]:
    """Read a run file (TOML or JSON): TrainConfig fields at the top, ModelConfig fields in ``[model]``.

    Returns (TrainConfig, model overrides dict). Unknown keys are errors naming the file.
    """
    data = read_config_file(path)
    model = data.pop("model", {})
    if not isinstance(model, dict):
        raise ValueError(f"{path}: 'model' must be a table of ModelConfig fields, got {model!r}")
    check_model_overrides(model, where=f"{path} [model]")
    return from_dict(TrainConfig, data, where=str(path)), model


def check_model_overrides(model: dict[str, Any], where: str = "[model]") -> None:
    """Unknown ModelConfig keys are errors (listing the known ones)."""
    from scratchlm.model import ModelConfig

    names = {f.name for f in dataclasses.fields(ModelConfig) if f.init}
    unknown = sorted(set(model) - names)
    if unknown:
        raise ValueError(f"{where}: unknown model option(s) {unknown}; expected some of {sorted(names)}")


def train_config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """JSON/pickle-safe dict (Paths as strings)."""
    out = dataclasses.asdict(cfg)
    return {k: str(v) if isinstance(v, Path) else v for k, v in out.items()}


# Settings that must not change when resuming, or the continuation would not be the same run.
RESUME_INVARIANTS = ("batch_size", "grad_accum_steps", "context_length", "seed", "engine")
