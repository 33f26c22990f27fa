"""The commands each sandbox is running for its caller, so that deferrable work waits for them.

A rollback leaves work behind it: the warm pool prepares the next rollback to the same
checkpoint (a btrfs clone, a mount namespace, carriers, a read-ahead), the killed
processes' keepers tear their address spaces down, the old generation is unmounted. None of
it is needed before the sandbox's next rollback, but an agent runs its next command right
after a rollback (a tree search's step: roll back, act), and on a machine of two CPUs that
work, started a fixed few milliseconds later, ran during the command and slowed it: a
150 ms command right after a rollback took 4-5 ms longer than the same command without
one, and 1.2-1.6 ms longer with that work pushed 0.4 s later (/tmp probe, stop 61; the
figures of `benchmarks/after_rollback.py` are in the README). So it waits, after its own
short delay, until the sandbox runs no command of its caller's (exec, a session's command),
which is when the agent thinks; but never longer than QUIET_CAP_S, so that a long command
(a test suite) neither holds the old address spaces nor leaves the next rollback
unprepared for its whole length: past a second, that work is a small share of the
command's time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import trio

QUIET_CAP_S = 1.0   # deltaboxd --quiet-wait-ms


class Foreground:
    """Per sandbox, how many of its caller's commands are running."""

    def __init__(self, cap: float = QUIET_CAP_S) -> None:
        self.cap = cap
        self._running: dict[str, int] = {}
        self._idle: dict[str, trio.Event] = {}   # set when the sandbox's count drops to 0

    def busy(self, sandbox_id: str) -> bool:
        return sandbox_id in self._running

    @contextmanager
    def command(self, sandbox_id: str) -> Iterator[None]:
        """Around a command the caller waits for (its answer is what it waits for)."""
        self._running[sandbox_id] = self._running.get(sandbox_id, 0) + 1
        try:
            yield
        finally:
            left = self._running.pop(sandbox_id) - 1
            if left:
                self._running[sandbox_id] = left
            elif (idle := self._idle.pop(sandbox_id, None)) is not None:
                idle.set()

    async def quiet(self, sandbox_id: str) -> None:
        """Return once the sandbox runs none of its caller's commands, or after `cap`
        seconds of waiting for that (0: at once)."""
        if self.cap <= 0:
            return
        with trio.move_on_after(self.cap):
            while sandbox_id in self._running:
                await self._idle.setdefault(sandbox_id, trio.Event()).wait()
