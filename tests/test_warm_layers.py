"""The warm pool's clones stay bounded: a long session of checkpoints and rollbacks, or forks
from many checkpoints, must not leave a clone behind per checkpoint (each btrfs snapshot keeps
back-references in the store's extent tree, and every later commit pays for them: see
deltabox/daemon/warm.py, MAX_SPARES). Real daemon, real btrfs store."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from conftest import DaemonProc, new_sandbox, private_daemon

from deltabox import Sandbox
from deltabox.daemon.service import CLEAN_AFTER_DELETES
from deltabox.daemon.warm import MAX_SPARES

WARM_GENERATIONS = 2


def settled_layers(d: DaemonProc) -> int:
    """How many layers the store holds once the daemon's background work has stopped
    changing that number for a second."""
    store = Path(d.state_dir) / "store" / "layers"
    last, since = -1, time.monotonic()
    deadline = time.monotonic() + 60
    while time.monotonic() - since < 1.0:
        assert time.monotonic() < deadline, "the store's layers never settled"
        n = len(os.listdir(store))
        if n != last:
            last, since = n, time.monotonic()
        time.sleep(0.05)
    return last


def layers_added(warm_generations: int, step: Callable[[Sandbox, int], None],
                 n: int) -> int:
    """Layers the store gained over `n` calls of step(sandbox, i) on a fresh private daemon,
    counted while the sandbox still holds its checkpoints."""
    with private_daemon("dbx-warm-") as d:
        d.start("--no-inspector", "--warm-generations", str(warm_generations))
        with new_sandbox(d.socket) as sbx:
            sbx.exec("true")
            before = settled_layers(d)
            for i in range(n):
                step(sbx, i)
            return settled_layers(d) - before


def test_checkpoints_and_rollbacks_keep_no_clone_per_checkpoint() -> None:
    cycles = 12

    def cycle(sbx: Sandbox, i: int) -> None:
        sbx.files.write("f", f"{i}")
        cp = sbx.checkpoint()
        sbx.files.write("f", "changed")
        sbx.rollback(cp)
        assert sbx.files.read("f").decode() == f"{i}"

    grown = layers_added(WARM_GENERATIONS, cycle, cycles)
    # One layer per checkpoint, plus at most the ready generations (their clones) and the
    # live layer's successor; a spare per checkpoint would add `cycles` more.
    assert cycles <= grown <= cycles + WARM_GENERATIONS + 1, grown


def test_spares_left_by_forks_are_bounded() -> None:
    forked = MAX_SPARES + 4

    def fork_one(sbx: Sandbox, i: int) -> None:
        sbx.files.write("f", f"{i}")
        cp = sbx.checkpoint()
        kid = sbx.fork(cp)[0]
        assert kid.files.read("f").decode() == f"{i}"
        kid.kill()

    grown = layers_added(0, fork_one, forked)
    # One layer per checkpoint, and a spare for at most MAX_SPARES of them.
    assert forked <= grown <= forked + MAX_SPARES, grown


def test_removed_forks_are_dropped_from_the_store_within_seconds() -> None:
    """Forks made and removed in bulk (tree search) leave deleted subvolumes that btrfs's
    cleaner would drop only at its periodic wake-up (up to 30 s); until then every snapshot
    pays for them. The daemon has it drop them once enough piled up (clean_store)."""
    with private_daemon("dbx-warm-") as d:
        d.start("--no-inspector")
        store = str(Path(d.state_dir) / "store")
        with new_sandbox(d.socket) as sbx:
            sbx.files.write("f", "x")
            kids = sbx.fork(sbx.checkpoint(), count=CLEAN_AFTER_DELETES + 4)
            for kid in kids:
                kid.kill()
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                r = subprocess.run(["btrfs", "subvolume", "list", "-d", store],
                                   capture_output=True, text=True, check=True)
                if not r.stdout.strip():
                    break
                time.sleep(0.2)
            assert not r.stdout.strip(), f"still not dropped after 15 s:\n{r.stdout}"
