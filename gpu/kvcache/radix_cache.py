"""Radix prefix cache over the paged KV pool (SGLang's RadixCache, page granular).

A node holds whole pages: `key` is a run of token ids whose length is a multiple of
page_size and `pages` the KV pages holding them. A request that matched a prefix locks
the path to its node (lock_ref), so pages used by running requests are never evicted;
unlocked leaves are evicted least-recently-used first when the pool runs short.

Eviction candidates live in a heap of (last_access, node) entries that is never searched:
an entry is pushed whenever a node may have become an unlocked leaf or was touched, and
entries that no longer describe their node (touched since, locked, grown a child, evicted)
are skipped when popped. So an eviction costs O(log n) per leaf, not a walk of the tree:
a server whose pool is full of cached prefixes evicts on every admission.

Requests of a LoRA adapter compute other KV for the same tokens: each adapter id (the `salt`)
has its own root, so a lookup or insertion never crosses from one adapter's (or the base
model's, salt 0) pages to another's, while eviction and its accounting stay one pool-wide LRU.

With `disabled` the tree stays empty: nothing matches and released pages go straight
back to the pool, so the scheduler has one code path for both modes.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int32)


class TreeNode:
    __slots__ = ("children", "parent", "key", "pages", "lock_ref", "last_access")

    def __init__(self, parent: TreeNode | None, key: np.ndarray, pages: np.ndarray) -> None:
        self.children: dict[bytes, TreeNode] = {}
        self.parent = parent
        self.key = key  # int32 [n * page_size] token ids
        self.pages = pages  # int32 [n]
        self.lock_ref = 0
        self.last_access = 0


class RadixCache:
    def __init__(self, pool, disabled: bool = False) -> None:
        self.pool = pool
        self.page_size: int = pool.page_size
        self.disabled = disabled
        self._clock = itertools.count(1)
        self.root = TreeNode(None, _EMPTY, _EMPTY)
        self.root.lock_ref = 1  # the root is never evicted
        self._roots: dict[int, TreeNode] = {0: self.root}  # salt -> its root (parentless, never evicted)
        self.evictable_pages = 0  # pages in nodes nobody locks
        self.protected_pages = 0  # pages in nodes some running request locks
        self._heap: list[tuple[int, int, TreeNode]] = []  # (last_access, id, node), lazily pruned
        self._live_bound = 0  # live entries at the last rebuild of the heap

    @property
    def cached_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    # ---- lookup -------------------------------------------------------------
    def root_of(self, salt: int) -> TreeNode:
        """The root of `salt`'s tree (a LoRA adapter's id; 0: the base model's, `root`)."""
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = TreeNode(None, _EMPTY, _EMPTY)
            root.lock_ref = 1
        return root

    def forget_salt(self, salt: int) -> None:
        """`salt` (an unloaded LoRA adapter's id) gets a fresh, empty root if it is used again;
        its old pages are never matched again and leave by eviction, as any unlocked page."""
        if salt:
            self._roots.pop(salt, None)

    def match_prefix(self, ids: np.ndarray, salt: int = 0) -> tuple[np.ndarray, TreeNode]:
        """Pages of the longest cached page-aligned prefix of `ids` among `salt`'s, and the node
        where it ends (split so that the node ends exactly there: locking it locks just that prefix)."""
        root = self.root if salt == 0 else self.root_of(salt)
        if self.disabled:
            return _EMPTY, root
        ids = np.asarray(ids, dtype=np.int32)  # keys are compared as int32 bytes
        ps, now = self.page_size, next(self._clock)
        node, pos, found = root, 0, []
        end = len(ids) // ps * ps
        while pos < end:
            child = node.children.get(ids[pos : pos + ps].tobytes())
            if child is None:
                break
            self._touch(child, now)
            m = _common_pages(child.key, ids[pos:end], ps) * ps
            if m < len(child.key):
                child = self._split(child, m)
            found.append(child.pages)
            pos += m
            node = child  # on a split, the next lookup is the first differing page: no child
        pages = _EMPTY if not found else found[0] if len(found) == 1 else np.concatenate(found)
        return pages, node

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut `child` after its first m tokens; returns the new upper node."""
        ps = self.page_size
        parent = _parent(child)
        upper = TreeNode(parent, child.key[:m], child.pages[: m // ps])
        upper.lock_ref = child.lock_ref  # every lock on child's path also covers upper
        upper.last_access = child.last_access
        upper.children[child.key[m : m + ps].tobytes()] = child
        parent.children[child.key[:ps].tobytes()] = upper
        child.parent = upper
        child.key = child.key[m:]
        child.pages = child.pages[m // ps :]
        return upper

    # ---- insertion ------------------------------------------------------------
    def insert(
        self, ids: np.ndarray, pages: np.ndarray, node: TreeNode | None = None, pos: int = 0
    ) -> tuple[int, TreeNode, list[np.ndarray]]:
        """Adds ids (a multiple of page_size tokens) held in `pages`, below `node` (the root
        by default) whose path holds ids[:pos] already, so a request's release starts where
        its matched prefix ends instead of comparing that prefix again from the root.
        Returns how many leading tokens were already cached, the node whose path ends at
        len(ids), and the tree's pages for ids[pos:] in path order. The caller owns its pages
        for the cached range and must free the ones that are not the tree's own (duplicates
        computed by a concurrent request)."""
        ids = np.asarray(ids, dtype=np.int32)
        ps, now = self.page_size, next(self._clock)
        node = self.root if node is None else node
        self._touch_ancestors(node, now)
        end, found = len(pages) * ps, []
        while pos < end:
            child = node.children.get(ids[pos : pos + ps].tobytes())
            if child is None:
                leaf = TreeNode(node, ids[pos:end].copy(), pages[pos // ps :].copy())
                node.children[leaf.key[:ps].tobytes()] = leaf
                self.evictable_pages += len(leaf.pages)
                self._touch(leaf, now)
                found.append(leaf.pages)
                return pos, leaf, found
            self._touch(child, now)
            m = _common_pages(child.key, ids[pos:end], ps) * ps
            if m < len(child.key):
                child = self._split(child, m)
            found.append(child.pages)
            pos += m
            node = child
        return pos, node, found

    # ---- locking ------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        while node.parent is not None:  # up to its root (each salt's root has no parent)
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
                self.protected_pages += len(node.pages)
            node.lock_ref += 1
            node = _parent(node)

    def unlock(self, node: TreeNode) -> None:
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
                self.protected_pages -= len(node.pages)
                self._push_candidate(node)
            node = _parent(node)

    # ---- a request's pages ------------------------------------------------------
    def release(self, ids: np.ndarray, pages: np.ndarray, prefix_pages: int, node: TreeNode) -> None:
        """A request is done with its KV (finished, aborted or retracted): its full pages go
        into the tree, duplicates and the partly filled last page back to the pool, and its
        lock on `node` (the end of the prefix it matched, `prefix_pages` pages) is dropped.
        `ids` are the tokens whose KV is in `pages`."""
        full = min(len(ids) // self.page_size, len(pages))
        if self.disabled:
            self.pool.free(pages)
            return
        self._insert_own(ids, pages, full, prefix_pages, node)
        if len(pages) > full:
            self.pool.free(pages[full:])
        self.unlock(node)

    def cache_prefix(
        self, ids: np.ndarray, pages: np.ndarray, prefix_pages: int, node: TreeNode
    ) -> tuple[np.ndarray, TreeNode]:
        """A running request's full pages enter the tree early (after a prefill chunk), so
        requests arriving meanwhile share them. Returns the tree's pages for that prefix
        (they replace the request's own, whose duplicates are freed) and the new node to
        hold locked in place of `node`."""
        full = min(len(ids) // self.page_size, len(pages))
        if self.disabled or full <= prefix_pages:
            return pages[:prefix_pages], node
        new_node, found = self._insert_own(ids, pages, full, prefix_pages, node)
        self.lock(new_node)
        self.unlock(node)
        return np.concatenate([pages[:prefix_pages], *found]), new_node

    def _insert_own(
        self, ids: np.ndarray, pages: np.ndarray, full: int, prefix_pages: int, node: TreeNode
    ) -> tuple[TreeNode, list[np.ndarray]]:
        """Inserts a request's first `full` pages below `node`, the end of its prefix (the
        tree's own pages[:prefix_pages]), and frees its duplicates of pages the tree had."""
        ps = self.page_size
        already, end, found = self.insert(ids[: full * ps], pages[:full], node, prefix_pages * ps)
        if already // ps > prefix_pages:
            self.pool.free(pages[prefix_pages : already // ps])
        return end, found

    # ---- eviction -------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Frees at least num_pages pages of unlocked leaves, least recently used first
        (fewer if not that many are evictable); returns how many were freed."""
        freed = 0
        while freed < num_pages and self.evictable_pages and self._heap:
            stamp, _, leaf = heapq.heappop(self._heap)
            if stamp != leaf.last_access or not _evictable(leaf):
                continue  # stale: the node changed after this entry was pushed
            self.pool.free(leaf.pages)
            freed += len(leaf.pages)
            self.evictable_pages -= len(leaf.pages)
            parent = _parent(leaf)
            del parent.children[leaf.key[: self.page_size].tobytes()]
            leaf.parent = None  # detached: any other entry of it is stale
            self._push_candidate(parent)
        return freed

    def flush(self) -> int:
        """Drops every unlocked cached page (`/flush_cache`); returns how many were freed."""
        return self.evict(self.evictable_pages)

    def _touch_ancestors(self, node: TreeNode, now: int) -> None:
        """`node` and the nodes above it, as a walk from the root to it would."""
        while node.parent is not None:
            self._touch(node, now)
            node = _parent(node)

    def _touch(self, node: TreeNode, now: int) -> None:
        node.last_access = now
        self._push_candidate(node)

    def _push_candidate(self, node: TreeNode) -> None:
        if not _evictable(node):
            return
        heapq.heappush(self._heap, (node.last_access, id(node), node))
        if len(self._heap) > 4 * self._live_bound + 64:  # mostly stale entries: rebuild
            self._heap = [e for e in self._heap if e[0] == e[2].last_access and _evictable(e[2])]
            heapq.heapify(self._heap)
            self._live_bound = len(self._heap)


def _evictable(node: TreeNode) -> bool:
    """An unlocked leaf still in the tree (the root has lock_ref 1)."""
    return node.lock_ref == 0 and not node.children and node.parent is not None


def _parent(node: TreeNode) -> TreeNode:
    """The node above `node`, a node of the tree below its root."""
    if node.parent is None:
        raise ValueError("the root and detached nodes have no parent")
    return node.parent


def _common_pages(key: np.ndarray, ids: np.ndarray, page_size: int) -> int:
    """Whole pages at the start of `key` that equal the start of `ids` (int32 both), whose
    first pages are equal (the node was found by them): no compare at all for a one-page node.
    Compared as bytes, a page at a time past the first difference: a third of a numpy compare
    and flatnonzero's time at a prompt's few pages (docs/perf-notes.md)."""
    n = min(len(key), len(ids)) // page_size * page_size
    if n == page_size:
        return 1
    a, b = key[:n].tobytes(), ids[:n].tobytes()
    if a == b:
        return n // page_size
    step = 4 * page_size
    at = step
    while at < len(a) and a[at : at + step] == b[at : at + step]:
        at += step
    return at // step
