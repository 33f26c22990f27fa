"""A host-wide memory budget for process templates, least recently used out.

A template shares its pages copy-on-write with the process it was made from; what it costs is
the pages only it still maps: those the live process (or a restored child) has written since
the checkpoint. The kernel reports exactly that per process as `Private_Clean +
Private_Dirty` in /proc/PID/smaps_rollup (a page mapped by one process only is private);
while carriers spawned ahead from the templates share those pages (warm.py), the pages
mapped by no more than the template and its carriers are counted (/proc/kpagecount).

The daemon measures its templates every `interval` seconds, off the trio thread, and when
their sum exceeds the budget releases whole checkpoints' templates, least recently used
first (used = captured, restored or forked from). An evicted checkpoint keeps its files; a
rollback to it restarts processes and says so.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from ..cr import native
from ..cr.engine import ProcessState

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
# The page walk takes at most this share of one CPU: it reads every template's page tables
# and, for templates with carriers, a page count per page (0.4 s for 31 checkpoints of a
# 200 MB process here). Run every 2 s regardless, an idle daemon holding 40 such
# checkpoints used 16.8% of a CPU (4.6% with this bound and the resident-size shortcut).
WALK_SHARE = 0.05


def process_private_bytes(pid: int) -> int:
    """Memory only this process maps (0 if it is gone)."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return total


def resident_bytes(pid: int) -> int:
    """All of pid's resident memory, from a counter (/proc/pid/statm: no page walk); 0 if
    it is gone. A template costs at most this."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return 0


def states_bound(states: Iterable[ProcessState]) -> int:
    """An upper bound of what these checkpoints' templates cost, cheap to take: when it is
    within the budget, nothing can be over it and the page walk (state_bytes) is skipped."""
    return sum(resident_bytes(p) for st in states for p in st.template_pids)


def state_bytes(state: ProcessState, carriers: int = 0) -> int:
    """What one checkpoint's templates cost now. `carriers`: how many sets of carriers
    spawned ahead from them exist (warm.py): they map the same pages and never write, so
    a page the live process no longer maps is mapped by the template and each carrier."""
    if not carriers:
        return sum(process_private_bytes(p) for p in state.template_pids)
    total = 0
    for p in state.template_pids:
        try:
            total += native.exclusive_bytes(p, 1 + carriers)
        except native.CRError:
            pass  # gone
    return total


def touch(state: ProcessState) -> None:
    """Mark a checkpoint's templates as just used."""
    state.last_used = time.monotonic()


def over_budget(states: Iterable[tuple[str, ProcessState, int]], budget: int,
                prefer: set[str] = frozenset(), keep: set[str] = frozenset()) -> list[str]:
    """Keys of the least recently used states to evict so that the rest fit in `budget`,
    those in `prefer` (a complete dump can rebuild them) first, those in `keep` (their dump
    is still being written from them) only if the budget cannot be met otherwise.
    `states`: (key, state, its cost in bytes)."""
    ordered = sorted(states, key=lambda t: (t[0] not in prefer, t[1].last_used))
    total = sum(cost for _, _, cost in ordered)
    out: list[str] = []
    for key, _, cost in ordered:
        if total <= budget:
            break
        if key in keep:
            continue
        out.append(key)
        total -= cost
    for key, _, cost in ordered:   # memory first: a dump backlog must not grow without bound
        if total <= budget:
            break
        if key in keep:
            out.append(key)
            total -= cost
    return out
