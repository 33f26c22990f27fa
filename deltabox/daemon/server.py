"""The gRPC face of the daemon.

grpcio's server runs handlers on its own worker threads; every handler hands its work to the
trio loop that owns all daemon state (`trio.from_thread.run`) and waits for the answer, so the
daemon's logic stays single-threaded and structured. DeltaBoxError subclasses become their
status codes here, once.
"""

from __future__ import annotations

import hmac
import logging
import queue
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, NoReturn, TypeVar

import grpc
import pydantic
import trio

from ..api import deltabox_pb2 as pb
from ..api import deltabox_pb2_grpc as pb_grpc
from ..errors import DeltaBoxError, InvalidArgument
from ..fs.files import FileStat
from ..models import CreateParams
from .db import CheckpointRow, SandboxRow
from .idlegc import IdleCollector
from .service import Daemon, Ran, Read, Wrote

log = logging.getLogger("deltaboxd")
T = TypeVar("T")


def sandbox_pb(d: Daemon, r: SandboxRow, duration_ms: float = 0.0) -> pb.SandboxInfo:
    return pb.SandboxInfo(
        id=r.id, family_id=r.family_id, state=r.state if r.id in d.live else "stopped",
        image=r.image, head_checkpoint_id=r.head_cp or "", memory_mb=r.memory_mb,
        pids_max=r.pids_max, cpus=r.cpus, created_at=r.created_at, init_pid=d.init_pid(r.id),
        duration_ms=duration_ms, hostname=r.hostname, disk_mb=r.disk_mb,
        uid_map=d.uid_map(r))


def checkpoint_pb(c: CheckpointRow) -> pb.CheckpointInfo:
    return pb.CheckpointInfo(
        id=c.id, parent_id=c.parent_id or "", sandbox_id=c.sandbox_id, family_id=c.family_id,
        kind=c.kind, created_at=c.created_at, duration_ms=c.duration_ms,
        files_changed=c.files_changed, bytes_changed=c.bytes_changed, label=c.label,
        reasons=c.reasons, freeze_ms=c.freeze_ms, processes_from=c.procs_of or "")


def stat_pb(s: FileStat) -> pb.FileStat:
    return pb.FileStat(path=s.path, type=s.type, size=s.size, mode=s.mode, mtime=s.mtime,
                       link_target=s.link_target or "")


def exec_pb(ran: Ran) -> pb.ExecResponse:
    out = ran.out
    return pb.ExecResponse(exit_code=out.exit_code, stdout=out.stdout, stderr=out.stderr,
                           duration_ms=out.duration_ms, stdout_truncated=out.stdout_truncated,
                           stderr_truncated=out.stderr_truncated, note=ran.note,
                           checkpoint_id=ran.checkpoint_id, rollback=rollback_pb(ran))


def rollback_pb(ran: Ran | Wrote | Read) -> pb.RollbackResponse | None:
    """The rollback a command, a write or a read asked for (`rollback_to`), unset if none."""
    return pb.RollbackResponse(**ran.rollback) if ran.rollback is not None else None


class Servicer(pb_grpc.DeltaBoxServicer):
    def __init__(self, daemon: Daemon, token: trio.lowlevel.TrioToken,
                 auth_token: str | None, idle: IdleCollector) -> None:
        self.d = daemon
        self.trio_token = token
        self.auth_token = auth_token
        self.idle = idle  # counts the calls in progress: see idlegc

    # -- the bridge --
    def _authorize(self, context: grpc.ServicerContext) -> None:
        if self.auth_token is None or context.peer().startswith("unix:"):
            return
        meta = dict(context.invocation_metadata())
        given = meta.get("authorization", "").removeprefix("Bearer ")
        if not hmac.compare_digest(given, self.auth_token):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong token: set DELTABOX_TOKEN to the daemon's token")

    def _run(self, context: grpc.ServicerContext, fn: Callable[..., Awaitable[T]],
             *args: Any) -> T:
        self._authorize(context)
        try:
            return trio.from_thread.run(self.idle.call, fn, *args, trio_token=self.trio_token)
        except Exception as e:
            _abort(context, e)

    def _run_answering(self, context: grpc.ServicerContext,
                       fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """As _run, for work that answers before it ends: `fn(*args, answer=...)` calls
        `answer(result)` once the caller has what it asked for and goes on with its
        bookkeeping in the trio loop (still a call in progress for idlegc), while this
        thread sends the answer. Unlike a checkpoint's EarlyAnswer (daemon/pending.py),
        which the handler's task awaits, the answer leaves the loop at once: the work need
        not yield between the answer and what follows it. Started without waiting for the
        loop (run_sync_soon): one thread hop in, one out, as _run."""
        self._authorize(context)
        box: queue.SimpleQueue = queue.SimpleQueue()

        async def job() -> None:
            answered = False

            def answer(result: T) -> None:
                nonlocal answered
                answered = True
                box.put((True, result))
            try:
                result = await fn(*args, answer=answer)
                if not answered:
                    box.put((True, result))
            except BaseException as e:
                if not answered:
                    box.put((False, e))
                else:  # the caller has its answer; the bookkeeping after it failed
                    log.error("after answering: %s", traceback.format_exc())
                if not isinstance(e, Exception):
                    raise

        def start() -> None:  # in the loop: an exception here would crash it
            try:
                self.d.background.start_soon(self.idle.call, job)
            except RuntimeError:  # the nursery is closed: shutting down
                box.put((False, trio.RunFinishedError()))

        try:
            self.trio_token.run_sync_soon(start)
        except trio.RunFinishedError as e:
            _abort(context, e)
        ok, item = box.get()
        if ok:
            return item
        _abort(context, item if isinstance(item, Exception) else trio.RunFinishedError())

    def _answered(self, context: grpc.ServicerContext, wanted: object = True
                  ) -> trio.Event | None:
        """An event set in the trio loop once this call has ended (its answer sent), for
        work the call leaves in the background to wait for; None unless `wanted`."""
        if not wanted:
            return None
        ev = trio.Event()

        def ended() -> None:
            try:
                self.trio_token.run_sync_soon(ev.set)
            except trio.RunFinishedError:
                pass
        context.add_callback(ended)
        return ev

    def _sync(self, context: grpc.ServicerContext, fn: Callable[..., T], *args: Any) -> T:
        async def call() -> T:
            return fn(*args)
        return self._run(context, call)

    # -- daemon --
    def Info(self, request, context):  # noqa: N802
        return pb.InfoResponse(**self._sync(context, self.d.info))

    # -- sandboxes --
    def CreateSandbox(self, request, context):  # noqa: N802
        async def call() -> pb.SandboxInfo:
            params = CreateParams(image=request.image, memory_mb=request.memory_mb,
                                  pids_max=request.pids_max, cpus=request.cpus,
                                  hostname=request.hostname, env=dict(request.env),
                                  disk_mb=request.disk_mb,
                                  user_namespace=request.user_namespace,
                                  huge_pages=request.huge_pages)
            t = trio.current_time()
            row = await self.d.create(params)
            return sandbox_pb(self.d, row, (trio.current_time() - t) * 1000)
        return self._run(context, call)

    def GetSandbox(self, request, context):  # noqa: N802
        return self._sync(context, lambda: sandbox_pb(self.d, self.d.get(request.sandbox_id)))

    def ListSandboxes(self, request, context):  # noqa: N802
        return self._sync(context, lambda: pb.ListSandboxesResponse(
            sandboxes=[sandbox_pb(self.d, r) for r in self.d.list()]))

    def RemoveSandbox(self, request, context):  # noqa: N802
        freed = self._run(context, self.d.remove, request.sandbox_id)
        return pb.RemoveSandboxResponse(sandbox_id=request.sandbox_id, checkpoints_freed=freed)

    # -- commands --
    def Exec(self, request, context):  # noqa: N802
        ran = self._run(context, self.d.exec, request.sandbox_id, list(request.argv),
                        request.shell, request.cwd, dict(request.env), request.stdin,
                        request.timeout, None, request.checkpoint, request.checkpoint_label,
                        self._answered(context, request.checkpoint), request.rollback_to)
        return exec_pb(ran)

    def ExecStream(self, request, context) -> Iterator[pb.ExecChunk]:  # noqa: N802
        self._authorize(context)
        answered = self._answered(context, request.checkpoint)
        chunks: queue.SimpleQueue = queue.SimpleQueue()
        scope = trio.CancelScope()

        def sink(name: str, data: bytes) -> None:
            chunks.put(pb.ExecChunk(**{name: data}))

        async def job() -> None:
            with scope:
                try:
                    ran = await self.d.exec(request.sandbox_id, list(request.argv),
                                            request.shell, request.cwd, dict(request.env),
                                            request.stdin, request.timeout, sink,
                                            request.checkpoint, request.checkpoint_label,
                                            answered, request.rollback_to)
                    chunks.put(pb.ExecChunk(done=True, exit_code=ran.out.exit_code,
                                            duration_ms=ran.out.duration_ms,
                                            checkpoint_id=ran.checkpoint_id, note=ran.note,
                                            rollback=rollback_pb(ran)))
                    return
                except BaseException as e:
                    chunks.put(e)
                    if not isinstance(e, Exception):
                        raise
            chunks.put(trio.Cancelled.__new__(trio.Cancelled) if scope.cancelled_caught
                       else RuntimeError("exec ended without a result"))

        async def start() -> None:
            self.d.background.start_soon(self.idle.call, job)

        self._run(context, start)
        context.add_callback(lambda: _cancel(scope, self.trio_token))
        while True:
            item = chunks.get()
            if isinstance(item, pb.ExecChunk):
                yield item
                if item.done:
                    return
                continue
            if isinstance(item, DeltaBoxError):
                context.abort(item.code, item.message)
            context.abort(grpc.StatusCode.CANCELLED if isinstance(item, trio.Cancelled)
                          else grpc.StatusCode.INTERNAL, f"exec failed: {item!r}")

    def SessionRun(self, request, context):  # noqa: N802
        ran = self._run(context, self.d.session_run, request.sandbox_id, request.session,
                        request.command, request.timeout, request.checkpoint,
                        request.checkpoint_label, self._answered(context, request.checkpoint),
                        request.rollback_to, request.tty)
        return exec_pb(ran)

    def SessionClose(self, request, context):  # noqa: N802
        self._run(context, self.d.session_close, request.sandbox_id, request.session)
        return pb.SessionCloseResponse()

    def ListSessions(self, request, context):  # noqa: N802
        names = self._sync(context, self.d.sessions, request.sandbox_id)
        return pb.ListSessionsResponse(sessions=names)

    # -- files --
    def _files(self, context, request, op: str, *args: Any, **kw: Any) -> Any:
        return self._run(context, lambda: self.d.files(request.sandbox_id, op, *args, **kw))

    def ReadFile(self, request, context):  # noqa: N802
        r = self._run(context, self.d.read_file, request.sandbox_id, request.path,
                      request.rollback_to)
        return pb.FileData(data=r.data, rollback=rollback_pb(r))

    def WriteFile(self, request, context):  # noqa: N802
        w = self._run(context, self.d.write_file, request.sandbox_id, request.path,
                      request.data, request.mode or None, request.append,
                      request.make_parents, request.checkpoint, request.checkpoint_label,
                      self._answered(context, request.checkpoint), request.rollback_to)
        return pb.WriteFileResponse(stat=stat_pb(w.stat), checkpoint_id=w.checkpoint_id,
                                    note=w.note, rollback=rollback_pb(w))

    def ListDir(self, request, context):  # noqa: N802
        entries = self._files(context, request, "list", request.path)
        return pb.ListDirResponse(entries=[stat_pb(e) for e in entries])

    def StatFile(self, request, context):  # noqa: N802
        return stat_pb(self._files(context, request, "stat", request.path))

    def RemoveFile(self, request, context):  # noqa: N802
        self._files(context, request, "remove", request.path, recursive=request.recursive)
        return pb.RemoveFileResponse()

    def MakeDir(self, request, context):  # noqa: N802
        return stat_pb(self._files(context, request, "mkdir", request.path))

    def UploadTar(self, request, context):  # noqa: N802
        n = self._files(context, request, "upload_tar", request.path, request.tar)
        return pb.UploadTarResponse(entries=n)

    def DownloadTar(self, request, context):  # noqa: N802
        return pb.FileData(data=self._files(context, request, "download_tar", request.path))

    # -- checkpoints --
    def Checkpoint(self, request, context):  # noqa: N802
        if request.background:
            answered = self._answered(context)

            async def promise() -> pb.CheckpointInfo:
                cp_id = await self.d.checkpoint_soon(request.sandbox_id, request.mode,
                                                     request.label, answered)
                row = self.d.get(request.sandbox_id)
                return pb.CheckpointInfo(id=cp_id, sandbox_id=row.id, family_id=row.family_id,
                                         kind="pending", label=request.label,
                                         created_at=time.time())
            return self._run(context, promise)
        cp = self._run(context, self.d.checkpoint, request.sandbox_id, request.mode,
                       request.label, self._answered(context))
        return checkpoint_pb(cp)

    def Rollback(self, request, context):  # noqa: N802
        r = self._run_answering(context, self.d.rollback, request.sandbox_id,
                                request.checkpoint_id)
        return pb.RollbackResponse(**r)

    def Fork(self, request, context):  # noqa: N802
        async def call() -> pb.ForkResponse:
            t = trio.current_time()
            rows, state, note = await self.d.fork(request.checkpoint_id, request.count,
                                                  shared_layer=request.shared_layer)
            ms = (trio.current_time() - t) * 1000
            return pb.ForkResponse(sandboxes=[sandbox_pb(self.d, r) for r in rows],
                                   duration_ms=ms, process_state=state, note=note)
        return self._run(context, call)

    def ListCheckpoints(self, request, context):  # noqa: N802
        cps = self._run(context, self.d.checkpoints, request.sandbox_id)
        return pb.ListCheckpointsResponse(checkpoints=[checkpoint_pb(c) for c in cps])

    def GetCheckpoint(self, request, context):  # noqa: N802
        return checkpoint_pb(self._run(context, self.d.get_checkpoint, request.checkpoint_id))

    def DeleteCheckpoint(self, request, context):  # noqa: N802
        freed = self._run(context, self.d.delete_checkpoint, request.checkpoint_id)
        return pb.DeleteCheckpointResponse(layer_freed=freed)

    def Diff(self, request, context):  # noqa: N802
        a, m, d, note = self._run(context, self.d.diff, request.from_checkpoint_id,
                                  request.to_checkpoint_id)
        return pb.DiffResponse(added=a, modified=m, deleted=d, note=note)

    def TurnEffects(self, request, context):  # noqa: N802
        backend, eff, decision = self._run(context, self.d.turn_effects, request.sandbox_id,
                                           request.checkpoint_id)
        return pb.TurnEffectsResponse(
            backend=backend, effects_json=eff.model_dump_json() if eff is not None else "",
            kind=decision.kind if decision else "",
            reasons=decision.reasons if decision else [])


def _abort(context: grpc.ServicerContext, e: Exception) -> NoReturn:
    """End the call with the status code `e` means (DeltaBoxError's own, once, here)."""
    if isinstance(e, DeltaBoxError):
        context.abort(e.code, e.message)
    elif isinstance(e, pydantic.ValidationError):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, _validation_message(e))
    elif isinstance(e, trio.RunFinishedError):
        context.abort(grpc.StatusCode.UNAVAILABLE, "deltaboxd is shutting down; retry")
    else:  # a bug: say so, keep serving
        log.error("internal error: %s",
                  "".join(traceback.format_exception(type(e), e, e.__traceback__)))
        context.abort(grpc.StatusCode.INTERNAL, f"internal error in deltaboxd: {e!r} "
                      "(see the daemon log)")
    raise AssertionError("unreachable")


def _cancel(scope: trio.CancelScope, token: trio.lowlevel.TrioToken) -> None:
    try:
        trio.from_thread.run_sync(scope.cancel, trio_token=token)
    except trio.RunFinishedError:
        pass


def _validation_message(e: pydantic.ValidationError) -> str:
    parts = [f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()]
    return "invalid request: " + "; ".join(parts)


MAX_MESSAGE = 512 << 20


def make_server(servicer: Servicer, socket_path: str, listen: str | None,
                workers: int = 64) -> grpc.Server:
    from concurrent.futures import ThreadPoolExecutor

    opts = [("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.max_receive_message_length", MAX_MESSAGE)]
    server = grpc.server(ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"),
                         options=opts)
    pb_grpc.add_DeltaBoxServicer_to_server(servicer, server)
    if server.add_insecure_port("unix:" + socket_path) == 0:
        raise InvalidArgument(f"cannot listen on unix socket {socket_path}")
    if listen:
        if server.add_insecure_port(listen) == 0:
            raise InvalidArgument(f"cannot listen on {listen}")
    return server
