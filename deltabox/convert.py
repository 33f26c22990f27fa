"""Proto messages -> pydantic models, in one place so the SDK and the CLI agree.

proto3 has no null: empty id strings become None here, where the models allow it.
"""

from __future__ import annotations

from collections.abc import Iterable

from deltabox import models
from deltabox.api import deltabox_pb2 as pb


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def exec_result(resp: pb.ExecResponse) -> models.ExecResult:
    return exec_result_from_parts(resp.exit_code, resp.stdout, resp.stderr, resp.duration_ms,
                                  resp.note, resp.stdout_truncated, resp.stderr_truncated,
                                  resp.checkpoint_id, rollback_of(resp))


def exec_result_from_parts(exit_code: int, stdout: bytes, stderr: bytes, duration_ms: float,
                           note: str = "", stdout_truncated: bool = False,
                           stderr_truncated: bool = False, checkpoint_id: str = "",
                           rollback: models.RollbackResult | None = None) -> models.ExecResult:
    """Shared by Exec and ExecStream (whose output arrives in chunks)."""
    return models.ExecResult(
        exit_code=exit_code, stdout=_decode(stdout), stderr=_decode(stderr),
        duration_ms=duration_ms, stdout_bytes=stdout, stderr_bytes=stderr, note=note,
        stdout_truncated=stdout_truncated, stderr_truncated=stderr_truncated,
        checkpoint_id=checkpoint_id, rollback=rollback,
    )


def rollback_of(msg: pb.ExecResponse | pb.ExecChunk | pb.WriteFileResponse | pb.FileData
                ) -> models.RollbackResult | None:
    """The rollback a command, a write or a read asked for (`rollback_to`), None if none."""
    return rollback_result(msg.rollback) if msg.HasField("rollback") else None


def checkpoint(msg: pb.CheckpointInfo) -> models.Checkpoint:
    return models.Checkpoint(
        id=msg.id, parent_id=msg.parent_id or None, sandbox_id=msg.sandbox_id,
        family_id=msg.family_id, kind=msg.kind, created_at=msg.created_at,
        duration_ms=msg.duration_ms, files_changed=msg.files_changed,
        bytes_changed=msg.bytes_changed, label=msg.label, reasons=list(msg.reasons),
        freeze_ms=msg.freeze_ms, processes_from=msg.processes_from or None,
    )


def turn_report(msg: pb.TurnEffectsResponse) -> models.TurnReport:
    eff = (models.TurnEffects.model_validate_json(msg.effects_json) if msg.effects_json
           else None)
    return models.TurnReport(backend=msg.backend, effects=eff, kind=msg.kind,
                             reasons=list(msg.reasons))


def checkpoints(msgs: Iterable[pb.CheckpointInfo]) -> list[models.Checkpoint]:
    return [checkpoint(m) for m in msgs]


def rollback_result(msg: pb.RollbackResponse) -> models.RollbackResult:
    return models.RollbackResult(
        sandbox_id=msg.sandbox_id, checkpoint_id=msg.checkpoint_id,
        duration_ms=msg.duration_ms, sessions_restarted=list(msg.sessions_restarted),
        processes_killed=msg.processes_killed, process_state=msg.process_state,
        note=msg.note,
    )


def diff_result(msg: pb.DiffResponse) -> models.DiffResult:
    return models.DiffResult(added=list(msg.added), modified=list(msg.modified),
                             deleted=list(msg.deleted), note=msg.note)


def file_info(msg: pb.FileStat) -> models.FileInfo:
    return models.FileInfo(path=msg.path, type=msg.type, size=msg.size, mode=msg.mode,
                           mtime=msg.mtime, link_target=msg.link_target)


def write_result(msg: pb.WriteFileResponse) -> models.WriteResult:
    return models.WriteResult(**file_info(msg.stat).model_dump(),
                              checkpoint_id=msg.checkpoint_id, rollback=rollback_of(msg),
                              note=msg.note)


def sandbox_info(msg: pb.SandboxInfo) -> models.SandboxInfo:
    return models.SandboxInfo(
        id=msg.id, family_id=msg.family_id, state=msg.state, image=msg.image,
        head_checkpoint_id=msg.head_checkpoint_id or None, memory_mb=msg.memory_mb,
        pids_max=msg.pids_max, cpus=msg.cpus, created_at=msg.created_at,
        init_pid=msg.init_pid, hostname=msg.hostname, disk_mb=msg.disk_mb,
        uid_map=msg.uid_map,
    )


def daemon_info(msg: pb.InfoResponse) -> models.DaemonInfo:
    return models.DaemonInfo(
        version=msg.version, state_dir=msg.state_dir, socket=msg.socket,
        store_backend=msg.store_backend, store_path=msg.store_path,
        cgroup_version=msg.cgroup_version, sandboxes=msg.sandboxes,
        checkpoints=msg.checkpoints, store_bytes_total=msg.store_bytes_total,
        store_bytes_free=msg.store_bytes_free, process_backend=msg.process_backend,
        inspector_backend=msg.inspector_backend, store_durability=msg.store_durability,
        disk_quota=msg.disk_quota, transparent_hugepages=msg.transparent_hugepages,
        cgroup_favordynmods=msg.cgroup_favordynmods,
    )
