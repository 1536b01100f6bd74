"""The BlockManager: a pool of fixed-size KV blocks, ref-counted, with prefix caching.

- Every sequence owns a *block table*: the ids of the blocks that hold its K/V, in order.
- A block holds `block_size` consecutive tokens. When it is full and computed, it is registered
  under a chained hash `hash((parent_hash, tokens))`, so a later prompt with the same prefix can
  take it (ref count + 1) instead of recomputing it. A hit is checked against the stored token ids
  (and the parent hash), so a hash collision can never hand out wrong K/V.
- A block whose ref count drops to 0 goes to the free list but keeps its hash: it can still be hit
  until it is reused. Fresh blocks are taken from the least recently freed end (LRU eviction).
- Blocks that are written are never shared: only full, registered blocks are shared, and a
  sequence only writes into its own last, partial block.

Sliding windows (`window`: set when EVERY layer of the model is windowed, `kv_cache.kv_window`): a query at
position p reads keys p - window + 1 .. p only, so once a sequence's next query position is q, its leading
blocks that end before q - window + 1 are never read again. `drop_out_of_window` releases them and puts the
*null block* in their table entries: block 0, reserved at start (never allocated, never written, always zero),
so the table keeps one entry per logical block (slot arithmetic and context lengths are unchanged) and a reader
that gathers the whole table (the torch paged path) reads finite zeros that the window masks out; the kernels
skip blocks before the window. Prefix caching stays exact:

- a dropped block is released like any other: it keeps its hash while it sits in the free list, and a later
  prompt may hit it, because its K/V depend only on the tokens up to it (chained hash), not on which sequence
  dropped it; once reallocated its hash is gone (`allocate`), so no hit can ever see overwritten K/V;
- `match_prefix` of a windowed pool only needs the blocks inside the window of the first uncomputed token:
  it takes the longest prefix whose *window* blocks are all cached (blocks before that window may have been
  evicted) and returns the null block for the rest, which are never taken.

Mixed models (some layers full, Gemma 2/3) keep every block: one shared block table cannot drop a block that a
full layer still reads (per-layer-kind tables, vLLM's hybrid allocator, would be the fix).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

NO_HASH = -1


def block_hash(parent_hash: int, tokens: Sequence[int]) -> int:
    """Chained hash of a full block: depends on every token before it through `parent_hash`."""
    return hash((parent_hash, tuple(tokens)))


def max_blocks_held(num_tokens: int, chunk: int, block_size: int, window: int | None) -> int:
    """The most blocks a sequence of up to `num_tokens` tokens holds at once when it is fed at most `chunk` tokens
    a step: all of them without a window; with one, the blocks spanning the window before a chunk and the chunk
    (window - 1 + chunk tokens, at any alignment: ceil((span - 1) / block_size) + 1 blocks)."""
    full = -(-num_tokens // block_size)
    if window is None:
        return full
    span = window - 1 + min(chunk, num_tokens)  # tokens from the window's first key to the chunk's last token
    return min(full, -(-(span - 1) // block_size) + 1)


class NoFreeBlocksError(RuntimeError):
    """Raised by allocate() when the pool cannot provide the requested number of blocks."""


class BlockManager:
    """Ref-counted KV blocks with a prefix cache. Pure bookkeeping: it never touches tensors."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None):
        """`window`: the sliding window of every layer (None: full attention somewhere, keep every block); a
        windowed pool reserves block 0 as the null block (see the module docstring)."""
        reserved = 1 if window is not None else 0
        if num_blocks < 1 + reserved or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= {1 + reserved} and block_size >= 1, got "
                             f"{num_blocks}, {block_size}" + (" (a windowed pool reserves a null block)" if reserved
                                                              else ""))
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"BlockManager window must be None or a positive number of tokens, got {window!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.null_block: int | None = 0 if window is not None else None
        self.ref_count = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.key_of: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(reserved, num_blocks))
        if self.null_block is not None:
            self.ref_count[self.null_block] = 1  # held by the pool itself, forever
        self.prefix_cache_queries = 0  # blocks looked up
        self.prefix_cache_hits = 0  # blocks found
        self.num_dropped = 0  # blocks released by the window (drop_out_of_window), in total

    # --- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks sequences can hold: the pool less the null block of a windowed pool."""
        return self.num_blocks - (self.null_block is not None)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def window_start_block(self, next_position: int) -> int:
        """How many leading blocks lie entirely before the window of a query at `next_position` (every later query
        of the sequence is at or after it): those are never read again. 0 without a window."""
        if self.window is None:
            return 0
        return max(0, next_position - self.window + 1) // self.block_size

    def max_blocks_held(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a sequence of up to `num_tokens` tokens holds at once when fed at most `chunk` tokens a
        step (`max_blocks_held` of this pool's block size and window)."""
        return max_blocks_held(num_tokens, chunk, self.block_size, self.window)

    def match_prefix(self, token_ids: Sequence[int], max_blocks: int) -> tuple[list[int], list[int]]:
        """The cached blocks (and their hashes) for the leading full blocks of `token_ids`, at most
        `max_blocks`. No reference is taken: call take() on them. A windowed pool returns the null block for
        leading blocks before the window of the first uncomputed token (see the module docstring)."""
        if not self.enable_prefix_caching:
            return [], []
        if self.window is not None:
            return self._match_windowed(token_ids, max_blocks)
        bs = self.block_size
        blocks: list[int] = []
        hashes: list[int] = []
        parent = NO_HASH
        n_full = min(len(token_ids) // bs, max_blocks)
        for i in range(n_full):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens)
            self.prefix_cache_queries += 1
            b = self.hash_to_block.get(h)
            if b is None or self.key_of[b] != (parent, tokens):
                self.prefix_cache_queries += n_full - i - 1  # the rest are misses too
                break
            self.prefix_cache_hits += 1
            blocks.append(b)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def _match_windowed(self, token_ids: Sequence[int], max_blocks: int) -> tuple[list[int], list[int]]:
        """The longest prefix of L full blocks whose blocks inside the window of position L * block_size are all
        cached: null blocks before that window, the cached ones after, and the hashes of all L."""
        bs = self.block_size
        n_full = min(len(token_ids) // bs, max_blocks)
        hashes: list[int] = []
        found: list[int | None] = []
        parent = NO_HASH
        for i in range(n_full):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens)
            b = self.hash_to_block.get(h)
            found.append(b if b is not None and self.key_of[b] == (parent, tokens) else None)
            hashes.append(h)
            parent = h
        best, run = 0, 0  # run: cached blocks in a row ending at block i
        for i in range(n_full):
            run = run + 1 if found[i] is not None else 0
            if run >= i + 1 - self.window_start_block((i + 1) * bs):
                best = i + 1
        self.prefix_cache_queries += n_full
        self.prefix_cache_hits += best
        start = self.window_start_block(best * bs)
        blocks = [self.null_block] * start + [b for b in found[start:best]]
        return blocks, hashes[:best]

    def num_free_after_take(self, block_ids: Sequence[int]) -> int:
        """How many blocks stay free once `block_ids` (cached hits) are taken."""
        return self.num_free_blocks - sum(1 for b in block_ids if self.ref_count[b] == 0)

    # --- changes -------------------------------------------------------------------------------
    def take(self, block_ids: Sequence[int]) -> None:
        """Add a reference to existing blocks (prefix-cache hits, or forked sequences); null entries stay null."""
        for b in block_ids:
            if b == self.null_block:
                continue
            if self.ref_count[b] == 0:
                del self.free[b]
            self.ref_count[b] += 1

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks (ref count 1), evicting the least recently freed cached blocks."""
        if n > len(self.free):
            raise NoFreeBlocksError(f"need {n} KV blocks, only {len(self.free)} free of {self.num_blocks}")
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.hash_of[b]
            if h is not None:
                if self.hash_to_block.get(h) == b:
                    del self.hash_to_block[h]
                self.hash_of[b] = None
                self.key_of[b] = None
            self.ref_count[b] = 1
            out.append(b)
        return out

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; blocks at 0 become free (tail blocks evicted first). Null entries
        (blocks a window dropped) are skipped."""
        for b in reversed(block_ids):
            if b == self.null_block:
                continue
            if self.ref_count[b] <= 0:
                raise RuntimeError(f"block {b} released more often than taken")
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free[b] = None

    def drop_out_of_window(self, table: list[int], next_position: int, done: int = 0) -> int:
        """Release the blocks of `table` that lie before the window of a query at `next_position` and put the
        null block in their entries (in place); returns how many leading entries are null now, which the caller
        may pass back as `done` to skip them next time. Nothing happens without a window."""
        end = min(self.window_start_block(next_position), len(table))
        for k in range(done, end):
            b = table[k]
            if b != self.null_block:
                self.release([b])
                table[k] = self.null_block
                self.num_dropped += 1
        return max(done, end)

    def register(self, block_id: int, parent_hash: int, tokens: Sequence[int]) -> int:
        """Record that full block `block_id` holds `tokens` after the prefix hashed `parent_hash`;
        returns its hash (the parent hash of the next block)."""
        tokens = tuple(tokens)
        if block_id == self.null_block:
            raise RuntimeError("the null block holds no tokens and cannot be registered in the prefix cache")
        if len(tokens) != self.block_size:
            raise ValueError(f"only full blocks are cached: got {len(tokens)} tokens, block_size {self.block_size}")
        h = block_hash(parent_hash, tokens)
        if self.enable_prefix_caching and self.hash_of[block_id] is None and h not in self.hash_to_block:
            self.hash_to_block[h] = block_id
            self.hash_of[block_id] = h
            self.key_of[block_id] = (parent_hash, tokens)
        return h

    def reset_prefix_cache(self) -> int:
        """Forget the hashes of every free block (blocks in use keep theirs), so no later prompt can hit them;
        returns how many were forgotten. Benchmarks call it between repeats of the same workload."""
        forgotten = 0
        for b in self.free:
            h = self.hash_of[b]
            if h is not None:
                if self.hash_to_block.get(h) == b:
                    del self.hash_to_block[h]
                self.hash_of[b] = self.key_of[b] = None
                forgotten += 1
        return forgotten

    def check_invariants(self, owners: dict[int, list[int]]) -> None:
        """Assert the pool is consistent with `owners` (seq id -> block table): every block's ref count
        equals the number of tables that hold it, free blocks are exactly those at 0, hashes map back; null entries
        of a windowed pool must be a prefix of each table (only blocks before the window are dropped)."""
        counts = [0] * self.num_blocks
        if self.null_block is not None:
            counts[self.null_block] = 1  # the pool's own reference
        for table in owners.values():
            held = [b for b in table if b != self.null_block]
            if len(set(held)) != len(held):
                raise AssertionError(f"a block table holds a block twice: {table}")
            for b in held:
                counts[b] += 1
        if counts != self.ref_count:
            bad = [(b, counts[b], self.ref_count[b]) for b in range(self.num_blocks) if counts[b] != self.ref_count[b]]
            raise AssertionError(f"ref counts differ from owners (block, owners, ref): {bad[:10]}")
        if self.null_block is not None:
            for table in owners.values():
                nulls = sum(1 for b in table if b == self.null_block)
                if any(b != self.null_block for b in table[:nulls]):
                    raise AssertionError(f"null blocks that are not a prefix of the block table: {table}")
        free = {b for b in range(self.num_blocks) if self.ref_count[b] == 0}
        if free != set(self.free):
            raise AssertionError("free list differs from blocks with ref count 0")
        for h, b in self.hash_to_block.items():
            if self.hash_of[b] != h:
                raise AssertionError(f"hash table points to block {b} that does not carry hash {h}")
