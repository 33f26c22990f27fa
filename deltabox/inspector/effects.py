"""What one turn of a sandbox did, as the inspector saw it (JSON-serialisable)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

LIST_CAP = 1000


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True)


class ForkedProcess(_Model):
    pid: int                    # host pid (tid for a thread)
    parent_pid: int
    comm: str = ""
    thread: bool = False
    alive_at_end: bool          # still running when the turn ended


class ExecedProcess(_Model):
    pid: int
    filename: str
    comm: str = ""


class ExitedProcess(_Model):
    pid: int
    comm: str = ""
    thread: bool = False        # a thread of a process that lives on
    long_lived: bool            # it existed when the turn began


class SignalledProcess(_Model):
    pid: int                    # target (host tid)
    signal: int
    how: str                    # "sent" (by a sandbox process) | "delivered"
    sender: int | None = None
    handler: bool = False       # delivered to a user handler (the target ran code)
    long_lived: bool


class RanProcess(_Model):
    pid: int
    comm: str = ""
    how: str                    # "syscall <name>" | "cpu time" | "signal handler"


class AddressSpaceChange(_Model):
    pid: int
    comm: str = ""
    syscalls: list[str]


class SocketOp(_Model):
    pid: int
    comm: str = ""
    op: str                     # socket | socketpair | bind | listen | connect | accept | sendto
    family: str = ""            # unix | inet | inet6 | netlink | ... | "" unknown
    address: str | None = None  # ip / unix path ("@name" abstract)
    port: int | None = None
    long_lived: bool = False


class TurnEffects(_Model):
    """Everything recovery-relevant a sandbox's processes did between two turn boundaries.

    Paths are as the process saw them (inside the sandbox); a relative path whose base is not
    known is given as "<cwd>/rel" or "<fd N>/rel"; a write through a descriptor whose path is
    not known as "<inode DEV:INO>". Lists are capped at LIST_CAP entries (`paths_truncated`
    / `processes_truncated` say so; a cut path string also sets `paths_truncated`)."""

    key: str
    started_at: float
    ended_at: float
    backend: str = ""
    files_written: list[str] = Field(default_factory=list)
    files_created: list[str] = Field(default_factory=list)
    files_deleted: list[str] = Field(default_factory=list)
    files_renamed: list[str] = Field(default_factory=list)       # "old -> new"
    files_chmodded: list[str] = Field(default_factory=list)
    files_truncated: list[str] = Field(default_factory=list)
    files_attrs_changed: list[str] = Field(default_factory=list)  # chown, xattr, times
    files_transient: list[str] = Field(default_factory=list)     # created and removed
    paths_truncated: bool = False
    processes_forked: list[ForkedProcess] = Field(default_factory=list)
    processes_execed: list[ExecedProcess] = Field(default_factory=list)
    processes_exited: list[ExitedProcess] = Field(default_factory=list)
    processes_signalled: list[SignalledProcess] = Field(default_factory=list)
    processes_ran: list[RanProcess] = Field(default_factory=list)
    processes_new_alive: list[int] = Field(default_factory=list)  # appeared, still running
    processes_truncated: bool = False
    long_lived: list[int] = Field(default_factory=list)   # processes alive at start and end
    address_space_changed: list[AddressSpaceChange] = Field(default_factory=list)
    sockets: list[SocketOp] = Field(default_factory=list)
    other_effects: list[str] = Field(default_factory=list)  # ptrace, SysV IPC, mounts, ...
    lost_events: int = 0
    late_events: int = 0      # events of an earlier turn that arrived after it had ended
    outside_entries: list[int] = Field(default_factory=list)
    complete: bool = True
    incomplete_reasons: list[str] = Field(default_factory=list)
    events: int = 0           # events consumed for this turn

    @property
    def files_changed(self) -> bool:
        return bool(self.files_written or self.files_created or self.files_deleted or
                    self.files_renamed or self.files_chmodded or self.files_truncated or
                    self.files_attrs_changed)
