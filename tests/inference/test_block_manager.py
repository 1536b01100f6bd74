"""BlockManager: ref counts, prefix-cache hits, collision checks and LRU eviction (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import scratchlm.inference.block_manager as bm_module
from scratchlm.inference.block_manager import NO_HASH, BlockManager, NoFreeBlocksError


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
