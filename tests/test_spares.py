"""The fork spares' pool (daemon/spares.py) over real processes.

`sleep` processes stand in for the inits: what the pool does with an init is wait for its
exit, hand it to a fork or stop it. The daemon's real spares (cgroups, namespaces, a fork
taking them, the owner's removal) are tested in test_cr.py and test_recovery.py."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import trio

from deltabox.background import GuardedNursery
from deltabox.daemon import spares as spares_mod
from deltabox.daemon.idlegc import IdleCollector
from deltabox.daemon.spares import Kind, Spares
from deltabox.sandbox import runtime
from deltabox.sandbox.cgroups import Limits

KIND = Kind("sb-0000000001", Limits(4096, 4096, 0.0), False)
OTHER = Kind("sb-0000000001", Limits(1024, 4096, 0.0), False)   # other limits


class Pool:
    """A Spares whose inits are `sleep`s; records what it booted and stopped."""

    def __init__(self, nursery: trio.Nursery, **kw: Any) -> None:
        self.booted: list[str] = []
        self.stopped: list[str] = []
        self.booting = self.most_at_once = 0
        ids = (f"sb-{i:010x}" for i in itertools.count(100))
        self.spares = Spares(self.boot, self.stop, lambda: next(ids),
                             GuardedNursery(nursery), **{"per_owner": 32, **kw})

    async def boot(self, sid: str, kind: Kind) -> runtime.Runtime:
        self.booting += 1
        self.most_at_once = max(self.most_at_once, self.booting)
        try:
            proc = await trio.lowlevel.open_process(["sleep", "1000"])
            await trio.sleep(0.02)   # an init takes a while to report ready
        finally:
            self.booting -= 1
        self.booted.append(sid)
        return runtime.Runtime(sid, None, proc, proc.pid, -1)  # type: ignore[arg-type]

    async def stop(self, rt: runtime.Runtime) -> None:
        if rt.launcher.returncode is None:
            rt.launcher.kill()
        await rt.launcher.wait()
        self.stopped.append(rt.sandbox_id)

    def ready(self, owner: str = KIND.owner) -> list[str]:
        return [s.sid for s in self.spares._ready.get(owner, [])]


async def _until(cond: Any, timeout: float = 5.0) -> None:
    with trio.fail_after(timeout):
        while not cond():
            await trio.sleep(0.01)


def test_spares_are_booted_two_at_a_time_taken_by_kind_trimmed_and_dropped() -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            p = Pool(nursery)
            p.spares.want(KIND, 5)
            await _until(lambda: len(p.ready()) == 5)
            assert p.most_at_once == 2
            assert p.spares.take(OTHER) is None   # other limits: not this kind's init
            got = p.spares.take(KIND)
            assert got is not None and got.rt.launcher.returncode is None
            assert got.sid not in p.ready()
            p.spares.want(KIND, 2)   # a fork of 2 children: two spares, not four
            await _until(lambda: len(p.stopped) == 2)
            assert len(p.ready()) == 2 and got.sid not in p.stopped
            p.spares.want(KIND, 100)   # at most per_owner
            await _until(lambda: len(p.ready()) == 32, timeout=10)
            await trio.sleep(0.1)
            assert len(p.ready()) == 32
            left = p.ready()
            await p.spares.drop(KIND.owner)
            assert p.ready() == [] and set(left) <= set(p.stopped)
            p.spares.want(KIND, 1)   # the owner came back (another boot of it)
            await _until(lambda: len(p.ready()) == 1)
            await p.spares.close()
            assert p.ready() == []
            got.rt.launcher.kill()   # taken: the fork's to stop, here the test's
            await got.rt.launcher.wait()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_spare_whose_init_dies_or_idles_is_stopped() -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            p = Pool(nursery, idle_s=1.0)
            p.spares.want(KIND, 2)
            await _until(lambda: len(p.ready()) == 2)
            first, second = p.spares._ready[KIND.owner]
            first.rt.launcher.kill()   # its owner's init died, taking it along
            await _until(lambda: first.sid in p.stopped)
            assert p.ready() == [second.sid]
            with trio.fail_after(3):   # never taken: stopped after idle_s
                await _until(lambda: second.sid in p.stopped)
            assert p.ready() == [] and second.rt.launcher.returncode is not None
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_spares_boot_once_the_calls_have_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fork's children run their first commands at once: the spares that replace the
    ones it took wait until the daemon's calls stop (idlegc.IdleCollector.quiet), and a
    daemon that never stops gets them after QUIET_WAIT_S anyway."""
    monkeypatch.setattr(spares_mod, "QUIET_WAIT_S", 1.0)
    calls = IdleCollector(quiet_s=0.05, threshold=10**9)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            p = Pool(nursery)
            p.spares.quiet = calls.quiet
            ended = trio.Event()

            async def child_command() -> None:
                await trio.sleep(0.3)
                ended.set()
            nursery.start_soon(calls.call, child_command)
            await trio.sleep(0.01)
            p.spares.want(KIND, 2)
            await ended.wait()
            assert p.booted == []                   # not while the call ran
            await _until(lambda: len(p.ready()) == 2)

            async def endless() -> None:
                await trio.sleep(100)
            nursery.start_soon(calls.call, endless)
            await trio.sleep(0.01)
            got = p.spares.take(KIND)
            assert got is not None
            p.spares.want(KIND, 2)
            with trio.fail_after(0.8):
                await trio.sleep(0.5)
                assert len(p.ready()) == 1          # still waiting for quiet
            await _until(lambda: len(p.ready()) == 2, timeout=2.0)   # at most QUIET_WAIT_S
            await p.spares.close()
            got.rt.launcher.kill()   # taken: the fork's to stop, here the test's
            await got.rt.launcher.wait()
            nursery.cancel_scope.cancel()

    trio.run(main)
