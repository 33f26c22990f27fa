"""A tree search's step in one call: `rollback_to=` on exec, session runs and file writes
rolls the sandbox back to a checkpoint, then runs the command or writes the file (and, with
`checkpoint=`, checkpoints its end). The command sees the checkpoint's files and sessions; a rollback that fails runs
nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

import deltabox
from deltabox import Sandbox


def test_a_step_runs_from_the_checkpoint_and_checkpoints_its_end(sbx: Sandbox) -> None:
    s = sbx.session("main")
    node = s.run("cd /tmp && X=node && echo node > /workspace/f", checkpoint="full")
    s.run("cd / && X=elsewhere && echo elsewhere > /workspace/f")

    step = s.run("pwd; echo $X; cat /workspace/f; echo child > /workspace/f",
                 rollback_to=node.checkpoint_id, checkpoint="auto")
    assert step.rollback is not None
    assert step.rollback.checkpoint_id == node.checkpoint_id
    assert step.rollback.process_state == "restored", step.rollback.note
    assert not step.rollback.sessions_restarted and not step.note, step
    assert step.stdout.splitlines() == ["/tmp", "node", "node"]
    assert step.checkpoint_id and step.checkpoint_id != node.checkpoint_id

    # The next step expands the node again: the child's change is not there.
    again = s.run("cat /workspace/f", rollback_to=node.checkpoint_id)
    assert again.stdout == "node\n" and again.checkpoint_id == ""
    # ...and the child's checkpoint holds what its step left.
    assert s.run("cat /workspace/f", rollback_to=step.checkpoint_id).stdout == "child\n"
    assert s.run(":").rollback is None  # no rollback asked, none reported


def test_exec_and_streamed_exec_roll_back_first(sbx: Sandbox) -> None:
    sbx.files.write("g", "at the checkpoint")
    cp = sbx.checkpoint()
    sbx.files.write("g", "later")

    r = sbx.exec(["cat", "/workspace/g"], rollback_to=cp)
    assert r.stdout == "at the checkpoint" and r.rollback is not None
    assert r.rollback.checkpoint_id == cp.id

    sbx.files.write("g", "later again")
    chunks: list[bytes] = []
    r = sbx.exec("cat /workspace/g", rollback_to=cp.id, on_stdout=chunks.append)
    assert b"".join(chunks) == b"at the checkpoint"
    assert r.rollback is not None and r.rollback.checkpoint_id == cp.id


def test_a_rollback_that_fails_runs_nothing(daemon, sbx: Sandbox) -> None:
    sbx.files.write("h", "now")
    with pytest.raises(deltabox.NotFound):
        sbx.exec("touch /workspace/ran", rollback_to="cp-0000000000")
    with pytest.raises(deltabox.NotFound):
        sbx.session("main").run("touch /workspace/ran", rollback_to="cp-0000000000")
    with pytest.raises(deltabox.InvalidArgument, match="not a checkpoint id"):
        sbx.exec("touch /workspace/ran", rollback_to="nonsense")
    other = Sandbox.create(socket=daemon.socket)
    try:
        foreign = other.checkpoint()
        with pytest.raises(deltabox.FailedPrecondition, match="another sandbox family"):
            sbx.exec("touch /workspace/ran", rollback_to=foreign)
    finally:
        other.kill()
    assert not sbx.files.exists("ran") and sbx.files.read("h") == b"now"
    # Bad input of the command itself is refused before the rollback: nothing changes.
    cp = sbx.checkpoint()
    sbx.files.write("h", "after")
    with pytest.raises(deltabox.InvalidArgument):
        sbx.exec("echo \0", rollback_to=cp)
    assert sbx.files.read("h") == b"after"


def _edited_since_a_node(sbx: Sandbox) -> tuple[deltabox.Session, deltabox.Checkpoint]:
    """A node (src.py, a session), then changes since: src.py rewritten, a file made, a
    shell variable set."""
    s = sbx.session("main")
    sbx.files.write("src.py", "x = 'node'\n")
    node = sbx.checkpoint()
    s.run("X=later")
    sbx.files.write("src.py", "x = 'elsewhere'\n")
    sbx.files.write("other", "made after the node")
    return s, node


def test_an_edit_is_a_step_too(sbx: Sandbox) -> None:
    """files.write(..., rollback_to=, checkpoint=): rolled back to the node, the file
    written there, the result checkpointed; the node and the child each keep their own."""
    s, node = _edited_since_a_node(sbx)

    w = sbx.files.write("src.py", "x = 'child'\n", rollback_to=node, checkpoint="auto",
                        checkpoint_label="child")
    assert w.path == "/workspace/src.py" and w.size == len("x = 'child'\n")
    assert w.rollback is not None and w.rollback.checkpoint_id == node.id
    assert w.rollback.process_state == "restored"
    assert w.checkpoint_id and w.checkpoint_id != node.id
    assert not sbx.files.exists("other")            # the node's files, then the edit
    assert s.run("echo ${X-unset}").stdout == "unset\n"  # the node's session
    child = sbx.get_checkpoint(w.checkpoint_id)
    assert child.label == "child" and child.kind in ("fs", "full")

    sbx.rollback(node)
    assert sbx.files.read("src.py") == b"x = 'node'\n"
    sbx.rollback(w.checkpoint_id)
    assert sbx.files.read("src.py") == b"x = 'child'\n"
    plain = sbx.files.write("plain", "no step")
    assert plain.rollback is None and plain.checkpoint_id == ""


def test_a_read_begins_a_step(sbx: Sandbox) -> None:
    """files.read(..., rollback_to=): an edit that reads the file first (str_replace) starts
    its step with the read, rolled back to the node; the write then checkpoints the end."""
    s, node = _edited_since_a_node(sbx)

    text = sbx.files.read("src.py", rollback_to=node)
    assert text == b"x = 'node'\n" and isinstance(text, deltabox.ReadBytes)
    assert text.rollback is not None and text.rollback.checkpoint_id == node.id
    assert text.rollback.process_state == "restored"
    assert not sbx.files.exists("other")            # rolled back before the read
    assert s.run("echo ${X-unset}").stdout == "unset\n"
    w = sbx.files.write("src.py", text.replace(b"node", b"child"), checkpoint="auto")
    sbx.rollback(node)
    sbx.rollback(w.checkpoint_id)
    assert sbx.files.read("src.py") == b"x = 'child'\n"
    plain = sbx.files.read("src.py")
    assert type(plain) is bytes                     # no rollback asked: plain bytes

    sbx.files.write("src.py", "x = 'elsewhere'\n")
    with pytest.raises(deltabox.NotFound):          # absent at the node: rolled back anyway
        sbx.files.read("other", rollback_to=node)
    assert sbx.files.read("src.py") == b"x = 'node'\n"


def test_a_read_whose_rollback_fails_reads_nothing(sbx: Sandbox) -> None:
    sbx.files.write("e", "before")
    cp = sbx.checkpoint()
    sbx.files.write("e", "now")
    with pytest.raises(deltabox.NotFound, match="cp-0000000000"):
        sbx.files.read("e", rollback_to="cp-0000000000")
    with pytest.raises(deltabox.InvalidArgument, match="path"):
        sbx.files.read("", rollback_to=cp)      # refused for itself, before the rollback
    assert sbx.files.read("e") == b"now"           # not rolled back


def test_an_edit_whose_rollback_fails_writes_nothing(sbx: Sandbox) -> None:
    sbx.files.write("e", "before")
    cp = sbx.checkpoint()
    sbx.files.write("e", "now")
    with pytest.raises(deltabox.NotFound):
        sbx.files.write("e", "edited", rollback_to="cp-0000000000")
    with pytest.raises(deltabox.InvalidArgument, match="checkpoint"):
        sbx.files.write("e", "edited", rollback_to=cp, checkpoint="sometimes")
    with pytest.raises(deltabox.InvalidArgument, match="mode"):
        sbx.files.write("e", "edited", rollback_to=cp, mode=0o17777)
    assert sbx.files.read("e") == b"now"           # neither rolled back nor written


def test_cli_exec_rollback_to(daemon, sbx: Sandbox) -> None:
    sbx.files.write("k", "kept")
    cp = sbx.checkpoint()
    sbx.files.write("k", "changed")
    r = subprocess.run([sys.executable, "-m", "deltabox.cli", "--socket", daemon.socket,
                        "exec", sbx.id, "--rollback-to", cp.id, "--", "cat", "/workspace/k"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "kept" and f"rolled back to {cp.id} first" in r.stderr
