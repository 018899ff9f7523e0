"""One heap policy for a benchmark process: glibc's malloc with fixed trim and mmap thresholds.

With glibc's defaults both thresholds move as the process frees large blocks, so whether freeing a traced
forward's ~70 MB of saved outputs hands the top of the heap back to the kernel (and the next forward faults
every page in again: ~5,000 minor faults, several ms on ResNet-18) depends on the order of earlier frees, not
on the code measured. Measured on this machine (``bench_trace.py``'s workloads, one process per line): the
same keep-every-output floor took 0 faults a forward in one process and 5,400-6,100 in most forwards of the
next; the floors came out in the wrong order (keeping and copying cheaper than keeping alone). Fixed thresholds
make every measured function pay the same allocator, so a ratio is about the code. ``--default-heap`` on a
benchmark keeps glibc's defaults (the numbers a default-configured process gets, with that noise).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

DEFAULT_HEAP_ENV = "TL_BENCH_DEFAULT_HEAP"  # inherited by a benchmark's worker processes
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_TRIM_BYTES = 2**31 - 1  # never give the heap's top back to the kernel
_MMAP_BYTES = 32 * 2**20  # glibc's largest mmap threshold (64-bit): blocks below it come from the heap


def set_policy(argv: list[str]) -> str:
    """Applies the policy ``argv`` asks for (``--default-heap`` or not) to this process and its workers; returns
    its description for the benchmark's header."""
    if "--default-heap" in argv or os.environ.get(DEFAULT_HEAP_ENV) == "1":
        os.environ[DEFAULT_HEAP_ENV] = "1"
        return "glibc malloc, default (moving) trim and mmap thresholds"
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or sys.platform != "linux":
        return "the platform's allocator (no glibc mallopt here)"
    if not (mallopt(_M_TRIM_THRESHOLD, _TRIM_BYTES) and mallopt(_M_MMAP_THRESHOLD, _MMAP_BYTES)):
        return "glibc malloc, default thresholds (mallopt refused the fixed ones)"
    return f"glibc malloc, fixed thresholds (trim never, mmap above {_MMAP_BYTES >> 20} MB; --default-heap: glibc's)"
