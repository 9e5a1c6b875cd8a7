"""How a CPU rank's C allocator treats tensor memory.

glibc's malloc maps every allocation above its mmap threshold (at most 32 MB) fresh from the
kernel and unmaps it on free, so each large activation of every micro-batch is page-faulted in
again: on CPU the update at `micro_batch_tokens` 8192 took 1.12x its time at 1024 (bench/
packing.py), though it does the same work in fewer calls. Serving large blocks from the heap
and keeping freed memory (up to 2 GiB above the peak in use) makes the larger budget as fast or
faster (0.97x). The price is memory: freed blocks stay resident, and because tensors are
allocated aligned, a freed block does not always fit the next request of its own size, so the
heap settles above the step's peak in use (in a loop of 64/12/20 MB temporaries the process's
peak resident memory was 425 MB against 413 MB with the defaults, which map the blocks instead;
tests/unit/test_cpu_memory.py checks the reuse). GPU ranks keep glibc's defaults: their
activations live in CUDA's caching allocator.
"""

from __future__ import annotations

import ctypes

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
KEEP_FREED_BYTES = 2**31 - 1  # mallopt takes an int


def keep_freed_memory() -> bool:
    """Large allocations from the heap, freed memory kept for reuse. False where the C library
    is not glibc (no mallopt), which leaves its allocator as it is."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES) == 1
