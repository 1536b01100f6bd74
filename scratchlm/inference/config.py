"""`EngineConfig`: the knobs of the serving engine (typed dataclass: CLI flags and TOML files)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = {"auto": None, **DTYPES, "int8": torch.int8}  # auto: the model's dtype


@dataclass
class EngineConfig:
    """How the engine batches, caches and computes."""

    max_num_seqs: int = field(default=64, metadata={"help": "most sequences in one step (continuous batch size)"})
    max_num_batched_tokens: int = field(
        default=512, metadata={"help": "token budget of one step: decodes + prefill chunks (chunked prefill)"}
    )
    max_model_len: int | None = field(
        default=None, metadata={"help": "longest prompt + output in tokens; None = the model's max_seq_len"}
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV-cache block"})
    kv_cache_memory: int = field(
        default=1 << 30, metadata={"help": "bytes of memory for the paged KV cache (sets the number of blocks)"}
    )
    enable_prefix_caching: bool = field(
        default=True, metadata={"help": "reuse the KV blocks of shared prompt prefixes (chained block hashes)"}
    )
    scheduling_policy: Literal["shortest-first", "fcfs"] = field(
        default="shortest-first",
        metadata={"help": "order of waiting requests: shortest-first (shortest remaining prompt first, aged by the "
                          "tokens scheduled since arrival, so none starves; lowers the median time to first token "
                          "of a wave of requests) | fcfs (arrival order); preempted requests always go first"},
    )
    dtype: Literal["float32", "bfloat16", "float16"] = field(
        default="float32", metadata={"help": "weights dtype, and the KV cache's with kv_cache_dtype=auto (fp32 is "
                                             "fastest on most CPUs)"}
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "int8"] = field(
        default="auto",
        metadata={"help": "KV cache storage: auto (= dtype, float32 by default) | float32 | bfloat16 | float16 | int8 "
                          "(one float32 scale per token and KV head); compact caches hold 2-3.8x more tokens in "
                          "kv_cache_memory and decode attention reads that many fewer bytes (docs/quantization.md)"},
    )
    device: str = field(default="cpu", metadata={"help": "torch device: cpu, cuda, cuda:1, ..."})
    seed: int = field(default=0, metadata={"help": "seeds the generators of requests that give no seed"})
    quantization: str | None = field(
        default=None,
        metadata={"help": "weight quantization: none | gguf (keep a .gguf's quantized tensors packed, each in its "
                          "own type: Q4_0/Q4_1/Q8_0, Q5_0/Q5_1, K-quants, IQ4_NL/IQ4_XS) | "
                          "int8 | int4[-gN][-sym|-asym][+head4|+nohead][+rtn|+mse|+gptq] (int4 keeps the head at int8; "
                          "see docs/quantization.md)"},
    )
    quantization_calibration: str | None = field(
        default=None,
        metadata={"help": "UTF-8 text file whose first quantization_calibration_tokens tokens calibrate int4: the "
                          "default int4 scheme then runs sequential GPTQ (+mse: the scale search weighs each input "
                          "channel by its E[x^2]); None = weight-only search"},
    )
    quantization_calibration_tokens: int = field(
        default=16384, metadata={"help": "tokens of quantization_calibration used (fixed: the file's first ones; "
                                         "GPTQ overfits a few thousand)"}
    )
    speculative: str | None = field(
        default=None,
        metadata={"help": "speculative decoding: ngram[:N] (prompt lookup) | draft:PATH (a smaller model with the "
                          "same tokenizer) | layers:K (the target's first K layers); see docs/speculative.md"},
    )
    num_speculative_tokens: int | None = field(
        default=None, metadata={"help": "most tokens drafted per sequence and step; k adapts per sequence up to it "
                                        "(None = 8 for ngram, 4 for a draft model)"}
    )
    tensor_parallel_size: int = field(
        default=1, metadata={"help": "tensor-parallel ranks (attention sharded by KV head, MLP and vocab split); "
                                     "the engine spawns them, or joins a torchrun launch (docs/parallelism.md)"}
    )
    pipeline_parallel_size: int = field(
        default=1, metadata={"help": "pipeline stages (layers split by parameter count); world = TP x PP ranks"}
    )
    pipeline_stage_layers: str | None = field(
        default=None, metadata={"help": "explicit layers per pipeline stage, e.g. '3,2'; None = balanced"}
    )
    pipeline_microbatches: int | None = field(
        default=None, metadata={"help": "micro-batches in flight per step under PP; None = pipeline_parallel_size"}
    )
    context_parallel_size: int = field(
        default=1, metadata={"help": "context-parallel ranks: a sequence's KV cache is sharded over them token by "
                                     "token, long prefill chunks run ring attention, decode merges by LSE; "
                                     "world = TP x CP (docs/sequence_parallel.md)"}
    )
    context_parallel_threshold: int = field(
        default=512, metadata={"help": "prefill chunks of at least this many tokens are split over the CP ranks "
                                       "(ring attention); shorter chunks and decodes run replicated"}
    )
    expert_parallel_size: int = field(
        default=1, metadata={"help": "expert-parallel ranks of a mixture-of-experts model: each holds 1/N of every "
                                     "MoE layer's experts (token rows exchanged with all-to-all) and runs attention "
                                     "for its share of the sequences; world = TP x EP (docs/moe.md)"}
    )
    parallel_timeout_s: float = field(
        default=60.0, metadata={"help": "seconds before a TP/PP step collective with a dead or hung rank fails"}
    )
    tokenizer: str | None = field(
        default=None, metadata={"help": "tokenizer to use instead of the model's own, or for a model that has none: "
                                        "a folder with tokenizer.json, a tokenizer.json, a .gguf, a llama2.c "
                                        "tok*.bin or a scratchlm .pt checkpoint (None = the model's)"}
    )
    trace: str | None = field(
        default=None, metadata={"help": "write the engine's steps to this file as Chrome trace-event JSON (open in "
                                        "ui.perfetto.dev): one track per stage, per rank under TP/PP/CP"}
    )

    def __post_init__(self) -> None:
        problems = []
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory",
                     "num_speculative_tokens"):
            v = getattr(self, name)
            if v is None and name == "num_speculative_tokens":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                problems.append(f"{name}={v!r} must be a positive integer")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            problems.append(f"max_model_len={self.max_model_len!r} must be None or an integer >= 2")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size",
                     "expert_parallel_size", "context_parallel_threshold"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                problems.append(f"{name}={v!r} must be a positive integer")
        mb = self.pipeline_microbatches
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int) or mb < 1):
            problems.append(f"pipeline_microbatches={mb!r} must be None or a positive integer")
        if not isinstance(self.parallel_timeout_s, int | float) or not self.parallel_timeout_s > 0:
            problems.append(f"parallel_timeout_s={self.parallel_timeout_s!r} must be a positive number of seconds")
        if self.tokenizer is not None and not Path(self.tokenizer).exists():
            problems.append(f"tokenizer={self.tokenizer!r} not found (a folder with tokenizer.json, a tokenizer.json, "
                            "a .gguf, a llama2.c tok*.bin or a scratchlm .pt checkpoint)")
        if self.scheduling_policy not in ("shortest-first", "fcfs"):
            problems.append(f"scheduling_policy={self.scheduling_policy!r} must be shortest-first or fcfs")
        if self.dtype not in DTYPES:
            problems.append(f"dtype={self.dtype!r} must be one of {sorted(DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            problems.append(f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of {list(KV_CACHE_DTYPES)}")
        elif self.kv_cache_dtype not in ("auto", self.dtype) and self.world_size > 1:
            problems.append(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported with tensor/pipeline/context "
                            "parallelism yet: use kv_cache_dtype=auto there")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError):
            problems.append(f"device={self.device!r} is not a torch device (cpu, cuda, cuda:0, ...)")
        if self.quantization not in (None, "none", "gguf"):
            from scratchlm.inference.quantization.scheme import parse_scheme

            try:
                parse_scheme(self.quantization)
            except ValueError as e:
                problems.append(f"quantization={self.quantization!r}: {e}")
        if self.quantization_calibration is not None and not Path(self.quantization_calibration).is_file():
            problems.append(f"quantization_calibration={self.quantization_calibration!r} is not a file "
                            "(expected a UTF-8 text file)")
        v = self.quantization_calibration_tokens
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            problems.append(f"quantization_calibration_tokens={v!r} must be a positive integer")
        if self.speculative not in (None, "none"):
            from scratchlm.inference.speculative.method import parse_speculative

            try:
                parse_speculative(self.speculative)
            except ValueError as e:
                problems.append(str(e))
        if self.trace is not None and not Path(self.trace).parent.is_dir():
            problems.append(f"trace={self.trace!r}: folder {str(Path(self.trace).parent)!r} does not exist")
        if problems:
            raise ValueError("invalid EngineConfig: " + "; ".join(problems))

    @property
    def world_size(self) -> int:
        """Processes the engine runs as: tensor x pipeline x context x expert parallel ranks."""
        return (self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size
                * self.expert_parallel_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV cache's storage dtype (torch.int8: int8 with scales, see inference/kv_cache.py)."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype
