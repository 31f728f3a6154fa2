"""The paged KV block pool, counted the way vLLM's BlockPool counts it.

vLLM reserves block 0 as the null block, so ``num_gpu_blocks - 1`` blocks are allocatable and
``vllm:kv_cache_usage_perc`` is ``used / (num_gpu_blocks - 1)``. Only counts matter here: which physical
block a sequence holds has no effect on memory pressure.
"""

from __future__ import annotations


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``tokens`` tokens of KV (ceil division)."""
    return -(-tokens // block_size)


class BlockPool:
    """Free/used block counter; allocation fails instead of over-committing."""

    def __init__(self, num_gpu_blocks: int) -> None:
        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be >= 2 (one is the null block)")
        self.num_gpu_blocks = num_gpu_blocks
        self.capacity = num_gpu_blocks - 1
        self.used = 0

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def usage(self) -> float:
        return self.used / self.capacity

    def allocate(self, n: int) -> bool:
        if n < 0:
            raise ValueError("cannot allocate a negative number of blocks")
        if n > self.free:
            return False
        self.used += n
        return True

    def release(self, n: int) -> None:
        if n < 0 or n > self.used:
            raise ValueError(f"releasing {n} blocks with {self.used} in use")
        self.used -= n
