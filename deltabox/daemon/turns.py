"""Turns: what each sandbox did since its last checkpoint, and the checkpoint policy on it.

A *turn* is the span between two turn boundaries of a sandbox: its boot, a checkpoint, a
rollback or the restore of a fork. The eBPF inspector (deltabox/inspector) records what the
sandbox's processes did in it; at a checkpoint with mode "auto" the policy turns that into

- `skipped`: nothing a checkpoint holds changed; the checkpoint aliases its parent's files
  and processes (no snapshot, no capture);
- `fs`: only files changed; a new file snapshot, the parent's process templates reused;
- `full`: processes (may have) changed; files and processes captured.

Conservative by construction: no inspector (bcc cannot load here, or it is still loading),
lost events, a watch that began mid-turn, a process that entered from outside, all mean
`full`. The daemon's own session shells run in every turn that uses them; their running is
discounted only when the shell's own state (variables, functions, cwd, jobs, ...; see
sandbox/session.py) is the same as at the turn's start.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping

import trio

from ..background import GuardedNursery
from ..inspector import Decision, Inspector, InspectorUnavailable, TurnEffects, decide

log = logging.getLogger("deltaboxd")
HISTORY = 64          # per sandbox: effects of the last turns closed by checkpoints


class Turns:
    """The daemon's one inspector (or its absence) and per-sandbox turn bookkeeping.
    Used from the trio thread only."""

    def __init__(self) -> None:
        self.inspector: Inspector | None = None
        self.status = "none: not loaded"
        self._watched: dict[str, tuple[int, set[int]]] = {}    # sid -> (cgroup id, pids)
        self._partial: set[str] = set()      # watch began mid-turn: next turn is not whole
        self.history: dict[str, OrderedDict[str, tuple[TurnEffects | None, Decision]]] = {}

    # ---- lifecycle -------------------------------------------------------------------

    async def load(self, background: GuardedNursery, enabled: bool = True) -> None:
        """Compile and attach the eBPF program (seconds: in a worker thread, while the
        daemon already serves; until then every auto checkpoint is full)."""
        if not enabled:
            self.status = "none: disabled (--no-inspector); every auto checkpoint is full"
            return
        self.status = "loading"
        try:
            insp = await trio.to_thread.run_sync(
                lambda: Inspector.load(daemon_pid=os.getpid()))
        except InspectorUnavailable as e:
            self.status = f"none: {e}; every auto checkpoint is full"
            log.warning("turn inspector unavailable (%s): every auto checkpoint is full", e)
            return
        except Exception as e:  # a bug in loading must not take the daemon down
            self.status = f"none: loading failed ({e}); every auto checkpoint is full"
            log.exception("turn inspector failed to load")
            return
        self.inspector = insp
        self.status = insp.backend
        background.start_soon(insp.run)
        for sid, (cgid, pids) in list(self._watched.items()):
            self._partial.add(sid)          # it ran unobserved until now
            self._arm(sid, cgid, pids)
        log.info("turn inspector: %s", insp.backend)

    def close(self) -> None:
        if self.inspector is not None:
            self.inspector.close()
            self.inspector = None
            self.status = "none: daemon shutting down"

    # ---- watching --------------------------------------------------------------------

    def watch(self, sid: str, cgroup_id: int, pids: Iterable[int],
              lived_on: Collection[int] = (),
              restored: Mapping[int, Collection[int]] | None = None) -> None:
        """A turn of `sid` begins now (boot, rollback, fork restore): `pids` are the host
        pids of the processes in its cgroup that are known to the daemon; `lived_on`, those
        of them that were there in the previous turn too (its init); `restored`, those a
        restore let go already, with the system calls they were stopped in at the
        checkpoint (Inspector.watch)."""
        pids = set(pids)
        self._watched[sid] = (cgroup_id, pids)
        if self.inspector is not None:
            self.inspector.poll()  # what happened before now belongs to the ended turn
        self._partial.discard(sid)
        if self.inspector is None:
            self._partial.add(sid)
            return
        self._arm(sid, cgroup_id, pids, lived_on, restored)

    def _arm(self, sid: str, cgroup_id: int, pids: set[int],
             lived_on: Collection[int] = (),
             restored: Mapping[int, Collection[int]] | None = None) -> None:
        assert self.inspector is not None
        try:
            self.inspector.watch(sid, cgroup_id, pids=sorted(pids), lived_on=lived_on,
                                 restored=restored)
        except (InspectorUnavailable, ValueError, KeyError, OSError) as e:
            log.warning("sandbox %s: inspector cannot watch it (%s): its checkpoints are "
                        "full", sid, e)
            self._partial.add(sid)

    def unwatch(self, sid: str) -> None:
        self._watched.pop(sid, None)
        self._partial.discard(sid)
        self.history.pop(sid, None)
        if self.inspector is not None:
            self.inspector.unwatch(sid)

    def _watching(self, sid: str) -> bool:
        return self.inspector is not None and sid in self.inspector.watched()

    def expect_entry(self, sid: str, pid: int) -> None:
        """The daemon is about to put `pid` (a dbx-enter) into the sandbox."""
        if self._watching(sid):
            self.inspector.expect_entry(sid, pid)  # type: ignore[union-attr]

    def note_files(self, sid: str, op: str, path: str) -> None:
        """A change the daemon's files API made from outside the sandbox's cgroup."""
        if not self._watching(sid):
            return
        kind = {"write": "written", "upload_tar": "written", "mkdir": "created",
                "remove": "deleted"}.get(op)
        if kind is not None:
            self.inspector.note_files(sid, **{kind: [path]})  # type: ignore[union-attr]

    # ---- turn boundaries -------------------------------------------------------------

    def end_turn(self, sid: str, pids: Iterable[int] = ()) -> TurnEffects | None:
        """End the current turn (call with the sandbox's cgroup frozen) and return what it
        did, or None when the inspector did not watch it whole."""
        if not self._watching(sid):
            return None
        try:
            eff = self.inspector.turn(sid, pids)  # type: ignore[union-attr]
        except (InspectorUnavailable, KeyError) as e:
            log.warning("sandbox %s: ending its turn failed: %s", sid, e)
            return None
        if sid in self._partial:
            self._partial.discard(sid)
            return eff.model_copy(update=dict(
                complete=False, incomplete_reasons=[
                    *eff.incomplete_reasons, "the inspector did not see the whole turn (it "
                    "began watching late, or an earlier checkpoint failed)"]))
        return eff

    def current(self, sid: str) -> TurnEffects | None:
        """The current turn so far (None: not watched)."""
        if not self._watching(sid):
            return None
        return self.inspector.peek(sid)  # type: ignore[union-attr]

    def may_have_made_ipc(self, sid: str) -> bool:
        """Whether the current turn may have made IPC objects so far (an IPC call, or a
        part of it not watched)."""
        if sid in self._partial or not self._watching(sid):
            return True
        try:
            return self.inspector.saw_ipc(sid)  # type: ignore[union-attr]
        except (InspectorUnavailable, KeyError):
            return True

    def lost_turn(self, sid: str) -> None:
        """A turn ended without a checkpoint holding its effects (the checkpoint failed):
        the next one must not build on them."""
        if sid in self._watched:
            self._partial.add(sid)

    def decide(self, effects: TurnEffects | None, *, parent_reuse: str | None,
               has_parent: bool, processes_alive: bool, quiet: Iterable[int]) -> Decision:
        """The checkpoint policy for a turn (see the module docstring). `parent_reuse`: why
        the parent checkpoint's processes cannot stand for the running ones (None: they
        can)."""
        if effects is None:
            return Decision(kind="full", reasons=[f"inspector: {self.status}"
                                                  if self.inspector is None else
                                                  "the inspector did not watch this turn"])
        if has_parent and parent_reuse is not None:
            return Decision(kind="full", reasons=[parent_reuse])
        # Files created and removed again within the turn (git status's index.lock) leave
        # only their directory's mtime changed: not a change (README, "what a skipped
        # checkpoint restores").
        return decide(effects, parent_kind="full" if has_parent else None,
                      processes_alive=processes_alive, quiet=set(quiet))

    def record(self, sid: str, cp_id: str, effects: TurnEffects | None,
               decision: Decision) -> None:
        h = self.history.setdefault(sid, OrderedDict())
        h[cp_id] = (effects, decision)
        while len(h) > HISTORY:
            h.popitem(last=False)

    def recorded(self, sid: str, cp_id: str) -> tuple[TurnEffects | None, Decision] | None:
        return self.history.get(sid, {}).get(cp_id)
