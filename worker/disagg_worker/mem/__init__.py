"""Paged KV memory: page allocator, per-layer KV pool and the radix prefix cache."""
from .allocator import OutOfPages, PageAllocator
from .radix import CacheStats, MatchResult, Node, RadixCache

__all__ = ["CacheStats", "MatchResult", "Node", "OutOfPages", "PageAllocator", "RadixCache"]
