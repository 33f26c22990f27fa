"""What the daemon's memory is made of, logged on SIGUSR1.

A long soak's daemon RSS climbs (README, Not yet) and stays up once every sandbox is gone:
either objects are kept (Python's, or native ones made through the C core and grpc) or the
allocators keep freed memory. One line tells them apart without a debugger or a restart:
glibc's own account of its heap (`mallinfo2`: bytes in use, bytes free but kept), Python's
(`sys.getallocatedblocks`, the collector's objects, frozen ones, the most common types) and
the process's RSS. Nothing here runs unless asked: `kill -USR1 <deltaboxd's pid>`.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import sys
from collections import Counter
from typing import Any

from .budget import resident_bytes

log = logging.getLogger("deltaboxd")


class _Mallinfo2(ctypes.Structure):
    # glibc >= 2.33, malloc.h: every field a size_t.
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def malloc_info() -> dict[str, float] | None:
    """glibc malloc's totals over its arenas, in MiB (None: not glibc, or too old)."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2
    m = fn()
    mib = 1 << 20
    return {"heap_mb": m.arena / mib,            # obtained by brk/sbrk and arena mmaps
            "in_use_mb": m.uordblks / mib,       # handed out, not freed
            "free_kept_mb": m.fordblks / mib,    # freed, still held by malloc
            "mmapped_mb": m.hblkhd / mib,        # big blocks, each its own mapping
            "free_chunks": m.ordblks}


def report(top: int = 12) -> dict[str, Any]:
    """The report's fields (see the module's docstring). Walks every tracked object:
    ~10-50 ms for a busy daemon, on the trio thread (it must not race the objects)."""
    objects = gc.get_objects()
    types = Counter(type(o).__name__ for o in objects)
    ours = Counter(type(o).__qualname__ for o in objects
                   if type(o).__module__.startswith("deltabox."))
    out: dict[str, Any] = {
        "rss_mb": round(resident_bytes(os.getpid()) / (1 << 20), 1),
        "python_blocks": sys.getallocatedblocks(),
        "gc_objects": len(objects),          # tracked and not frozen: those that come and go
        "gc_frozen": gc.get_freeze_count(),
        "gc_counts": gc.get_count(),
        "top_types": dict(types.most_common(top)),
        "deltabox_types": dict(ours.most_common(top)),   # the daemon's own classes
    }
    del objects
    m = malloc_info()
    if m is not None:
        out["malloc"] = {k: round(v, 1) for k, v in m.items()}
    return out


def log_report() -> None:
    log.info("memory: %s", json.dumps(report(), separators=(",", ":")))
