"""Checkpoints at the turn boundary, taken in the background: `checkpoint=` on exec and
session runs, `checkpoint(background=True)`. The id comes back at once; the checkpoint is the
sandbox as it was when the command ended, whatever comes after; whatever names it waits for
it; a failure reaches whoever names it."""

from __future__ import annotations

import pytest

import deltabox
from deltabox import Sandbox

from conftest import OWN_PS


def test_exec_checkpoint_is_the_state_at_the_commands_end(sbx: Sandbox) -> None:
    r = sbx.exec("echo one > /workspace/f", checkpoint="auto", checkpoint_label="after one")
    assert r.exit_code == 0 and r.checkpoint_id.startswith("cp-")
    # The next command comes at once: it must not get in before the checkpoint.
    sbx.exec("echo two > /workspace/f; touch /workspace/later")
    res = sbx.rollback(r.checkpoint_id)
    assert res.checkpoint_id == r.checkpoint_id
    assert sbx.files.read("f") == b"one\n" and not sbx.files.exists("later")
    cp = sbx.get_checkpoint(r.checkpoint_id)
    assert cp.label == "after one" and cp.kind in ("fs", "full")


def test_session_checkpoint_keeps_the_shell(sbx: Sandbox) -> None:
    s = sbx.session("main")
    r = s.run("cd /tmp && X=kept && alias ll='ls -l'", checkpoint="full")
    assert r.checkpoint_id
    s.run("cd / && X=changed && unalias ll")
    res = sbx.rollback(r.checkpoint_id)
    assert res.process_state == "restored"
    out = s.run("pwd; echo $X; alias ll").stdout
    assert out.splitlines() == ["/tmp", "kept", "alias ll='ls -l'"]


def test_background_checkpoint_is_pending_then_listed_and_forkable(sbx: Sandbox) -> None:
    sbx.files.write("a.txt", "A")
    cp = sbx.checkpoint(background=True, label="bg")
    assert cp.kind == "pending" and cp.sandbox_id == sbx.id and cp.label == "bg"
    sbx.files.write("a.txt", "B")  # after the promise: not in the checkpoint
    listed = {c.id: c for c in sbx.checkpoints()}
    assert cp.id in listed and listed[cp.id].kind in ("fs", "full")
    (kid,) = sbx.fork(cp.id)
    try:
        assert kid.files.read("a.txt") == b"A"
    finally:
        kid.kill()
    assert sbx.files.read("a.txt") == b"B"


def test_streamed_exec_carries_the_checkpoint(sbx: Sandbox) -> None:
    chunks: list[bytes] = []
    r = sbx.exec("echo streamed > /workspace/s; cat /workspace/s", checkpoint="fs",
                 on_stdout=chunks.append)
    assert b"".join(chunks) == b"streamed\n" and r.checkpoint_id
    sbx.exec("rm /workspace/s")
    sbx.rollback(r.checkpoint_id)
    assert sbx.files.read("s") == b"streamed\n"


def test_a_failed_background_checkpoint_reports_its_error_to_whoever_names_it(
        sbx: Sandbox) -> None:
    # A process holding a generic netlink socket cannot be captured: a full checkpoint
    # must be refused.
    r = sbx.exec("nohup python3 -c \"import socket, time\n"
                 "s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 16)\n"
                 "time.sleep(1000)\" >/dev/null 2>&1 & sleep 0.3", checkpoint="full")
    assert r.exit_code == 0 and r.checkpoint_id  # the command's output is not lost
    with pytest.raises(deltabox.FailedPrecondition,
                       match=rf"(?s){r.checkpoint_id} was requested in the background and "
                       r"failed: .*netlink"):
        sbx.rollback(r.checkpoint_id)
    with pytest.raises(deltabox.FailedPrecondition, match="netlink"):
        sbx.get_checkpoint(r.checkpoint_id)
    assert sbx.checkpoints() == []  # nothing half-made was committed
    assert "python3" in sbx.exec(f"{OWN_PS} comm=").stdout  # the sandbox runs on


def test_bad_checkpoint_mode_is_refused_before_the_command_runs(sbx: Sandbox) -> None:
    with pytest.raises(deltabox.InvalidArgument, match="checkpoint mode 'sometimes'"):
        sbx.exec("touch /workspace/ran", checkpoint="sometimes")
    with pytest.raises(deltabox.InvalidArgument, match="label longer"):
        sbx.session("main").run("touch /workspace/ran", checkpoint="auto",
                                checkpoint_label="x" * 201)
    assert not sbx.files.exists("ran") and sbx.checkpoints() == []


def test_timed_out_command_takes_no_checkpoint(sbx: Sandbox) -> None:
    with pytest.raises(deltabox.DeadlineExceeded):
        sbx.exec("sleep 5", timeout=0.5, checkpoint="auto")
    assert sbx.checkpoints() == []
