"""BlockManager: ref counts, prefix-cache hits, collision checks and LRU eviction (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import scratchlm.inference.block_manager as bm_module
from scratchlm.inference.block_manager import NO_HASH, BlockManager, NoFreeBlocksError, max_blocks_held


def register_all(bm: BlockManager, table: list[int], tokens: list[int]) -> None:
    parent = NO_HASH
    for i in range(len(tokens) // bm.block_size):
        parent = bm.register(table[i], parent, tokens[i * bm.block_size:(i + 1) * bm.block_size])


def test_prefix_hit_takes_cached_blocks_and_counts() -> None:
    bm = BlockManager(8, 4)
    tokens = list(range(10))
    table = bm.allocate(3)
    register_all(bm, table, tokens)
    blocks, _ = bm.match_prefix(tokens + [99], max_blocks=10)
    assert blocks == table[:2]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (2, 2)
    bm.take(blocks)
    assert [bm.ref_count[b] for b in table] == [2, 2, 1]
    # a different first block misses everything after it (chained hashes)
    assert bm.match_prefix([7] + tokens[1:], 10)[0] == []


def test_freed_cached_blocks_stay_hittable_until_evicted_lru() -> None:
    bm = BlockManager(4, 2)
    a = bm.allocate(2)
    register_all(bm, a, [1, 2, 3, 4])
    bm.release(a)  # tail block freed first: evicted first
    assert bm.num_free_blocks == 4
    assert bm.match_prefix([1, 2, 3, 4], 2)[0] == a
    fresh = bm.allocate(2)  # the two never-used blocks go first (they were freed earliest: at start)
    assert set(fresh).isdisjoint(a)
    assert bm.match_prefix([1, 2, 3, 4], 2)[0] == a
    (third,) = bm.allocate(1)  # now the LRU cached block: a[1] (released before a[0])
    assert third == a[1]
    assert bm.match_prefix([1, 2, 3, 4], 2)[0] == [a[0]]


def test_hash_collision_is_caught_by_token_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bm_module, "block_hash", lambda parent, tokens: 42)
    bm = BlockManager(4, 2)
    a = bm.allocate(1)
    bm.register(a[0], NO_HASH, [1, 2])
    assert bm.match_prefix([1, 2], 1)[0] == a
    assert bm.match_prefix([3, 4], 1)[0] == []  # same hash, other tokens: a miss, not wrong K/V


def test_errors_are_clear() -> None:
    bm = BlockManager(2, 2)
    with pytest.raises(NoFreeBlocksError, match="need 3 KV blocks, only 2 free"):
        bm.allocate(3)
    b = bm.allocate(1)
    bm.release(b)
    with pytest.raises(RuntimeError, match="released more often"):
        bm.release(b)
    with pytest.raises(ValueError, match="only full blocks"):
        bm.register(0, NO_HASH, [1])
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        BlockManager(0, 4)


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "hit", "release", "register"]), st.integers(0, 7),
              st.lists(st.integers(0, 3), min_size=1, max_size=12)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(1, 4), st.booleans())
def test_random_operations_keep_the_pool_consistent(ops, block_size: int, caching: bool) -> None:
    """Owners hold tables; every op sequence leaves ref counts == owners and free == refcount 0."""
    bm = BlockManager(12, block_size, caching)
    owners: dict[int, list[int]] = {}
    contents: dict[int, list[int]] = {}
    next_id = 0
    for op, k, tokens in ops:
        keys = sorted(owners)
        if op == "alloc":
            n = bm.blocks_needed(len(tokens))
            if n <= bm.num_free_blocks:
                owners[next_id] = bm.allocate(n)
                contents[next_id] = tokens
                next_id += 1
            else:
                with pytest.raises(NoFreeBlocksError):
                    bm.allocate(n)
        elif op == "hit":
            blocks, _ = bm.match_prefix(tokens, max_blocks=len(tokens) // block_size)
            if blocks and bm.num_free_after_take(blocks) >= 0:
                bm.take(blocks)
                owners[next_id] = list(blocks)
                contents[next_id] = tokens[:len(blocks) * block_size]
                next_id += 1
        elif op == "release" and keys:
            key = keys[k % len(keys)]
            bm.release(owners.pop(key))
            contents.pop(key)
        elif op == "register" and keys:
            key = keys[k % len(keys)]
            register_all(bm, owners[key], contents[key])
        bm.check_invariants(owners)
        # every cached block that matches a prefix holds exactly those tokens
        for key, table in owners.items():
            blocks, _ = bm.match_prefix(contents[key], len(table))
            for i, b in enumerate(blocks):
                assert bm.key_of[b][1] == tuple(contents[key][i * block_size:(i + 1) * block_size])


def test_reset_prefix_cache_forgets_free_blocks_only() -> None:
    bm = BlockManager(8, 2)
    held = bm.allocate(2)
    register_all(bm, held, [1, 2, 3, 4])
    done = bm.allocate(2)
    register_all(bm, done, [5, 6, 7, 8])
    bm.release(done)
    assert bm.reset_prefix_cache() == 2
    assert bm.match_prefix([5, 6, 7, 8], 2)[0] == []  # freed blocks: forgotten
    assert bm.match_prefix([1, 2, 3, 4], 2)[0] == held  # blocks in use keep their hashes
    bm.check_invariants({0: held})
    assert bm.reset_prefix_cache() == 0


# --- sliding windows -------------------------------------------------------------------------------------------


def test_windowed_pool_reserves_a_null_block_and_drops_blocks_before_the_window() -> None:
    bm = BlockManager(8, 4, window=8)
    assert bm.null_block == 0 and bm.num_free_blocks == 7 and bm.num_usable_blocks == 7
    table = bm.allocate(5)  # 20 tokens
    assert 0 not in table
    register_all(bm, table, list(range(20)))
    # next query at 17 reads keys 10..17: blocks 0 (0-3) and 1 (4-7) lie before it, block 2 (8-11) does not
    assert bm.window_start_block(17) == 2
    held = list(table)
    assert bm.drop_out_of_window(held, 17) == 2
    assert held == [0, 0, *table[2:]]
    assert [bm.ref_count[b] for b in table] == [0, 0, 1, 1, 1] and bm.num_free_blocks == 4
    bm.check_invariants({1: held})
    assert bm.drop_out_of_window(held, 17, done=2) == 2  # idempotent
    # dropped blocks keep their hash while free: their K/V are intact, a later prompt may hit them
    blocks, hashes = bm.match_prefix(list(range(20)) + [99], max_blocks=5)
    assert blocks == [0, 0, 0, *table[3:]] and len(hashes) == 5  # the window of position 20 starts in block 3
    blocks, hashes = bm.match_prefix(list(range(12)) + [99], max_blocks=3)  # window of 12: keys 5..12
    assert blocks == [0, table[1], table[2]] and len(hashes) == 3  # table[1] was dropped: a hit on a free block
    assert bm.num_free_after_take(blocks) == bm.num_free_blocks - 1
    bm.release(held)
    assert bm.num_free_blocks == 7 and bm.ref_count[0] == 1
    with pytest.raises(RuntimeError, match="null block"):
        bm.register(0, NO_HASH, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="num_blocks >= 2"):
        BlockManager(1, 4, window=8)


def test_windowed_match_needs_only_the_blocks_inside_the_window() -> None:
    """A sequence that slid past its first blocks freed them first, so they are evicted first: a later prompt with
    the same tokens still hits the whole prefix (only the window's blocks are needed and taken); a block missing
    inside the window ends the hit."""
    tokens = list(range(24))  # 6 blocks of 4
    bm = BlockManager(8, 4, window=6)
    table = bm.allocate(6)
    register_all(bm, table, tokens)
    held = list(table)
    bm.drop_out_of_window(held, 24)  # keys 19..24 are in blocks 4, 5: blocks 0-3 freed (head first)
    assert held[:4] == [0] * 4 and bm.num_dropped == 4
    bm.release(held)  # the sequence finishes: free list = [unused, t0, t1, t2, t3, t5, t4]
    bm.allocate(3)  # evicts the unused block, t0 and t1
    plain_chain_broken = bm.hash_of[table[0]] is None and bm.hash_of[table[1]] is None
    assert plain_chain_broken
    blocks, hashes = bm.match_prefix(tokens + [1], 6)
    assert blocks == [0, 0, 0, 0, table[4], table[5]] and len(hashes) == 6
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (6, 6)
    assert bm.num_free_after_take(blocks) == bm.num_free_blocks - 2
    # a block before the window may be shorter than the window's: position 20's window (15..20) needs blocks 3, 4
    blocks, hashes = bm.match_prefix(tokens[:20] + [1], 5)
    assert blocks == [0, 0, 0, table[3], table[4]] and len(hashes) == 5
    bm.allocate(3)  # evicts t2, t3, t5
    assert bm.match_prefix(tokens + [1], 6) == ([], [])  # L = 6 misses block 5, L = 5 block 3, ... no prefix fits
    plain = BlockManager(8, 4)
    t = plain.allocate(6)
    register_all(plain, t, tokens)
    plain.release(t[:2])
    plain.allocate(plain.num_free_blocks)  # evicts t0, t1
    assert plain.match_prefix(tokens + [1], 6) == ([], [])  # without a window the chain needs every block


def test_max_blocks_held_is_the_worst_alignment() -> None:
    """The bound equals the most blocks spanned by window - 1 keys and a chunk, over every start position."""
    for bs in (1, 2, 3, 4, 16):
        for window in (1, 2, 5, 8, 17):
            for chunk in (1, 3, 16):
                worst = 0
                for start in range(0, 4 * (window + chunk + bs)):
                    first = max(0, start - window + 1) // bs
                    last = (start + chunk - 1) // bs
                    worst = max(worst, last - first + 1)
                assert max_blocks_held(10**6, chunk, bs, window) == worst, (bs, window, chunk)
    assert max_blocks_held(10, 16, 4, None) == 3
    assert max_blocks_held(10, 16, 4, 8) == 3  # never more than the whole sequence


window_ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "hit", "release", "register", "grow"]), st.integers(0, 7),
              st.lists(st.integers(0, 3), min_size=1, max_size=16)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(window_ops, st.integers(1, 4), st.integers(1, 9), st.booleans())
def test_random_windowed_operations_keep_the_pool_consistent(ops, block_size: int, window: int,
                                                             caching: bool) -> None:
    """Sequences grow token by token, dropping blocks before their window, and hit each other's prefixes: ref
    counts always equal the owners, null entries are a prefix, and every taken block holds the tokens it claims."""
    bm = BlockManager(14, block_size, caching, window=window)
    seqs: dict[int, tuple[list[int], list[int], list[int]]] = {}  # id -> (table, tokens, hashes)
    next_id = 0
    for op, k, tokens in ops:
        keys = sorted(seqs)
        if op == "alloc":
            n = bm.blocks_needed(len(tokens))
            if n <= bm.num_free_blocks:
                seqs[next_id] = (bm.allocate(n), list(tokens), [])
                next_id += 1
        elif op == "hit":
            blocks, hashes = bm.match_prefix(tokens, max_blocks=len(tokens) // block_size)
            if blocks and bm.num_free_after_take(blocks) >= 0:
                bm.take(blocks)
                seqs[next_id] = (list(blocks), tokens[: len(blocks) * block_size], list(hashes))
                next_id += 1
        elif op == "release" and keys:
            bm.release(seqs.pop(keys[k % len(keys)])[0])
        elif op == "register" and keys:
            table, toks, hashes = seqs[keys[k % len(keys)]]
            while len(hashes) < len(toks) // block_size:
                i = len(hashes)
                hashes.append(bm.register(table[i], hashes[-1] if hashes else NO_HASH,
                                          toks[i * block_size : (i + 1) * block_size]))
        elif op == "grow" and keys:  # one more token computed; everything before its window is dropped
            table, toks, hashes = seqs[keys[k % len(keys)]]
            if bm.blocks_needed(len(toks) + 1) > len(table):
                if not bm.num_free_blocks:
                    continue
                table.extend(bm.allocate(1))
            toks.append(tokens[0])
            while len(hashes) < len(toks) // block_size:  # register before dropping, as the scheduler does
                i = len(hashes)
                hashes.append(bm.register(table[i], hashes[-1] if hashes else NO_HASH,
                                          toks[i * block_size : (i + 1) * block_size]))
            bm.drop_out_of_window(table, len(toks))
        bm.check_invariants({key: table for key, (table, _, _) in seqs.items()})
        for table, toks, _ in seqs.values():
            for i, b in enumerate(table):
                if b != bm.null_block and bm.key_of[b] is not None and (i + 1) * block_size <= len(toks):
                    assert bm.key_of[b][1] == tuple(toks[i * block_size : (i + 1) * block_size])
