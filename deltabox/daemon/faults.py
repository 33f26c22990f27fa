"""Test-only fault injection: make deltaboxd kill itself (SIGKILL) at a named step, or
pause at one.

    DELTABOX_CRASH_AT=<step>        die the first time <step> is reached
    DELTABOX_CRASH_AT=<step>:<n>    die the n-th time (1-based)
    DELTABOX_PAUSE_AT=<point>:<s>   sleep <s> seconds (trio) the first time <point> is
                                    reached: opens a race's window wide, so that a test
                                    can act inside it (PAUSE_POINTS)

The kill is real (`kill -9` of the daemon's own pid: no cleanup, no atexit, no finally), so a
restart exercises the same recovery as a crash or an OOM kill of the daemon would. Used by
tests/test_faults.py; the steps are the `crash_point("...")` calls in daemon/service.py
(listed in STEPS). Unset (the normal case), `crash_point` is a dict lookup and a return.
Never set this in production.
"""

from __future__ import annotations

import logging
import os
import signal

import trio

log = logging.getLogger("deltaboxd")

# Every named step, so a test can parametrize over them and a typo fails loudly.
STEPS = (
    "checkpoint.frozen",          # cgroup frozen, nothing captured yet
    "checkpoint.snapshotted",     # file layer snapshotted (fs) / captured (full), still frozen
    "checkpoint.captured",        # thawed; capture done, metadata not written
    "checkpoint.before_commit",   # just before the SQLite transaction
    "checkpoint.after_commit",    # just after it
    "checkpoint.answered",        # an fs checkpoint answered, its snapshot not yet taken
    "rollback.killed",            # the sandbox's processes were killed
    "rollback.generation",        # the new file-system generation is built (uncommitted)
    "rollback.before_commit",
    "rollback.after_commit",
    "rollback.restoring",         # committed; restoring processes from templates
    "fork.cloned",                # a fork's child is booted on its cloned layer, the lanes open
    "fork.booted",                # the forks are booted (uncommitted)
    "fork.before_commit",
    "remove.before_commit",       # sandbox stopped, rows not yet deleted
    "remove.after_commit",
    "remove.tearing_down",        # answered: processes SIGKILLed, cgroup and mounts still there
    "remove.before_layer_delete",  # rows gone, layers not yet deleted
    "delete_checkpoint.before_commit",
    "delete_checkpoint.after_commit",
)


def _parse(spec: str) -> tuple[str, int] | None:
    if not spec:
        return None
    name, _, nth = spec.partition(":")
    if name not in STEPS:
        log.error("DELTABOX_CRASH_AT=%r: unknown step (known: %s); ignored", spec,
                  ", ".join(STEPS))
        return None
    try:
        n = int(nth) if nth else 1
    except ValueError:
        log.error("DELTABOX_CRASH_AT=%r: the count after ':' must be an integer; ignored", spec)
        return None
    return name, max(n, 1)


_target = _parse(os.environ.get("DELTABOX_CRASH_AT", ""))
_hits: dict[str, int] = {}


def crash_point(name: str) -> None:
    """Kill this process with SIGKILL if DELTABOX_CRASH_AT names this step (and count)."""
    if _target is None or _target[0] != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= _target[1]:
        log.warning("DELTABOX_CRASH_AT=%s: killing deltaboxd (SIGKILL) at %s", name, name)
        for h in logging.getLogger().handlers + log.handlers:
            try:
                h.flush()
            except Exception:
                pass
        os.kill(os.getpid(), signal.SIGKILL)


# Every named pause point (`pause_point("...")` in daemon/service.py).
PAUSE_POINTS = (
    "fork.source_found",   # a fork found its templates' sandbox, before taking its lock
)


def _parse_pause(spec: str) -> tuple[str, float] | None:
    name, _, secs = spec.partition(":")
    if not spec:
        return None
    try:
        pause = float(secs)
    except ValueError:
        pause = -1.0
    if name not in PAUSE_POINTS or pause < 0:
        log.error("DELTABOX_PAUSE_AT=%r: want <point>:<seconds>, a point among %s; ignored",
                  spec, ", ".join(PAUSE_POINTS))
        return None
    return name, pause


_pause = _parse_pause(os.environ.get("DELTABOX_PAUSE_AT", ""))


async def pause_point(name: str) -> None:
    """Sleep once here if DELTABOX_PAUSE_AT names this point."""
    global _pause
    if _pause is None or _pause[0] != name:
        return
    secs, _pause = _pause[1], None
    log.warning("DELTABOX_PAUSE_AT: pausing %.1f s at %s", secs, name)
    await trio.sleep(secs)
