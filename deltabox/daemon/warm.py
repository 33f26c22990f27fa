"""The warm pool of file-system state: work done for a rollback before it is asked for.

After a checkpoint, while the agent is thinking, the daemon prepares in the background
- for the sandbox that took the checkpoint, a *ready generation*: a writable clone of the
  checkpoint (a btrfs snapshot costs a transaction commit, milliseconds that would otherwise
  sit on the critical path of every rollback) already mounted as that sandbox's root in a new
  mount namespace. Rolling back to it is then a kill of the sandbox's processes and a swap of
  two file descriptors; after the rollback, another one is prepared for the next rollback to
  the same checkpoint;
- once a fork (or the rollback of a stopped sandbox) has taken a clone of a checkpoint, a
  *spare*: an unmounted clone for the next one;
- in a ready generation, the checkpoint's processes that a rollback gives new pids anyway
  (group and session leaders: every session shell) spawned ahead from their templates and
  held stopped (DeltaCR.prespawn): the rollback lets them run. The others need their pid,
  which the live process holds until the rollback kills it.

Everything is keyed by the checkpoint's *layer*: checkpoints that alias their parent (a
skipped checkpoint) share its layer, and so its spare and ready generation. A sandbox that
stacks a checkpoint's layer read-only (a shared-layer fork child) goes back to that
checkpoint on a new *empty* layer over it: its ready generation is keyed `stacked_key(layer)`.

Nothing here is durable: after a crash, spares are unreferenced layers that recovery removes.
Ready generations hold a mount namespace each, so they are bounded per sandbox (oldest out);
spares are bounded too (MAX_SPARES, least recently prepared out): see there why.
"""

from __future__ import annotations

import functools
import logging
import os
import select
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from ..background import GuardedNursery
from ..cr.engine import ProcessState, Prespawned
from ..fs.prewarm import prewarm
from ..fs.store import Store
from ..sandbox.reaper import kill_pidfds
from ..sandbox.runtime import Generation, Runtime
from .scheduler import IOScheduler

log = logging.getLogger("deltaboxd")

# (sandbox id, checkpoint layer, its clone) -> a generation of that sandbox on the clone, and
# the runtime it is valid for (a generation is bound to the sandbox's pid namespace).
BuildFn = Callable[[str, str, str], Awaitable[tuple[Generation, Runtime] | None]]

MAX_QUEUED = 64   # background I/O jobs waiting for a slot beyond which nothing is prepared
# Ready generations per sandbox that hold carriers (the most recently prepared): each set is
# stopped processes in the sandbox's cgroup (a checkpoint's freeze and listing pay for them)
# and their page tables and pipes; older ready generations keep only their mount.
MAX_CARRIER_SETS = 8
# Threads that clone layers on demand at once (a fork of many: concurrent snapshots, each in a
# directory of its own (BtrfsStore._staged), share transaction commits). Their own limiter:
# on trio's default one (40), a fork of 32 or more
# would hold the threads every other sandbox needs to start a process (trio starts
# processes from a worker thread) until its clones are done.
CLONE_THREADS = 32
# Spares kept at once (least recently prepared out). Clones are not free after they are made:
# a btrfs snapshot copies its source's root node, adding a back-reference to each of that
# node's children (~300 for a 10k-file tree) that stays in the extent tree until the snapshot
# is deleted *and* btrfs's cleaner has dropped it (it runs every 30 s); every later transaction
# commit rewrites more of the grown extent tree. Hence no spare per checkpoint ahead of need:
# there was one, re-made after every ready generation built, and in benchmarks/long_session.py
# (60 checkpoint + rollback cycles of bash + 200 MB python + 10k files, every checkpoint kept)
# the store wrote 16.2-16.7 MB per cycle by the last 10 cycles where it now writes 9.1-9.2,
# and those checkpoints took 27.6-29.5 ms (daemon p50) where they now take 19.3-21.5 (two
# runs each, interleaved).
MAX_SPARES = 16

STACKED = "stacked:"


def stacked_key(cp_layer: str) -> str:
    """The key of what is prepared for a rollback to `cp_layer`'s checkpoint by a sandbox
    that stacks that layer: an empty layer over it, not a clone of it."""
    return STACKED + cp_layer


def source_layer(key: str) -> str:
    """The checkpoint layer a key prepares for."""
    return key.removeprefix(STACKED)


@dataclass
class Ready:
    layer_id: str
    generation: Generation
    runtime: Runtime
    procs: Prespawned | None = None     # set by the `prespawn` hook
    # carriers dropped (their templates went) whose discard waits for the sandbox's lock:
    # a rollback that takes this generation discards them first, under that lock (they
    # hold objects of the generation that it makes again: a pty's index in its devpts)
    dropped: list[Prespawned] = field(default_factory=list)
    reading: trio.Event | None = None   # set when a read ahead of its files has ended


# Hooks the daemon sets: spawn a Ready's processes ahead (sets ready.procs), discard
# processes spawned ahead (under the sandbox's lock), and wait until a sandbox runs no
# command of its caller's (foreground.py).
PrespawnFn = Callable[[str, str, Ready], Awaitable[None]]
DiscardFn = Callable[[str, Prespawned], Awaitable[None]]
QuietFn = Callable[[str], Awaitable[None]]


class WarmPool:
    def __init__(self, store: Store, background: GuardedNursery, build: BuildFn,
                 exists: Callable[[str], bool], is_current: Callable[[str, Runtime], bool],
                 io: IOScheduler, per_sandbox: int = 8, max_spares: int = MAX_SPARES,
                 delay: float = 0.02, prewarm_bytes: int = 0) -> None:
        self.store = store
        self.io = io
        self.background = background
        self.build = build
        self.exists = exists
        self.is_current = is_current
        self.per_sandbox = per_sandbox
        self.max_spares = max_spares
        self.delay = delay
        self.prewarm_bytes = prewarm_bytes
        # checkpoint layer -> its clone, least recently prepared first
        self.spares: OrderedDict[str, str] = OrderedDict()
        self.preparing: set[tuple[str | None, str]] = set()  # (sandbox, layer) under way
        # sandbox -> checkpoint layer -> Ready
        self.ready: dict[str, OrderedDict[str, Ready]] = {}
        self.new_id: Callable[[], str] = lambda: ""
        self.prespawn: PrespawnFn | None = None
        self.discard_procs: DiscardFn | None = None
        self.quiet: QuietFn | None = None
        self.clone_threads = trio.CapacityLimiter(CLONE_THREADS)

    @property
    def enabled(self) -> bool:
        return self.store.cheap_clone

    def prepare(self, sandbox_id: str | None, cp_layer: str) -> None:
        """Start preparing for a rollback (or fork) to the checkpoint(s) on `cp_layer`, in
        the background (nothing to do if it is prepared already)."""
        if not self.enabled:
            return
        if cp_layer in self.spares and (sandbox_id is None or
                                        cp_layer in self.ready.get(sandbox_id, {})):
            return
        key = (sandbox_id, cp_layer)
        # Once per (sandbox, layer) at a time; and none while background I/O is backed up:
        # warm state only saves a rollback a clone it can make on demand, and each queued
        # job holds memory until it runs (a soak of 32 sandboxes grew the queue unbounded).
        if key in self.preparing or self.io.queued >= MAX_QUEUED:
            return
        self.preparing.add(key)
        self.background.start_soon(self._prepare, sandbox_id, cp_layer)

    async def _prepare(self, sandbox_id: str | None, cp_layer: str) -> None:
        try:
            await self._prepare_now(sandbox_id, cp_layer)
        finally:
            self.preparing.discard((sandbox_id, cp_layer))

    async def _prepare_now(self, sandbox_id: str | None, cp_layer: str) -> None:
        # Let the call that triggered this, and the agent's next step, go first: a snapshot
        # here shares btrfs's transaction commit with their snapshots, and the whole
        # preparation competes for the CPUs with the sandbox's next command (after a
        # rollback, the agent runs one at once): it waits for that command's end.
        await trio.sleep(self.delay)
        if sandbox_id is not None and self.quiet is not None:
            await self.quiet(sandbox_id)
        src = source_layer(cp_layer)
        if cp_layer not in self.spares and self.max_spares > 0:
            layer = self.new_id()
            if not self.exists(src):
                return
            if src != cp_layer:
                await self.io.run(src, self.store.new_layer, layer)
            else:
                await self.io.run(cp_layer, self.store.clone, cp_layer, layer)
            if not self.exists(src) or cp_layer in self.spares:
                await trio.to_thread.run_sync(self.store.delete, layer)
            else:
                self._keep_spare(cp_layer, layer)
        if sandbox_id is not None:
            await self._make_ready(sandbox_id, cp_layer)

    async def _make_ready(self, sandbox_id: str, cp_layer: str) -> None:
        if self.per_sandbox <= 0 or cp_layer in self.ready.get(sandbox_id, {}):
            return
        layer = self.spares.pop(cp_layer, None)
        if layer is None:
            return
        async with self.io.slot(source_layer(cp_layer)):
            built = await self.build(sandbox_id, cp_layer, layer)
        if built is None or not self.exists(source_layer(cp_layer)) or \
                not self.is_current(sandbox_id, built[1]) or \
                cp_layer in self.ready.get(sandbox_id, {}):  # a concurrent prepare won
            await trio.to_thread.run_sync(self.store.delete, layer)
            if built is not None:
                await trio.to_thread.run_sync(built[0].close)
            return
        slot = self.ready.setdefault(sandbox_id, OrderedDict())
        ready = slot[cp_layer] = Ready(layer, built[0], built[1])
        while len(slot) > self.per_sandbox:
            _, old = slot.popitem(last=False)
            self._discard(old, sandbox_id)
        if self.prespawn is not None:
            await self.prespawn(sandbox_id, cp_layer, ready)
            holding = [r for r in slot.values() if r.procs is not None]  # oldest first
            for old_ready in holding[:max(0, len(holding) - MAX_CARRIER_SETS)]:
                self._discard_procs(sandbox_id, old_ready)
        if self.prewarm_bytes > 0 and cp_layer == source_layer(cp_layer):
            await self._prewarm(sandbox_id, cp_layer, ready)

    async def _prewarm(self, sandbox_id: str, cp_layer: str, ready: Ready) -> None:
        """Read the clone's files ahead (fs/prewarm.py) while it waits; a clone stacked
        empty over its checkpoint (stacked_key) has none of its own."""
        # Its own key: nothing in the foreground waits for it (io.wait).
        async with self.io.slot("prewarm:" + ready.layer_id):
            if not self.is_ready(sandbox_id, cp_layer, ready):
                return   # taken (or dropped) meanwhile: its files are read on demand
            upper = self.store.layer_path(ready.layer_id) / "upper"
            ready.reading = trio.Event()
            t0 = time.perf_counter()
            try:
                done = await trio.to_thread.run_sync(
                    functools.partial(prewarm, upper, max_bytes=self.prewarm_bytes))
            finally:
                ready.reading.set()
            log.debug("sandbox %s: read ahead for %s in %.1f ms: %s", sandbox_id, cp_layer,
                      (time.perf_counter() - t0) * 1000, done)

    def _keep_spare(self, cp_layer: str, layer: str) -> None:
        """Keep `layer` as cp_layer's spare; past max_spares, the least recently prepared
        spare is deleted (in the background)."""
        self.spares[cp_layer] = layer
        while len(self.spares) > self.max_spares:
            _, old = self.spares.popitem(last=False)
            self._delete_later(old)

    def _delete_later(self, layer: str) -> None:
        """Delete an unmounted clone in the background (a transaction commit)."""
        self.background.start_soon(trio.to_thread.run_sync, self.store.delete, layer)

    def is_ready(self, sandbox_id: str, cp_layer: str, ready: Ready) -> bool:
        """`ready` is still the one waiting for a rollback of that sandbox to cp_layer."""
        return self.ready.get(sandbox_id, {}).get(cp_layer) is ready

    def take_ready(self, sandbox_id: str, cp_layer: str, rt: Runtime) -> Ready | None:
        """A prepared generation of this sandbox on a clone of `cp_layer`, if ready."""
        ready = self.ready.get(sandbox_id, {}).pop(cp_layer, None)
        if ready is not None and ready.runtime is not rt:  # the sandbox was rebooted
            self._discard(ready, sandbox_id)
            return None
        return ready

    def carriers_of(self, sandbox_id: str, state: ProcessState) -> int:
        """How many ready generations hold carriers of `state`'s processes."""
        return sum(r.procs is not None and r.procs.state is state
                   for r in self.ready.get(sandbox_id, {}).values())

    def drop_procs(self, sandbox_id: str, state: ProcessState) -> None:
        """`state`'s templates go (evicted, released): so do its children spawned ahead,
        which would keep its pages alive."""
        for ready in self.ready.get(sandbox_id, {}).values():
            if ready.procs is not None and ready.procs.state is state:
                self._discard_procs(sandbox_id, ready)

    async def take_layer(self, cp_layer: str, spare_after: bool = True) -> str:
        """A writable clone of a checkpoint's layer: the spare if ready, else a fresh
        snapshot. `spare_after`: prepare a spare for the next call (a fork; a rollback
        prepares a ready generation instead, which a spare would only duplicate)."""
        layer = self.spares.pop(cp_layer, None)
        if layer is None:
            layer = self.new_id()
            await trio.to_thread.run_sync(self.store.clone, cp_layer, layer,
                                          limiter=self.clone_threads)
        if spare_after:
            self.prepare(None, cp_layer)
        return layer

    def drop_layer(self, cp_layer: str) -> None:
        """No checkpoint uses `cp_layer` any more: drop what was prepared for it."""
        for key in (cp_layer, stacked_key(cp_layer)):
            layer = self.spares.pop(key, None)
            if layer is not None:
                self._delete_later(layer)
            for sid, slot in self.ready.items():
                ready = slot.pop(key, None)
                if ready is not None:
                    self._discard(ready, sid)

    def drop_sandbox(self, sandbox_id: str) -> None:
        for ready in self.ready.pop(sandbox_id, {}).values():
            self._discard(ready, sandbox_id)

    def close(self) -> None:
        """At shutdown: release every prepared namespace and layer now."""
        for slot in self.ready.values():
            for ready in slot.values():
                if ready.procs is not None:  # the sandboxes are being stopped: kill only
                    _kill_now(ready.procs.spawned)
                    ready.procs.plan.close_all()
                ready.generation.close()
                self.store.delete(ready.layer_id)
        self.ready.clear()
        for layer in self.spares.values():
            self.store.delete(layer)
        self.spares.clear()

    def _discard_procs(self, sandbox_id: str, ready: Ready) -> None:
        procs, ready.procs = ready.procs, None
        if procs is not None and self.discard_procs is not None:
            ready.dropped.append(procs)
            self.background.start_soon(self.discard_procs, sandbox_id, procs)

    def _discard(self, ready: Ready, sandbox_id: str) -> None:
        procs, ready.procs = ready.procs, None

        async def discard() -> None:
            if procs is not None and self.discard_procs is not None:
                await self.discard_procs(sandbox_id, procs)  # they live in the generation
            if ready.reading is not None:  # its files are open in a worker thread
                await ready.reading.wait()
            await trio.to_thread.run_sync(ready.generation.close)
            await trio.to_thread.run_sync(self.store.delete, ready.layer_id)
        self.background.start_soon(discard)


def _kill_now(pids: set[int], timeout: float = 1.0) -> None:
    """SIGKILL and wait (a pidfd polls readable at exit): they hold the generation's mount
    namespace and files of its layer until then."""
    fds = kill_pidfds(pids)
    try:
        for fd in fds:
            select.select([fd], [], [], timeout)
    finally:
        for fd in fds:
            os.close(fd)
