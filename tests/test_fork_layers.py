"""fork(shared_layer=True): the children stack the source checkpoint's layer, read-only and
shared, under an empty layer of their own (Daemon._fork_files): what they see, what they
change, how long that layer lives, and what a default fork does instead."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from deltabox import Sandbox

from conftest import DaemonProc


def _layers_holding(daemon: DaemonProc, path: str) -> set[str]:
    """The store's layers whose own files (their upper) include `path`."""
    layers = daemon.state_dir / "store" / "layers"
    return {p.name for p in layers.iterdir() if (p / "upper" / path.lstrip("/")).exists()}


def _stacking(daemon: DaemonProc, sandbox_id: str) -> tuple[Path, list[str]]:
    """A sandbox's own writable layer (its path) and the layers it stacks, from the
    daemon's database (read-only)."""
    import sqlite3

    db = sqlite3.connect(f"file:{daemon.state_dir / 'deltabox.db'}?mode=ro", uri=True)
    try:
        layer, bases = db.execute("SELECT layer_id, bases FROM sandboxes WHERE id=?",
                                  (sandbox_id,)).fetchone()
    finally:
        db.close()
    return daemon.state_dir / "store" / "layers" / layer, [b for b in bases.split(":") if b]


def _shares(daemon: DaemonProc, kid: Sandbox, path: str, base: str) -> None:
    """`kid` stacks the layer `base` and its own layer holds nothing at `path`."""
    own, bases = _stacking(daemon, kid.id)
    assert base in bases, (own.name, bases)
    assert not (own / "upper" / path.lstrip("/")).exists(), f"{own.name} has a copy of {path}"


def _wait_gone(daemon: DaemonProc, path: str, timeout: float = 20) -> set[str]:
    deadline = time.monotonic() + timeout
    while (left := _layers_holding(daemon, path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _story(daemon: DaemonProc, layers: set[str], path: str) -> str:
    """For a failure: what each layer left holds at `path`, and the daemon's log about it."""
    root = daemon.state_dir / "store" / "layers"
    held = {name: (root / name / "upper" / path.lstrip("/")).read_bytes()[:20]
            for name in layers}
    log = [line for line in daemon.log.read_text(errors="replace").splitlines()
           if any(name in line for name in layers)]
    return f"{held}; daemon log: {log[-20:]}"


def test_children_share_the_checkpoint_layer(daemon: DaemonProc, sbx: Sandbox) -> None:
    tag = uuid.uuid4().hex[:12]
    marker, doomed = f"/data/{tag}/marker", f"/data/{tag}/doomed"
    sbx.files.write(marker, "base")
    sbx.files.write(doomed, "x")
    cp = sbx.checkpoint()
    kids = sbx.fork(cp, count=2, shared_layer=True)
    try:
        for i, k in enumerate(kids):
            assert k.files.read(marker) == b"base"
            k.files.write(f"/data/{tag}/kid{i}", str(i))
            own = _layers_holding(daemon, f"/data/{tag}/kid{i}")
            assert len(own) == 1  # the child's own layer...
            assert not (_layer(daemon, own) / "upper" / marker.lstrip("/")).exists()
            # ...holds nothing of the checkpoint's files: they are read from its layer.
        kids[0].files.write(marker, "changed by kid0")
        kids[0].exec(["rm", doomed])
        assert kids[1].files.read(marker) == b"base"
        assert kids[1].exec(["cat", doomed]).stdout == "x"
        assert sbx.files.read(marker) == b"base"
        mine = kids[0].checkpoint()
        diff = sbx.diff(cp, mine)
        assert f"/data/{tag}/kid0" in diff.added
        assert marker in diff.modified and doomed in diff.deleted
        assert f"/data/{tag}/kid1" not in diff.added
        assert not (set(sbx.diff(mine, mine).added) | set(sbx.diff(mine, mine).modified))
        kids[0].rollback(cp)  # back to the source checkpoint itself
        assert kids[0].files.read(marker) == b"base"
        assert kids[0].exec(["cat", doomed]).stdout == "x"
        kids[0].rollback(mine)
        assert kids[0].files.read(marker) == b"changed by kid0"
        assert kids[0].exec(["test", "-e", doomed]).exit_code == 1
    finally:
        for k in kids:
            k.kill()


def _layer(daemon: DaemonProc, names: set[str]) -> Path:
    return daemon.state_dir / "store" / "layers" / next(iter(names))


def test_the_shared_layer_outlives_its_checkpoint_and_source(daemon: DaemonProc) -> None:
    """Deleting the checkpoint and removing the sandbox that took it keep its layer while
    a child stacks it; the last child removed frees it."""
    tag = uuid.uuid4().hex[:12]
    marker = f"/data/{tag}/marker"
    src = Sandbox.create(socket=daemon.socket)
    kid = None
    try:
        src.files.write(marker, "base")
        cp = src.checkpoint()
        kid = src.fork(cp, shared_layer=True)[0]
        mine = kid.checkpoint()
        src.delete_checkpoint(cp)
    finally:
        src.kill()
    try:
        assert kid is not None
        assert kid.files.read(marker) == b"base"
        kid.files.write(marker, "later")
        kid.rollback(mine)
        assert kid.files.read(marker) == b"base"
        assert _layers_holding(daemon, marker)  # the checkpoint's layer, still stacked
    finally:
        if kid is not None:
            kid.kill()
    left = _wait_gone(daemon, marker)
    assert not left, f"the shared layer was not freed: {_story(daemon, left, marker)}"


def test_a_child_keeps_sharing_across_its_rollbacks(daemon: DaemonProc, sbx: Sandbox,
                                                    ebpf: str) -> None:
    """A shared-layer child stays one: its auto checkpoint after a turn that only read
    (`skipped` in any other sandbox: an alias of its parent) is a snapshot of its own layer,
    and a rollback to the checkpoint it was forked from gives it a new empty layer over that
    checkpoint's, as the fork did. Before, both rollbacks gave it a writable copy of all
    the checkpoint's files (read cold from a new snapshot after each rollback, counted in
    its disk quota) while its siblings shared one."""
    tag = uuid.uuid4().hex[:12]
    marker = f"/data/{tag}/marker"
    sbx.files.write(marker, "base")
    shell = sbx.session("main")
    shell.run(f"cd /data/{tag} && X=forked")
    cp = sbx.checkpoint(mode="full")
    kid = sbx.fork(cp, shared_layer=True)[0]
    try:
        base = _stacking(daemon, kid.id)[1][0]  # the checkpoint's layer
        assert kid.exec(["cat", marker]).stdout == "base"
        mine = kid.checkpoint()
        assert mine.kind == "fs", mine.reasons
        assert any("stacks that checkpoint's files read-only" in r for r in mine.reasons)
        # The second rollback to `cp` takes what the warm pool prepared after the first
        # (an empty layer over cp's, mounted, its session spawned ahead).
        for target in (mine, cp, cp):
            kid.files.write(marker, "later")  # copied up into the child's live layer
            time.sleep(0.5)
            rb = kid.rollback(target)
            assert kid.files.read(marker) == b"base"
            _shares(daemon, kid, marker, base)
            assert rb.process_state == "restored", rb.note
            assert kid.session("main").run("pwd; echo $X").stdout.split() == [
                f"/data/{tag}", "forked"]
        assert kid.files.write(marker, "again").size == 5  # still writable, as its own
        assert sbx.files.read(marker) == b"base"
    finally:
        kid.kill()


def test_a_stopped_child_boots_again_sharing(daemon: DaemonProc, sbx: Sandbox) -> None:
    """A shared-layer child whose init died is stopped; rolled back to its fork point, it
    boots on a new empty layer over the checkpoint's, as a live one does."""
    import os
    import signal

    tag = uuid.uuid4().hex[:12]
    marker = f"/data/{tag}/marker"
    sbx.files.write(marker, "base")
    cp = sbx.checkpoint()
    kid = sbx.fork(cp, shared_layer=True)[0]
    try:
        kid.files.write(marker, "later")
        base = _stacking(daemon, kid.id)[1][0]
        os.kill(kid.info().init_pid, signal.SIGKILL)  # as if the kernel had killed it
        deadline = time.monotonic() + 10
        while kid.info().state != "stopped" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kid.info().state == "stopped"
        kid.rollback(cp)
        assert kid.info().state == "running"
        assert kid.exec(["cat", marker]).stdout == "base"
        _shares(daemon, kid, marker, base)
    finally:
        kid.kill()


def test_forks_of_forks_see_every_ancestor(daemon: DaemonProc, sbx: Sandbox) -> None:
    """Each generation of forks stacks one more layer, up to a limit beyond which a child
    gets a copy: every level sees what each ancestor wrote, and its own changes only."""
    tag = uuid.uuid4().hex[:12]
    made: list[Sandbox] = []
    cur = sbx
    try:
        for level in range(7):
            cur.files.write(f"/data/{tag}/level{level}", str(level))
            cur.files.write(f"/data/{tag}/last", str(level))
            cp = cur.checkpoint()
            cur = cur.fork(cp, shared_layer=True)[0]
            made.append(cur)
            for j in range(level + 1):
                assert cur.files.read(f"/data/{tag}/level{j}") == str(j).encode()
            assert cur.files.read(f"/data/{tag}/last") == str(level).encode()
        first = sbx.checkpoints()[0]
        diff = sbx.diff(first, cur.checkpoint())
        assert {f"/data/{tag}/level{j}" for j in range(1, 7)} <= set(diff.added)
        assert f"/data/{tag}/last" in diff.modified
        assert sbx.files.read(f"/data/{tag}/last") == b"0"
    finally:
        for k in made:
            k.kill()


def test_default_fork_copies_and_keeps_posix_semantics(daemon: DaemonProc,
                                                         sbx: Sandbox) -> None:
    """Without shared_layer a child owns a snapshot of the checkpoint: hard links stay
    links and its directories can be renamed, as in the source; a shared-layer child
    shows overlayfs's limits on the same files instead."""
    tag = uuid.uuid4().hex[:12]
    d = f"/data/{tag}"
    sbx.exec(["sh", "-c", f"mkdir -p {d}/dir && echo one > {d}/a && ln {d}/a {d}/b"])
    cp = sbx.checkpoint()
    kid = sbx.fork(cp)[0]
    shared = sbx.fork(cp, shared_layer=True)[0]
    try:
        r = kid.exec(["sh", "-c", f"echo two >> {d}/a; cat {d}/b; stat -c %h {d}/b; "
                                  f"python3 -c 'import os; os.rename(\"{d}/dir\", "
                                  f"\"{d}/moved\")' && echo renamed"])
        assert r.stdout.split() == ["one", "two", "2", "renamed"], r
        r = shared.exec(["python3", "-c", f"import os; os.rename('{d}/dir', '{d}/moved')"])
        assert r.exit_code != 0 and "Invalid cross-device link" in r.stderr
        r = shared.exec(["sh", "-c", f"echo two >> {d}/a; cat {d}/b"])
        assert r.stdout.split() == ["one"]  # the link broke at the copy-up
    finally:
        kid.kill()
        shared.kill()
