"""The radix prefix cache over a real PagePool: page-granular matching, node splits,
duplicate pages, lock_ref protection, LRU eviction, and the disabled path."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu.kvcache.page_pool import PagePool
from gpu.kvcache.radix_cache import RadixCache, _common_pages

PS = 4


def ids(*tokens) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


def finish(cache: RadixCache, tokens: np.ndarray, prefix_pages=0, node=None) -> np.ndarray:
    """What the scheduler does for a request that computed `tokens` on top of a matched
    prefix: allocate the rest, then release everything into the cache."""
    pool = cache.pool
    matched, node = cache.match_prefix(tokens[:-1]) if node is None else (None, node)
    prefix_pages = len(matched) if matched is not None else prefix_pages
    cache.lock(node)
    own = pool.alloc(pool.pages_for(len(tokens)) - prefix_pages)
    pages = np.concatenate([matched, own])
    cache.release(tokens, pages, prefix_pages, node)
    return pages


def test_page_pool_alloc_free_and_double_free():
    pool = PagePool(8, PS)
    a = pool.alloc(3)
    assert a.dtype == np.int32 and a.tolist() == [0, 1, 2] and pool.num_free == 5
    assert pool.alloc(6) is None and pool.alloc(0).tolist() == []
    pool.free(a[1:])
    assert pool.num_free == 7 and pool.alloc(2).tolist() == [1, 2]  # freed pages come back first
    for bad in ([3], [0, 0], [8], [-1]):  # free already / twice in one call / outside the pool
        with pytest.raises(ValueError):
            pool.free(np.array(bad, np.int32))
    assert pool.num_free == 5, "a refused free changes nothing"
    pool.free([0, 1, 2])
    assert pool.num_free == 8 and sorted(pool.alloc(8).tolist()) == list(range(8))


def test_match_is_page_aligned_and_splits_nodes():
    pool = PagePool(32, PS)
    cache = RadixCache(pool)
    a = np.arange(10, dtype=np.int32)  # 2 full pages + 2 tokens
    pages_a = finish(cache, a)
    assert cache.cached_pages == 2 and pool.num_free == 30  # the partial page went back
    # same first page, different second page: matches one page, splits the node
    b = np.concatenate([a[:4], ids(99, 98, 97, 96, 95)])
    got, node = cache.match_prefix(b)
    assert got.tolist() == pages_a[:1].tolist() and len(node.key) == PS
    assert len(cache.root.children) == 1 and len(node.children) == 1
    # full match, limited to whole pages of the query
    got, _ = cache.match_prefix(a[:7])
    assert got.tolist() == pages_a[:1].tolist()
    got, _ = cache.match_prefix(a)
    assert got.tolist() == pages_a[:2].tolist()
    assert cache.match_prefix(ids(5, 5, 5, 5))[0].size == 0


def test_duplicate_pages_from_concurrent_requests_are_freed():
    pool = PagePool(32, PS)
    cache = RadixCache(pool)
    tokens = np.arange(12, dtype=np.int32)
    # two requests computed the same 3 pages without sharing (both started on an empty tree)
    n1, n2 = cache.match_prefix(tokens)[1], cache.match_prefix(tokens)[1]
    p1, p2 = pool.alloc(3), pool.alloc(3)
    cache.lock(n1), cache.lock(n2)
    cache.release(tokens, p1, 0, n1)
    cache.release(tokens, p2, 0, n2)
    assert cache.cached_pages == 3 and pool.num_free == 32 - 3
    assert cache.match_prefix(tokens)[0].tolist() == p1.tolist()


def test_cache_prefix_hands_back_the_tree_pages_and_moves_the_lock():
    pool = PagePool(32, PS)
    cache = RadixCache(pool)
    tokens = np.arange(11, dtype=np.int32)
    first = finish(cache, tokens)
    # a second request that did not see the cached prefix (arrived before it was inserted)
    node = cache.root
    cache.lock(node)
    own = pool.alloc(3)
    tree_pages, new_node = cache.cache_prefix(tokens, own, 0, node)
    assert tree_pages.tolist() == first[:2].tolist()
    assert new_node.lock_ref == 1 and cache.protected_pages == 2 and cache.evictable_pages == 0
    assert pool.num_free == 32 - 2 - 1  # own[:2] were duplicates; own[2] (partial) still held
    cache.release(tokens, np.concatenate([tree_pages, own[2:]]), 2, new_node)
    assert cache.protected_pages == 0 and pool.num_free == 30


def test_locked_pages_are_never_evicted_and_lru_goes_first():
    pool = PagePool(16, PS)
    cache = RadixCache(pool)
    old, new, held = (np.arange(8, dtype=np.int32) + base for base in (0, 100, 200))
    finish(cache, np.append(old, 1))
    finish(cache, np.append(new, 1))
    held_pages = finish(cache, np.append(held, 1))
    cache.match_prefix(new)  # touch: `new` is now more recent than `old`
    _, held_node = cache.match_prefix(held)
    cache.lock(held_node)
    assert cache.evictable_pages == 4 and cache.protected_pages == 2
    assert cache.evict(1) == 2  # a whole leaf: `old`
    assert cache.match_prefix(old)[0].size == 0 and cache.match_prefix(new)[0].size == 2
    assert cache.evict(100) == 2  # only `new` is left to evict
    assert cache.match_prefix(held)[0].tolist() == held_pages[:2].tolist()
    assert pool.num_free == 16 - 2
    cache.unlock(held_node)
    assert cache.flush() == 2 and pool.num_free == 16 and cache.cached_pages == 0


def test_eviction_climbs_from_leaves_to_parents():
    pool = PagePool(16, PS)
    cache = RadixCache(pool)
    trunk = np.arange(8, dtype=np.int32)
    finish(cache, np.concatenate([trunk, ids(1, 2, 3, 4, 0)]))
    finish(cache, np.concatenate([trunk, ids(5, 6, 7, 8, 0)]))
    assert cache.cached_pages == 4  # trunk (2) + two branches (1 each)
    assert cache.evict(4) == 4 and pool.num_free == 16 and not cache.root.children


def test_disabled_cache_matches_nothing_and_frees_everything():
    pool = PagePool(8, PS)
    cache = RadixCache(pool, disabled=True)
    tokens = np.arange(9, dtype=np.int32)
    pages, node = cache.match_prefix(tokens)
    assert pages.size == 0 and node is cache.root
    finish(cache, tokens)
    assert pool.num_free == 8 and cache.cached_pages == 0 and cache.match_prefix(tokens)[0].size == 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=14), st.booleans()), min_size=1, max_size=30)
)
def test_random_requests_keep_pages_accounted(ops):
    """Random prompts over a tiny alphabet (so prefixes collide) finish or stay running;
    pages are either free, in the tree, or held by a running request, never lost or doubled,
    and every cached prefix maps to the pages that hold exactly those tokens."""
    pool = PagePool(64, PS)
    cache = RadixCache(pool)
    owner: dict[int, tuple] = {}  # page -> tokens it holds
    running = []
    for tokens, keep_running in ops:
        tokens = np.array(tokens, dtype=np.int32)
        matched, node = cache.match_prefix(tokens[:-1])
        cache.lock(node)
        need = pool.pages_for(len(tokens)) - len(matched)
        if pool.num_free < need:
            cache.evict(need - pool.num_free)
        if pool.num_free < need:
            cache.unlock(node)
            continue
        pages = np.concatenate([matched, pool.alloc(need)])
        for i, p in enumerate(pages):
            prefix = tuple(tokens[: (i + 1) * PS])
            if i < len(matched):
                assert owner[int(p)] == prefix
            else:
                owner[int(p)] = prefix
        if keep_running:
            running.append((tokens, pages, len(matched), node))
        else:
            cache.release(tokens, pages, len(matched), node)
        held = sum(len(p) - pm for _, p, pm, _ in running)
        assert pool.num_free + cache.cached_pages + held == 64
        got, _ = cache.match_prefix(tokens)
        for i, p in enumerate(got):
            assert owner[int(p)] == tuple(tokens[: (i + 1) * PS])
    for tokens, pages, prefix, node in running:
        cache.release(tokens, pages, prefix, node)
    assert cache.protected_pages == 0
    cache.flush()
    assert pool.num_free == 64


def _reference_evict(cache: RadixCache, num_pages: int) -> int:
    """Eviction by a walk of the whole tree: the unlocked leaf with the oldest last_access
    goes first, its parent becomes a candidate once childless."""
    freed = 0
    while freed < num_pages:
        leaves, stack = [], [cache.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children and node is not cache.root and node.lock_ref == 0:
                leaves.append(node)
        if not leaves:
            break
        leaf = min(leaves, key=lambda n: n.last_access)
        cache.pool.free(leaf.pages)
        freed += len(leaf.pages)
        cache.evictable_pages -= len(leaf.pages)
        del leaf.parent.children[leaf.key[: cache.page_size].tobytes()]
    return freed


def _tree_state(cache: RadixCache) -> list:
    out, stack = [], [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        path = path + tuple(node.key.tolist())
        out.append((path, tuple(node.pages.tolist()), node.lock_ref))
        stack.extend((c, path) for c in node.children.values())
    return sorted(out)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 2), min_size=1, max_size=14),
            st.sampled_from(["finish", "hold", "touch", "unhold", "evict"]),
            st.integers(1, 6),
        ),
        min_size=1,
        max_size=40,
    )
)
def test_heap_eviction_matches_a_full_tree_walk(ops):
    """The heap of candidates evicts exactly what scanning every leaf for the least recently
    used unlocked one would, through touches, locks, splits and parents becoming leaves."""
    import copy

    pool = PagePool(40, PS)
    cache = RadixCache(pool)
    held = []
    for tokens, op, n in ops:
        tokens = np.array(tokens, dtype=np.int32)
        if op in ("finish", "hold"):
            matched, node = cache.match_prefix(tokens[:-1])
            cache.lock(node)
            need = pool.pages_for(len(tokens)) - len(matched)
            if pool.num_free < need:
                cache.evict(need - pool.num_free)  # compared below, on explicit evictions
            if pool.num_free < need:
                cache.unlock(node)
                continue
            pages = np.concatenate([matched, pool.alloc(need)])
            if op == "hold":  # a running request: its full pages in the tree, locked
                tree_pages, node = cache.cache_prefix(tokens, pages, len(matched), node)
                held.append((node, pages[len(tree_pages) :]))
            else:
                cache.release(tokens, pages, len(matched), node)
        elif op == "touch":
            cache.match_prefix(tokens)
        elif op == "unhold" and held:
            node, own = held.pop(0)
            cache.unlock(node)
            pool.free(own)
        elif op == "evict":
            reference = copy.deepcopy(cache)
            assert cache.evict(n) == _reference_evict(reference, n)
            assert _tree_state(cache) == _tree_state(reference)
            assert pool.num_free == reference.pool.num_free
    for node, own in held:
        cache.unlock(node)
        pool.free(own)
    cache.flush()
    assert cache.cached_pages == 0 and pool.num_free == 40


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=PS, max_size=8 * PS),
    st.lists(st.integers(0, 3), min_size=0, max_size=8 * PS),
)
def test_common_pages_counts_the_whole_pages_both_start_with(first, rest):
    """_common_pages against a page-by-page reference: a node's key and a prompt whose first
    pages are equal, of any lengths (not whole pages), over an alphabet small enough that they
    often agree for several pages."""
    key = np.array(first + rest, dtype=np.int32)
    other = np.array(first[:PS] + rest[::-1] + first[PS:], dtype=np.int32)
    n = min(len(key), len(other)) // PS
    want = 1
    while want < n and (key[want * PS : (want + 1) * PS] == other[want * PS : (want + 1) * PS]).all():
        want += 1
    assert _common_pages(key, other, PS) == want
    assert _common_pages(key, key, PS) == len(key) // PS
