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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

NO_HASH = -1


def block_hash(parent_hash: int, tokens: Sequence[int]) -> int:
    """Chained hash of a full block: depends on every token before it through `parent_hash`."""
    return hash((parent_hash, tuple(tokens)))


class NoFreeBlocksError(RuntimeError):
    """Raised by allocate() when the pool cannot provide the requested number of blocks."""


class BlockManager:
    """Ref-counted KV blocks with a prefix cache. Pure bookkeeping: it never touches tensors."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.key_of: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.prefix_cache_queries = 0  # blocks looked up
        self.prefix_cache_hits = 0  # blocks found

    # --- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: Sequence[int], max_blocks: int) -> tuple[list[int], list[int]]:
        """The cached blocks (and their hashes) for the leading full blocks of `token_ids`, at most
        `max_blocks`. No reference is taken: call take() on them."""
        if not self.enable_prefix_caching:
            return [], []
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

    def num_free_after_take(self, block_ids: Sequence[int]) -> int:
        """How many blocks stay free once `block_ids` (cached hits) are taken."""
        return self.num_free_blocks - sum(1 for b in block_ids if self.ref_count[b] == 0)

    # --- changes -------------------------------------------------------------------------------
    def take(self, block_ids: Sequence[int]) -> None:
        """Add a reference to existing blocks (prefix-cache hits, or forked sequences)."""
        for b in block_ids:
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
        """Drop one reference from each block; blocks at 0 become free (tail blocks evicted first)."""
        for b in reversed(block_ids):
            if self.ref_count[b] <= 0:
                raise RuntimeError(f"block {b} released more often than taken")
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free[b] = None

    def register(self, block_id: int, parent_hash: int, tokens: Sequence[int]) -> int:
        """Record that full block `block_id` holds `tokens` after the prefix hashed `parent_hash`;
        returns its hash (the parent hash of the next block)."""
        tokens = tuple(tokens)
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
        equals the number of tables that hold it, free blocks are exactly those at 0, hashes map back."""
        counts = [0] * self.num_blocks
        for table in owners.values():
            if len(set(table)) != len(table):
                raise AssertionError(f"a block table holds a block twice: {table}")
            for b in table:
                counts[b] += 1
        if counts != self.ref_count:
            bad = [(b, counts[b], self.ref_count[b]) for b in range(self.num_blocks) if counts[b] != self.ref_count[b]]
            raise AssertionError(f"ref counts differ from owners (block, owners, ref): {bad[:10]}")
        free = {b for b in range(self.num_blocks) if self.ref_count[b] == 0}
        if free != set(self.free):
            raise AssertionError("free list differs from blocks with ref count 0")
        for h, b in self.hash_to_block.items():
            if self.hash_of[b] != h:
                raise AssertionError(f"hash table points to block {b} that does not carry hash {h}")
