"""Durable metadata in SQLite: sandboxes and the checkpoint tree.

Rows are the commit point of every operation: a layer on disk that no row names is garbage
(a crash between making it and committing), removed on the next start.
"""

from __future__ import annotations

import functools
import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
  id TEXT PRIMARY KEY, family_id TEXT NOT NULL, state TEXT NOT NULL, image TEXT NOT NULL,
  layer_id TEXT NOT NULL, head_cp TEXT, memory_mb INTEGER NOT NULL, pids_max INTEGER NOT NULL,
  cpus REAL NOT NULL, hostname TEXT NOT NULL, env TEXT NOT NULL, created_at REAL NOT NULL,
  base_gen INTEGER NOT NULL DEFAULT 0, disk_mb INTEGER NOT NULL DEFAULT 0,
  userns INTEGER NOT NULL DEFAULT 0, bases TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS checkpoints (
  id TEXT PRIMARY KEY, family_id TEXT NOT NULL, sandbox_id TEXT NOT NULL, parent_id TEXT,
  layer_id TEXT NOT NULL, image TEXT NOT NULL, kind TEXT NOT NULL, label TEXT NOT NULL,
  created_at REAL NOT NULL, duration_ms REAL NOT NULL, files_changed INTEGER NOT NULL,
  bytes_changed INTEGER NOT NULL, freeze_ms REAL NOT NULL, gen INTEGER NOT NULL DEFAULT 0,
  reasons TEXT NOT NULL DEFAULT '[]', procs_of TEXT, bases TEXT NOT NULL DEFAULT '',
  snapshot_of TEXT
);
CREATE INDEX IF NOT EXISTS cp_family ON checkpoints(family_id);
CREATE INDEX IF NOT EXISTS sb_family ON sandboxes(family_id);
"""


@dataclass
class SandboxRow:
    id: str
    family_id: str
    state: str
    image: str
    layer_id: str
    head_cp: str | None
    memory_mb: int
    pids_max: int
    cpus: float
    hostname: str
    env: dict[str, str]
    created_at: float
    base_gen: int = 0
    disk_mb: int = 0          # quota on each writable layer it gets (0 = none)
    userns: bool = False      # has a user namespace (a family shares one; forks keep it)
    # Read-only checkpoint layers stacked under its writable layer, top first (a fork's
    # children share their source checkpoint's layer this way: see Daemon._fork_files).
    bases: list[str] = field(default_factory=list)


@dataclass
class CheckpointRow:
    id: str
    family_id: str
    sandbox_id: str
    parent_id: str | None
    layer_id: str
    image: str
    kind: str
    label: str
    created_at: float
    duration_ms: float
    files_changed: int
    bytes_changed: int
    freeze_ms: float
    gen: int = 0
    reasons: list[str] = field(default_factory=list)
    # The checkpoint whose captured processes this one restores: itself for "full", the
    # parent's for a policy "fs" or "skipped" (nothing ran since), None for file state only.
    procs_of: str | None = None
    bases: list[str] = field(default_factory=list)   # those of the sandbox it was taken in
    # Set while the checkpoint's file snapshot is still to be taken from this writable layer
    # (answered first: Daemon._deferred_snapshot); recovery takes it if a crash came between.
    snapshot_of: str | None = None


class Database:
    """Thin typed access to the metadata; every write is one transaction."""

    def __init__(self, path: Path) -> None:
        self.conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.executescript(SCHEMA)
        self._migrate()

    def _migrate(self) -> None:
        """Bring a state dir made by an older daemon up to this schema."""
        cols = {r[1] for r in self.conn.execute("PRAGMA table_info(sandboxes)")}
        if "disk_mb" not in cols:
            self.conn.execute("ALTER TABLE sandboxes ADD COLUMN disk_mb INTEGER NOT NULL "
                              "DEFAULT 0")
        if "userns" not in cols:
            self.conn.execute("ALTER TABLE sandboxes ADD COLUMN userns INTEGER NOT NULL "
                              "DEFAULT 0")
        if "bases" not in cols:
            self.conn.execute("ALTER TABLE sandboxes ADD COLUMN bases TEXT NOT NULL DEFAULT ''")
        cols = {r[1] for r in self.conn.execute("PRAGMA table_info(checkpoints)")}
        if "procs_of" not in cols:
            self.conn.execute("ALTER TABLE checkpoints ADD COLUMN procs_of TEXT")
            self.conn.execute("UPDATE checkpoints SET procs_of=id WHERE kind='full'")
        if "bases" not in cols:
            self.conn.execute("ALTER TABLE checkpoints ADD COLUMN bases TEXT NOT NULL "
                              "DEFAULT ''")
        if "snapshot_of" not in cols:
            self.conn.execute("ALTER TABLE checkpoints ADD COLUMN snapshot_of TEXT")

    def close(self) -> None:
        self.conn.close()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """`with db.transaction():` commits on success, rolls back on error."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    # sandboxes
    def put_sandbox(self, s: SandboxRow) -> None:
        d = columns(s)
        d["env"] = json.dumps(s.env)
        d["bases"] = _join_bases(s.bases)
        cols = ", ".join(d)
        marks = ", ".join(f":{k}" for k in d)
        self.conn.execute(f"INSERT OR REPLACE INTO sandboxes ({cols}) VALUES ({marks})", d)

    def get_sandbox(self, sid: str) -> SandboxRow | None:
        r = self.conn.execute("SELECT * FROM sandboxes WHERE id=?", (sid,)).fetchone()
        return _sandbox(r) if r else None

    def sandboxes(self) -> list[SandboxRow]:
        rows = self.conn.execute("SELECT * FROM sandboxes ORDER BY created_at").fetchall()
        return [_sandbox(r) for r in rows]

    def delete_sandbox(self, sid: str) -> None:
        self.conn.execute("DELETE FROM sandboxes WHERE id=?", (sid,))

    def family_has_other(self, family_id: str, sid: str) -> bool:
        """Whether a sandbox other than `sid` is of the family (one indexed probe: a fork's
        children are removed one by one, and reading every row each time is quadratic)."""
        return self.conn.execute("SELECT 1 FROM sandboxes WHERE family_id=? AND id!=? LIMIT 1",
                                 (family_id, sid)).fetchone() is not None

    def family_sandboxes(self, family_id: str) -> list[SandboxRow]:
        rows = self.conn.execute("SELECT * FROM sandboxes WHERE family_id=?", (family_id,))
        return [_sandbox(r) for r in rows.fetchall()]

    # checkpoints
    def put_checkpoint(self, c: CheckpointRow) -> None:
        d = columns(c)
        d["reasons"] = json.dumps(c.reasons)
        d["bases"] = _join_bases(c.bases)
        cols = ", ".join(d)
        marks = ", ".join(f":{k}" for k in d)
        self.conn.execute(f"INSERT OR REPLACE INTO checkpoints ({cols}) VALUES ({marks})", d)

    def get_checkpoint(self, cid: str) -> CheckpointRow | None:
        r = self.conn.execute("SELECT * FROM checkpoints WHERE id=?", (cid,)).fetchone()
        return _checkpoint(r) if r else None

    def family_checkpoints(self, family_id: str) -> list[CheckpointRow]:
        rows = self.conn.execute(
            "SELECT * FROM checkpoints WHERE family_id=? ORDER BY created_at", (family_id,))
        return [_checkpoint(r) for r in rows.fetchall()]

    def all_checkpoints(self) -> list[CheckpointRow]:
        rows = self.conn.execute("SELECT * FROM checkpoints ORDER BY created_at").fetchall()
        return [_checkpoint(r) for r in rows]

    def unsnapshotted(self) -> list[CheckpointRow]:
        """Checkpoints whose file snapshot was still to be taken when a daemon stopped."""
        rows = self.conn.execute("SELECT * FROM checkpoints WHERE snapshot_of IS NOT NULL")
        return [_checkpoint(r) for r in rows.fetchall()]

    def snapshot_taken(self, cid: str, files: int, nbytes: int, reasons: list[str],
                       freeze_ms: float) -> None:
        """A deferred file snapshot is taken: only the columns it fills (and the freeze,
        which lasted until it was, for a sandbox that runs something)."""
        self.conn.execute("UPDATE checkpoints SET files_changed=?, bytes_changed=?, "
                          "reasons=?, freeze_ms=?, snapshot_of=NULL WHERE id=?",
                          (files, nbytes, json.dumps(reasons), freeze_ms, cid))

    def set_base_gen(self, sid: str, gen: int) -> None:
        self.conn.execute("UPDATE sandboxes SET base_gen=? WHERE id=?", (gen, sid))

    def delete_checkpoint(self, cid: str) -> None:
        self.conn.execute("DELETE FROM checkpoints WHERE id=?", (cid,))

    def reparent(self, old_parent: str, new_parent: str | None) -> None:
        self.conn.execute("UPDATE checkpoints SET parent_id=? WHERE parent_id=?",
                          (new_parent, old_parent))
        self.conn.execute("UPDATE sandboxes SET head_cp=? WHERE head_cp=?",
                          (new_parent, old_parent))

    def procs_refs(self, cp_id: str) -> int:
        """How many checkpoints restore the processes captured at cp_id."""
        r = self.conn.execute("SELECT COUNT(*) FROM checkpoints WHERE procs_of=?", (cp_id,))
        return int(r.fetchone()[0])

    def procs_of_layer(self, layer_id: str) -> str | None:
        """The process state a rollback to the checkpoint(s) on `layer_id` restores (they
        share it: a checkpoint shares a layer only with the parent it aliases)."""
        r = self.conn.execute("SELECT procs_of FROM checkpoints WHERE layer_id=? "
                              "ORDER BY created_at DESC LIMIT 1", (layer_id,)).fetchone()
        return None if r is None else r[0]

    def layer_refs(self, layer_id: str) -> int:
        r = self.conn.execute("SELECT COUNT(*) FROM checkpoints WHERE layer_id=?", (layer_id,))
        n = r.fetchone()[0]
        r = self.conn.execute("SELECT COUNT(*) FROM sandboxes WHERE layer_id=?", (layer_id,))
        return int(n) + int(r.fetchone()[0])

    def base_refs(self, layer_id: str) -> int:
        """How many rows stack `layer_id` under their layer (as one of their bases)."""
        pattern = f"%:{layer_id}:%"
        n = 0
        for table in ("checkpoints", "sandboxes"):
            r = self.conn.execute(f"SELECT COUNT(*) FROM {table} WHERE bases != '' AND "
                                  "':' || bases || ':' LIKE ?", (pattern,))
            n += int(r.fetchone()[0])
        return n

    def bases_of_layer(self, layer_id: str) -> list[str]:
        """The bases of the checkpoint(s) on `layer_id` (those sharing a layer share them)."""
        r = self.conn.execute("SELECT bases FROM checkpoints WHERE layer_id=? LIMIT 1",
                              (layer_id,)).fetchone()
        return _split_bases(r[0]) if r else []

    def referenced_layers(self) -> set[str]:
        """Every layer a row names, as its own or as a base."""
        out: set[str] = set()
        for table in ("checkpoints", "sandboxes"):
            for layer, bases in self.conn.execute(f"SELECT layer_id, bases FROM {table}"):
                out.add(layer)
                out.update(_split_bases(bases))
        return out


def columns(row: object) -> dict[str, object]:
    """A row dataclass's fields by name, for an INSERT: shallow (dataclasses.asdict copies
    every list and dict deeply: 46 against 2.6 us for a checkpoint row here, and a
    checkpoint writes two rows)."""
    return {name: getattr(row, name) for name in _field_names(type(row))}


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def _join_bases(bases: list[str]) -> str:
    return ":".join(bases)


def _split_bases(text: str) -> list[str]:
    return [b for b in text.split(":") if b]


def _sandbox(r: sqlite3.Row) -> SandboxRow:
    d = dict(r)
    d["env"] = json.loads(d["env"])
    d["userns"] = bool(d["userns"])
    d["bases"] = _split_bases(d["bases"])
    return SandboxRow(**d)


def _checkpoint(r: sqlite3.Row) -> CheckpointRow:
    d = dict(r)
    d["reasons"] = json.loads(d["reasons"])
    d["bases"] = _split_bases(d["bases"])
    return CheckpointRow(**d)
