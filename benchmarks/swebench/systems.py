"""The systems compared, behind one interface: run an action, checkpoint a node, roll back
to a node, make fan-out children. Every system runs in DeltaBox sandboxes started from the
same base checkpoint (the task's "image": repo + venv), runs the same actions through the
same SDK calls (`exec` with the trajectory's interpreter, env, cwd and timeout; `files` for
edits), and differs only in how it saves and restores state:

- `deltabox`: `sbx.checkpoint()` (mode auto) / `sbx.rollback(cp)` / `sbx.fork(cp, N)`.
- `copytree`: checkpoint = `cp -a --reflink=never WORKDIR /.bench-snapshots/NODE` inside the
  sandbox; rollback = `rm -rf WORKDIR && cp -a` of the copy back. Process/session state to
  replay: none (every action is a fresh subshell). In fan-out the copy leaves the sandbox
  (`download_tar`), each child is a fresh sandbox from the image plus `upload_tar` of it.
- `docker_commit`: checkpoint = a copy of the container's writable layer (what `docker
  commit` stores): the files of the sandbox's overlay upper dir that changed since the
  container started, copied on the host, plus the paths it deleted. Rollback = `docker run`
  of the committed image: a fresh sandbox from the base image, then the layers of the node's
  image applied (one `rm -rf` of deleted paths, one `upload_tar`).
- `restart_replay`: checkpoint = nothing; rollback = fresh sandbox from the image + replay of
  every action on the path from the root to the node.
- `floor`: the same actions, no checkpoint, no rollback.

Timed operations are appended to `System.ops`; the end-to-end time is their sum.
"""

from __future__ import annotations

import io
import os
import shutil
import sqlite3
import stat
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import kill_and_wait

from .env import SandboxEnv
from .trajectory import Action, Trajectory

SNAPSHOTS = "/.bench-snapshots"
Code = int | str


@dataclass
class Ctx:
    """What every system needs: the daemon, the task, the base image, the shared limits."""

    socket: str
    state_dir: Path               # the daemon's (docker_commit reads layer dirs from it)
    scratch: Path                 # host dir for docker_commit's layers
    traj: Trajectory
    env: SandboxEnv
    timeout: float                # per action, seconds; the same for every system
    think: float = 0.0            # pause before each decision (untimed)
    settle: Callable[[], float] = lambda: 0.0    # between two systems' runs (untimed)

    def fresh(self) -> Any:
        """A new sandbox from the base image (what `docker run IMAGE` is to docker: the
        image's files read-only and shared under a layer of its own, `shared_layer`)."""
        from deltabox import Sandbox

        return Sandbox.fork_from(self.env.base_checkpoint, socket=self.socket,
                                 shared_layer=True)[0]


def run_action(ctx: Ctx, sbx: Any, action: Action) -> Code:
    """Apply one action as the agent issued it; an exit code, or a string for what went
    wrong ("timeout", "no-match" when an edit's old text is absent, "missing", "error:X")."""
    if action.kind == "shell":
        return run_shell(ctx, sbx, action)[0]
    return run_edit(ctx, sbx, action)[0]


@dataclass
class NoWrite:
    """An edit that wrote nothing (its old text absent): the rollback its read carried."""
    rollback: Any
    checkpoint_id: str = ""


def run_edit(ctx: Ctx, sbx: Any, action: Action, **turn: Any) -> tuple[Code, Any]:
    """A file action (create, or replace `old` by `new` once); with `checkpoint=MODE,
    checkpoint_label=...` and `rollback_to=CP` as run_shell's: the rollback in the
    action's first call (an edit's read of the file, a create's write), the checkpoint in
    its write. (code, the SDK's WriteResult with the rollback's result, a NoWrite if
    nothing was written, or None if the first call failed)."""
    from deltabox import errors

    path = action.path if action.path.startswith("/") else f"{ctx.env.workdir}/{action.path}"
    first = {"rollback_to": turn.pop("rollback_to")} if "rollback_to" in turn else {}
    try:
        if action.kind == "create":
            return 0, sbx.files.write(path, action.content, **first, **turn)
        data = sbx.files.read(path, **first)
    except errors.NotFound:
        return "missing", None
    except errors.DeltaBoxError as e:
        return f"error:{type(e).__name__}", None
    rolled = getattr(data, "rollback", None)
    text = data.decode("utf-8", errors="surrogateescape")
    if action.old not in text:
        return "no-match", NoWrite(rolled)
    w = sbx.files.write(path, text.replace(action.old, action.new, 1).encode(
        "utf-8", errors="surrogateescape"), **turn)
    return 0, w.model_copy(update={"rollback": rolled}) if rolled is not None else w


def run_shell(ctx: Ctx, sbx: Any, action: Action, **turn: Any) -> tuple[Code, Any]:
    """A shell action; with `checkpoint=MODE, checkpoint_label=...` the sandbox is
    checkpointed at its end (DeltaBox's turn-boundary checkpoint), with `rollback_to=CP`
    rolled back first. (code, the SDK's ExecResult or None on a timeout)."""
    from deltabox import errors

    try:
        r = sbx.exec([*ctx.traj.interpreter, action.cmd], cwd=ctx.env.workdir,
                     env=ctx.env.exec_env, timeout=ctx.timeout, **turn)
    except errors.DeadlineExceeded:
        return "timeout", None
    return r.exit_code, r


def state_hash(ctx: Ctx, sbx: Any) -> dict[str, str]:
    """Digest of what the agent can observe: the workdir's files (without caches and .git),
    `git status`, and the venv's installed distributions. Untimed."""
    wd = ctx.env.workdir
    prune = (r"\( -name .git -o -name __pycache__ -o -name .pytest_cache "
             r"-o -name '*.egg-info' \) -prune")
    script = (f"cd {wd} && {{ find . {prune} -o -type f -print0 | LC_ALL=C sort -z | "
              "xargs -0 -r sha256sum; find . " + prune + " -o -type l -printf '%p -> %l\\n' "
              "| LC_ALL=C sort; } | sha256sum | cut -c1-16; "
              "git --no-optional-locks status --porcelain 2>&1 | sha256sum | cut -c1-16; ")
    if ctx.env.venv:
        script += (f"ls {ctx.env.venv}/lib/python3*/site-packages | LC_ALL=C sort | "
                   "sha256sum | cut -c1-16")
    else:
        script += "echo none"
    r = sbx.exec(["bash", "-c", script], timeout=120)
    parts = r.stdout.split()
    keys = ("workdir", "git_status", "site_packages")
    return dict(zip(keys, parts)) if len(parts) == 3 else {"error": r.stderr[-200:]}


class System:
    """Base: one live sandbox, a list of timed operations, the codes of the actions."""

    name = "system"
    forks = True                  # makes children in fan-out (the floor: the action N times)

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.sbx: Any = None
        self.ops: list[dict[str, Any]] = []
        self.cleanup_ms: list[float] = []      # kills of replaced sandboxes (untimed)
        self.tag: dict[str, Any] = {}          # merged into every record (phase, fan-out N)
        self.replay_codes: list[dict[str, Any]] = []   # paths replayed (_replay)

    # --- bookkeeping ----------------------------------------------------------------------
    def record(self, op: str, ms: float, **extra: Any) -> dict[str, Any]:
        rec = {"op": op, "ms": ms, **self.tag, **extra}
        self.ops.append(rec)
        return rec

    def _kill(self, sbx: Any) -> None:
        """Untimed: kill a sandbox and wait until the daemon has torn it down (it answers
        before), so that no timed operation that follows pays for it."""
        t0 = time.perf_counter()
        try:
            kill_and_wait([sbx])
        except Exception:
            pass
        self.cleanup_ms.append((time.perf_counter() - t0) * 1000)

    # --- the interface --------------------------------------------------------------------
    def start(self) -> None:
        """Untimed: a sandbox from the image (every system starts the same way)."""
        self.sbx = self.ctx.fresh()

    def action(self, idx: int, step: int, sbx: Any | None = None, **extra: Any) -> Code:
        """Run action `idx` (in `sbx`, default the live sandbox), timed."""
        t0 = time.perf_counter()
        code = run_action(self.ctx, sbx or self.sbx, self.ctx.traj.actions[idx])
        self.record("action", (time.perf_counter() - t0) * 1000, step=step, action=idx,
                    code=code, **extra)
        return code

    def pause(self) -> None:
        """The agent's model "thinking" before its next decision (untimed, every system)."""
        if self.ctx.think > 0:
            time.sleep(self.ctx.think)

    def checkpoint(self, node: int, path: list[int], step: int) -> None:
        """Save the live state as `node` (whose path from the root is `path`)."""

    def act_and_checkpoint(self, idx: int, step: int, node: int, path: list[int]) -> Code:
        """An expansion: action `idx`, then save the result as `node`."""
        code = self.action(idx, step, node=node)
        self.checkpoint(node, path, step)
        return code

    def rollback(self, node: int, path: list[int], step: int) -> None:
        raise NotImplementedError

    def extras(self) -> dict[str, Any]:
        """What results.json keeps of this system besides its operations."""
        return {}

    def _replay(self, sbx: Any, path: list[int], step: int) -> list[Code]:
        """Run the actions of `path` in `sbx` (a fresh sandbox): the node's state without
        C/R. Their codes are kept in replay_codes; timing them is the caller's choice."""
        codes = [run_action(self.ctx, sbx, self.ctx.traj.actions[i]) for i in path]
        self.replay_codes.append({"step": step, "actions": list(path), "codes": codes})
        return codes

    def _restart(self, path: list[int], step: int) -> float:
        """The live sandbox replaced by a fresh one with `path` replayed in it (the kill
        of the old one untimed); the ms the fresh one and the replay took."""
        old, self.sbx = self.sbx, None
        self._kill(old)
        t0 = time.perf_counter()
        self.sbx = self.ctx.fresh()
        self._replay(self.sbx, path, step)
        return (time.perf_counter() - t0) * 1000

    def children(self, node: int, path: list[int], n: int, step: int) -> list[Any]:
        """`n` sandboxes in the state of `node` (fan-out); the caller kills them."""
        raise NotImplementedError

    def hash(self, sbx: Any | None = None) -> dict[str, str]:
        return state_hash(self.ctx, sbx or self.sbx)

    def close(self) -> None:
        if self.sbx is not None:
            self._kill(self.sbx)
            self.sbx = None


class Floor(System):
    """The same actions in the same states, without checkpoint or rollback. A step that
    expands another node than the live one gets that node's state off the clock: a fresh
    sandbox with the node's path replayed, untimed (restart_replay's rollback, unpaid).
    Before stop 59 the floor ran every expansion's action on one path, so its actions did
    other work than the tree's (a `python x.py` after a rollback compiles its modules again;
    on the floor's path they were compiled already)."""

    name = "floor"
    forks = False

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        self.replays_untimed_ms: list[float] = []

    def rollback(self, node: int, path: list[int], step: int) -> None:
        self.replays_untimed_ms.append(self._restart(path, step))
        # The replay is a burst of commands: the action right after it ran on a busy
        # machine, 2-3 ms faster than after a think pause as at the floor's other steps
        # (stop 72: requests-5414's `nl | sed` 7.6 against 10.8 ms p50), which charged
        # the systems that do pay a rollback with that difference. An agent without C/R
        # thinks before every action: so does the floor, after its untimed replay.
        self.pause()

    def extras(self) -> dict[str, Any]:
        return {"replay_codes": self.replay_codes,
                "replays_untimed_ms": self.replays_untimed_ms}


class DeltaBox(System):
    name = "deltabox"

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        self.cps: dict[int, Any] = {}

    def checkpoint(self, node: int, path: list[int], step: int) -> None:
        from deltabox import errors

        refused = ""
        t0 = time.perf_counter()
        try:
            cp = self.sbx.checkpoint(label=f"node {node}")
        except errors.FailedPrecondition as e:
            # A process DeltaCR cannot capture (e.g. a server an agent left running): keep
            # going with the files, as the baselines do, and say so in the record.
            refused = str(e)[:300]
            cp = self.sbx.checkpoint(mode="fs", label=f"node {node}")
        self.record("checkpoint", (time.perf_counter() - t0) * 1000, step=step, node=node,
                    kind=cp.kind, reasons=list(cp.reasons), server_ms=cp.duration_ms,
                    freeze_ms=cp.freeze_ms, files_changed=cp.files_changed,
                    bytes_changed=cp.bytes_changed, auto_refused=refused)
        self.cps[node] = cp

    def rollback(self, node: int, path: list[int], step: int) -> None:
        t0 = time.perf_counter()
        rb = self.sbx.rollback(self.cps[node])
        self.record("rollback", (time.perf_counter() - t0) * 1000, step=step, node=node,
                    server_ms=rb.duration_ms, process_state=rb.process_state, note=rb.note)

    def children(self, node: int, path: list[int], n: int, step: int) -> list[Any]:
        """fork(count=n) with `shared_layer=True`, as a fan-out should: the children stack
        the checkpoint's layer read-only, so the files their action reads are read once,
        not once per child (a clone's files start with a cold page cache: an import-heavy
        python ~40 ms slower per child in a probe, benchmarks/swebench/README.md)."""
        t0 = time.perf_counter()
        kids = self.sbx.fork(self.cps[node], count=n, shared_layer=True)
        self.record("fork", (time.perf_counter() - t0) * 1000, step=step, node=node, count=n,
                    process_state=kids[0].process_state if kids else "", shared_layer=True)
        return kids


class DeltaBoxTurn(DeltaBox):
    """DeltaBox driven as an agent loop would: a tree-search step is one call. A shell
    action is `exec(..., rollback_to=NODE, checkpoint="auto")`: the rollback to the node
    it expands, the action, and the checkpoint at its end asked for in the same call. The
    daemon takes the checkpoint while the agent thinks (the untimed pause); a rollback or
    fork naming it waits for it if it is not done. A file action carries the same: a
    create's write both (`files.write(..., rollback_to=, checkpoint=)`), an edit the
    rollback in its read of the file (`files.read(..., rollback_to=)`, since stop 59; a
    call of its own before) and the checkpoint in its write; one that writes nothing (its
    old text absent) takes its checkpoint with `checkpoint(background=True)`. Recorded: a
    rollback inside the action's call as its daemon time, the action as the rest of the
    call; as the checkpoint's client time only an extra call (0 when the action's call
    took it); the checkpoint's own daemon time and kind are read afterwards, untimed."""

    name = "deltabox_turn"

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        self.pending: tuple[int, int] | None = None   # (node, step) of a deferred rollback

    def rollback(self, node: int, path: list[int], step: int) -> None:
        """Deferred to the next action's call (act_and_checkpoint)."""
        self.pending = (node, step)

    def act_and_checkpoint(self, idx: int, step: int, node: int, path: list[int]) -> Code:
        action = self.ctx.traj.actions[idx]
        label = f"node {node}"
        rollback, self.pending = self.pending, None
        t0 = time.perf_counter()
        turn: dict[str, Any] = {"checkpoint": "auto", "checkpoint_label": label}
        if rollback is not None:
            turn["rollback_to"] = self.cps[rollback[0]]
        act = run_shell if action.kind == "shell" else run_edit
        code, r = act(self.ctx, self.sbx, action, **turn)
        cp_id, rb = (r.checkpoint_id, r.rollback) if r is not None else ("", None)
        t1 = t2 = time.perf_counter()
        if not cp_id and action.kind != "shell":  # nothing written: a call of its own
            cp_id = self.sbx.checkpoint(label=label, background=True).id
            t2 = time.perf_counter()
        rb_ms = 0.0
        if rollback is not None and rb is None:  # the action timed out or failed: no answer
            self.record("rollback", 0.0, step=rollback[1], node=rollback[0], attached=True,
                        note="in the action's call, which timed out or failed (its time is "
                        "there)")
        elif rollback is not None:
            rb_ms = rb.duration_ms
            self.record("rollback", rb_ms, step=rollback[1], node=rollback[0],
                        server_ms=rb.duration_ms, process_state=rb.process_state,
                        note=rb.note, attached=True)
        # The command's own run as the daemon timed it (shell actions): the rest of the
        # action's time is the call's (round trip, spawn, the rollback's leftovers).
        run_ms = getattr(r, "duration_ms", None) if action.kind == "shell" else None
        self.record("action", (t1 - t0) * 1000 - rb_ms, step=step, action=idx, code=code,
                    node=node, **({"run_ms": run_ms} if run_ms is not None else {}))
        self.record("checkpoint", (t2 - t1) * 1000, step=step, node=node, cp_id=cp_id,
                    attached=r is not None)
        self.cps[node] = cp_id
        return code

    def close(self) -> None:
        """Untimed: each checkpoint's kind and daemon time, now that all are taken."""
        from deltabox import errors

        for rec in self.ops:
            if rec["op"] == "checkpoint" and rec.get("cp_id") and self.sbx is not None:
                try:
                    cp = self.sbx.get_checkpoint(rec["cp_id"])
                except errors.DeltaBoxError as e:  # it failed: say why, in its record
                    rec.update(kind="failed", error=str(e)[:300])
                    continue
                rec.update(kind=cp.kind, server_ms=cp.duration_ms, freeze_ms=cp.freeze_ms,
                           reasons=list(cp.reasons))
        super().close()


class Copytree(System):
    name = "copytree"

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        self.tars: dict[int, bytes] = {}

    def start(self) -> None:
        super().start()
        self.sbx.exec(["mkdir", "-p", SNAPSHOTS])

    def _exec(self, script: str) -> None:
        r = self.sbx.exec(["bash", "-c", script], cwd="/", timeout=600)
        if r.exit_code != 0:
            raise RuntimeError(f"copytree: {script!r} failed: {r.stderr[-500:]}")

    def checkpoint(self, node: int, path: list[int], step: int) -> None:
        wd = self.ctx.env.workdir
        t0 = time.perf_counter()
        self._exec(f"rm -rf {SNAPSHOTS}/{node} && cp -a --reflink=never {wd} {SNAPSHOTS}/{node}")
        self.record("checkpoint", (time.perf_counter() - t0) * 1000, step=step, node=node)

    def rollback(self, node: int, path: list[int], step: int) -> None:
        wd = self.ctx.env.workdir
        t0 = time.perf_counter()
        self._exec(f"rm -rf {wd} && cp -a --reflink=never {SNAPSHOTS}/{node} {wd}")
        self.record("rollback", (time.perf_counter() - t0) * 1000, step=step, node=node,
                    replayed=0)

    def children(self, node: int, path: list[int], n: int, step: int) -> list[Any]:
        wd = self.ctx.env.workdir
        t0 = time.perf_counter()
        data = self.sbx.files.download_tar(f"{SNAPSHOTS}/{node}")
        self.record("copy_out", (time.perf_counter() - t0) * 1000, step=step, node=node,
                    bytes=len(data))
        kids = []
        for i in range(n):
            t0 = time.perf_counter()
            kid = self.ctx.fresh()
            kids.append(kid)
            kid.exec(["rm", "-rf", wd], cwd="/")
            kid.files.upload_tar(wd, data)
            self.record("child", (time.perf_counter() - t0) * 1000, step=step, node=node,
                        child=i)
        return kids


# ---- docker_commit: the container's writable layer, copied on the host --------------------

Meta = tuple[int, int, int, int, int, int]     # type bits, ino, size, mtime_ns, ctime_ns, rdev


def upper_dir(state_dir: Path, sandbox_id: str) -> Path:
    """The host path of a sandbox's writable layer (overlay upper dir), from the daemon's
    SQLite metadata (read-only)."""
    db = sqlite3.connect(f"file:{state_dir / 'deltabox.db'}?mode=ro", uri=True, timeout=10)
    try:
        row = db.execute("SELECT layer_id FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
    finally:
        db.close()
    if row is None:
        raise RuntimeError(f"sandbox {sandbox_id} not in the daemon's metadata")
    return state_dir / "store" / "layers" / row[0] / "upper"


def scan(root: Path) -> dict[str, Meta]:
    """Every entry under an upper dir with the stat fields that change when it is written."""
    out: dict[str, Meta] = {}
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(root / rel if rel else root) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                r = f"{rel}/{e.name}" if rel else e.name
                out[r] = (stat.S_IFMT(st.st_mode) | stat.S_IMODE(st.st_mode), st.st_ino,
                          st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_rdev)
                if stat.S_ISDIR(st.st_mode):
                    stack.append(r)
    return out


def _is_whiteout(meta: Meta) -> bool:
    return stat.S_ISCHR(meta[0]) and meta[5] == 0


@dataclass
class Layer:
    """One commit: files copied to `dir`, paths deleted, and the image it sits on."""

    node: int
    base: int | None              # node whose image the container started from (None: base)
    dir: Path
    files: list[str] = field(default_factory=list)     # relative paths, parents first
    deleted: list[str] = field(default_factory=list)


def minimal_deletions(paths: list[str]) -> list[str]:
    """Drop paths under a deleted directory (one `rm -rf` of the top covers them)."""
    out: list[str] = []
    for p in sorted(paths):
        if not out or not p.startswith(out[-1] + "/"):
            out.append(p)
    return out


class DockerCommit(System):
    name = "docker_commit"

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        self.layers: dict[int, Layer] = {}
        self.start_node: int | None = None          # image the live container runs
        self.start_meta: dict[str, Meta] = {}
        self.dir = ctx.scratch / f"docker-{os.getpid()}-{id(self):x}"

    def start(self) -> None:
        super().start()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._container_started(None)

    def _container_started(self, node: int | None) -> None:
        """Docker knows a new container's (empty) upper for free: record ours, untimed."""
        self.start_node = node
        self.start_meta = scan(upper_dir(self.ctx.state_dir, self.sbx.id))

    def checkpoint(self, node: int, path: list[int], step: int) -> None:
        t0 = time.perf_counter()
        upper = upper_dir(self.ctx.state_dir, self.sbx.id)
        now = scan(upper)
        changed = [p for p, m in now.items() if self.start_meta.get(p) != m]
        deleted = [p for p in self.start_meta if p not in now]
        t1 = time.perf_counter()
        layer = Layer(node, self.start_node, self.dir / str(node))
        layer.dir.mkdir()
        for rel in sorted(changed):
            meta = now[rel]
            if _is_whiteout(meta):
                deleted.append(rel)
                continue
            src, dst = upper / rel, layer.dir / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if stat.S_ISDIR(meta[0]):
                dst.mkdir(exist_ok=True)
                shutil.copystat(src, dst)
            elif stat.S_ISLNK(meta[0]):
                os.symlink(os.readlink(src), dst)
            elif stat.S_ISREG(meta[0]):
                shutil.copy2(src, dst)
            else:
                continue          # fifos/devices: nothing an agent's repo work makes
            layer.files.append(rel)
        layer.deleted = minimal_deletions(deleted)
        self.layers[node] = layer
        t2 = time.perf_counter()
        # Counted: the scan (finding the container's changes) and the copy. Like docker's,
        # the upper holds only the container's own changes (the image is a shared lower,
        # Ctx.fresh); docker's own fixed costs (pause, tar, digest, layer registration) are
        # not paid here.
        self.record("checkpoint", (t2 - t0) * 1000, step=step, node=node,
                    scan_ms=(t1 - t0) * 1000, copy_ms=(t2 - t1) * 1000,
                    files=len(layer.files), deleted=len(layer.deleted))

    def _chain(self, node: int | None) -> list[Layer]:
        out: list[Layer] = []
        while node is not None:
            layer = self.layers[node]
            out.append(layer)
            node = layer.base
        return out[::-1]

    def _restore_into(self, kid: Any, node: int) -> dict[str, Any]:
        """Apply the node's image (its chain of layers) to a fresh container."""
        merged: dict[str, Path] = {}
        deleted: list[str] = []
        for layer in self._chain(node):
            for d in layer.deleted:
                deleted.append(d)
                for p in [p for p in merged if p == d or p.startswith(d + "/")]:
                    del merged[p]
            for rel in layer.files:
                merged[rel] = layer.dir / rel
        if deleted:
            kid.exec(["rm", "-rf", "--", *("/" + d for d in minimal_deletions(deleted))],
                     cwd="/", timeout=600)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
            for rel in sorted(merged):
                tf.add(str(merged[rel]), arcname=rel, recursive=False)
        if merged:
            kid.files.upload_tar("/", buf.getvalue())
        return {"files": len(merged), "deleted": len(deleted), "bytes": buf.tell()}

    def rollback(self, node: int, path: list[int], step: int) -> None:
        old, self.sbx = self.sbx, None
        self._kill(old)                  # `docker rm -f` of the old container: not counted
        t0 = time.perf_counter()
        self.sbx = self.ctx.fresh()
        info = self._restore_into(self.sbx, node)
        self.record("rollback", (time.perf_counter() - t0) * 1000, step=step, node=node,
                    replayed=0, **info)
        self._container_started(node)

    def children(self, node: int, path: list[int], n: int, step: int) -> list[Any]:
        kids = []
        for i in range(n):
            t0 = time.perf_counter()
            kid = self.ctx.fresh()
            kids.append(kid)
            info = self._restore_into(kid, node)
            self.record("child", (time.perf_counter() - t0) * 1000, step=step, node=node,
                        child=i, **info)
        return kids

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.dir, ignore_errors=True)


class RestartReplay(System):
    name = "restart_replay"

    def rollback(self, node: int, path: list[int], step: int) -> None:
        self.record("rollback", self._restart(path, step), step=step, node=node,
                    replayed=len(path))

    def extras(self) -> dict[str, Any]:
        return {"replay_codes": self.replay_codes}

    def children(self, node: int, path: list[int], n: int, step: int) -> list[Any]:
        kids = []
        for i in range(n):
            t0 = time.perf_counter()
            kid = self.ctx.fresh()
            kids.append(kid)
            self._replay(kid, path, step)
            self.record("child", (time.perf_counter() - t0) * 1000, step=step, node=node,
                        child=i, replayed=len(path))
        return kids


SYSTEMS: dict[str, type[System]] = {c.name: c for c in
                                    (Floor, DeltaBox, DeltaBoxTurn, Copytree, DockerCommit,
                                     RestartReplay)}
BASELINES = ("copytree", "docker_commit", "restart_replay")
CR_OPS = ("checkpoint", "rollback", "fork", "child", "copy_out")
