"""Paged KV memory: page allocator, radix prefix cache, and (in `mem.kv_pool`, which needs
torch) the per-layer KV pool. The allocator and the cache are pure Python."""

from .allocator import PageAllocator, pages_for
from .radix import CacheStats, MatchResult, Node, RadixCache

__all__ = ["CacheStats", "MatchResult", "Node", "PageAllocator", "RadixCache", "pages_for"]
