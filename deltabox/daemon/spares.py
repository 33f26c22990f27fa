"""Fork spares: inits booted ahead for the next fork of a sandbox.

A fork child starts with its init: a cgroup of its own, then dbx-init making the
namespaces (pid, nested below the sandbox that holds the templates; mount, uts, ipc, net,
cgroup) and joining the cgroups, a few ms of which the moves into the cgroups wait for an
RCU grace period (README, "Host tuning: cgroup favordynmods"). None of that depends on the
checkpoint, only on the sandbox the child nests under and on the child's limits; so after
a fork that restored processes, the daemon boots that many spares in the background (at
most `per_owner`) once its calls have stopped for a moment (the children's first commands
go first; at most QUIET_WAIT_S later whatever the load), and the next fork from the same
sandbox takes them: it then only clones layers, builds the children's file systems and
restores their processes.

A spare is an idle init in a cgroup of its own, under the id its sandbox will have (the
hostname is set at boot). It costs two small processes, a pid in the owner's namespace (the
owner's `ps` lists a `dbx-init` per spare, as it lists its forks' inits) and a network
namespace. Spares go with their owner (its teardown, or its init dying takes them down), at
shutdown, and after a crash as leftovers (recover removes every sandbox cgroup it does not
know).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import trio

from ..background import GuardedNursery
from ..sandbox import runtime
from ..sandbox.cgroups import Limits

log = logging.getLogger("deltaboxd")

# How many spares are booted at once: enough to refill a fan-out before the next one, few
# enough that an agent's next command does not queue behind them.
BOOT_AT_ONCE = 2
# How long a refill waits for the daemon's calls to stop (Spares.quiet) before it boots
# anyway. Booting right after a fork, it shared the 2 CPUs with the children's first
# calls: the first file read in the first child took 6-10 ms against 2-3 without spares.
QUIET_WAIT_S = 2.0
# A spare not taken for this long is stopped: a sandbox that forked once and then works on
# alone does not hold its fan-out's worth of namespaces for ever (its next fork boots
# them again).
IDLE_S = 300.0


@dataclass(frozen=True)
class Kind:
    """What a spare must match to be a fork child's init."""

    owner: str          # the sandbox its pid namespace is nested below
    limits: Limits
    userns: bool


@dataclass
class Spare:
    sid: str
    kind: Kind
    rt: runtime.Runtime
    watch: trio.CancelScope = field(default_factory=trio.CancelScope)


# boot(sid, kind) -> the runtime of a new init (its cgroup made); stop(rt): kill it, remove
# its cgroup.
Boot = Callable[[str, Kind], Awaitable[runtime.Runtime]]
Stop = Callable[[runtime.Runtime], Awaitable[None]]


class Spares:
    def __init__(self, boot: Boot, stop: Stop, new_id: Callable[[], str],
                 background: GuardedNursery, per_owner: int, idle_s: float = IDLE_S) -> None:
        self._boot = boot
        self._stop = stop
        self._new_id = new_id
        self._background = background
        self.per_owner = per_owner
        self.idle_s = idle_s
        self._ready: dict[str, list[Spare]] = {}     # owner -> spares
        self._wanted: dict[Kind, int] = {}            # how many to keep, per kind
        self._refilling: set[Kind] = set()
        self._booting: dict[Kind, int] = {}           # boots under way, per kind
        self._limiter = trio.CapacityLimiter(BOOT_AT_ONCE)
        # Waits until no call has run for a moment (at most the given seconds); set by the
        # daemon's main (idlegc.IdleCollector.quiet). None: refill at once.
        self.quiet: Callable[[float], Awaitable[None]] | None = None

    def take(self, kind: Kind) -> Spare | None:
        """A booted spare of this kind whose init still runs, or None."""
        spares = self._ready.get(kind.owner, [])
        for i, s in enumerate(spares):
            if s.kind == kind and not s.rt.exited.is_set():
                del spares[i]
                s.watch.cancel()   # the sandbox's own watch takes over
                return s
        return None

    def want(self, kind: Kind, count: int) -> None:
        """Keep `count` spares of this kind (at most per_owner; a fork just took some):
        boot the missing ones, or stop those over it, in the background."""
        if self.per_owner <= 0:
            return
        self._wanted[kind] = min(count, self.per_owner)
        spares = self._ready.get(kind.owner, [])
        mine = [s for s in spares if s.kind == kind]
        for spare in mine[self._wanted[kind]:]:
            spares.remove(spare)
            spare.watch.cancel()
            self._background.start_soon(self._stop, spare.rt)
        if kind not in self._refilling:
            self._refilling.add(kind)
            self._background.start_soon(self._refill, kind)

    async def _refill(self, kind: Kind) -> None:
        """Boot the missing spares of a kind, again while more are wanted meanwhile; a round
        that boots none (the owner went) ends it."""
        try:
            while self._missing(kind):
                if self.quiet is not None:  # after the calls that want the CPU now
                    await self.quiet(QUIET_WAIT_S)
                if not (missing := self._missing(kind)):
                    break
                booted: list[bool] = []
                async with trio.open_nursery() as nursery:
                    for _ in range(missing):
                        nursery.start_soon(self._boot_one, kind, booted)
                if not any(booted):
                    break
        finally:
            self._refilling.discard(kind)

    def _missing(self, kind: Kind) -> int:
        have = sum(1 for s in self._ready.get(kind.owner, []) if s.kind == kind)
        return max(0, self._wanted.get(kind, 0) - have - self._booting.get(kind, 0))

    async def _boot_one(self, kind: Kind, booted: list[bool]) -> None:
        async with self._limiter:
            if kind not in self._wanted or not self._missing(kind):
                return  # dropped, or taken care of meanwhile
            sid = self._new_id()
            self._booting[kind] = self._booting.get(kind, 0) + 1
            try:
                rt = await self._boot(sid, kind)
            except Exception as e:  # e.g. the owner went meanwhile: no spare, no harm
                log.info("fork spare for %s not booted: %s", kind.owner, e)
                return
            finally:
                self._booting[kind] -= 1
                if not self._booting[kind]:
                    del self._booting[kind]
            spare = Spare(sid, kind, rt)
            if kind not in self._wanted:   # dropped while it booted
                await self._stop(rt)
                return
            self._ready.setdefault(kind.owner, []).append(spare)
            self._background.start_soon(self._watch, spare)
            booted.append(True)

    async def _watch(self, spare: Spare) -> None:
        """Reap a spare's launcher; if its init dies while it waits (its owner's init died,
        taking every process of the namespaces below with it), or it waits for idle_s,
        drop it."""
        with spare.watch:
            with trio.move_on_after(self.idle_s):
                await spare.rt.launcher.wait()
                spare.rt.exited.set()
            spares = self._ready.get(spare.kind.owner, [])
            if spare in spares:
                spares.remove(spare)
                await self._stop(spare.rt)

    async def drop(self, owner: str) -> None:
        """Stop every spare of `owner` (its teardown: they live in its pid namespace)."""
        for kind in [k for k in self._wanted if k.owner == owner]:
            del self._wanted[kind]
        for spare in self._ready.pop(owner, []):
            spare.watch.cancel()
            try:
                await self._stop(spare.rt)
            except Exception:  # its owner's teardown goes on; a restart removes the rest
                log.exception("stopping fork spare %s failed", spare.sid)

    async def close(self) -> None:
        for owner in list(self._ready):
            await self.drop(owner)
        self._wanted.clear()
