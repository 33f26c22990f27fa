"""Pydantic models at the API boundary: what the SDK returns and the daemon validates."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deltabox.inspector.effects import TurnEffects


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True)


class RollbackResult(_Model):
    sandbox_id: str
    checkpoint_id: str
    duration_ms: float
    sessions_restarted: list[str] = Field(default_factory=list)
    processes_killed: int = 0
    process_state: str = ""
    note: str = ""


class ExecResult(_Model):
    exit_code: int
    stdout: str
    stderr: str
    duration_ms: float
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    note: str = ""
    # The checkpoint asked for at the command's end (`checkpoint=`): its id, taken in the
    # background; "" if none was asked for or none could be taken (`note` says why).
    checkpoint_id: str = ""
    # The rollback asked for before the command (`rollback_to=`); None if none was.
    rollback: RollbackResult | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class Checkpoint(_Model):
    id: str
    parent_id: str | None
    sandbox_id: str
    family_id: str
    kind: str
    created_at: float
    duration_ms: float
    files_changed: int = 0
    bytes_changed: int = 0
    label: str = ""
    reasons: list[str] = Field(default_factory=list)
    freeze_ms: float = 0.0
    # The checkpoint whose captured processes a rollback to this one restores (itself for
    # "full"; the parent's for "fs"/"skipped" decided by the policy); None: files only.
    processes_from: str | None = None


class DiffResult(_Model):
    added: list[str]
    modified: list[str]
    deleted: list[str]
    note: str = ""


class FileInfo(_Model):
    path: str
    type: str
    size: int
    mode: int
    mtime: float
    link_target: str = ""


class WriteResult(FileInfo):
    """A written file's info; with the checkpoint asked for after the write and the
    rollback asked for before it, as in ExecResult."""
    checkpoint_id: str = ""
    rollback: RollbackResult | None = None
    note: str = ""


class ReadBytes(bytes):
    """A file's bytes as `Files.read(path, rollback_to=cp)` returns them: bytes in every
    way, with the rollback asked for before the read (as ExecResult.rollback)."""

    rollback: RollbackResult | None

    def __new__(cls, data: bytes, rollback: RollbackResult | None) -> ReadBytes:
        out = super().__new__(cls, data)
        out.rollback = rollback
        return out


class SandboxInfo(_Model):
    id: str
    family_id: str
    state: str
    image: str
    head_checkpoint_id: str | None
    memory_mb: int
    pids_max: int
    cpus: float
    created_at: float
    init_pid: int
    hostname: str = ""
    disk_mb: int = 0
    uid_map: str = ""         # "0 BASE COUNT" with a user namespace ("" = root is host root)


class DaemonInfo(_Model):
    version: str
    state_dir: str
    socket: str
    store_backend: str
    store_path: str
    cgroup_version: str
    sandboxes: int
    checkpoints: int
    store_bytes_total: int
    store_bytes_free: int
    process_backend: str
    inspector_backend: str
    store_durability: str = ""
    disk_quota: str = ""
    transparent_hugepages: str = ""
    cgroup_favordynmods: str = ""


MIN_PIDS = 8
MIN_CPUS = 0.01


class CreateParams(_Model):
    """Validated CreateSandbox request (daemon side)."""

    image: str = ""
    memory_mb: int = Field(default=0, ge=0, le=1 << 20)
    pids_max: int = Field(default=0, ge=0, le=1 << 22)
    cpus: float = Field(default=0.0, ge=0.0, le=1024.0)
    hostname: str = Field(default="", max_length=63, pattern=r"^[A-Za-z0-9.-]*$")
    env: dict[str, str] = Field(default_factory=dict)
    disk_mb: int = Field(default=0, ge=0, le=1 << 30)
    user_namespace: bool = False
    huge_pages: bool = False

    @field_validator("cpus")
    @classmethod
    def _enough_cpu(cls, v: float) -> float:
        # the kernel's smallest CFS quota is 1 ms per 100 ms period
        if 0 < v < MIN_CPUS:
            raise ValueError(f"must be 0 (unlimited) or at least {MIN_CPUS}")
        return v

    @field_validator("pids_max")
    @classmethod
    def _enough_pids(cls, v: int) -> int:
        # init, the exec helper and a shell need a few; fewer cannot even start the sandbox
        if 0 < v < MIN_PIDS:
            raise ValueError(f"must be 0 (the daemon's default) or at least {MIN_PIDS}")
        return v


class TurnReport(_Model):
    """What a sandbox did in a turn, as the eBPF inspector saw it (`Sandbox.turn_effects`)."""

    backend: str                     # inspector backend, or "none: <why>"
    effects: TurnEffects | None      # None: the inspector did not watch this turn
    kind: str = ""                   # for a checkpoint's turn: skipped | fs | full
    reasons: list[str] = Field(default_factory=list)
