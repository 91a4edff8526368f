"""CudaCachingAllocator against hand-computed scenarios. Each expected number is derived in a comment
from the rules of c10/cuda/CUDACachingAllocator.cpp: round_size, get_pool (<= 1 MiB small),
get_allocation_size (2 MiB / 20 MiB / 2 MiB multiple), should_split (small: >= 512 B left;
large: > 1 MiB left), best fit, try_merge_blocks, release_cached_blocks."""

from __future__ import annotations

import random

import pytest

from memplan.allocator import BASELINE_KEY, CudaCachingAllocator, get_allocation_size, round_size

KiB, MiB = 1 << 10, 1 << 20


def run(*ops, **kwargs) -> CudaCachingAllocator:
    """ops: ("a", key, nbytes) or ("f", key); checks the invariants after every op."""
    a = CudaCachingAllocator(**kwargs)
    for op in ops:
        a.alloc(op[1], op[2]) if op[0] == "a" else a.free(op[1])
        a.check()
    return a


def test_rounding_rules():
    assert [round_size(n) for n in (1, 511, 512, 513, 1024)] == [512, 512, 512, 1024, 1024]
    assert get_allocation_size(1 * MiB) == 2 * MiB  # <= kSmallSize: a kSmallBuffer
    assert get_allocation_size(1 * MiB + 512) == 20 * MiB  # (1 MiB, 10 MiB): a kLargeBuffer
    assert get_allocation_size(10 * MiB) == 10 * MiB  # >= kMinLargeAlloc: rounded to 2 MiB
    assert get_allocation_size(10 * MiB + 512) == 12 * MiB


def test_tiny_alloc_reserves_a_small_segment():
    # 100 B -> round_size 512 (small pool) -> cudaMalloc kSmallBuffer = 2 MiB; 2 MiB - 512 left >= 512: split
    a = run(("a", "x", 100))
    assert (a.reserved, a.allocated, a.num_segments) == (2 * MiB, 512, 1)


def test_two_600k_share_one_small_segment():
    # 600 KiB = 1200 * 512 <= 1 MiB: small pool. First: new 2 MiB segment, split (1448 KiB left).
    # Second: best fit is that 1448 KiB block, split again (848 KiB left). One segment.
    a = run(("a", "x", 600 * KiB), ("a", "y", 600 * KiB))
    assert (a.reserved, a.allocated, a.num_segments) == (2 * MiB, 1200 * KiB, 1)


def test_one_mib_is_small_and_one_mib_plus_one_byte_is_large():
    # 1 MiB <= kSmallSize: two of them fill one 2 MiB segment (first split leaves 1 MiB >= 512; second exact fit)
    a = run(("a", "x", MiB), ("a", "y", MiB))
    assert (a.reserved, a.allocated) == (2 * MiB, 2 * MiB)
    # 1 MiB + 1 -> 1 MiB + 512 > kSmallSize: large pool, < 10 MiB -> a 20 MiB kLargeBuffer
    a.alloc("z", MiB + 1)
    assert (a.reserved, a.allocated) == (22 * MiB, 3 * MiB + 512)


def test_5mib_allocs_share_a_20mib_segment():
    # 5 MiB: large pool, < kMinLargeAlloc -> 20 MiB segment; 15 MiB left > 1 MiB: split.
    # Second 5 MiB: best fit the 15 MiB remainder, 10 MiB left: split. No new segment.
    a = run(("a", "x", 5 * MiB))
    assert (a.reserved, a.allocated) == (20 * MiB, 5 * MiB)
    a.alloc("y", 5 * MiB)
    assert (a.reserved, a.allocated, a.num_segments) == (20 * MiB, 10 * MiB, 1)


def test_30mib_reserves_exactly_30mib():
    # 30 MiB >= kMinLargeAlloc -> segment = 30 MiB rounded up to 2 MiB = 30 MiB; nothing left, no split
    a = run(("a", "x", 30 * MiB))
    assert (a.reserved, a.allocated) == (30 * MiB, 30 * MiB)


def test_31mib_plus_one_byte_reserves_32mib_and_counts_it_all_as_allocated():
    # round_size: 31 MiB + 512. Segment: ceil to 2 MiB = 32 MiB. Left: 1 MiB - 512, not > kSmallSize:
    # no split, so the whole 32 MiB block is handed out and allocated_bytes grows by block->size = 32 MiB.
    a = run(("a", "x", 31 * MiB + 1))
    assert (a.reserved, a.allocated) == (32 * MiB, 32 * MiB)


def test_free_then_realloc_reuses():
    # the freed 30 MiB block goes back to the large pool and is the best fit for the same request
    a = run(("a", "x", 30 * MiB), ("f", "x"), ("a", "y", 30 * MiB))
    assert (a.reserved, a.peak_reserved, a.allocated, a.num_segments) == (30 * MiB, 30 * MiB, 30 * MiB, 1)
    # the same in the small pool: the 2 MiB segment merged back whole serves the next 100 B
    a = run(("a", "x", 100), ("f", "x"), ("a", "y", 100))
    assert (a.reserved, a.num_segments) == (2 * MiB, 1)


def test_pools_are_separate():
    # a free 2 MiB small segment cannot serve a 1.5 MiB (large) request -> new 20 MiB segment
    a = run(("a", "x", 100), ("f", "x"), ("a", "y", 3 * MiB // 2))
    assert (a.reserved, a.num_segments) == (22 * MiB, 2)


def fragmented() -> CudaCachingAllocator:
    # four 5 MiB blocks A B C D tile one 20 MiB segment: splits leave 15, 10, 5 MiB, and D is an exact fit
    return run(*[("a", k, 5 * MiB) for k in "ABCD"], ("f", "A"), ("f", "C"))


def test_fragmentation_needs_a_new_segment():
    # A and C are free but not adjacent (B, D live): two 5 MiB holes, no 8 MiB block ->
    # a new 20 MiB segment (8 MiB < kMinLargeAlloc), split leaving 12 MiB.
    a = fragmented()
    assert (a.reserved, a.allocated) == (20 * MiB, 10 * MiB)
    a.alloc("E", 8 * MiB)
    a.check()
    assert (a.reserved, a.allocated, a.num_segments) == (40 * MiB, 18 * MiB, 2)


def test_coalescing_serves_a_larger_request_from_the_cache():
    a = fragmented()
    a.alloc("E", 8 * MiB)  # as above: 40 MiB reserved, a 12 MiB free remainder in segment 2
    # freeing B merges A + B + C into one free 15 MiB block at the start of segment 1
    a.free("B")
    a.check()
    # 14 MiB: the 12 MiB remainder is too small; the merged 15 MiB block fits -> no new segment.
    # 1 MiB left is not > kSmallSize: no split, the whole 15 MiB block is allocated.
    a.alloc("F", 14 * MiB)
    a.check()
    assert (a.reserved, a.allocated, a.num_segments) == (40 * MiB, 5 * MiB + 8 * MiB + 15 * MiB, 2)
    # without merging, the three 5 MiB holes would have forced a third segment
    b = fragmented()
    b.alloc("E", 8 * MiB)
    b.alloc("F", 14 * MiB)
    assert b.reserved == 54 * MiB  # 14 MiB >= kMinLargeAlloc: a new 14 MiB segment (40 + 14)


def test_best_fit_picks_the_smallest_block():
    # free blocks of 15 MiB (segment 1, after A+B+C merge) and 12 MiB (segment 2): 11 MiB takes the 12 MiB one,
    # 1 MiB left -> no split (12 MiB allocated); then 13 MiB takes the 15 MiB block, 2 MiB left > 1 MiB -> split
    a = fragmented()
    a.alloc("E", 8 * MiB)
    a.free("B")
    a.alloc("F", 11 * MiB)
    a.alloc("G", 13 * MiB)
    a.check()
    assert (a.reserved, a.allocated) == (40 * MiB, 5 * MiB + 8 * MiB + 12 * MiB + 13 * MiB)


def test_capacity_releases_cached_segments_before_failing():
    # capacity 32 MiB. A freed 30 MiB segment stays cached (reserved 30). Small requests: 3 x 600 KiB fit
    # in one new 2 MiB segment (reserved 32 = capacity); the 4th does not fit in the 248 KiB left and a
    # new 2 MiB segment would make 34 > 32 -> release_cached_blocks frees the unsplit 30 MiB -> 2 + 2 = 4.
    a = run(("a", "big", 30 * MiB), ("f", "big"), *[("a", i, 600 * KiB) for i in range(4)], capacity_bytes=32 * MiB)
    assert (a.reserved, a.peak_reserved, a.num_segments, a.ooms) == (4 * MiB, 32 * MiB, 2, [])


def test_out_of_memory_is_recorded():
    # capacity 4 MiB: two 1 MiB fill one 2 MiB small segment (not releasable: split and live);
    # 2 MiB is a large request -> a 20 MiB segment, 2 + 20 > 4 even after releasing the cache -> OOM,
    # recorded, and the simulation goes on over capacity.
    a = run(("a", "x", MiB), ("a", "y", MiB), ("a", "z", 2 * MiB), capacity_bytes=4 * MiB)
    assert len(a.ooms) == 1
    oom = a.ooms[0]
    assert (oom.key, oom.size, oom.segment_bytes, oom.reserved) == ("z", 2 * MiB, 20 * MiB, 2 * MiB)
    assert a.reserved == 22 * MiB


def test_release_cached_blocks_keeps_split_segments():
    # the segment of x is split (a 15 MiB free remainder) and live: not released; y's is whole and free: released
    a = run(("a", "x", 5 * MiB), ("a", "y", 100), ("f", "y"))
    a.release_cached_blocks()
    a.check()
    assert (a.reserved, a.num_segments) == (20 * MiB, 1)


def test_baseline_constructors():
    # int: one pre-existing allocation of 3 MiB -> one 20 MiB segment with a 17 MiB free remainder
    a = CudaCachingAllocator(3 * MiB)
    a.check()
    assert (a.reserved, a.peak_reserved, a.allocated) == (20 * MiB, 20 * MiB, 3 * MiB)
    a.alloc("x", 10 * MiB)  # fits in the remainder: no new segment
    assert a.reserved == 20 * MiB
    a.free(BASELINE_KEY)
    a.check()
    # per-storage sizes: 100 B -> 2 MiB small segment, 3 MiB -> 20 MiB segment, 50 MiB -> 50 MiB segment
    b = CudaCachingAllocator.from_live({"w": 100, "v": 3 * MiB, "u": 50 * MiB})
    b.check()
    assert (b.reserved, b.allocated) == (72 * MiB, 512 + 3 * MiB + 50 * MiB)
    b.free("u")
    assert (b.reserved, b.allocated) == (72 * MiB, 512 + 3 * MiB)
    c = CudaCachingAllocator.from_live([100, 100, 3 * MiB])
    assert (c.reserved, c.allocated) == (22 * MiB, 1024 + 3 * MiB)
    assert CudaCachingAllocator(0).reserved == 0


def test_zero_bytes_unknown_keys_and_double_alloc():
    a = run(("a", "scratch", 0), ("f", "scratch"), ("a", "scratch", 0), ("f", "scratch"))
    assert (a.reserved, a.unknown_frees) == (0, 0)  # allocate() skips malloc for 0 bytes
    a.free("never")
    assert a.unknown_frees == 1
    a.alloc("x", 100)
    with pytest.raises(ValueError):
        a.alloc("x", 100)


def test_reset_peak_stats():
    a = run(("a", "x", 30 * MiB), ("f", "x"), ("a", "y", 100), ("f", "y"))
    a.release_cached_blocks()
    a.reset_peak_stats()
    assert (a.peak_reserved, a.peak_allocated) == (0, 0)


def test_random_sequences_keep_invariants():
    rng = random.Random(0)
    sizes = [0, 1, 511, 513, 100 * KiB, MiB, MiB + 1, 3 * MiB, 9 * MiB, 10 * MiB, 11 * MiB + 7, 40 * MiB]
    for trial in range(20):
        a = CudaCachingAllocator(capacity_bytes=rng.choice([None, 200 * MiB]))
        live: list[int] = []
        for i in range(200):
            if live and rng.random() < 0.45:
                a.free(live.pop(rng.randrange(len(live))))
            else:
                a.alloc(i, rng.choice(sizes))
                live.append(i)
            a.check()
        for key in live:
            a.free(key)
        a.check()
        assert a.allocated == 0
        a.release_cached_blocks()
        assert a.reserved == 0 and a.num_segments == 0  # every segment merged back into one free block
