"""Automatic prefix caching: full pages of token prefixes shared across requests by hash.

Page `i` of a token sequence is keyed by a digest chained over every token before it:
`h_i = blake2b(h_{i-1} || tokens[i*P:(i+1)*P])`, so equal keys mean equal prefixes (up to a
128-bit collision). The cache pins each page it holds (PagePool.pin): the page outlives the
request that wrote it, counts as shared, and is never written again. Pages no sequence uses
are evicted least-recently-used first when the pool needs room.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

_ROOT = b"kvcompile-prefix-v1"


def page_hashes(tokens: list[int], page_size: int, known: list[bytes]) -> list[bytes]:
    """Extend `known` (digests of the first pages) to every full page of `tokens`."""
    out = list(known)
    prev = out[-1] if out else _ROOT
    for i in range(len(out), len(tokens) // page_size):
        chunk = tokens[i * page_size:(i + 1) * page_size]
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(array("q", chunk).tobytes())
        prev = h.digest()
        out.append(prev)
    return out


class PrefixCache:
    def __init__(self, pool):
        self.pool = pool
        self._pages: OrderedDict[bytes, int] = OrderedDict()   # digest -> page, LRU first
        self._by_page: dict[int, bytes] = {}
        self.queries = 0           # prompt tokens looked up
        self.hits = 0              # of which served from the cache
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._pages

    def pages(self) -> set[int]:
        return set(self._by_page)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def match(self, hashes: list[bytes], max_pages: int) -> list[int]:
        """The cached pages of the longest prefix of `hashes` (at most `max_pages`); marks them
        recently used."""
        out = []
        for h in hashes[:max_pages]:
            page = self._pages.get(h)
            if page is None:
                break
            self._pages.move_to_end(h)
            out.append(page)
        return out

    def record(self, query_tokens: int, hit_tokens: int) -> None:
        """Count a prompt's lookup: `hit_tokens` of its `query_tokens` were cached."""
        self.queries += query_tokens
        self.hits += hit_tokens

    def insert(self, hashes: list[bytes], pages: list[int]) -> None:
        """Offer full pages (hashes[i] keys pages[i]); keys already cached keep their page."""
        for h, p in zip(hashes, pages):
            if h in self._pages:
                self._pages.move_to_end(h)
                continue
            if p in self._by_page:   # the page is cached under another key: cannot be
                continue             # (one page holds one prefix), but never pin it twice
            self.pool.pin([p])
            self._pages[h] = p
            self._by_page[p] = h

    def remove_pages(self, pages) -> None:
        """Forget these pages (their content is not to be trusted, e.g. NaN)."""
        for p in pages:
            h = self._by_page.pop(p, None)
            if h is not None:
                del self._pages[h]
                self.pool.unpin([p])

    def evictable(self) -> int:
        return sum(1 for p in self._by_page if self.pool.refcount(p) == 1)

    def evict(self, n: int) -> int:
        """Free up to `n` pages that only the cache holds, least recently used first."""
        freed = []
        for h, p in self._pages.items():
            if len(freed) >= n:
                break
            if self.pool.refcount(p) == 1:
                freed.append((h, p))
        for h, p in freed:
            del self._pages[h]
            del self._by_page[p]
        if freed:
            self.pool.unpin([p for _, p in freed])
        self.evictions += len(freed)
        return len(freed)

    def clear(self) -> None:
        if self._by_page:
            self.pool.unpin(list(self._by_page))
        self._pages.clear()
        self._by_page.clear()
