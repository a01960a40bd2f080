"""Freed activation memory given back to the system, so a long row's backward does not keep the forward's.

glibc serves an allocation below its mmap threshold from its heap, and raises that threshold to the
size of every mapped block freed (up to 32 MB): after the first large activation is freed, the
step's many 1-32 MB tensors are carved from heaps that fragment, and their freed pages stay
resident. At 2 x 4k packed tokens of the tiny model that retained memory was half the backward's
peak (0.76 GB against 0.41 GB with a fixed threshold; ``docs/training-at-scale.md``). A fixed
threshold (``mallopt(M_MMAP_THRESHOLD)``, which also turns its rise off) maps every block of at
least that size on its own and unmaps it when freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 1 << 20


def map_large_blocks(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process; False where the C library
    is not glibc (nothing changed)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
