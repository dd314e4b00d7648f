"""Paged KV cache for one sequence: a page allocator, a page table, and the K/V storage.

Storage layout (the CUDA kernels read exactly this, so it must not change without them):

    k, v : [num_layers, num_pages, PAGE, n_kv_heads, head_dim]     PAGE = KV_PAGE_SIZE = 16

contiguous, row-major. Token position `p` of the sequence lives in physical page
`page_table[p // PAGE]` at slot `p % PAGE`; for one layer the element (p, h, d) is at
    ((layer * num_pages + page_table[p // PAGE]) * PAGE + p % PAGE) * n_kv_heads * head_dim
    + h * head_dim + d
K is stored *after* RoPE (the rotated keys), V as projected. Pages are handed out from a
free list, so after truncate/extend cycles the page table need not be sorted: kernels must
go through the page table, never assume page i holds positions 16i..16i+15.

Invariants: `length` positions are valid; exactly ceil(length / PAGE) pages are in the page
table (a partial last page is allowed; its tail slots hold stale data that attention must
mask by length); every other page is on the free list.
"""

from __future__ import annotations

import math

import torch

from .config import KV_PAGE_SIZE
from .errors import ContextFullError


class OutOfPagesError(ContextFullError):
    """The allocator has no free page left (the sequence would exceed the cache capacity)."""


class PageAllocator:
    """A free list of page ids 0..num_pages-1; lowest ids are handed out first."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages={num_pages} must be positive")
        self.num_pages = num_pages
        # a stack with the lowest id on top, so a fresh cache fills pages 0, 1, 2, ...
        self._free: list[int] = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise OutOfPagesError(
                f"out of KV cache pages: all {self.num_pages} pages "
                f"({self.num_pages * KV_PAGE_SIZE} tokens) are in use")
        return self._free.pop()

    def free(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} is outside 0..{self.num_pages - 1}")
        if page in self._free:  # O(pages), but pages are few and this catches real bugs
            raise ValueError(f"page {page} freed twice")
        self._free.append(page)


class KVCache:
    """K/V pages for a single sequence of up to `max_tokens` tokens."""

    def __init__(self, num_layers: int, n_kv_heads: int, head_dim: int, max_tokens: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens={max_tokens} must be positive")
        self.num_layers, self.n_kv_heads, self.head_dim = num_layers, n_kv_heads, head_dim
        self.num_pages = math.ceil(max_tokens / KV_PAGE_SIZE)
        shape = (num_layers, self.num_pages, KV_PAGE_SIZE, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.allocator = PageAllocator(self.num_pages)
        self.page_table: list[int] = []
        self.length = 0

    @property
    def capacity(self) -> int:
        """Tokens the storage can hold (max_tokens rounded up to whole pages)."""
        return self.num_pages * KV_PAGE_SIZE

    def page_table_tensor(self, device: str | torch.device | None = None) -> torch.Tensor:
        """The page table as int32 [num_used_pages] (what a kernel takes)."""
        return torch.tensor(self.page_table, dtype=torch.int32,
                            device=device if device is not None else self.k.device)

    def reserve(self, n_tokens: int) -> None:
        """Make sure pages for positions 0..n_tokens-1 are in the page table.

        All-or-nothing: when the allocator runs out, the pages taken here are given back.
        Does not change `length` (the caller sets it once K/V of every layer is written).
        """
        need = math.ceil(n_tokens / KV_PAGE_SIZE) - len(self.page_table)
        taken: list[int] = []
        try:
            for _ in range(need):
                taken.append(self.allocator.alloc())
        except OutOfPagesError:
            for p in reversed(taken):
                self.allocator.free(p)
            raise OutOfPagesError(
                f"{n_tokens} tokens need {math.ceil(n_tokens / KV_PAGE_SIZE)} KV pages, the "
                f"cache has {self.num_pages} ({self.capacity} tokens)") from None
        self.page_table.extend(taken)

    def truncate(self, n: int) -> None:
        """Keep positions 0..n-1; free every page that holds none of them."""
        if not 0 <= n <= self.length:
            raise ValueError(f"truncate({n}): the cache holds {self.length} tokens")
        self.rollback(n)

    def rollback(self, n: int) -> None:
        """Undo a failed append: back to `n` valid tokens, freeing pages reserved beyond."""
        keep = math.ceil(n / KV_PAGE_SIZE)
        while len(self.page_table) > keep:
            self.allocator.free(self.page_table.pop())
        self.length = n

    def _slots(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(physical page, slot) of positions start..start+n-1, as int64 tensors [n]."""
        pos = torch.arange(start, start + n)
        table = torch.tensor(self.page_table, dtype=torch.int64)
        return table[pos // KV_PAGE_SIZE].to(self.k.device), (pos % KV_PAGE_SIZE).to(self.k.device)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [n, n_kv_heads, head_dim] of positions start..start+n-1 of `layer`.

        The pages must have been reserved (reserve(start + n)).
        """
        n = k.shape[0]
        if start + n > len(self.page_table) * KV_PAGE_SIZE:
            raise ValueError(f"write of positions {start}..{start + n - 1}: only "
                             f"{len(self.page_table)} pages reserved")
        pages, slots = self._slots(start, n)
        self.k[layer, pages, slots] = k.to(self.k.dtype)
        self.v[layer, pages, slots] = v.to(self.v.dtype)

    def gather(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous copies of K, V of positions 0..n-1 of `layer`: [n, n_kv_heads, head_dim]."""
        used = math.ceil(n / KV_PAGE_SIZE)
        if used > len(self.page_table):
            raise ValueError(f"gather of {n} tokens: only {len(self.page_table)} pages in use")
        table = torch.tensor(self.page_table[:used], dtype=torch.int64, device=self.k.device)
        shape = (used * KV_PAGE_SIZE, self.n_kv_heads, self.head_dim)
        k = self.k[layer].index_select(0, table).reshape(shape)[:n]
        v = self.v[layer].index_select(0, table).reshape(shape)[:n]
        return k, v
