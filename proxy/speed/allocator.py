"""glibc's allocator, told to keep the memory large buffers come and go in (``serve``).

By default glibc maps an allocation of 128 KiB or more on its own and unmaps it when it is
freed, and hands the free top of its heap back to the kernel once it passes a threshold
that follows those sizes. The proxy's large buffers come and go all the time: the loop
reads a socket 256 KiB at a time into a new ``bytes``, and a request body of megabytes is
its chunks, freed at once when it is refused or parsed. Every such buffer then comes back
as fresh pages, each faulted in and zeroed by the kernel on first touch, on the loop's
thread: under large uploads that is a tenth of the proxy's CPU, and every other tenant's
latency waits on it (docs/benchmarks.md).

Fixed thresholds keep such buffers in the heap, reused: allocations up to
``MMAP_THRESHOLD`` come from the heap, and up to ``TRIM_THRESHOLD`` of free memory at its
top stays mapped (a bound on what the process holds beyond what it uses).
"""

from __future__ import annotations

import ctypes
import platform

MMAP_THRESHOLD = 4 << 20  # bytes: larger allocations are mapped on their own
TRIM_THRESHOLD = 64 << 20  # bytes of free heap top kept mapped
# mallopt(3)'s parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_large_buffers() -> bool:
    """Set glibc's thresholds (process-wide); False where the C library is not glibc or
    refuses them, which changes nothing."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return (int(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) == 1
            and int(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)) == 1)
