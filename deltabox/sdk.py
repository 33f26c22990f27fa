"""The Python SDK: a thin, synchronous wrapper over deltaboxd's gRPC API.

    with Sandbox.create() as sbx:
        sbx.files.write("/workspace/x.py", "print(1)")
        cp = sbx.checkpoint()
        print(sbx.exec("python3 x.py").stdout)
        sbx.rollback(cp)

Objects hold only ids; the daemon owns all state, so a Sandbox can be rebuilt from its id
anywhere with `Sandbox.connect`.
"""

from __future__ import annotations

import builtins
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

from deltabox import convert, errors
from deltabox.api import deltabox_pb2 as pb
from deltabox.client import Client, connect, default_socket
from deltabox.models import (Checkpoint, DaemonInfo, DiffResult, ExecResult, FileInfo,
                             ReadBytes, RollbackResult, SandboxInfo, TurnReport, WriteResult)

__all__ = ["Sandbox", "Session", "Files", "info"]

# Extra seconds the RPC deadline allows beyond a command's own timeout, so the daemon (which
# kills the command and reports DEADLINE_EXCEEDED) normally answers before gRPC gives up.
_EXEC_DEADLINE_GRACE = 30.0

OutputCallback = Callable[[bytes], object]
CheckpointLike = Checkpoint | str

_clients: dict[tuple[str, str], Client] = {}
_clients_lock = threading.Lock()


def _client(socket: str | None) -> Client:
    """One shared channel per daemon address, so many Sandbox objects don't each open one."""
    address = socket or default_socket()
    key = (address, os.environ.get("DELTABOX_TOKEN", ""))
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = connect(address)
        return client


def _cp_id(cp: CheckpointLike) -> str:
    return cp if isinstance(cp, str) else cp.id


def _cp_id_or_none(cp: CheckpointLike | None) -> str:
    """A request's optional checkpoint field: "" when none is given."""
    return "" if cp is None else _cp_id(cp)


def _deadline(timeout: float | None) -> float | None:
    return timeout + _EXEC_DEADLINE_GRACE if timeout else None


def info(socket: str | None = None) -> DaemonInfo:
    """What the daemon is running on (store backend, cgroup version, counts)."""
    return convert.daemon_info(_client(socket).call("Info", pb.InfoRequest()))


class Sandbox:
    """A handle to one sandbox in deltaboxd. Cheap; holds only the id and a client."""

    def __init__(self, sandbox_id: str, client: Client) -> None:
        self.id = sandbox_id
        self._client = client
        self.files = Files(self)
        # Set on sandboxes returned by fork: "restored" (the checkpoint's processes run
        # here too) or "restarted" (files only), and the daemon's reason.
        self.process_state = ""
        self.fork_note = ""

    # --- construction -------------------------------------------------------------------

    @classmethod
    def create(cls, image: str | None = None, socket: str | None = None,
               memory_mb: int | None = None, pids_max: int | None = None,
               cpus: float | None = None, env: Mapping[str, str] | None = None,
               hostname: str | None = None, disk_mb: int | None = None,
               user_namespace: bool = False, huge_pages: bool = False) -> Sandbox:
        """Start a new sandbox. `image`: a directory or tarball on the daemon's host; None
        = the host root, read-only. Unset limits take the daemon's defaults.
        `user_namespace`: its root is an unprivileged host id, not host root.
        `huge_pages`: its programs' malloc memory in 2 MiB pages where the host allows it
        (glibc.malloc.hugetlb=1): checkpoints, rollbacks and forks of large processes copy
        1/512th of the page-table entries (README: Host tuning)."""
        req = pb.CreateSandboxRequest(
            image=image or "", memory_mb=memory_mb or 0, pids_max=pids_max or 0,
            cpus=cpus or 0.0, hostname=hostname or "", env=dict(env or {}),
            disk_mb=disk_mb or 0, user_namespace=user_namespace, huge_pages=huge_pages,
        )
        client = _client(socket)
        return cls(client.call("CreateSandbox", req).id, client)

    @classmethod
    def connect(cls, sandbox_id: str, socket: str | None = None) -> Sandbox:
        """Attach to an existing sandbox; raises NotFound if there is none with that id."""
        client = _client(socket)
        client.call("GetSandbox", pb.SandboxRef(sandbox_id=sandbox_id))
        return cls(sandbox_id, client)

    @classmethod
    def fork_from(cls, checkpoint: CheckpointLike, count: int = 1,
                  socket: str | None = None, shared_layer: bool = False
                  ) -> builtins.list[Sandbox]:
        """New sandboxes that each start from `checkpoint` (of any family); see `fork`
        for `shared_layer`."""
        return _fork(_client(socket), _cp_id(checkpoint), count, shared_layer)

    # --- commands -----------------------------------------------------------------------

    def exec(self, cmd: str | Sequence[str], timeout: float | None = 30,
             cwd: str | None = None, env: Mapping[str, str] | None = None,
             stdin: bytes | str | None = None, on_stdout: OutputCallback | None = None,
             on_stderr: OutputCallback | None = None, checkpoint: str | None = None,
             checkpoint_label: str = "", rollback_to: CheckpointLike | None = None
             ) -> ExecResult:
        """Run a command to completion. A str runs via `bash -c`; a list is argv.

        With `on_stdout`/`on_stderr`, output is streamed to them chunk by chunk as it
        arrives (and still collected in the result). A timeout raises DeadlineExceeded.
        With `checkpoint` ("auto", "fs" or "full") the sandbox is checkpointed at the
        command's end, in the background: `result.checkpoint_id` names it at once, and
        whatever names it later (rollback, fork, get_checkpoint) waits for it.
        With `rollback_to`, the sandbox is first rolled back to that checkpoint (as
        `rollback` does; `result.rollback` says how): a tree search's step in one call.
        If the rollback fails, the command does not run and its error is raised.
        """
        req = self._exec_request(cmd, timeout, cwd, env, stdin)
        req.checkpoint, req.checkpoint_label = checkpoint or "", checkpoint_label
        req.rollback_to = _cp_id_or_none(rollback_to)
        if on_stdout is None and on_stderr is None:
            resp = self._client.call("Exec", req, timeout=_deadline(timeout))
            return convert.exec_result(resp)
        return self._exec_streaming(req, _deadline(timeout), on_stdout, on_stderr)

    def _exec_request(self, cmd: str | Sequence[str], timeout: float | None,
                      cwd: str | None, env: Mapping[str, str] | None,
                      stdin: bytes | str | None) -> pb.ExecRequest:
        if isinstance(stdin, str):
            stdin = stdin.encode()
        req = pb.ExecRequest(sandbox_id=self.id, timeout=timeout or 0.0, cwd=cwd or "",
                             env=dict(env or {}), stdin=stdin or b"")
        if isinstance(cmd, str):
            req.shell = cmd
        else:
            if not cmd:
                raise errors.InvalidArgument("exec: empty argv")
            req.argv.extend(cmd)
        return req

    def _exec_streaming(self, req: pb.ExecRequest, deadline: float | None,
                        on_stdout: OutputCallback | None,
                        on_stderr: OutputCallback | None) -> ExecResult:
        out: builtins.list[bytes] = []
        err: builtins.list[bytes] = []
        for chunk in self._client.stream("ExecStream", req, timeout=deadline):
            if chunk.stdout:
                out.append(chunk.stdout)
                if on_stdout is not None:
                    on_stdout(chunk.stdout)
            if chunk.stderr:
                err.append(chunk.stderr)
                if on_stderr is not None:
                    on_stderr(chunk.stderr)
            if chunk.done:
                return convert.exec_result_from_parts(chunk.exit_code, b"".join(out),
                                                      b"".join(err), chunk.duration_ms,
                                                      note=chunk.note,
                                                      checkpoint_id=chunk.checkpoint_id,
                                                      rollback=convert.rollback_of(chunk))
        raise errors.Internal("ExecStream ended without an exit status")

    def session(self, name: str = "main", tty: bool = False) -> Session:
        """A persistent bash session (cwd, env, jobs survive between runs). With `tty`, its
        commands run on a pseudo-terminal (programs see a terminal; their output comes back
        as a terminal shows it, stderr merged into stdout, lines ending "\r\n")."""
        return Session(self, name, tty)

    def sessions(self) -> builtins.list[str]:
        resp = self._client.call("ListSessions", pb.SandboxRef(sandbox_id=self.id))
        return list(resp.sessions)

    # --- checkpoints --------------------------------------------------------------------

    def checkpoint(self, mode: str = "auto", label: str = "",
                   background: bool = False) -> Checkpoint:
        """Capture the sandbox's state. mode: "auto" | "fs" (files only) | "full".

        `background=True` returns at once a Checkpoint of kind "pending" (its id, sandbox
        and label); it is taken right after, before any later operation on the sandbox.
        `get_checkpoint(id)` waits for it and returns it, or raises why it failed.

        A checkpoint (any but a forced "fs" one, on the embedded store without
        `--durable`) is committed and answered first, its snapshot (and a full one's
        process templates) made right after, before any later operation (the sandbox's
        processes stay stopped meanwhile: nothing can change the files); its answer then
        has files_changed = bytes_changed = 0 and says so in `reasons`: `get_checkpoint`
        has the counts, and waits for them."""
        req = pb.CheckpointRequest(sandbox_id=self.id, mode=mode, label=label,
                                   background=background)
        return convert.checkpoint(self._client.call("Checkpoint", req))

    def get_checkpoint(self, cp: CheckpointLike) -> Checkpoint:
        """A checkpoint's record (waits for a pending one)."""
        req = pb.CheckpointRef(checkpoint_id=_cp_id(cp))
        return convert.checkpoint(self._client.call("GetCheckpoint", req))

    def turn_effects(self, cp: CheckpointLike | None = None) -> TurnReport:
        """What the sandbox's processes did since its last checkpoint (or rollback), as the
        eBPF inspector saw it; with `cp`: the turn that checkpoint closed, and the policy's
        decision (kind, reasons). `.effects` is None when the inspector did not watch."""
        req = pb.TurnEffectsRequest(sandbox_id=self.id,
                                    checkpoint_id=_cp_id(cp) if cp is not None else "")
        return convert.turn_report(self._client.call("TurnEffects", req))

    def rollback(self, cp: CheckpointLike) -> RollbackResult:
        """Return this sandbox to `cp` (a checkpoint of its own family)."""
        req = pb.RollbackRequest(sandbox_id=self.id, checkpoint_id=_cp_id(cp))
        return convert.rollback_result(self._client.call("Rollback", req))

    def fork(self, cp: CheckpointLike | None = None, count: int = 1,
             shared_layer: bool = False) -> builtins.list[Sandbox]:
        """`count` new sandboxes starting from `cp`; None checkpoints this sandbox first.

        `shared_layer=True`: the children use the checkpoint's files as a container uses
        its image, read-only under an empty layer of their own: the files they read share
        one page cache (warm across children and their rollbacks), but renaming a
        directory that came from the checkpoint fails with EXDEV, and hard links from it
        break when one of them is written. Default: each child gets a snapshot."""
        cp_id = _cp_id(cp) if cp is not None else self.checkpoint().id
        return _fork(self._client, cp_id, count, shared_layer)

    def checkpoints(self) -> builtins.list[Checkpoint]:
        """The whole family's checkpoints, parents before children."""
        resp = self._client.call("ListCheckpoints", pb.SandboxRef(sandbox_id=self.id))
        return convert.checkpoints(resp.checkpoints)

    def diff(self, a: CheckpointLike, b: CheckpointLike) -> DiffResult:
        """Paths added / modified / deleted going from checkpoint `a` to `b`."""
        req = pb.DiffRequest(from_checkpoint_id=_cp_id(a), to_checkpoint_id=_cp_id(b))
        return convert.diff_result(self._client.call("Diff", req))

    def delete_checkpoint(self, cp: CheckpointLike) -> bool:
        """Drop a checkpoint; True if its storage layer was freed."""
        req = pb.CheckpointRef(checkpoint_id=_cp_id(cp))
        return bool(self._client.call("DeleteCheckpoint", req).layer_freed)

    # --- lifecycle ----------------------------------------------------------------------

    def info(self) -> SandboxInfo:
        resp = self._client.call("GetSandbox", pb.SandboxRef(sandbox_id=self.id))
        return convert.sandbox_info(resp)

    def kill(self) -> int:
        """Remove the sandbox and everything only it used; returns checkpoints freed."""
        resp = self._client.call("RemoveSandbox", pb.SandboxRef(sandbox_id=self.id))
        return int(resp.checkpoints_freed)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.kill()
        except errors.NotFound:
            pass  # already gone
        except errors.DeltaBoxError:
            if exc is None:
                raise  # otherwise let the body's exception be the one reported

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sandbox) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    @classmethod
    def list(cls, socket: str | None = None) -> builtins.list[SandboxInfo]:
        """All sandboxes the daemon knows."""
        resp = _client(socket).call("ListSandboxes", pb.ListSandboxesRequest())
        return [convert.sandbox_info(s) for s in resp.sandboxes]


def _fork(client: Client, checkpoint_id: str, count: int,
          shared_layer: bool = False) -> builtins.list[Sandbox]:
    if count < 1:
        raise errors.InvalidArgument(f"fork count must be at least 1, got {count}")
    resp = client.call("Fork", pb.ForkRequest(checkpoint_id=checkpoint_id, count=count,
                                              shared_layer=shared_layer))
    out = [Sandbox(s.id, client) for s in resp.sandboxes]
    for sbx in out:  # what the fork brought along, as the daemon reported it
        sbx.process_state, sbx.fork_note = resp.process_state, resp.note
    return out


class Session:
    """A named bash session inside a sandbox; created by the daemon on first run."""

    def __init__(self, sandbox: Sandbox, name: str, tty: bool = False) -> None:
        self.sandbox = sandbox
        self.name = name
        self.tty = tty

    def run(self, command: str, timeout: float | None = None, checkpoint: str | None = None,
            checkpoint_label: str = "", rollback_to: CheckpointLike | None = None
            ) -> ExecResult:
        """Run bash source in the session. On timeout the session is restarted.
        `checkpoint`, `rollback_to`: as in `Sandbox.exec` (after the rollback, the session
        is the one the checkpoint holds: its cwd, variables and jobs)."""
        req = pb.SessionRunRequest(sandbox_id=self.sandbox.id, session=self.name,
                                   command=command, timeout=timeout or 0.0,
                                   checkpoint=checkpoint or "",
                                   checkpoint_label=checkpoint_label,
                                   rollback_to=_cp_id_or_none(rollback_to), tty=self.tty)
        resp = self.sandbox._client.call("SessionRun", req, timeout=_deadline(timeout))
        return convert.exec_result(resp)

    def close(self) -> None:
        req = pb.SessionRef(sandbox_id=self.sandbox.id, session=self.name)
        self.sandbox._client.call("SessionClose", req)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.close()
        except errors.DeltaBoxError:
            if exc is None:
                raise

    def __repr__(self) -> str:
        return f"Session({self.sandbox.id!r}, {self.name!r})"


class Files:
    """File access inside the sandbox root. Relative paths are relative to /workspace."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    def _call(self, method: str, request: Any) -> Any:
        return self._sandbox._client.call(method, request)

    def _ref(self, path: str) -> pb.FileRef:
        return pb.FileRef(sandbox_id=self._sandbox.id, path=path)

    def write(self, path: str, data: bytes | str, mode: int | None = None,
              make_parents: bool = True, append: bool = False,
              checkpoint: str | None = None, checkpoint_label: str = "",
              rollback_to: CheckpointLike | None = None) -> WriteResult:
        """Write (or with `append`, extend) a file. `checkpoint` and `rollback_to` as in
        Sandbox.exec: an edit as a tree search's step in one call (rolled back to the
        node, the file written, the result checkpointed: `result.checkpoint_id`). If the
        rollback fails, nothing is written and its error is raised."""
        if isinstance(data, str):
            data = data.encode()
        req = pb.WriteFileRequest(sandbox_id=self._sandbox.id, path=path, data=data,
                                  mode=mode or 0, append=append, make_parents=make_parents,
                                  checkpoint=checkpoint or "",
                                  checkpoint_label=checkpoint_label,
                                  rollback_to=_cp_id_or_none(rollback_to))
        return convert.write_result(self._call("WriteFile", req))

    def read(self, path: str, rollback_to: CheckpointLike | None = None) -> ReadBytes:
        """The file's bytes. With `rollback_to`, the sandbox is first rolled back to that
        checkpoint, as in Sandbox.exec: a step that begins by reading the file it edits is
        one call; the bytes are then a ReadBytes whose `rollback` is the rollback's
        result. If the rollback fails, nothing is read and its error is raised."""
        req = pb.ReadFileRequest(sandbox_id=self._sandbox.id, path=path,
                                 rollback_to=_cp_id_or_none(rollback_to))
        msg = self._call("ReadFile", req)
        if not req.rollback_to:
            return bytes(msg.data)
        return ReadBytes(msg.data, convert.rollback_of(msg))

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return self.read(path).decode(encoding, errors="replace")

    def stat(self, path: str) -> FileInfo:
        return convert.file_info(self._call("StatFile", self._ref(path)))

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
        except errors.NotFound:
            return False
        return True

    def remove(self, path: str, recursive: bool = False) -> None:
        req = pb.RemoveFileRequest(sandbox_id=self._sandbox.id, path=path, recursive=recursive)
        self._call("RemoveFile", req)

    def mkdir(self, path: str) -> FileInfo:
        return convert.file_info(self._call("MakeDir", self._ref(path)))

    def upload_tar(self, path: str, tar_bytes: bytes) -> int:
        """Extract a tar archive into directory `path`; returns the number of entries."""
        req = pb.UploadTarRequest(sandbox_id=self._sandbox.id, path=path, tar=tar_bytes)
        return int(self._call("UploadTar", req).entries)

    def download_tar(self, path: str) -> bytes:
        """A tar archive of `path` (file or directory)."""
        return bytes(self._call("DownloadTar", self._ref(path)).data)

    def list(self, path: str = "/workspace") -> builtins.list[FileInfo]:
        resp = self._call("ListDir", self._ref(path))
        return [convert.file_info(e) for e in resp.entries]
