"""Keep freed memory for reuse in the sidecar process (glibc's ``mallopt``).

A pack allocates a few buffers of the request's size (the body, the token column out of
it, the sequences rebuilt from prefix references) and frees them when it answers. With
glibc's defaults the large ones are fresh ``mmap`` s, or heap memory trimmed back to the
OS after each request, so the next request's buffers are new pages again, faulted in one
by one on first touch: about 0.5 ms per MB on the 2-core benchmark VM (25 ms of a 10M-
token round trip; BENCHMARKS.md, Service). Keeping up to ``keep_bytes`` of freed memory
lets the next request reuse the same pages.

The cost is resident memory: the process keeps up to ``keep_bytes`` it does not use
(bounded; the history and the planner are unaffected). It is set once per process, by
the uvicorn worker factory (:func:`treepack.service.app.create_app_from_env`), never by
:func:`~treepack.service.app.create_app`, so an application embedding the app keeps its
own allocator settings.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["keep_freed_memory"]

# mallopt parameters (glibc malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
_MMAP_THRESHOLD_MAX = 32 << 20


def keep_freed_memory(keep_bytes: int) -> bool:
    """Serve allocations up to 32 MiB from the heap and trim it only beyond ``keep_bytes``.

    Args:
        keep_bytes: freed memory the process may keep; 0 leaves glibc's defaults.

    Returns:
        True when the settings took effect (glibc), False otherwise (another C library,
        or ``keep_bytes`` 0).
    """
    if keep_bytes <= 0:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    keep = min(int(keep_bytes), 2**31 - 1)
    ok = mallopt(_M_MMAP_THRESHOLD, min(keep, _MMAP_THRESHOLD_MAX)) == 1
    return mallopt(_M_TRIM_THRESHOLD, keep) == 1 and ok
