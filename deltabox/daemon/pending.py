"""Checkpoints promised to a client before they are committed.

A checkpoint requested in the background (`Checkpoint` with `background`, or `checkpoint`
on `Exec` / `SessionRun`: the turn boundary) gets its id at once; the daemon takes it right
after, under the sandbox's lock, while the client goes on (an agent's next model call).
Until it is committed the id is *pending*: an operation that names it waits for it, and if
it failed, gets its error -- the client has no other way to learn why. A daemon that dies
before the commit never had the checkpoint: the id is then unknown (NOT_FOUND), never a
half-made checkpoint.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import trio

from ..errors import DeltaBoxError

# Failures kept for clients that ask about them later (oldest forgotten first).
FAILED_KEPT = 1024


@dataclass
class _Promise:
    sandbox_id: str
    done: trio.Event = field(default_factory=trio.Event)


class PendingCheckpoints:
    def __init__(self) -> None:
        self._promised: dict[str, _Promise] = {}
        self._failed: OrderedDict[str, DeltaBoxError] = OrderedDict()

    def promise(self, cp_id: str, sandbox_id: str) -> None:
        self._promised[cp_id] = _Promise(sandbox_id)

    def settle(self, cp_id: str, error: DeltaBoxError | None = None) -> None:
        """The checkpoint is committed (no error) or will never be (its error)."""
        if error is not None:
            self._failed[cp_id] = error
            while len(self._failed) > FAILED_KEPT:
                self._failed.popitem(last=False)
        p = self._promised.pop(cp_id, None)
        if p is not None:
            p.done.set()

    async def wait(self, cp_id: str) -> None:
        """Return once `cp_id` is not pending; raise its error if it failed."""
        p = self._promised.get(cp_id)
        if p is not None:
            await p.done.wait()
        err = self._failed.get(cp_id)
        if err is not None:
            raise type(err)(f"checkpoint {cp_id} was requested in the background and failed: "
                            f"{err.message}")

    async def wait_sandbox(self, sandbox_id: str) -> None:
        """Return once none of the sandbox's checkpoints is pending (failures not raised:
        a listing shows what exists)."""
        for p in [p for p in self._promised.values() if p.sandbox_id == sandbox_id]:
            await p.done.wait()


class EarlyAnswer:
    """The answer of an operation that a background task runs and may hand back before it
    is done (an fs checkpoint answered before its snapshot: Daemon._deferred_snapshot):
    the caller waits for `give` or `fail`; the task goes on after `give`."""

    def __init__(self) -> None:
        self._set = trio.Event()
        self._value: Any = None
        self._error: Exception | None = None

    @property
    def given(self) -> bool:
        return self._set.is_set()

    def give(self, value: Any) -> None:
        if not self._set.is_set():
            self._value = value
            self._set.set()

    def fail(self, error: Exception) -> None:
        if not self._set.is_set():
            self._error = error
            self._set.set()

    async def wait(self) -> Any:
        await self._set.wait()
        if self._error is not None:
            raise self._error
        return self._value


class Underway:
    """Checkpoints being taken, by the checkpoint they will hang from. A checkpoint reads
    its parent once, at its start, and commits against it (its parent_id; a `skipped` one
    shares its layer; an unchanged turn restores its processes): deleting that parent in
    between would leave the new row naming a deleted one and free what it shares. So
    delete_checkpoint waits for them (`clear`): milliseconds, never a whole command, since
    a checkpoint holds its parent only from its start to its commit."""

    def __init__(self) -> None:
        self._by_parent: dict[str, list[trio.Event]] = {}

    @contextlib.contextmanager
    def hanging_from(self, parent_id: str | None) -> Iterator[None]:
        if parent_id is None:
            yield
            return
        done = trio.Event()
        self._by_parent.setdefault(parent_id, []).append(done)
        try:
            yield
        finally:
            waiting = self._by_parent[parent_id]
            waiting.remove(done)
            if not waiting:
                del self._by_parent[parent_id]
            done.set()

    async def clear(self, parent_id: str) -> None:
        """Return once no checkpoint being taken hangs from `parent_id` (with no await
        between this and the caller's next step, none starts meanwhile)."""
        while waiting := self._by_parent.get(parent_id):
            await waiting[0].wait()
