"""`LLMEngine` (add_request / abort_request / step) and the offline `LLM` API on top of it.

One step is three lines, as in nano-vllm: `schedule()` -> `run()` -> `postprocess()`.
The engine owns no global state: the scheduler, block manager, KV cache and runner are its fields.
It is not thread-safe: one loop owns it (the server's background loop, or `LLM.generate`).

Isolation: a failure while sampling, detokenizing or stop-checking one request finishes that request
alone, with `RequestOutput.error` set and finish reason "error"; the rest of the batch goes on. The
sampler runs batched; when the batched call raises, each row is sampled on its own to find the
culprit(s) (greedy rows get the same token either way; a seeded row sampled before the failure may
draw a different, equally valid, sample that step). A failure of the forward pass itself still
fails the whole step (the caller, e.g. the server's engine loop, fails the requests in flight).

Prompt log-probabilities (`SamplingParams.prompt_logprobs`) are computed in the prefill: each chunk of such a prompt
returns its positions' logits (scheduler.py), turned here into {token: logprob} dicts and ranks on sample 0 (once
per request) and shown in `RequestOutput.prompt_logprobs` once the prompt is complete; max_tokens 0 finishes the
request ("length") at its last prompt token instead of sampling.

Structured outputs (`SamplingParams.structured_outputs`, inference/structured.py): the spec is compiled when the
request is added (a spec llguidance cannot compile is a ValueError carrying its message), and each sample gets its
own grammar matcher. The token masks of the step's constrained samples are filled on a worker thread while the
forward runs and applied by the batched sampler on those rows only; the matcher consumes each appended token (a
token it rejects fails that request alone), and a complete grammar stops the sequence with finish reason "stop".
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from scratchlm.inference.block_manager import BlockManager, max_blocks_held
from scratchlm.inference.config import EngineConfig
from scratchlm.inference.events import EventStream
from scratchlm.inference.executor import Executor, UniProcExecutor, default_executor_class
from scratchlm.inference.kv_cache import kv_shape, kv_v_dim, kv_window, num_blocks_for_budget
from scratchlm.inference.outputs import CompletionOutput, EngineStats, RequestOutput
from scratchlm.inference.params import SamplingParams
from scratchlm.inference.runner import build_model_input
from scratchlm.inference.sampler import Sampler, SamplingRow
from scratchlm.inference.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from scratchlm.inference.sequence import Sequence, SequenceStatus
from scratchlm.inference.structured import GrammarCompiler, GrammarMatcher, MaskFill, check_structured

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Request:
    """A request: its prompt and its n sequences (samples). Samples 1..n-1 fork from sample 0
    once the prompt is computed, sharing its full KV blocks."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False
    aborted: bool = False
    error: str | None = None  # why the engine failed this request alone (sampling, detokenizing, stop check)
    matchers: list[GrammarMatcher] = field(default_factory=list)  # one per sample under structured_outputs

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def sampling_group(self, seq: Sequence) -> list[Sequence]:
        """The samples that draw a token from `seq`'s logits: all n when sample 0 has just finished the prompt."""
        if self.params.n > 1 and not self.forked and seq.index == 0:
            return self.seqs
        return [seq]


def stop_prefix_hold(text: str, stops: list[str]) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of a stop string (text to hold back).

    Only the last len(stop) - 1 characters are looked at, and only where the stop's first character occurs
    there; each candidate is one C-level `startswith` (bounded stops: 16 x 256 characters)."""
    hold = 0
    for s in stops:
        m = min(len(s) - 1, len(text))
        if m <= hold:
            continue
        tail = text[len(text) - m :]
        j = tail.find(s[0])
        while j != -1 and m - j > hold:
            if s.startswith(tail[j:]):
                hold = m - j
                break
            j = tail.find(s[0], j + 1)
    return hold


class LLMEngine:
    """The streaming-capable engine; see docs/contracts.md and docs/engine.md.

    `LLMEngine(model, tokenizer, model_config, config)` runs `model` in this process; with
    `executor=` (and `model=None`) the steps run wherever that executor put the model (e.g. the ranks
    of a tensor/pipeline-parallel executor: `scratchlm.inference.executor`). `from_pretrained` picks one."""

    def __init__(self, model: torch.nn.Module | None, tokenizer: Any, model_config: Any,
                 config: EngineConfig | None = None, executor: Executor | None = None):
        self.config = config or EngineConfig()
        self.model_config = model_config
        self.tokenizer = tokenizer
        c = self.config
        dtype = c.kv_torch_dtype  # what the KV cache stores
        self.max_model_len = c.max_model_len or model_config.max_seq_len
        # Context parallelism: a logical block of C x block_size tokens is one block_size block on each of
        # the C ranks (token p on rank p % C), so num_blocks counts blocks per rank (docs/sequence_parallel.md).
        block = c.block_size * c.context_parallel_size
        num_blocks, window = self._size_kv_pool(model_config, block, dtype)
        self.executor = executor if executor is not None else UniProcExecutor(model, model_config, tokenizer, c)
        self.block_manager = BlockManager(num_blocks, block, c.enable_prefix_caching, window=window)
        self.scheduler = Scheduler(self.block_manager, c.max_num_seqs, c.max_num_batched_tokens, c.scheduling_policy)
        self.runner = self.executor.start(num_blocks)  # allocates the KV cache (each rank its shard)
        self.cache = self.runner.cache
        self.sampler = Sampler()
        self.grammars = GrammarCompiler(tokenizer) if tokenizer is not None else None  # structured outputs
        self._masks: dict[int, torch.Tensor] = {}  # seq_id -> this step's grammar masks (1 + its drafts rows)
        self.requests: dict[str, Request] = {}
        self._aborted: list[Request] = []
        self._rng = random.Random(c.seed)
        self._next_seq_id = 0
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self.events = EventStream()  # step events for the inspector and traces; free while nobody listens
        self.tracer = None
        if c.trace:  # Chrome trace-event JSON of every step (inference/trace.py)
            from scratchlm.inference.trace import StepTracer

            self.tracer = StepTracer(self, c.trace)
        self.speculator = None
        if c.speculative not in (None, "none"):
            from scratchlm.inference.speculative import Speculator

            self.speculator = Speculator(self, c.speculative, k_max=c.num_speculative_tokens)
        log.info("engine: %d KV blocks of %d tokens (%.1f MiB, %s), max_model_len %d, dtype %s, device %s%s",
                 num_blocks, c.block_size, self.cache.nbytes / 2**20, self.cache.dtype, self.max_model_len, c.dtype,
                 c.device, "" if window is None else
                 f", sliding window {window}: blocks before it are freed (at most "
                 f"{self.block_manager.max_blocks_held(self.max_model_len, c.max_num_batched_tokens)} per sequence)")

    def _size_kv_pool(self, model_config: Any, block: int, dtype: torch.dtype) -> tuple[int, int | None]:
        """(number of KV blocks, the window that frees blocks or None) from the model's `kv_spec()`, the memory
        budget and the longest sequence; lowers `self.max_model_len` when not even one sequence would fit.

        When every layer is windowed (Mistral), a sequence holds at most the blocks of its window plus a chunk
        (`BlockManager.max_blocks_held`), so the pool is capped by that and contexts longer than the pool are
        served. When only some layers are (Gemma 2/3), one shared block table keeps every block for the full
        layers, so the windowed layers' KV stays as large as the context: sized and logged as such."""
        c = self.config
        spec = model_config.kv_spec()
        n_layers, heads, dim = kv_shape(spec)  # a clear error when the layers differ (one cache tensor)
        window = kv_window(spec)
        if window is None and any(s.window is not None for s in spec):
            log.info("KV cache: %d of %d layers are windowed but the others attend to the whole context: their "
                     "KV blocks stay allocated for the whole sequence (one block table serves every layer; freeing "
                     "per layer kind needs a hybrid allocator, not implemented), so KV memory grows with context",
                     sum(s.window is not None for s in spec), len(spec))
        if window is not None and c.context_parallel_size > 1:
            log.info("KV cache: sliding-window block freeing is off under context parallelism (its attention "
                     "does not take windows)")
            window = None
        num_blocks = num_blocks_for_budget(c.kv_cache_memory, n_layers, heads, dim, block, dtype, kv_v_dim(spec))
        reserved = 1 if window is not None else 0  # the null block of a windowed pool
        per_seq = max_blocks_held(self.max_model_len, c.max_num_batched_tokens, block, window)
        # Never more blocks than max_num_seqs sequences can use at once (saves memory on small models).
        num_blocks = min(num_blocks, c.max_num_seqs * per_seq + 1 + reserved)
        usable = num_blocks - reserved
        if usable < 1:
            raise ValueError(f"kv_cache_memory={c.kv_cache_memory} holds {num_blocks} KV block, and a windowed pool "
                             "reserves one as its null block: raise kv_cache_memory")
        if usable < per_seq:  # one sequence of max_model_len tokens would not fit: shorten it to what does
            lowered = usable * block
            log.warning("max_model_len %d lowered to %d: the KV cache holds only %d blocks of %d tokens",
                        self.max_model_len, lowered, usable, block)
            self.max_model_len = lowered
        return num_blocks, window

    @classmethod
    def from_pretrained(cls, model_path: str | Path | None = None, config: EngineConfig | None = None,
                        executor_class: type | None = None) -> LLMEngine:
        """Load a model (HF dir, .gguf, llama2.c .bin, scratchlm or quantized checkpoint; None = the default model),
        with `config.quantization` applied, through `executor_class` (default: one process, or the multi-process
        executor when tensor x pipeline x context parallel size > 1; `scratchlm.inference.executor`)."""
        from scratchlm.defaults import default_model_path
        from scratchlm.model.loading.tokenizers import attach_tokenizer

        config = config or EngineConfig()
        path = Path(model_path) if model_path is not None else default_model_path()
        executor = (executor_class or default_executor_class(config)).from_pretrained(path, config)
        tokenizer = attach_tokenizer(executor.tokenizer, path, executor.model_config.vocab_size, config.tokenizer)
        return cls(None, tokenizer, executor.model_config, config, executor=executor)

    def shutdown(self) -> None:
        """Stop the executor's ranks, if any (also done at exit); the engine cannot step afterwards."""
        self.executor.shutdown()
        if self.grammars is not None:
            self.grammars.close()

    # --- requests ----------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | SequenceABC[int]) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids); ids are checked against the vocabulary."""
        vocab = self.model_config.vocab_size
        if isinstance(prompt, str):
            if self.tokenizer is None:
                from scratchlm.model.loading.tokenizers import NO_TOKENIZER

                raise ValueError(NO_TOKENIZER)
            ids = self.tokenizer.encode(prompt)
            bos = getattr(self.tokenizer, "bos_id", None)
            if getattr(self.tokenizer, "add_bos", False) and bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
            text = prompt
        elif isinstance(prompt, SequenceABC) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids, text = list(prompt), None
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        return text, ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        """Queue a request; errors (duplicate id, bad prompt, too long) raise ValueError."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        vocab = self.model_config.vocab_size
        if params.top_k is not None and params.top_k > vocab:
            raise ValueError(f"SamplingParams.top_k: got {params.top_k}, expected -1/0 (off) or an integer in "
                             f"[1, {vocab}] (the vocabulary size)")
        bad = sorted(t for t in params.logit_bias or {} if not 0 <= t < vocab)
        if bad:
            raise ValueError(f"SamplingParams.logit_bias: token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
        if params.n > self.config.max_num_seqs:  # every sample is a running sequence (it could never be scheduled)
            raise ValueError(f"SamplingParams.n: got {params.n}, expected at most max_num_seqs="
                             f"{self.config.max_num_seqs} (each sample is one running sequence)")
        text, ids = self.encode_prompt(prompt)
        generated = 0 if params.max_tokens == 0 else 1  # max_tokens 0 (prompt logprobs alone) only scores the prompt
        if len(ids) + generated > self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens does not fit max_model_len={self.max_model_len} "
                + ("(prompt + at least one generated token)" if generated else "")
            )
        bm = self.block_manager
        needed = bm.max_blocks_held(len(ids) + generated, self.config.max_num_batched_tokens)
        if needed > bm.num_usable_blocks:
            raise ValueError(
                f"prompt of {len(ids)} tokens needs {needed} KV blocks, the cache has {bm.num_usable_blocks}"
                f"; raise kv_cache_memory"
            )
        matchers = self._grammar_matchers(params)
        req = Request(request_id, text, ids, params, matchers=matchers)
        for i in range(params.n):
            req.seqs.append(Sequence(
                seq_id=self._new_seq_id(), request_id=request_id, index=i, params=params, prompt_ids=list(ids),
                arrival=self._next_seq_id, generator=self._generator(params, i),
            ))
        req.seqs[0].pending_forks = params.n - 1  # the scheduler reserves their slots with sample 0's
        self.requests[request_id] = req
        self.scheduler.add(req.seqs[0])
        self._prompt_tokens_total += len(ids)

    def _grammar_matchers(self, params: SamplingParams) -> list[GrammarMatcher]:
        """One matcher per sample for `params.structured_outputs` (none without); compiling (cached) raises a
        ValueError carrying llguidance's message."""
        spec = params.structured_outputs
        if spec is None:
            return []
        if self.grammars is None:
            from scratchlm.model.loading.tokenizers import NO_TOKENIZER

            raise ValueError(f"SamplingParams.structured_outputs needs the model's tokenizer: {NO_TOKENIZER}")
        check_structured(spec, self.grammars)
        return [self.grammars.matcher(spec) for _ in range(params.n)]

    def reset_prefix_cache(self) -> int:
        """Drop the prefix cache's entries for blocks no request holds; returns how many blocks it forgot."""
        return self.block_manager.reset_prefix_cache()

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks now; unknown or finished ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self._finish_all(req, "abort")
        req.aborted = True
        self._aborted.append(req)

    def _finish_all(self, req: Request, reason: str) -> None:
        """Finish every unfinished sample of `req` with `reason`, freeing its blocks."""
        for seq in req.seqs:
            if not seq.is_finished:
                if seq.status is SequenceStatus.WAITING and seq not in self.scheduler.waiting:
                    seq.status = SequenceStatus.FINISHED  # a fork that never started
                    seq.finish_reason = reason
                else:
                    self.scheduler.finish(seq, reason)
            seq.pending_forks = 0

    def _fail_request(self, req: Request, error: BaseException | str) -> None:
        """Isolation: finish `req` alone with an error; the rest of the batch is untouched."""
        if req.error is None:
            req.error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
            log.error("request %s failed in the engine (the others continue): %s", req.request_id, req.error)
        self._finish_all(req, "error")

    def embed(self, token_lists: list[list[int]], pooling: str = "last", normalize: bool = True) -> list[list[float]]:
        """Pooled final hidden states of each token list (inference/embeddings.py): a plain forward outside the
        scheduler and the KV cache, so call it between steps. Needs the whole model in this process (the
        one-process executor: NotImplementedError otherwise); lengths and ids are checked here (ValueError naming
        the input's index)."""
        from scratchlm.inference.embeddings import embed_tokens

        model = getattr(self.executor, "model", None)
        if model is None or not hasattr(model, "hidden_states"):
            raise NotImplementedError(f"embeddings need the whole model in this process; the "
                                      f"{type(self.executor).__name__} runs it elsewhere")
        vocab = self.model_config.vocab_size
        for i, ids in enumerate(token_lists):
            if not ids:
                raise ValueError(f"input {i} is empty")
            if len(ids) > self.max_model_len:
                raise ValueError(f"input {i} has {len(ids)} tokens; max_model_len is {self.max_model_len}")
            if any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"input {i} holds token ids outside the vocabulary [0, {vocab})")
        return embed_tokens(model, token_lists, pooling, normalize)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --- the step ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule -> run -> postprocess; returns the outputs of requests that progressed.
        With a listener on `self.events`, the step is timed and a `StepEvent` is built (events.py)."""
        if self.events.active:
            return self.events.observe(self, self._step)
        return self._step()

    def _step(self) -> list[RequestOutput]:
        self._masks = {}
        if self.speculator is not None:
            return self.speculator.step()  # the same three stages, with drafting and verification
        plan = self.scheduler.schedule()
        logits = self._run(plan)
        return self._postprocess(plan, logits)

    def _run(self, plan: SchedulerOutput) -> tuple[torch.Tensor, list[int]] | None:
        if plan.is_empty and not plan.block_copies:
            return None
        inp, rows = build_model_input(plan, self.block_manager.block_size)
        fill = self._start_masks(plan)
        try:
            logits = self.runner.execute(inp)
        finally:
            self._wait_masks(fill)
        self.scheduler.commit(plan)
        return logits, rows

    def _start_masks(self, plan: SchedulerOutput, drafts: dict[int, list[int]] | None = None
                     ) -> tuple[MaskFill, list[Sequence]] | None:
        """Start filling the grammar masks of every constrained sample this step samples (`drafts`: seq_id -> the
        draft tokens it verifies, one mask per position); call before the forward, `_wait_masks` after it."""
        jobs: list[tuple[GrammarMatcher, list[int]]] = []
        seqs: list[Sequence] = []
        for entry in plan.scheduled:
            req = self.requests.get(entry.seq.request_id)
            if not entry.samples or req is None or not req.matchers or req.error is not None:
                continue
            if req.params.max_tokens == 0:
                continue
            for s in req.sampling_group(entry.seq):
                jobs.append((req.matchers[s.index], (drafts or {}).get(s.seq_id, [])))
                seqs.append(s)
        return (self.grammars.start_fill(jobs), seqs) if jobs else None

    def _wait_masks(self, started: tuple[MaskFill, list[Sequence]] | None) -> None:
        """Join the fill started by `_start_masks`: `self._masks[seq_id]` = that sample's mask rows."""
        if started is None:
            return
        fill, seqs = started
        masks = fill.wait()
        ends = [*fill.offsets[1:], masks.shape[0]]
        self._masks = {s.seq_id: masks[a:b] for s, a, b in zip(seqs, fill.offsets, ends)}

    def _postprocess(self, plan: SchedulerOutput, result: tuple[torch.Tensor, list[int]] | None) -> list[RequestOutput]:
        progressed: dict[str, Request] = {}
        for req in self._aborted:
            progressed[req.request_id] = req
        self._aborted = []
        if result is not None:
            logits, rows = result
            sample_rows: list[SamplingRow] = []
            logit_rows: list[int] = []
            targets: list[tuple[Sequence, Request]] = []
            for entry, row in zip(plan.scheduled, rows):
                if row < 0:
                    continue
                seq = entry.seq
                req = self.requests[seq.request_id]
                if entry.num_prompt_logits and req.error is None:  # its prompt rows come first
                    try:
                        self._collect_prompt_logprobs(entry, logits[row : row + entry.num_prompt_logits])
                    except Exception as e:
                        self._fail_request(req, e)
                        progressed[req.request_id] = req
                row += entry.num_prompt_logits
                if seq.num_computed_tokens < len(seq):  # (committed) the chunk did not reach the last token
                    continue
                if req.params.max_tokens == 0:  # the prompt is scored: nothing to sample
                    self._finish_all(req, "length")
                    progressed[req.request_id] = req
                    continue
                for s in req.sampling_group(seq):  # sample 0 finished the prompt: all n samples draw from it
                    sample_rows.append(self._sampling_row(s))
                    logit_rows.append(row)
                    targets.append((s, req))
            if targets:
                index = torch.tensor(logit_rows, device=logits.device)
                token_ids, row_logprobs = self._sample(logits.index_select(0, index), sample_rows, targets)
                for seq, req in targets:  # forks first, while sample 0 surely still holds its blocks
                    if seq.index > 0 and not req.forked and req.error is None:
                        try:
                            self._fork(req.seqs[0], seq)
                        except Exception as e:
                            self._fail_request(req, e)
                for i, (seq, req) in enumerate(targets):
                    progressed[req.request_id] = req
                    if req.error is not None:
                        continue
                    try:
                        seq.append_token(token_ids[i])
                        if row_logprobs is not None and seq.logprobs is not None:
                            seq.logprobs.append(row_logprobs[i])
                        self._generation_tokens_total += 1
                        self._check_stop(seq)
                    except Exception as e:  # detokenizing or stop-checking this one request failed
                        self._fail_request(req, e)
                for seq, req in targets:
                    if req.params.n > 1 and seq.index == 0:
                        req.forked = True
                        seq.pending_forks = 0
        outputs = []
        for req in progressed.values():
            try:
                out = self._request_output(req)
            except Exception as e:
                self._fail_request(req, e)
                out = self._request_output(req)
            outputs.append(out)
            if req.finished:
                self.requests.pop(req.request_id, None)
        return outputs

    def _collect_prompt_logprobs(self, entry: ScheduledSequence, logits: torch.Tensor) -> None:
        """Append the prompt logprobs of `entry`'s chunk to its sequence: logits row j is position start + j, which
        scores prompt token start + j + 1 (raw log-softmax, as the sampled logprobs). Rows of positions already held
        (a recompute after preemption) are skipped; one past the first missing position would lose it (an error)."""
        seq = entry.seq
        start = seq.num_computed_tokens - entry.num_new_tokens  # `commit` already advanced it
        k = logits.shape[0]
        if start + 1 > len(seq.prompt_logprobs):
            raise RuntimeError(f"prompt logprobs: a chunk starts at position {start}, after the first missing one "
                               f"({len(seq.prompt_logprobs) - 1})")
        top_n = seq.params.prompt_logprobs
        targets = torch.tensor(seq.prompt_ids[start + 1 : start + 1 + k], device=logits.device)
        for a in range(0, k, 256):  # log-softmax in slices: one float32 copy of at most 256 x vocab
            lp = logits[a : a + 256].float().log_softmax(dim=-1)  # (rows, vocab)
            chosen = lp.gather(1, targets[a : a + 256, None])  # (rows, 1)
            ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
            chosen_l = chosen[:, 0].tolist()
            top = lp.topk(top_n, dim=-1) if top_n else None
            top_v, top_i = (top.values.tolist(), top.indices.tolist()) if top is not None else ([], [])
            for j in range(lp.shape[0]):
                position = start + a + j
                if position + 1 < len(seq.prompt_logprobs):
                    continue
                token = seq.prompt_ids[position + 1]
                d = {token: chosen_l[j]}
                for v, t in zip(top_v[j] if top_n else (), top_i[j] if top_n else ()):
                    d.setdefault(t, v)
                seq.prompt_logprobs.append(d)
                seq.prompt_ranks.append(ranks[j])

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], targets: list[tuple[Sequence, Request]]
                ) -> tuple[list[int | None], list[dict[int, float] | None] | None]:
        """Batched sampling; when it raises, sample each row alone and fail only the requests whose rows raise."""
        try:
            result = self.sampler(logits, rows)
            return list(result.token_ids), result.logprobs
        except Exception:
            log.warning("batched sampling of %d rows failed; sampling row by row to isolate the culprit", len(rows))
        token_ids: list[int | None] = []
        logprobs: list[dict[int, float] | None] = []
        for i, ((_, req), row) in enumerate(zip(targets, rows)):
            if req.error is not None:
                token_ids.append(None)
                logprobs.append(None)
                continue
            try:
                one = self.sampler(logits[i : i + 1], [row])
                token_ids.append(one.token_ids[0])
                logprobs.append(one.logprobs[0] if one.logprobs is not None else None)
            except Exception as e:
                self._fail_request(req, e)
                token_ids.append(None)
                logprobs.append(None)
        return token_ids, logprobs

    # --- helpers -------------------------------------------------------------------------------------
    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.greedy:
            return None
        g = torch.Generator(device=self.config.device)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        g.manual_seed((seed + 1_000_003 * index) % (1 << 63))
        return g

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        p = seq.params
        banned: list[int] = []
        if len(seq.output_ids) < p.min_tokens:
            eos = getattr(self.tokenizer, "eos_id", None)
            banned = list(p.stop_token_ids) + ([eos] if eos is not None and not p.ignore_eos else [])
        mask = self._masks.get(seq.seq_id)
        return SamplingRow(p, seq.generator, seq.prompt_ids, seq.output_ids, banned, request_id=seq.request_id,
                           token_mask=None if mask is None else mask[0])

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` the parent's computed prompt: full blocks shared, the partial last block copied."""
        bs = self.block_manager.block_size
        n_tokens = parent.num_computed_tokens
        n_full = n_tokens // bs
        shared = parent.block_table[:n_full]
        partial = parent.block_table[n_full:]
        if len(partial) > self.block_manager.num_free_blocks:
            self.scheduler.add(child)  # no room: it will recompute its prompt (mostly from the prefix cache)
            return
        self.block_manager.take(shared)
        child.block_table = list(shared)
        if partial:
            (dst,) = self.block_manager.allocate(1)
            child.block_table.append(dst)
            self.scheduler.pending_copies.append((partial[0], dst))
        child.block_hashes = list(parent.block_hashes[:n_full])
        child.num_dropped_blocks = min(parent.num_dropped_blocks, n_full)  # null entries (window) are shared as is
        child.num_computed_tokens = n_tokens
        self.scheduler.add_running(child)

    def _advance_grammar(self, seq: Sequence) -> bool:
        """Feed the newest output token to the sample's grammar (a ValueError when it rejects it); whether the
        grammar is now complete."""
        req = self.requests.get(seq.request_id)
        if req is None or not req.matchers:
            return False
        matcher = req.matchers[seq.index]
        matcher.advance(seq.output_ids[-1])
        return matcher.finished

    def _check_stop(self, seq: Sequence) -> None:
        """After a token is appended: advance the grammar, detokenize, and finish the sequence on EOS, a stop id or
        string, a complete grammar (whatever min_tokens says: nothing else may follow), max_tokens or max_model_len."""
        p = seq.params
        token = seq.output_ids[-1]
        n_out = len(seq.output_ids)
        reason: str | None = None
        stop_reason: str | int | None = None
        by_token = False
        grammar_done = self._advance_grammar(seq)
        eos = getattr(self.tokenizer, "eos_id", None)
        if grammar_done and token == eos:  # the grammar took the EOS (also under ignore_eos)
            reason, by_token = "stop", True
        elif n_out >= p.min_tokens:
            if not p.ignore_eos and token == eos:
                reason, by_token = "stop", True
            elif token in p.stop_token_ids:
                reason, stop_reason, by_token = "stop", token, True
        ids = seq.output_ids[:-1] if by_token else seq.output_ids
        old_len = len(seq.text)
        self._detokenize(seq, ids, final=reason is not None or grammar_done)
        if reason is None and p.stop and n_out >= p.min_tokens:
            longest = max(len(s) for s in p.stop)
            start = max(0, old_len - longest + 1)
            hits = [(seq.text.find(s, start), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                seq.text = seq.text[: i + len(s)] if p.include_stop_str_in_output else seq.text[:i]
                reason, stop_reason = "stop", s
        if reason is None and grammar_done:
            reason = "stop"
        if reason is None and ((p.max_tokens is not None and n_out >= p.max_tokens) or len(seq) >= self.max_model_len):
            reason = "length"
        if reason is not None:
            if reason == "length":
                self._detokenize(seq, ids, final=True)
            self.scheduler.finish(seq, reason, stop_reason)

    def _detokenize(self, seq: Sequence, ids: list[int], final: bool) -> None:
        """Incremental detokenization: append the text of new tokens, holding back incomplete UTF-8."""
        if (seq.read_offset >= len(ids) and not final) or self.tokenizer is None:  # no tokenizer: token ids only
            return
        decode = self.tokenizer.decode
        prefix = decode(ids[seq.prefix_offset : seq.read_offset])
        new = decode(ids[seq.prefix_offset :])
        if final or (len(new) > len(prefix) and not new.endswith("\ufffd")):
            seq.text += new[len(prefix) :]
            seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)

    @staticmethod
    def _visible_text(seq: Sequence) -> str:
        """Text safe to show: while running, hold back a tail that could still become a stop string."""
        text = seq.text
        if seq.is_finished or not seq.params.stop or seq.params.include_stop_str_in_output:
            return text
        return text[: len(text) - stop_prefix_hold(text, seq.params.stop)]

    def _request_output(self, req: Request) -> RequestOutput:
        outs = [
            CompletionOutput(
                index=s.index, text=self._visible_text(s), token_ids=list(s.output_ids),
                finish_reason=s.finish_reason, logprobs=list(s.logprobs) if s.logprobs is not None else None,
                stop_reason=s.stop_reason,
            )
            for s in req.seqs
        ]
        first = req.seqs[0]  # sample 0 scores the prompt (once per request); shown once complete
        scored = first.prompt_logprobs is not None and first.prompt_logprobs_from is None
        return RequestOutput(req.request_id, req.prompt, list(req.prompt_ids), outs, req.finished, error=req.error,
                             prompt_logprobs=first.prompt_logprobs if scored else None,
                             prompt_logprob_ranks=first.prompt_ranks if scored else None)

    # --- introspection -------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_total_blocks=bm.num_usable_blocks, num_free_blocks=bm.num_free_blocks,
            kv_cache_usage=1.0 - bm.num_free_blocks / bm.num_usable_blocks,
            prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions, prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            expert_load=self._expert_load(),
        )

    def _expert_load(self) -> dict[int, list[int]] | None:
        """The runner's per-expert routed rows per MoE layer, if it counts them (the expert-parallel runner)."""
        load = getattr(self.runner, "expert_load", None)
        return load() if callable(load) else None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` with the tokenizer's Jinja chat template, as HF's ``apply_chat_template(messages,
        tokenize=False, ...)``; `kwargs` are `render_chat`'s (``tools``, ``documents``, ``chat_template``, template
        variables such as ``enable_thinking``)."""
        from scratchlm.inference.chat_template import render_chat

        return render_chat(self.tokenizer, messages, add_generation_prompt, **kwargs)
