"""Giving a CPU training run's freed heap memory back to the system every few steps.

On a CPU the step's activations live in the process's heap. glibc raises its mmap threshold each time a large block
is freed, so later tensors come from the heap, and the free blocks of many sizes that a run's varying batch widths
leave there are kept rather than returned: the process's anonymous memory then grows with the steps, whatever the
data's size. glibc's `malloc_trim(0)` returns every whole free page; after every step it costs the next step the
page faults of re-taking them, so the trainer calls it every `release_host_memory_every` steps instead
(docs/results/2026-12-06-host-memory-trim-period.md). Elsewhere than glibc (musl, macOS) there is nothing to call and nothing done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def heap_trim() -> Callable[[], None] | None:
    """glibc's malloc_trim(0) as a no-argument call, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # a C library without malloc_trim (musl, macOS); None loads our own symbols
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)
