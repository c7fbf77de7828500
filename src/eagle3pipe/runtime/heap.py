"""The C heap of a stage process that answers many requests through one engine.

glibc's malloc returns freed heap memory to the OS only from the top of each heap (mallopt(3),
M_TRIM_THRESHOLD); freed space below a block still in use stays resident. A vLLM engine
allocates and frees blocks sized by its batch on every step, and glibc's dynamic mmap threshold
moves such blocks into the heap after the first is freed (mallopt(3), M_MMAP_THRESHOLD); there
they interleave with the stage's longer-lived objects, and without a release the process's
resident peak grows with the number of requests far faster than the objects alive at once
(bench/README.md, `conversations_memory_ratio`).

`release_free` calls glibc's malloc_trim(0), which gives back the free pages of every arena,
inside a heap as well as at its top (malloc_trim(3), glibc >= 2.8: madvise MADV_DONTNEED), at
the cost of one walk over the free chunks: a stage calls it between batches of work. Nothing a
stage computes depends on where its memory lies; this changes no output byte. Other C
libraries (musl, macOS) keep their allocators: the call reports that it did nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None on another C library."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return libc.malloc_trim if hasattr(libc, "gnu_get_libc_version") else None
    except (OSError, AttributeError, TypeError):
        return None


def release_free() -> bool:
    """Gives the heap's free pages back to the OS (glibc malloc_trim(0)); True when glibc
    released any, False when it had none to release or the C library is not glibc."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
