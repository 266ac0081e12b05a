"""PyTorch's CUDA caching allocator on one stream, replayed on an allocation trace (bench/allocator_trace.py):
a re-implementation of c10/cuda/CUDACachingAllocator.cpp's rules, with and without expandable segments.
Used by bench/planner_allocator.py."""

from __future__ import annotations

import bisect

MiB, GiB = 2**20, 2**30
# c10/cuda/CUDACachingAllocator.cpp
SMALL, SMALL_BUFFER, MIN_LARGE_ALLOC, ROUND_LARGE, LARGE_BUFFER, MIN_BLOCK = (
    MiB,
    2 * MiB,
    10 * MiB,
    2 * MiB,
    20 * MiB,
    512,
)


class _Block:
    __slots__ = ("allocated", "next", "prev", "ptr", "size", "small")

    def __init__(self, size: int, ptr: int, small: bool) -> None:
        self.size, self.ptr, self.small = size, ptr, small
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False


class CachingAllocator:
    """c10/cuda/CUDACachingAllocator.cpp's DeviceCachingAllocator on one stream, without expandable
    segments, max_split_size or garbage collection (the defaults)."""

    def __init__(self) -> None:
        self.pools: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}  # free (size, ptr, id)
        self.blocks: dict[int, _Block] = {}
        self.live: dict[int, _Block] = {}
        self.next_ptr = 0
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    def _cache(self, b: _Block) -> None:
        self.blocks[id(b)] = b
        bisect.insort(self.pools[b.small], (b.size, b.ptr, id(b)))

    def _uncache(self, b: _Block) -> None:
        pool = self.pools[b.small]
        pool.pop(bisect.bisect_left(pool, (b.size, b.ptr, id(b))))

    def malloc(self, key: int, n: int) -> None:
        size = MIN_BLOCK if n < MIN_BLOCK else -(-n // MIN_BLOCK) * MIN_BLOCK
        small = size <= SMALL
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            b = self.blocks[pool.pop(i)[2]]
        else:
            segment = (
                SMALL_BUFFER
                if small
                else LARGE_BUFFER
                if size < MIN_LARGE_ALLOC
                else -(-size // ROUND_LARGE) * ROUND_LARGE
            )
            b = _Block(segment, self.next_ptr, small)
            self.next_ptr += segment + (1 << 40)
            self.reserved += segment
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = b.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL:
            r = _Block(rest, b.ptr + size, small)
            r.prev, r.next = b, b.next
            if b.next:
                b.next.prev = r
            b.next, b.size = r, size
            self._cache(r)
        b.allocated = True
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.live[key] = b

    def free(self, key: int) -> None:
        b = self.live.pop(key)
        b.allocated = False
        self.allocated -= b.size
        for other in (b.prev, b.next):
            if other is not None and not other.allocated:
                self._uncache(other)
                if other is b.prev:
                    b.ptr, b.prev = other.ptr, other.prev
                    if b.prev:
                        b.prev.next = b
                else:
                    b.next = other.next
                    if b.next:
                        b.next.prev = b
                b.size += other.size
        self._cache(b)


class ExpandableAllocator:
    """The same allocator with expandable_segments:True (training.run sets it): one segment per pool whose
    physical pages (20 MiB in the large pool, 2 MiB in the small) are mapped at its end as needed. A
    request takes the smallest cached block that holds it, preferring any to the block at the mapped end
    (which could grow); when none does, the end block grows (new pages mapped after it, rounded to pages);
    every split is kept (512 B). Pages are unmapped only under memory pressure, so reserved is the highest
    end the pool reached."""

    def __init__(self) -> None:
        self.pools = {True: _Pool(SMALL_BUFFER), False: _Pool(LARGE_BUFFER)}
        self.live: dict[int, tuple[_Pool, int, int]] = {}
        self.allocated = self.peak_allocated = 0

    @property
    def reserved(self) -> int:
        return sum(p.mapped for p in self.pools.values())

    @property
    def peak_reserved(self) -> int:
        return sum(p.peak for p in self.pools.values())

    def malloc(self, key: int, n: int) -> None:
        size = MIN_BLOCK if n < MIN_BLOCK else -(-n // MIN_BLOCK) * MIN_BLOCK
        pool = self.pools[size <= SMALL]
        self.live[key] = (pool, pool.take(size), size)
        self.allocated += size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: int) -> None:
        pool, addr, size = self.live.pop(key)
        pool.give(addr, size)
        self.allocated -= size


class _Pool:
    """One expandable segment: free blocks by (size, address) and by address; [0, mapped) is mapped."""

    def __init__(self, page: int) -> None:
        self.page = page
        self.mapped = self.peak = 0
        self.by_size: list[tuple[int, int]] = []  # free (size, addr)
        self.by_addr: dict[int, int] = {}  # free addr -> size
        self.ends: dict[int, int] = {}  # free end addr -> start addr

    def _add(self, addr: int, size: int) -> None:
        bisect.insort(self.by_size, (size, addr))
        self.by_addr[addr] = size
        self.ends[addr + size] = addr

    def _drop(self, addr: int) -> int:
        size = self.by_addr.pop(addr)
        del self.ends[addr + size]
        self.by_size.pop(bisect.bisect_left(self.by_size, (size, addr)))
        return size

    def take(self, size: int) -> int:
        i = bisect.bisect_left(self.by_size, (size, -1))
        tail = self.ends.get(self.mapped)  # the free block at the mapped end, if any
        for j in range(i, len(self.by_size)):
            if self.by_size[j][1] != tail:
                addr = self.by_size[j][1]
                break
        else:  # only the end block, grown as needed
            addr = tail if tail is not None else self.mapped
            have = self._drop(tail) if tail is not None else 0
            if have < size:
                grow = -(-(size - have) // self.page) * self.page
                self.mapped += grow
                self.peak = max(self.peak, self.mapped)
                have += grow
            self._add(addr, have)
        have = self._drop(addr)
        if have > size:
            self._add(addr + size, have - size)
        return addr

    def give(self, addr: int, size: int) -> None:
        start = self.ends.get(addr)
        if start is not None:  # a free block just before
            size += self._drop(start)
            addr = start
        if addr + size in self.by_addr:  # a free block just after
            size += self._drop(addr + size)
        self._add(addr, size)


def replay(
    events: list[tuple[int, int, int]], expandable: bool = True
) -> CachingAllocator | ExpandableAllocator:
    a: CachingAllocator | ExpandableAllocator = ExpandableAllocator() if expandable else CachingAllocator()
    for kind, i, nbytes in events:
        if kind and nbytes:
            a.malloc(i, nbytes)
        elif not kind and i in a.live:
            a.free(i)
    return a
