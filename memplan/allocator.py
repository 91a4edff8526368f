"""A simulation of PyTorch's CUDA caching allocator, to predict `torch.cuda.max_memory_reserved()`.

Mirrors `DeviceCachingAllocator` in c10/cuda/CUDACachingAllocator.cpp for ONE stream with the
default PYTORCH_CUDA_ALLOC_CONF: no expandable segments, max_split_size unlimited (so the "oversize"
rules of get_free_block/should_split and release_available_cached_blocks never fire),
roundup_power2_divisions off, no garbage_collection_threshold, no recordStream events.

Addresses are virtual: each cudaMalloc'd segment starts after the previous one. Real cudaMalloc
addresses differ, which only matters for ties between equal-size free blocks (best fit breaks them
by address, BlockComparatorSize).

"allocated" follows the allocator's `allocated_bytes` stat: the size of the Block handed out, which
is more than round_size(request) when a large-pool block is not split (remainder <= 1 MiB), e.g. a
31 MiB + 1 byte tensor counts 32 MiB.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

MiB = 1 << 20
kMinBlockSize = 512  # all sizes are rounded to at least 512 bytes
kSmallSize = 1 * MiB  # largest "small" allocation
kSmallBuffer = 2 * MiB  # "small" allocations are packed in 2 MiB segments
kLargeBuffer = 20 * MiB  # "large" allocations may be packed in 20 MiB segments
kMinLargeAlloc = 10 * MiB  # allocations between 1 and 10 MiB may use kLargeBuffer
kRoundLarge = 2 * MiB  # round up large segments to 2 MiB

BASELINE_KEY = "<baseline>"  # the key of the single block the int constructor allocates


def round_size(nbytes: int) -> int:
    """DeviceCachingAllocator::round_size (roundup_power2_divisions off): at least 512, a multiple of 512."""
    if nbytes < kMinBlockSize:
        return kMinBlockSize
    return kMinBlockSize * ((nbytes + kMinBlockSize - 1) // kMinBlockSize)


def get_allocation_size(size: int) -> int:
    """DeviceCachingAllocator::get_allocation_size: how much one cudaMalloc reserves for a request."""
    if size <= kSmallSize:
        return kSmallBuffer
    if size < kMinLargeAlloc:
        return kLargeBuffer
    return kRoundLarge * ((size + kRoundLarge - 1) // kRoundLarge)


class _Block:
    """Block: a contiguous piece of one segment, linked to its neighbours in that segment."""

    __slots__ = ("addr", "allocated", "next", "prev", "segment", "size", "small")

    def __init__(self, addr: int, size: int, small: bool, segment: int):
        self.addr, self.size, self.small, self.segment = addr, size, small, segment
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Pool:
    """BlockPool: the free blocks of one pool, ordered like BlockComparatorSize (size, then address)."""

    def __init__(self, small: bool):
        self.small = small
        self.order: list[tuple[int, int]] = []  # sorted (size, addr)
        self.blocks: dict[int, _Block] = {}  # addr -> free block

    def insert(self, block: _Block) -> None:
        bisect.insort(self.order, (block.size, block.addr))
        self.blocks[block.addr] = block

    def remove(self, block: _Block) -> None:
        i = bisect.bisect_left(self.order, (block.size, block.addr))
        assert self.order[i] == (block.size, block.addr)
        del self.order[i]
        del self.blocks[block.addr]

    def best_fit(self, size: int) -> _Block | None:
        """get_free_block: lower_bound of the search key (size, ptr=0) — the smallest block that fits,
        the lowest address among equals."""
        i = bisect.bisect_left(self.order, (size, -1))
        return self.blocks[self.order[i][1]] if i < len(self.order) else None


@dataclass(frozen=True)
class OutOfMemory:
    """A request no segment could serve within capacity_bytes, even after release_cached_blocks.
    Torch would raise torch.OutOfMemoryError here; the simulation records it and goes on over capacity."""

    key: Hashable
    size: int  # round_size(request)
    segment_bytes: int  # the cudaMalloc that failed
    reserved: int  # reserved after releasing the cache
    allocated: int


class CudaCachingAllocator:
    """The reserved-memory tracker of memplan.estimate.simulate(): alloc(key, nbytes), free(key), peak_reserved.

    `CudaCachingAllocator(n)` starts with n bytes live as a single block (key BASELINE_KEY);
    `CudaCachingAllocator.from_live(sizes)` starts with each baseline storage as its own block, which
    is how they were allocated for real (and lets `free` release one of them by its key).
    """

    def __init__(self, initial_allocated_bytes: int = 0, *, capacity_bytes: int | None = None):
        self.capacity_bytes = capacity_bytes
        self._pools = {True: _Pool(small=True), False: _Pool(small=False)}
        self._live: dict[Hashable, _Block] = {}
        self._empty: set[Hashable] = set()  # keys allocated with 0 bytes: no block (allocate() skips malloc)
        self._segments: dict[int, int] = {}  # start address -> size of each cudaMalloc'd segment
        self._next_addr = 0
        self.reserved = self.peak_reserved = 0
        self.allocated = self.peak_allocated = 0
        self.ooms: list[OutOfMemory] = []
        self.unknown_frees = 0  # frees of keys never allocated here (ignored)
        if initial_allocated_bytes:
            self.alloc(BASELINE_KEY, initial_allocated_bytes)

    @classmethod
    def from_live(
        cls, blocks: Mapping[Hashable, int] | Iterable[int], *, capacity_bytes: int | None = None
    ) -> CudaCachingAllocator:
        """Allocate the blocks live before the step one by one, in order (key -> bytes, or bare byte
        counts keyed ("baseline", i))."""
        allocator = cls(capacity_bytes=capacity_bytes)
        items = blocks.items() if isinstance(blocks, Mapping) else ((("baseline", i), n) for i, n in enumerate(blocks))
        for key, nbytes in items:
            allocator.alloc(key, nbytes)
        return allocator

    # ----------------------------------------------------------------------------------------------

    def alloc(self, key: Hashable, nbytes: int) -> None:
        """DeviceCachingAllocator::malloc."""
        if key in self._live or key in self._empty:
            raise ValueError(f"{key!r} is already allocated")
        if nbytes == 0:  # NativeCachingAllocator::allocate does not call malloc for 0 bytes
            self._empty.add(key)
            return
        size = round_size(nbytes)
        pool = self._pools[size <= kSmallSize]  # get_pool
        block = pool.best_fit(size)
        if block is not None:
            pool.remove(block)
        else:
            block = self._alloc_block(key, size, pool)
        if self._should_split(block, size):  # alloc_found_block
            head = _Block(block.addr, size, block.small, block.segment)
            head.prev, head.next = block.prev, block
            if block.prev:
                block.prev.next = head
            block.prev = head
            block.addr += size
            block.size -= size
            pool.insert(block)
            block = head
        block.allocated = True
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: Hashable) -> None:
        """DeviceCachingAllocator::free -> free_block: merge with free neighbours, back into the pool."""
        if key in self._empty:
            self._empty.discard(key)
            return
        if key not in self._live:
            self.unknown_frees += 1
            return
        block = self._live.pop(key)
        block.allocated = False
        self.allocated -= block.size
        pool = self._pools[block.small]
        for neighbour in (block.prev, block.next):  # try_merge_blocks
            if neighbour is None or neighbour.allocated:
                continue
            pool.remove(neighbour)
            if neighbour is block.prev:  # [neighbour block]
                block.addr, block.prev = neighbour.addr, neighbour.prev
                if block.prev:
                    block.prev.next = block
            else:  # [block neighbour]
                block.next = neighbour.next
                if block.next:
                    block.next.prev = block
            block.size += neighbour.size
        pool.insert(block)

    def release_cached_blocks(self) -> None:
        """release_cached_blocks (also torch.cuda.empty_cache()): cudaFree every segment that is one whole free block."""
        for pool in self._pools.values():
            for block in [b for b in pool.blocks.values() if not b.is_split()]:
                pool.remove(block)
                del self._segments[block.segment]
                self.reserved -= block.size

    def reset_peak_stats(self) -> None:
        """torch.cuda.reset_peak_memory_stats(): peaks restart from the current values."""
        self.peak_reserved, self.peak_allocated = self.reserved, self.allocated

    @property
    def num_segments(self) -> int:
        return len(self._segments)

    # ----------------------------------------------------------------------------------------------

    @staticmethod
    def _should_split(block: _Block, size: int) -> bool:
        """should_split (max_split_size unlimited): small pool if >= 512 bytes remain, large if > 1 MiB remain."""
        remaining = block.size - size
        return remaining >= kMinBlockSize if block.small else remaining > kSmallSize

    def _alloc_block(self, key: Hashable, size: int, pool: _Pool) -> _Block:
        """malloc's fallback chain: alloc_block, then (release_available_cached_blocks is a no-op with
        max_split_size unlimited) release_cached_blocks and alloc_block again, else OutOfMemory."""
        segment_bytes = get_allocation_size(size)
        if not self._fits(segment_bytes):
            self.release_cached_blocks()
            if not self._fits(segment_bytes):
                self.ooms.append(OutOfMemory(key, size, segment_bytes, self.reserved, self.allocated))
        addr = self._next_addr
        self._next_addr += segment_bytes
        self._segments[addr] = segment_bytes
        self.reserved += segment_bytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return _Block(addr, segment_bytes, pool.small, addr)

    def _fits(self, segment_bytes: int) -> bool:
        return self.capacity_bytes is None or self.reserved + segment_bytes <= self.capacity_bytes

    def check(self) -> None:
        """Self-check of the invariants: segments tile exactly into linked blocks; stats add up."""
        blocks = list(self._live.values()) + [b for p in self._pools.values() for b in p.blocks.values()]
        assert len({id(b) for b in blocks}) == len(blocks)
        assert self.allocated == sum(b.size for b in self._live.values())
        assert self.reserved == sum(self._segments.values())
        assert sum(b.size for b in blocks) == self.reserved
        for b in blocks:
            start, size = b.segment, self._segments[b.segment]
            assert start <= b.addr and b.addr + b.size <= start + size
            assert (b.prev is None) == (b.addr == start) and (b.next is None) == (b.addr + b.size == start + size)
            assert b.next is None or (b.next.prev is b and b.next.addr == b.addr + b.size)
            assert b.allocated or not (b.next and not b.next.allocated), "two adjacent free blocks"
        assert self.peak_reserved >= self.reserved and self.peak_allocated >= self.allocated


class ExactAllocator:
    """The CPU allocator as its profiler events report it: each storage costs the bytes asked for."""

    def __init__(self) -> None:
        self._live: dict[Hashable, int] = {}
        self.allocated = self.peak_allocated = 0

    @classmethod
    def from_live(cls, blocks: Mapping[Hashable, int]) -> ExactAllocator:
        allocator = cls()
        for key, nbytes in blocks.items():
            allocator.alloc(key, nbytes)
        return allocator

    @property
    def peak_reserved(self) -> None:
        return None  # the CPU allocator keeps no cache of its own

    def alloc(self, key: Hashable, nbytes: int) -> None:
        self._live[key] = nbytes
        self.allocated += nbytes
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: Hashable) -> None:
        self.allocated -= self._live.pop(key, 0)
