"""A server's heap: freed memory handed back to the operating system after a large request, and
the objects of its start left out of the garbage collector's full passes.

glibc's malloc keeps what a thread freed in that thread's arena for reuse, so a server's resident
size stays at its peak after one large request has come and gone (docs/RL.md "OpenRLHF" has the
figures). `malloc_trim(0)` returns the free pages of every arena; elsewhere it is a no-op.

Python's full collection walks every object the collector tracks, and a server that has imported
torch and transformers and loaded its model holds hundreds of thousands: each pass holds the event
loop, and the connections of a flood set off such passes, so probes wait (docs/RL.md "OpenRLHF",
benchmarks/gc_pause.py). Those objects live as long as the server; `gc.freeze()` moves them out of
the collector's sight, and a pass then walks only what came after.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc


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


def freeze_startup_heap() -> None:
    """Once a server has loaded what it keeps for its whole life, before it serves: the garbage
    of the start collected, the rest left out of later collections. Only in a server's own process
    (its command's main): objects frozen are never collected, so a test process must not."""
    gc.collect()
    gc.freeze()
