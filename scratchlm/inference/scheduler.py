"""The scheduler: which sequences run in the next step, and how many of their tokens.

One policy covers prefill and decode (as vLLM v1): every sequence has `num_computed_tokens`, and a
step feeds each scheduled sequence some of its uncomputed tokens, within a token budget
(`max_num_batched_tokens`) and at most `max_num_seqs` sequences.

1. Running sequences first, oldest first: a decode takes 1 token, an unfinished prefill takes the
   next chunk that fits the budget (chunked prefill, mixed with the decodes in the same step).
   When the pool has no block for one, the newest running sequence is *preempted by recompute*:
   its blocks are freed and it returns to the waiting queue, ahead of every new sequence; later it
   recomputes its prompt + output (mostly from the prefix cache) and continues with the same tokens.
2. Then waiting sequences, while budget, sequence slots and blocks last, in this order:
   preempted ones first (oldest first), then new ones by `policy`:
   - ``"shortest-first"`` (the default): shortest remaining prefill first, with aging. A new
     sequence's priority is its uncomputed tokens + the scheduler's token clock when it arrived
     (the clock counts every token scheduled so far); lowest first, ties by arrival. So among
     sequences that arrive together (a wave of concurrent clients) the short prompts are prefilled
     first and start streaming while the long ones are still being prefilled, which lowers the
     median time to first token at the same total work; and a prompt of P tokens can be overtaken by
     a later arrival only while the engine has scheduled fewer than P tokens since it arrived: no
     sequence starves under any arrival pattern.
   - ``"fcfs"``: arrival order.
   The first sequence in that order that does not fit (slots or blocks) ends admission for the step:
   later ones never jump a sequence that is only waiting for room. The last admitted one may take a
   partial chunk of the remaining budget. A sequence whose request has n > 1 samples takes n slots:
   its n - 1 forks join the running batch without passing through the waiting queue, so their slots
   are reserved when it is admitted. A new sequence first takes the cached blocks of its prefix; a
   fully cached prompt still computes its last block, so that the last token has logits to sample
   (and cached blocks are never written). The priority counts uncomputed tokens, not cache hits.

Prompt logprobs (`SamplingParams.prompt_logprobs`): every chunk of such a prompt returns the logits of each of its
positions (`ScheduledSequence.num_prompt_logits`), so they are computed in the prefill, chunk by chunk, with no
second pass; such a sequence takes prefix-cache hits only for the positions whose logprobs it already holds (none
for a new request, as vLLM skips the cache for them), and its blocks are still registered for others.
With max_tokens 0 the engine finishes the request at its last prompt token instead of sampling there.

Sliding windows (a block manager with a `window`, every layer windowed): after each step `commit` frees the
blocks that fell before the window of the sequence's next query (`BlockManager.drop_out_of_window`; their
table entries become the null block), so a running sequence holds at most the blocks of its window plus its
chunk, whatever its length. A preempted sequence frees everything it holds and recomputes as before; a prefix
hit only takes the cached blocks inside the window of the first uncomputed token (`match_prefix`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from scratchlm.inference.block_manager import BlockManager
from scratchlm.inference.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens fed this step, starting at seq.num_computed_tokens
    num_logits: int = 1  # rows whose logits are returned when it samples: the last ones (k + 1 for a verify)
    num_prompt_logits: int = 0  # leading rows whose logits are returned for prompt logprobs (`prompt_logit_rows`)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token (so a token is sampled)."""
        return self.seq.num_computed_tokens + self.num_new_tokens == len(self.seq)


@dataclass
class SchedulerOutput:
    """The plan of one step: decodes first (1 token each), then prefill chunks."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the forward
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


POLICIES = ("shortest-first", "fcfs")


def scheduled(seq: Sequence, num_new: int) -> ScheduledSequence:
    """The plan entry of `seq` feeding `num_new` tokens from its `num_computed_tokens`, with the rows of its prompt
    logprobs (`prompt_logit_rows`)."""
    return ScheduledSequence(seq, num_new, num_prompt_logits=prompt_logit_rows(seq, seq.num_computed_tokens, num_new))


def prompt_logit_rows(seq: Sequence, start: int, num_new: int) -> int:
    """How many rows of a chunk (positions start .. start + num_new - 1) return their logits for the prompt logprobs:
    from the chunk's first up to the prompt's second-to-last position (position p scores prompt token p + 1), while
    some are missing. A chunk never starts after the first missing position (prefix-cache hits stop there), so no
    position is lost; one that starts before it (a recompute after preemption) returns a few rows again."""
    if seq.prompt_logprobs_from is None:
        return 0
    return max(0, min(start + num_new, seq.num_prompt_tokens - 1) - start)


class Scheduler:
    """Continuous batching with a token budget, chunked prefill and preemption by recompute.

    `policy` orders the new waiting sequences (see the module docstring): "shortest-first" (aged) or "fcfs"."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "shortest-first"):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"scheduler needs max_num_seqs >= 1 and max_num_batched_tokens >= 1, "
                f"got {max_num_seqs} and {max_num_batched_tokens}"
            )
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy: got {policy!r}, expected one of {', '.join(POLICIES)}")
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.pending_copies: list[tuple[int, int]] = []
        self.num_preemptions = 0
        self.clock = 0  # tokens scheduled so far (the aging clock of "shortest-first")
        self._priority: dict[int, int] = {}  # seq_id -> priority of a new waiting sequence (lower first)
        self._preempted: set[int] = set()  # seq_ids waiting after a preemption (they go first)

    # --- queue management ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._priority[seq.seq_id] = seq.num_uncomputed_tokens + self.clock

    def add_running(self, seq: Sequence) -> None:
        """A sequence that already holds its blocks (a fork of a running one)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Mark `seq` finished and free its blocks at once (finish, stop or abort)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self._forget(seq)
        self._free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _free(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)  # null entries (dropped by the window) are skipped
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        seq.num_dropped_blocks = 0

    def _forget(self, seq: Sequence) -> None:
        self._priority.pop(seq.seq_id, None)
        self._preempted.discard(seq.seq_id)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self._preempted.add(seq.seq_id)
        self.num_preemptions += 1
        out.preempted.append(seq)

    def admission_order(self) -> list[Sequence]:
        """The waiting sequences in the order they are admitted: preempted ones first (oldest first), then the
        new ones by the policy (aged shortest-remaining-prefill first, or arrival order)."""
        resumed = sorted((s for s in self.waiting if s.seq_id in self._preempted), key=lambda s: s.arrival)
        new = [s for s in self.waiting if s.seq_id not in self._preempted]
        if self.policy == "shortest-first":
            new.sort(key=lambda s: (self._priority.get(s.seq_id, 0), s.arrival))
        else:
            new.sort(key=lambda s: s.arrival)
        return resumed + new

    # --- the step plan ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(block_copies=self.pending_copies)
        self.pending_copies = []
        budget = self.max_num_batched_tokens
        decodes: list[ScheduledSequence] = []
        prefills: list[ScheduledSequence] = []

        self.running.sort(key=lambda s: s.arrival)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            need = self.blocks.blocks_needed(seq.num_computed_tokens + num_new) - len(seq.block_table)
            while need > self.blocks.num_free_blocks:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: nothing after it can run either
            if need > 0:
                seq.block_table.extend(self.blocks.allocate(need))
            entry = scheduled(seq, num_new)
            (decodes if num_new == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens else prefills).append(entry)
            budget -= num_new
            i += 1

        if not out.preempted and self.waiting and budget > 0:
            slots = len(self.running) + sum(s.pending_forks for s in self.running)  # forks to come count now
            for seq in self.admission_order():
                if budget <= 0 or slots + 1 + seq.pending_forks > self.max_num_seqs:
                    break
                cached, hashes = [], []
                if not seq.block_table:
                    max_cached = (len(seq) - 1) // self.blocks.block_size
                    if seq.prompt_logprobs_from is not None:  # its positions' logits are still needed: compute them
                        max_cached = min(max_cached, seq.prompt_logprobs_from // self.blocks.block_size)
                    cached, hashes = self.blocks.match_prefix(seq.token_ids, max_cached)
                start = len(cached) * self.blocks.block_size if cached else seq.num_computed_tokens
                num_new = min(len(seq) - start, budget)
                need = self.blocks.blocks_needed(start + num_new) - len(cached) - len(seq.block_table)
                if need > self.blocks.num_free_after_take(cached):
                    break
                self.waiting.remove(seq)
                self._forget(seq)
                if cached:
                    self.blocks.take(cached)
                    seq.block_table = list(cached)
                    seq.block_hashes = list(hashes)
                    seq.num_computed_tokens = start
                    seq.num_dropped_blocks = self.blocks.window_start_block(start)  # null entries of a window hit
                if need > 0:
                    seq.block_table.extend(self.blocks.allocate(need))
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                slots += 1 + seq.pending_forks
                prefills.append(scheduled(seq, num_new))
                budget -= num_new

        out.scheduled = decodes + prefills
        self.clock += self.max_num_batched_tokens - budget
        return out

    def commit(self, out: SchedulerOutput) -> None:
        """After the forward: advance progress, register newly full blocks in the prefix cache, and (windowed pool)
        free the blocks that fell before the window of each sequence's next query."""
        bs = self.blocks.block_size
        windowed = self.blocks.window is not None
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens
            n_full = seq.num_computed_tokens // bs
            while len(seq.block_hashes) < n_full:
                k = len(seq.block_hashes)
                parent = seq.block_hashes[-1] if seq.block_hashes else -1
                tokens = seq.token_ids[k * bs : (k + 1) * bs]
                seq.block_hashes.append(self.blocks.register(seq.block_table[k], parent, tokens))
            if windowed:  # registered first: a dropped block stays hittable until it is reused
                seq.num_dropped_blocks = self.blocks.drop_out_of_window(seq.block_table, seq.num_computed_tokens,
                                                                        seq.num_dropped_blocks)

    def owners(self) -> dict[int, list[int]]:
        """seq id -> block table of every sequence that holds blocks (for invariant checks)."""
        return {s.seq_id: s.block_table for s in [*self.running, *self.waiting] if s.block_table}
