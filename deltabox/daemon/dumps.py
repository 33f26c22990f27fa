"""Durable process state: background dumps of checkpoints' templates, restore from disk.

After a "full" checkpoint commits, every template of its ProcessState is dumped (native
`dump`, an incremental image against the same sandbox process's previous dump) into
`<state_dir>/dumps/<cp_id>/<nspid>/`, beside `state.json`: what a restore needs besides
memory (process records with fds and listeners, pipe groups, sessions) and the unread data
of pipes (`pipe-<inode>.data`). The whole directory is written as `.<cp_id>.tmp` and renamed
when complete; the `dumps` table records pending -> complete | failed. A dump that had not
completed when the daemon stopped is never used (recovery marks it failed and removes it).

Images of later dumps refer to their parent's images (chains, native/IMAGE_FORMAT.md): a
dropped checkpoint's directory stays until no other image depends on it (`image_depends_on`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from ..cr import (adoption, creds, eventloop, fifos, native, pidfds, pipebuf, posix_mq,
                  private_maps, ptys, shared_files, shm_files, sigio, sockopts, sysv_msg,
                  sysv_sem, sysv_shm, taskattrs, unlinked)
from ..cr.capture import ProcessRecord, SharedMapping, in_dev_shm
from ..cr.taskattrs import TaskAttrs
from ..cr.engine import (DeltaCR, PipeEnd, PipeGroup, ProcessState, lone_leaders, rebuilt_as,
                         _close_saved)
from .db import Database, columns
from .scheduler import IOScheduler

log = logging.getLogger("deltaboxd")

SCHEMA = """
CREATE TABLE IF NOT EXISTS dumps (
  cp_id TEXT PRIMARY KEY, sandbox_id TEXT NOT NULL, state TEXT NOT NULL,
  bytes INTEGER NOT NULL DEFAULT 0, ms REAL NOT NULL DEFAULT 0, error TEXT NOT NULL DEFAULT '',
  created_at REAL NOT NULL
);
"""
NOT_COMPLETED = "its process dump had not completed when the daemon stopped"
# Test-only: hold every dump back this long (tests/test_cr_durable.py kills the daemon while
# a dump is pending). Never set in production.
TEST_DELAY_S = float(os.environ.get("DELTABOX_TEST_DUMP_DELAY", "0") or 0)
# A dump starts this long after its checkpoint, so that the checkpoint's answer does not
# share the daemon with the dump's first steps (interleaved A/B on the full scenario, 20-24
# checkpoints per arm, twice: client p50 10.22 vs 10.54 and 10.04 vs 10.40 ms). It widens
# the window in which a daemon crash leaves the checkpoint without its dump by as much.
START_DELAY_S = 0.02


@dataclass
class DumpRow:
    cp_id: str
    sandbox_id: str
    state: str          # pending | complete | failed | dropped (checkpoint gone, dir kept)
    bytes: int = 0
    ms: float = 0.0
    error: str = ""
    created_at: float = 0.0


class Dumps:
    def __init__(self, db: Database, root: Path, cr: DeltaCR, io: IOScheduler,
                 fsync: bool = False, sandbox_lock=lambda sid: None,
                 ended=lambda sid: None) -> None:
        self.db, self.root, self.cr, self.io, self.fsync = db, root, cr, io, fsync
        # The sandbox's operation lock (or None), held around each process image: a dump
        # resumes the template for injected calls, which would hang in a cgroup frozen by a
        # checkpoint (and hang the ptrace thread with it). So a rollback or fork must never
        # wait for a pending dump while holding that lock.
        self.sandbox_lock = sandbox_lock
        # Called with the sandbox id after each of its dumps ends: templates kept only
        # because their dump was under way can go now (Daemon._evict_templates).
        self.ended = ended
        db.conn.executescript(SCHEMA)
        self.root.mkdir(parents=True, exist_ok=True)
        # One dump at a time per sandbox, in checkpoint order: a queue and one task
        # draining it (a parked task per pending dump costs ~13 KiB; backlogs happen).
        self.queues: dict[str, collections.deque[tuple[str, ProcessState, int]]] = {}
        self.events: dict[str, trio.Event] = {}          # cp id -> set when its dump ends
        # (sandbox, nspid, cmd) -> its last image, and the template it was written from (a
        # later checkpoint that kept that template gets the same image: _link_image)
        self.last: dict[tuple[str, int, str], tuple[Path, native.Template]] = {}
        # Images being read (a dump's parents, a restore's): kept with their chains.
        self.in_use: collections.Counter[Path] = collections.Counter()
        self._deps: dict[str, set[Path]] = {}             # complete dump -> images it needs
        self.worker_ms_max = 0.0     # longest single dump job on the ptrace thread

    # ---- rows --------------------------------------------------------------------------

    def row(self, cp_id: str) -> DumpRow | None:
        r = self.db.conn.execute("SELECT * FROM dumps WHERE cp_id=?", (cp_id,)).fetchone()
        return DumpRow(**dict(r)) if r else None

    def _put(self, r: DumpRow) -> None:
        d = columns(r)
        cols = ", ".join(d)
        self.db.conn.execute(f"INSERT OR REPLACE INTO dumps ({cols}) VALUES "
                             f"({', '.join(':' + k for k in d)})", d)

    def _rows(self, where: str = "1", *args: object) -> list[DumpRow]:
        rows = self.db.conn.execute(f"SELECT * FROM dumps WHERE {where} ORDER BY created_at",
                                    args).fetchall()
        return [DumpRow(**dict(r)) for r in rows]

    def path(self, cp_id: str) -> Path:
        return self.root / cp_id

    def describe(self, cp_id: str) -> str | None:
        """One line for a checkpoint's reasons, or None if it has no dump."""
        r = self.row(cp_id)
        if r is None or r.state == "dropped":
            return None
        if r.state == "complete":
            return f"process dump: complete ({r.bytes / 2**20:.1f} MiB, {r.ms:.0f} ms)"
        if r.state == "failed":
            return f"process dump: failed ({r.error})"
        return "process dump: pending"

    def complete(self, cp_id: str) -> bool:
        r = self.row(cp_id)
        return r is not None and r.state == "complete"

    def complete_among(self, cp_ids: set[str]) -> set[str]:
        """Those of cp_ids whose dump is complete (one query, for many)."""
        rows = self.db.conn.execute("SELECT cp_id FROM dumps WHERE state='complete'")
        return {r[0] for r in rows} & cp_ids

    def pending(self, cp_id: str) -> bool:
        ev = self.events.get(cp_id)
        return ev is not None and not ev.is_set()

    async def wait(self, cp_id: str, urgent: bool = False) -> None:
        """Until the dump of cp_id (if one is under way) has ended. urgent: a restore waits
        for it, so its sandbox's dumps take the next free I/O slots, ahead of other
        sandboxes' (IOScheduler.urgent). A queued dump is not waited for behind the others
        of its sandbox: a restore takes back its templates, or it was abandoned."""
        sid = self._sandbox_of(cp_id) if urgent else None
        with self.io.urgent(sid) if sid is not None else contextlib.nullcontext():
            ev = self.events.get(cp_id)
            if ev is not None:
                await ev.wait()
            await self.io.wait(cp_id)

    # ---- recovery and garbage collection -------------------------------------------------

    def recover(self, live_checkpoints: set[str]) -> None:
        """At start: a dump that had not completed is never used; dumps of checkpoints
        that are gone are dropped; leftovers are removed."""
        with self.db.transaction():
            for r in self._rows("state='pending'"):
                r.state, r.error = "failed", NOT_COMPLETED
                self._put(r)
            for r in self._rows("state!='dropped'"):
                if r.cp_id not in live_checkpoints:
                    r.state = "dropped"
                    self._put(r)
        keep = {r.cp_id for r in self._rows("state IN ('complete', 'dropped')")}
        for entry in self.root.iterdir():
            if entry.name not in keep:
                log.info("recover: removing incomplete process dump %s", entry.name)
                shutil.rmtree(entry, ignore_errors=True)
        self.gc()

    def drop(self, cp_ids: list[str]) -> None:
        """The checkpoints are gone: their dumps go once no other image needs them."""
        if not cp_ids:
            return
        with self.db.transaction():
            for cp_id in cp_ids:
                r = self.row(cp_id)
                if r is not None:
                    r.state = "dropped" if r.state in ("complete", "dropped") else "failed"
                    self._put(r)
                    if r.state == "failed":
                        self.db.conn.execute("DELETE FROM dumps WHERE cp_id=?", (cp_id,))
        gone = {self.path(c) for c in cp_ids}
        self.last = {k: v for k, v in self.last.items() if v[0].parent not in gone}
        self.gc()

    def gc(self) -> int:
        """Delete dropped dumps no remaining image depends on; returns how many. An image
        being read keeps its whole chain: a dump whose parent is a dropped checkpoint's
        image reads that image's parents too, and a linked image (_link_image) is its
        parent's copy, needing what it needs (a 32 x 1000 soak lost those ancestors: later
        restores failed with "parent image ... is missing")."""
        needed: set[Path] = set()
        for p in self.in_use:
            needed.add(p)
            needed.update(_ancestors(p)[0])
        for r in self._rows("state='complete'"):
            needed.update(self._depends_on(r.cp_id))
        freed = 0
        needed_dirs = {p.parent for p in needed}
        for r in self._rows("state='dropped'"):
            d = self.path(r.cp_id)
            if d in needed_dirs:
                continue
            shutil.rmtree(d, ignore_errors=True)
            self.db.conn.execute("DELETE FROM dumps WHERE cp_id=?", (r.cp_id,))
            self._deps.pop(r.cp_id, None)
            freed += 1
        for r in self._rows("state='failed'"):
            if r.error != NOT_COMPLETED:
                shutil.rmtree(self.path(r.cp_id), ignore_errors=True)
        return freed

    def _depends_on(self, cp_id: str) -> set[Path]:
        """Images a complete dump's images depend on (cached: complete images never change;
        reading every image's header at every deletion was O(all dumps)). A broken chain
        keeps the ancestors before the break (its restore will fail, naming it)."""
        deps = self._deps.get(cp_id)
        if deps is None:
            deps = set()
            for img in _images(self.path(cp_id)):
                got, error = _ancestors(img)
                deps |= got
                if error:
                    log.warning("process dump of %s: %s", cp_id, error)
            self._deps[cp_id] = deps
        return deps

    def _hold(self, images: list[Path]) -> None:
        """The images (and so their chains) are kept until _let_go: they are being read."""
        self.in_use.update(images)

    def _let_go(self, images: list[Path]) -> None:
        for p in images:
            self.in_use[p] -= 1
            if self.in_use[p] <= 0:
                del self.in_use[p]

    # ---- dump ------------------------------------------------------------------------------

    def add_pending(self, cp_id: str, sid: str) -> None:
        """Record that cp_id's dump is to be written: in the transaction that commits the
        checkpoint (one commit for both: the checkpoint's answer waits for it)."""
        self._put(DumpRow(cp_id, sid, "pending", 0, 0.0, "", time.time()))

    def schedule(self, start_soon, sid: str, cp_id: str, state: ProcessState,
                 seccomp_filters: int) -> None:
        """Write cp_id's dump (recorded by add_pending) in the background: its images, or
        with no process only its metadata (a file written and synced, so not on the
        checkpoint's path either)."""
        self.events[cp_id] = trio.Event()
        queue = self.queues.get(sid)
        if queue is None:
            queue = self.queues[sid] = collections.deque()
            start_soon(self._drain, sid, queue)
        queue.append((cp_id, state, seccomp_filters))

    def _sandbox_of(self, cp_id: str) -> str | None:
        """The sandbox whose queue holds cp_id's dump (None: not queued)."""
        return next((sid for sid, queue in self.queues.items()
                     if any(item[0] == cp_id for item in queue)), None)

    def abandon(self, cp_id: str) -> None:
        """cp_id's templates are being released before its queued dump began: that dump
        fails now, as it would at its turn, so that a restore waiting for it need not wait
        for the dumps queued before it. One under way fails by itself."""
        for sid, queue in self.queues.items():
            for i, item in enumerate(queue):
                if item[0] == cp_id:
                    if i > 0:
                        del queue[i]
                        self._failed(cp_id, sid, f"its templates were released before its "
                                     f"dump began, behind {i} dumps of the sandbox")
                    return

    def _not_needed(self, cp_id: str, why: str) -> None:
        """cp_id was deleted before its dump ended: nothing is lost, so not a warning (under
        load most dumps that do not complete end so: 264 of a 300-line sample of a 32 x 1000
        soak's warnings at stop 75)."""
        log.info("process dump of %s not written: its checkpoint was deleted (%s)", cp_id, why)
        ev = self.events.pop(cp_id, None)
        if ev is not None:
            ev.set()

    def _failed(self, cp_id: str, sid: str, error: str) -> None:
        """cp_id's dump ended without an image: recorded so (if its checkpoint is still
        there) and its waiters woken."""
        log.warning("process dump of %s failed: %s", cp_id, error)
        if self.row(cp_id) is not None:
            self._put(DumpRow(cp_id, sid, "failed", 0, 0.0, error, time.time()))
        ev = self.events.pop(cp_id, None)
        if ev is not None:
            ev.set()

    async def _drain(self, sid: str, queue: collections.deque) -> None:
        """Dump the sandbox's queued checkpoints one after the other, then end."""
        try:
            while queue:
                cp_id, state, seccomp_filters = queue[0]
                await self._dump(sid, cp_id, state, seccomp_filters)
                queue.popleft()
                self.ended(sid)
        finally:
            self.queues.pop(sid, None)
            for cp_id, _, _ in queue:  # cancelled (shutdown): nobody may wait forever
                ev = self.events.pop(cp_id, None)
                if ev is not None:
                    ev.set()

    async def _dump(self, sid: str, cp_id: str, state: ProcessState,
                    seccomp_filters: int) -> None:
        tmp = self.root / f".{cp_id}.tmp"
        total = 0
        parents: list[Path] = []
        job_ms = 0.0
        try:
            await trio.sleep(START_DELAY_S + TEST_DELAY_S)
            t0 = time.perf_counter()
            # Gone before its turn: fail without waiting for an I/O slot.
            if self.db.get_checkpoint(cp_id) is None:
                raise native.CRError(2, "the checkpoint was deleted before its dump")
            if _released(state):
                raise native.CRError(22, _released_before(cp_id))
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            for rec in state.records:
                tpl = state.templates[rec.pid]
                if tpl.released:
                    raise native.CRError(22, _released_before(cp_id))
                if rec.task is None:   # kept in the record (state.json), as is
                    rec.task = await self._task_attrs(sid, tpl)
                ok = _seccomp_filters(tpl.pid) <= seccomp_filters
                key = (sid, rec.nspid, rec.cmd)
                parent, made_by = self.last.get(key, (None, None))
                if parent is not None and not parent.is_dir():
                    parent = None
                if parent is not None:
                    self._hold([parent])
                    parents.append(parent)
                    # The template the parent image was written from (not one whose
                    # /dev/shm pages may have changed since: private_maps.copied_stale).
                    if (made_by is tpl and not _maps_dev_shm(rec)
                            and await trio.to_thread.run_sync(
                                _link_image, parent, tmp / str(rec.nspid), self.fsync)):
                        continue
                try:
                    st = await self._dump_one(sid, tpl, tmp / str(rec.nspid), parent, ok,
                                              state.captured_ns)
                except native.CRError:
                    if parent is None:
                        raise
                    shutil.rmtree(tmp / str(rec.nspid), ignore_errors=True)
                    st = await self._dump_one(sid, tpl, tmp / str(rec.nspid), None, ok,
                                              state.captured_ns)
                total += st.bytes_written
                job_ms = max(job_ms, st.ms)
                stale = private_maps.copied_stale(rec, tpl.pid, state.captured_ns,
                                                   state.shm_files)
                if stale:
                    raise native.CRError(errno.ESTALE, stale)
            async with self.io.slot(cp_id, group=sid):
                total += await trio.to_thread.run_sync(self._write_meta_sync, tmp, state)
            if self.db.get_checkpoint(cp_id) is None:
                raise native.CRError(2, "the checkpoint was deleted meanwhile")
            os.rename(tmp, self.path(cp_id))
            ms = (time.perf_counter() - t0) * 1000
            self._put(DumpRow(cp_id, sid, "complete", total, ms, "", time.time()))
            for rec in state.records:
                self.last[(sid, rec.nspid, rec.cmd)] = (self.path(cp_id) / str(rec.nspid),
                                                        state.templates[rec.pid])
            if state.family:   # the images a restore adopts children from (cr/adoption.py)
                if state.images is None:
                    state.images = adoption.Images(self.cr.images_dir)
                state.images.give({r.pid: str(self.path(cp_id) / str(r.nspid))
                                   for r in state.records if r.pid in state.family})
            log.info("process dump of %s: %d processes, %.1f MiB, %.0f ms (longest "
                     "process image %.0f ms)", cp_id, len(state.records),
                     total / 2**20, ms, job_ms)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if self.db.get_checkpoint(cp_id) is None:
                self._not_needed(cp_id, str(e))
            elif _released(state) and "released" not in str(e):
                self._failed(cp_id, sid, f"its templates were released during the dump ({e})")
            else:
                self._failed(cp_id, sid, str(e))
        finally:
            self._let_go(parents)
            if parents:  # a dump dropped while this one read it as a parent can go now
                self.gc()
            ev = self.events.pop(cp_id, None)
            if ev is not None:
                ev.set()

    async def _task_attrs(self, sid: str, tpl: native.Template) -> TaskAttrs:
        """The template's process's attributes (cr/taskattrs.py), read by injected calls
        under the sandbox's lock, as the dump's own: a template runs them, which it cannot
        while a checkpoint has the sandbox's cgroup frozen (a read outside the lock hung
        the ptrace thread, and so the daemon, until a thaw that thread was to do)."""
        lock = self.sandbox_lock(sid)
        async with lock if lock is not None else trio.Lock():
            if tpl.released:
                raise native.CRError(22, "the templates were released before their dump")
            return await self.cr.worker.run(taskattrs.read, tpl)

    async def _dump_one(self, sid: str, tpl: native.Template, path: Path,
                        parent: Path | None, seccomp_ok: bool,
                        files_as_of_ns: int) -> native.DumpStats:
        """One process image: what needs the tracer is a short job on the (shared) ptrace
        thread under the sandbox's lock; copying and hashing the pages (the bulk) runs on
        a plain thread, so checkpoints and rollbacks need not wait for it. Releasing the
        templates meanwhile makes this dump fail, never read another process
        (native/criu_incr.h)."""
        lock = self.sandbox_lock(sid)
        async with lock if lock is not None else trio.Lock():
            if tpl.released:
                raise native.CRError(22, "the templates were released before their dump")
            t0 = time.perf_counter()
            job = await self.cr.worker.run(
                lambda: native.dump_begin(tpl, path, parent, fsync=self.fsync,
                                          seccomp_ok=seccomp_ok,
                                          files_as_of_ns=files_as_of_ns))
        self.worker_ms_max = max(self.worker_ms_max, (time.perf_counter() - t0) * 1000)
        try:
            async with self.io.slot(str(path), group=sid):  # the I/O: pages copied, hashed, written
                return await trio.to_thread.run_sync(job.finish)
        except BaseException:
            job.abort()  # cancelled before the thread took it (else a no-op)
            raise

    def _write_meta_sync(self, tmp: Path, state: ProcessState) -> int:
        tmp.mkdir(exist_ok=True)
        pipes = {}
        total = 0
        for g in state.pipes.values():
            saved, n = _write_unread(tmp, f"pipe-{g.inode}.data", g.saved)
            total += n
            pipes[str(g.inode)] = dict(ends=[dataclasses.asdict(e) for e in g.ends],
                                       owner=g.owner, saved=saved, size=g.size)
        named_pipes = []
        for i, f in enumerate(state.fifos):
            saved, n = _write_unread(tmp, f"fifo-{i}.data", f.saved)
            total += n
            named_pipes.append(dict(dataclasses.asdict(f), saved=saved))
        files = _write_copies(tmp, "unlinked", state.unlinked)
        shm = _write_copies(tmp, "shm", state.shm_files)
        segments = _write_copies(tmp, "sysv", state.sysv_shm)
        queues = _write_copies(tmp, "msg", state.sysv_msg)
        sets = _write_copies(tmp, "sem", state.sysv_sem)
        pqueues = _write_copies(tmp, "pmq", state.posix_mq)
        total += sum(x.size for x in [*state.unlinked, *state.shm_files, *state.sysv_shm,
                                      *state.sysv_msg, *state.sysv_sem, *state.posix_mq])
        meta = dict(version=1, records=[_rec_json(r) for r in state.records], pipes=pipes,
                    sessions=state.sessions, session_states=state.session_states,
                    unlinked=files,
                    shared_files=[dataclasses.asdict(s) for s in state.shared_files],
                    shm_files=shm, fifos=named_pipes, ptys=[p.to_json() for p in state.ptys],
                    sysv_shm=segments, sysv_msg=queues, sysv_sem=sets, posix_mq=pqueues)
        raw = json.dumps(meta).encode()
        with open(tmp / "state.json", "wb") as f:
            f.write(raw)
            if self.fsync:
                os.fsync(f.fileno())
        return total + len(raw)

    # ---- restore ------------------------------------------------------------------------

    async def load(self, cp_id: str, host_pid: int, root_dir: str,
                   reserve_pids: bool = False) -> ProcessState:
        """Rebuild cp_id's templates from its dump, forked from host_pid (the sandbox's
        init) with mapped files resolved under root_dir. reserve_pids: the processes will
        be restored into host_pid's own pid namespace, so the templates must not take
        their pids. Raises ImageCorrupt / CRError / OSError / ValueError; nothing is left
        behind on failure. The images are kept meanwhile, should the checkpoint go."""
        images = _images(self.path(cp_id))
        self._hold(images)
        try:
            return await self._load(cp_id, host_pid, root_dir, reserve_pids)
        finally:
            self._let_go(images)
            r = self.row(cp_id)
            if r is None or r.state == "dropped":
                self.gc()

    async def _load(self, cp_id: str, host_pid: int, root_dir: str,
                    reserve_pids: bool) -> ProcessState:
        d = self.path(cp_id)
        try:
            meta = json.loads((d / "state.json").read_text())
        except (OSError, ValueError) as e:
            raise native.ImageCorrupt(74, f"{d / 'state.json'}: {e}") from e
        records = [_rec_from(r) for r in meta["records"]]
        if reserve_pids and records:
            # Above every pid and thread id the processes get back (a thread's is in its
            # image only), and their zombie children's.
            await _skip_pids(host_pid, max(max(r.nspid, native.image_info(
                d / str(r.nspid))[3] if r.threads > 1 else 0,
                *(z[0] for z in r.zombies)) for r in records))
        templates: dict[int, native.Template] = {}
        pipes: dict[int, PipeGroup] = {}
        files: list[unlinked.UnlinkedFile] = []
        shm: list[shm_files.ShmFile] = []
        named_pipes: list[fifos.Fifo] = []
        segments: list[sysv_shm.Segment] = []
        queues: list[sysv_msg.Queue] = []
        sets: list[sysv_sem.Set] = []
        pqueues: list[posix_mq.Queue] = []
        # The rebuilt templates map root_dir's files as they are now (the checkpoint's):
        # a later write in place there is looked for at each restore (cr/private_maps.py).
        captured_ns = time.time_ns()
        try:
            lone = lone_leaders(records)
            for rec in records:
                templates[rec.pid] = await self.cr.worker.run(
                    native.restore_template, host_pid, d / str(rec.nspid), root_dir)
                # Forked from host_pid: its nice, rlimits, timers, ... kept with the record.
                await self.cr.worker.run(rebuilt_as, templates[rec.pid], rec)
                if rec.creds is not None:   # root's copy of an unprivileged one (creds.py)
                    await self.cr.worker.run(creds.give, templates[rec.pid], rec.creds)
                    templates[rec.pid].rebuilt = True
                # Rebuilt by the sandbox's init, it is in none of the captured sessions:
                # a lone session leader's child leads its session again (cr/engine.py).
                templates[rec.pid].own_session_done = rec.pid in lone
            for ino, g in meta["pipes"].items():
                pg = PipeGroup(int(ino), [PipeEnd(**e) for e in g["ends"]], None, g["owner"],
                               g.get("size", pipebuf.PIPE_DEFAULT_SIZE))
                if g["saved"]:
                    pg.saved = pipebuf.refill((d / g["saved"]).read_bytes())
                pipes[pg.inode] = pg
            for f in meta.get("unlinked", []):
                files.append(_unlinked_from(f, d))
            for f in meta.get("shm_files", []):
                shm.append(_shm_from(f, d))
            for f in meta.get("sysv_shm", []):
                segments.append(_segment_from(f, d))
            for f in meta.get("sysv_msg", []):
                queues.append(_ipc_from(sysv_msg.Queue, f, d))
            for f in meta.get("sysv_sem", []):
                sets.append(_ipc_from(sysv_sem.Set, f, d))
            for f in meta.get("posix_mq", []):   # before stop 71: none
                pqueues.append(_ipc_from(posix_mq.Queue, f, d))
            for f in meta.get("fifos", []):
                named_pipes.append(_fifo_from(f, d))
        except BaseException:
            with trio.CancelScope(shield=True):
                for t in templates.values():
                    await self.cr.worker.run(t.release)
                _close_saved(pipes)
                unlinked.close_saved(files)
                shm_files.close_saved(shm)
                fifos.close_saved(named_pipes)
                sysv_shm.close_saved(segments)
                sysv_msg.close_saved(queues)
                sysv_sem.close_saved(sets)
                posix_mq.close_saved(pqueues)
            raise
        # Its processes' images serve the restores that adopt children (cr/adoption.py).
        images = adoption.Images(given={r.pid: str(d / str(r.nspid)) for r in records})
        return ProcessState(records, templates, pipes,
                            {k: int(v) for k, v in meta["sessions"].items()},
                            dict(meta["session_states"]), from_dump=cp_id, unlinked=files,
                            shared_files=[_shared_from(s) for s in meta.get("shared_files", [])],
                            shm_files=shm, fifos=named_pipes, images=images,
                            captured_ns=captured_ns,
                            ptys=[ptys.Pty.from_json(p) for p in meta.get("ptys", [])],
                            sysv_shm=segments, sysv_msg=queues, sysv_sem=sets,
                            posix_mq=pqueues)


async def _skip_pids(host_pid: int, last: int) -> None:
    """Let host_pid's pid namespace allocate new pids above `last` (ns_last_pid, written
    by a process whose active pid namespace it is): after a daemon restart the namespace
    is fresh, and rebuilt templates would otherwise take the very pids (low numbers) their
    processes must get back. Never lowered: in a namespace that has run on since (a live
    sandbox's templates evicted), winding its counter back would hand out again pids its
    other checkpoints' processes need back (they came back renumbered), and pids a program
    of the sandbox saw end (as no kernel does before the counter wraps)."""
    r = await trio.run_process(
        ["nsenter", "-t", str(host_pid), "-p", "--", "sh", "-c",
         f"[ \"$(cat /proc/sys/kernel/ns_last_pid)\" -ge {last} ] || "
         f"echo {last} > /proc/sys/kernel/ns_last_pid"], check=False, capture_stderr=True)
    if r.returncode != 0:
        log.warning("setting ns_last_pid in the pid namespace of %d failed: %s", host_pid,
                    r.stderr.decode(errors="replace").strip())


def _ancestors(img: Path) -> tuple[set[Path], str]:
    """The images img's chain needs (native.image_depends_on), as far as their headers
    can be read: all of them and "", or those before a missing or damaged one and why."""
    out: set[Path] = set()
    cur = os.path.abspath(img)
    try:
        depth, _, parent, _ = native.image_info(cur)
        for _ in range(depth):
            cur = os.path.normpath(os.path.join(cur, parent))
            out.add(Path(cur))
            _, _, parent, _ = native.image_info(cur)
    except native.CRError as e:
        return out, str(e)
    return out, ""


def _released(state: ProcessState) -> bool:
    return any(t.released for t in state.templates.values())


def _released_before(cp_id: str) -> str:
    return f"the templates of {cp_id} were released before their dump"


def _images(d: Path) -> list[Path]:
    try:
        return [p for p in d.iterdir() if p.is_dir() and p.name.isdigit()]
    except OSError:
        return []


IMAGE_FILES = ("core.img", "mm.img", "pagemap.img", "pages.img")   # native/IMAGE_FORMAT.md


def _link_image(src: Path, dst: Path, fsync: bool) -> bool:
    """Make `dst` the image `src` is, as hard links to its four files: an image never
    changes once written, its parent link is relative to its directory (every dump's
    images sit at the same depth), and a checkpoint that kept a template has exactly the
    image of the checkpoint it kept it from (no 200 MB read and hashed again). False when
    the links cannot be made here (then the caller dumps)."""
    try:
        dst.mkdir()
        for name in IMAGE_FILES:
            os.link(src / name, dst / name)
        if fsync:
            fd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return True
    except OSError as e:
        log.warning("linking process image %s to %s failed (%s): dumping it instead",
                    src, dst, e)
        shutil.rmtree(dst, ignore_errors=True)
        return False


def _seccomp_filters(pid: int) -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("Seccomp_filters:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 1 << 30


def init_seccomp_filters(pid: int) -> int:
    """How many seccomp filters the sandbox's init carries (restored processes are forked
    from it and get exactly its filters)."""
    n = _seccomp_filters(pid)
    return -1 if n == 1 << 30 else n


def _shared_from(s: dict) -> shared_files.SharedFile:
    """A shared description of a named file, as a dump keeps it."""
    return shared_files.SharedFile(s["path"], s["flags"], s["pos"],
                                   [(int(p), int(fd)) for p, fd in s["holders"]])


def _maps_dev_shm(rec: ProcessRecord) -> bool:
    return any(in_dev_shm(m.path) for m in rec.mapped_private)


def _fifo_from(f: dict, d: Path) -> fifos.Fifo:
    """A named pipe, as a dump keeps it: its unread bytes read back from their file."""
    return fifos.Fifo(f["path"], int(f["size"]), [
        fifos.FifoDescription(int(x["flags"]), [(int(p), int(fd)) for p, fd in x["holders"]])
        for x in f["descriptions"]],
        pipebuf.refill((d / f["saved"]).read_bytes()) if f["saved"] else None)


def _write_unread(tmp: Path, name: str, saved: int | None) -> tuple[str | None, int]:
    """A pipe's unread bytes kept at the checkpoint (a pipebuf.tee_copy, or None) written
    beside the state as `name`: (that name, or None if there were none; bytes written)."""
    data = pipebuf.peek(saved) if saved is not None else b""
    if not data:
        return None, 0
    (tmp / name).write_bytes(data)
    return name, len(data)


def _write_copies(tmp: Path, kind: str, objects: list) -> list[dict]:
    """Each object's content copy (its memfd, `saved`) written beside the state as
    KIND-I.data, sparse as the copy is: their metadata, naming that file."""
    out = []
    for i, x in enumerate(objects):
        assert x.saved is not None
        name = f"{kind}-{i}.data"
        fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            unlinked.copy_data(fd, x.saved, x.size)
        finally:
            os.close(fd)
        out.append(dict(dataclasses.asdict(x), saved=name))
    return out


def _memfd_of(f: dict, d: Path) -> int:
    """A memfd holding a copy read back from a dump (checked against its size)."""
    src = os.open(d / f["saved"], os.O_RDONLY | os.O_CLOEXEC)
    try:
        if (n := os.fstat(src).st_size) != f["size"]:
            raise native.ImageCorrupt(74, f"{f['saved']}: {n} bytes, the dump says "
                                      f"{f['size']}")
        fd = os.memfd_create("dbx-" + f["saved"].split("-")[0], os.MFD_CLOEXEC)
        try:
            unlinked.copy_data(fd, src, n)
        except BaseException:
            os.close(fd)
            raise
    finally:
        os.close(src)
    return fd


def _shm_from(f: dict, d: Path) -> shm_files.ShmFile:
    """A /dev/shm file of a dump, its content back in a memfd."""
    s = shm_files.ShmFile(f["path"], f["mode"], f["uid"], f["gid"], f["size"])
    s.saved = _memfd_of(f, d)
    return s


def _segment_from(f: dict, d: Path) -> sysv_shm.Segment:
    """A System V segment of a dump, its content back in a memfd."""
    s = sysv_shm.Segment(f["id"], f["key"], f["mode"], f["uid"], f["gid"], f["size"],
                         attached=[sysv_shm.Attachment(**a) for a in f["attached"]])
    s.saved = _memfd_of(f, d)
    return s


def _ipc_from(cls: Any, f: dict, d: Path) -> Any:
    """A System V message queue or semaphore set, or a POSIX message queue, of a dump (its
    fields as _write_copies wrote them), its copy back in a memfd."""
    x = cls(**{k.name: f[k.name] for k in dataclasses.fields(cls)
               if k.name != "fd" and k.name in f})
    x.fd = _memfd_of(dict(f, size=x.size), d)
    return x


def _unlinked_from(f: dict, d: Path) -> unlinked.UnlinkedFile:
    """A deleted-but-open file of a dump, its content back in a memfd."""
    u = unlinked.UnlinkedFile(f["path"], f["mode"], f["uid"], f["gid"], f["size"],
                              [unlinked.Description(x["flags"], x["pos"],
                                                    [tuple(h) for h in x["holders"]])
                               for x in f["descriptions"]],
                              maps=[unlinked.MapHolder(**m) for m in f.get("maps", [])],
                              memory=f.get("memory", False), seals=f.get("seals", 0))
    u.saved = _memfd_of(f, d)
    return u


def _rec_json(r: ProcessRecord) -> dict:
    d = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)
         if f.name not in ("fds", "listens", "loop", "shared", "mapped_ro",
                           "deleted_private", "mapped_private", "mlocks", "task",
                           "pidfds", "sigio", "creds", "mqueues")}
    d["fds"] = [{k: v for k, v in dataclasses.asdict(f).items() if k != "fdinfo"}
                for f in r.fds]
    # The named files' mappings are made again from them at every restore of templates
    # rebuilt from this dump (engine._PipePlan.remaps); the rebuild maps its own.
    d["shared"] = [dataclasses.asdict(m) for m in r.shared]
    d["mapped_ro"] = [dataclasses.asdict(m) for m in r.mapped_ro]
    # The rebuilt templates map the restored tree's files, which the sandbox may write
    # in place afterwards (cr/private_maps.py).
    d["mapped_private"] = [dataclasses.asdict(m) for m in r.mapped_private]
    d["listens"] = [dict(dataclasses.asdict(ls), addr=ls.addr.hex(), peer=ls.peer.hex(),
                         filter=ls.filter.hex(), options=sockopts.to_json(ls.options))
                    for ls in r.listens]
    d["loop"] = eventloop.to_json(r.loop)
    d["mlocks"] = [dataclasses.asdict(m) for m in r.mlocks]
    d["task"] = r.task.to_json() if r.task is not None else None
    d["pidfds"] = [dataclasses.asdict(p) for p in r.pidfds]
    d["sigio"] = [dataclasses.asdict(x) for x in r.sigio]
    d["mqueues"] = [dataclasses.asdict(x) for x in r.mqueues]
    d["creds"] = r.creds.to_json() if r.creds is not None else None
    return d


def _rec_from(d: dict) -> ProcessRecord:
    fds = []
    for f in d.pop("fds"):
        sock = f.pop("socket")
        rdev = f.pop("rdev")
        f["locks"] = tuple(f.get("locks", ()))
        fds.append(native.FdInfo(**f, rdev=tuple(rdev) if rdev else None,
                                 socket=native.SockInfo(**sock) if sock else None))
    # (before stop 64 only TCP listeners: no peer, no options; before stop 66 no groups;
    # before stop 67 no filter)
    listens = [native.ListenSocket(**dict(ls, addr=bytes.fromhex(ls["addr"]),
                                          peer=bytes.fromhex(ls.get("peer", "")),
                                          filter=bytes.fromhex(ls.get("filter", "")),
                                          options=sockopts.from_json(ls.get("options", [])),
                                          groups=tuple(tuple(g) for g in
                                                       ls.get("groups", ()))))
               for ls in d.pop("listens")]
    loop = eventloop.from_json(d.pop("loop", None))
    shared = [SharedMapping(**m) for m in d.pop("shared", [])]
    mapped_ro = [SharedMapping(**m) for m in d.pop("mapped_ro", [])]
    mapped_private = [SharedMapping(**m) for m in d.pop("mapped_private", [])]
    mlocks = [native.MemoryLock(**m) for m in d.pop("mlocks", [])]
    task = d.pop("task", None)   # absent in dumps made before stop 52
    pids = [pidfds.PidFd(**p) for p in d.pop("pidfds", [])]   # before stop 53: none
    async_io = [sigio.SigIO(**x) for x in d.pop("sigio", [])]   # before stop 69: none
    held_queues = [posix_mq.HeldQueue(**x) for x in d.pop("mqueues", [])]   # stop 71
    cred = d.pop("creds", None)   # before stop 57: none (such processes were refused)
    return ProcessRecord(**d, fds=fds, listens=listens, loop=loop, shared=shared,
                         mapped_ro=mapped_ro, mapped_private=mapped_private, mlocks=mlocks,
                         task=TaskAttrs.from_json(task) if task else None, pidfds=pids, sigio=async_io,
                         mqueues=held_queues,
                         creds=creds.Creds.from_json(cred) if cred else None)
