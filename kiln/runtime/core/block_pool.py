"""The pool of KV blocks: reference counts, an LRU free list, and the prefix cache.

A full block can be identified by a chained hash of its contents: the previous block's hash, its
token ids, and extra keys (anything else that changes its K/V: a tenant's cache salt, later a
LoRA id). Such a block, once freed, keeps its K/V and its hash: it sits in the free list, in
least-recently-freed order, until a request with the same prefix takes it back out (a hit) or the
pool needs a block and evicts it from the cold end. Blocks that hold nothing reusable go to the
cold end at once. Shared blocks are reference-counted and never written: sequences only append to
their own last block.

Hashes are keyed BLAKE2b with a secret drawn per process (or a `prefix_cache_seed` given), so a
tenant cannot predict another's block hashes, and a collision would take breaking the MAC.
"""
import hashlib
import secrets
from array import array
from collections import OrderedDict
from collections.abc import Sequence

NONE = b""  # the parent hash of a sequence's first block


class OutOfBlocks(Exception):
    pass


class BlockHasher:
    def __init__(self, seed: int | None = None):
        self.key = secrets.token_bytes(32) if seed is None else seed.to_bytes(32, "little", signed=True)

    def __call__(self, parent: bytes, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
        h = hashlib.blake2b(key=self.key, digest_size=16)
        h.update(parent)
        h.update(array("q", token_ids).tobytes())
        if extra_keys:
            h.update(b"|" + repr(extra_keys).encode())
        return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> the block holding those tokens
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # coldest first

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise OutOfBlocks(f"need {n} blocks, {len(self.free)} free")
        blocks = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            self._uncache(b)
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    # A block table's -1 entries hold no block (dropped behind a sliding window): share and release skip them.
    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            if b >= 0:
                self.ref_counts[b] += 1

    def release(self, blocks: list[int]) -> None:
        # The tail of a sequence last: its first blocks, the likeliest to be someone's prefix, stay longest.
        for b in reversed(blocks):
            if b < 0:
                continue
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0, f"block {b} released twice"
            if self.ref_counts[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:
                    self.free.move_to_end(b, last=False)  # nothing to reuse: the first to go

    # -- the prefix cache ---------------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest chain of `hashes` that is cached."""
        hits = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def take(self, blocks: list[int]) -> None:
        """Hits: one more reference each, out of the free list if nobody held them."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self.free[b]
            self.ref_counts[b] += 1

    def cache(self, block: int, block_hash: bytes) -> None:
        """A block now full and computed: findable by its hash (unless another block has it)."""
        if self.block_hash[block] is None and block_hash not in self.cached:
            self.block_hash[block] = block_hash
            self.cached[block_hash] = block

    def _uncache(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            del self.cached[h]
            self.block_hash[block] = None
