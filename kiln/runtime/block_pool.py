"""The pool of KV blocks: a free list and reference counts (blocks shared by forked sequences)."""
from collections import deque


class OutOfBlocks(Exception):
    pass


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise OutOfBlocks(f"need {n} blocks, {len(self.free)} free")
        blocks = [self.free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref_counts[b] += 1

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0, f"block {b} released twice"
            if self.ref_counts[b] == 0:
                self.free.append(b)
