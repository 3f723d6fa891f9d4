"""Freed memory handed back to the operating system after a large request.

glibc's malloc keeps what a thread freed in that thread's arena for reuse, so a server's resident
size stays at its peak after one large request has come and gone (issue 45 measured 1.2-1.4 GB
above the start). `malloc_trim(0)` returns the free pages of every arena; elsewhere it is a no-op.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def return_free_memory() -> None:
    """Give the free pages of malloc's arenas back (glibc; nothing elsewhere). ctypes releases the
    GIL during the call, which takes milliseconds."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
