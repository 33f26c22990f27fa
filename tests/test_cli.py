"""The `deltabox` CLI end to end (a thin client of the same gRPC API)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys


def cli(daemon, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "deltabox.cli", "--socket", daemon.socket, *args],
                       capture_output=True, text=True, timeout=120)
    if check and r.returncode != 0:
        raise AssertionError(f"deltabox {args}: {r.returncode} {r.stderr}")
    return r


def test_cli_workflow(daemon) -> None:
    sid = cli(daemon, "create").stdout.strip()
    try:
        assert cli(daemon, "exec", sid, "--", "sh", "-c", "echo hi > f; exit 3",
                   check=False).returncode == 3
        cp = cli(daemon, "checkpoint", sid).stdout.strip()
        cli(daemon, "exec", sid, "--", "rm", "f")
        cli(daemon, "rollback", sid, cp)
        assert cli(daemon, "exec", sid, "--", "cat", "f").stdout == "hi\n"
        r = cli(daemon, "--json", "exec", sid, "--session", "s", "--", "cd /tmp; pwd")
        assert json.loads(r.stdout)["stdout"] == "/tmp\n"
        r = cli(daemon, "--json", "exec", sid, "--session", "t", "--tty", "--", "tty")
        assert json.loads(r.stdout)["stdout"] == "/dev/pts/0\r\n"
        r = cli(daemon, "exec", sid, "--tty", "--", "tty", check=False)
        assert r.returncode == 2 and "--tty needs --session" in r.stderr
        kids = cli(daemon, "fork", cp, "--count", "2").stdout.split()
        assert len(kids) == 2
        cp2 = cli(daemon, "checkpoint", kids[0]).stdout.strip()
        tree = cli(daemon, "checkpoints", sid).stdout
        assert cp in tree and cp2 in tree
        listed = json.loads(cli(daemon, "--json", "checkpoints", sid).stdout)
        assert {c["id"] for c in listed} == {cp, cp2}
        assert sid in cli(daemon, "ls").stdout
        info = json.loads(cli(daemon, "--json", "info").stdout)
        assert info["store_backend"].startswith("btrfs")
        cli(daemon, "rm", *kids)
    finally:
        cli(daemon, "rm", sid, check=False)


def test_cli_checkpoint_at_the_commands_end(daemon) -> None:
    sid = cli(daemon, "create").stdout.strip()
    try:
        r = cli(daemon, "exec", sid, "--checkpoint", "fs", "--", "sh", "-c", "echo a > f")
        cp = re.fullmatch(r"deltabox: checkpoint (cp-[0-9a-f]{10}) \(taken in the background\)\n",
                          r.stderr)
        assert cp is not None, r.stderr
        bg = cli(daemon, "checkpoint", sid, "--background").stdout.strip()
        cli(daemon, "exec", sid, "--", "sh", "-c", "echo b > f")
        cli(daemon, "rollback", sid, cp.group(1))
        assert cli(daemon, "exec", sid, "--", "cat", "f").stdout == "a\n"
        assert bg in cli(daemon, "checkpoints", sid).stdout
        r = cli(daemon, "exec", sid, "--checkpoint", "sometimes", "--", "true", check=False)
        assert r.returncode == 2 and "invalid choice" in r.stderr
    finally:
        cli(daemon, "rm", sid, check=False)


def test_cli_cp_as_a_search_step(daemon, tmp_path) -> None:
    """`cp SRC ID:DST --rollback-to CP --checkpoint auto`: an edit as a tree search's step
    (rolled back to CP, the file written there, the result checkpointed)."""
    sid = cli(daemon, "create").stdout.strip()
    try:
        cli(daemon, "exec", sid, "--", "sh", "-c", "echo node > /workspace/f")
        cp = cli(daemon, "checkpoint", sid).stdout.strip()
        cli(daemon, "exec", sid, "--", "sh", "-c", "echo later > /workspace/g")
        src = tmp_path / "edit.txt"
        src.write_text("edited\n")
        r = cli(daemon, "cp", str(src), f"{sid}:/workspace/f", "--rollback-to", cp,
                "--checkpoint", "auto", "--checkpoint-label", "step")
        assert f"rolled back to {cp} first" in r.stderr, r.stderr
        child = re.search(r"checkpoint (cp-[0-9a-f]{10}) \(taken in the background\)", r.stderr)
        assert child is not None, r.stderr
        assert cli(daemon, "exec", sid, "--", "cat", "/workspace/f").stdout == "edited\n"
        assert cli(daemon, "exec", sid, "--", "test", "-e", "/workspace/g",
                   check=False).returncode == 1          # the node's files, then the edit
        cli(daemon, "rollback", sid, cp)
        assert cli(daemon, "exec", sid, "--", "cat", "/workspace/f").stdout == "node\n"
        cli(daemon, "rollback", sid, child.group(1))
        assert cli(daemon, "exec", sid, "--", "cat", "/workspace/f").stdout == "edited\n"
        r = cli(daemon, "cp", f"{sid}:/workspace/f", str(tmp_path / "out"), "--checkpoint",
                "auto", check=False)                      # a download checkpoints nothing
        assert r.returncode == 2 and "goes with an upload" in r.stderr, r.stderr
        assert not (tmp_path / "out").exists()
        # a read at the node: rolled back to CP, then the file downloaded
        r = cli(daemon, "cp", f"{sid}:/workspace/f", "-", "--rollback-to", cp)
        assert r.stdout == "node\n" and f"rolled back to {cp} first" in r.stderr, r.stderr
        assert cli(daemon, "exec", sid, "--", "test", "-e", "/workspace/g",
                   check=False).returncode == 1
    finally:
        cli(daemon, "rm", sid, check=False)


def test_cli_errors(daemon) -> None:
    r = cli(daemon, "rollback", "sb-0000000000", "cp-0000000000", check=False)
    assert r.returncode == 1 and "no sandbox" in r.stderr
    r = subprocess.run([sys.executable, "-m", "deltabox.cli", "info"], capture_output=True,
                       text=True, env=dict(os.environ, DELTABOX_SOCKET="/nonexistent.sock"))
    assert r.returncode == 1 and "is it running" in r.stderr


def test_cli_create_with_a_user_namespace(daemon) -> None:
    info = json.loads(cli(daemon, "--json", "create", "--userns").stdout)
    try:
        assert info["uid_map"] == "0 100000 65536"
        assert cli(daemon, "exec", info["id"], "--", "id", "-u").stdout == "0\n"
        row = next(line for line in cli(daemon, "ls").stdout.splitlines()
                   if line.startswith(info["id"]))
        header = cli(daemon, "ls").stdout.splitlines()[0].split()
        assert row.split()[header.index("ROOT")] == "100000"
        assert "--userns" in cli(daemon, "create", "--help").stdout
    finally:
        cli(daemon, "rm", info["id"], check=False)


def test_rm_all_removes_every_sandbox_and_their_processes() -> None:
    from conftest import private_daemon

    with private_daemon("dbx-rmall-") as d:
        d.start()
        a = cli(d, "create").stdout.strip()
        b = cli(d, "create").stdout.strip()
        cli(d, "exec", a, "--session", "s", "--", "sleep 613.25 &")
        cli(d, "checkpoint", b)
        r = cli(d, "--json", "rm", "--all")
        assert sorted(x["id"] for x in json.loads(r.stdout)) == sorted([a, b])
        assert json.loads(cli(d, "--json", "ls").stdout) == []
        assert subprocess.run(["pgrep", "-f", "sleep 613.25"], capture_output=True).returncode == 1
        again = cli(d, "rm", "--all")
        assert again.stdout == "" and again.returncode == 0
        bad = cli(d, "rm", check=False)
        assert bad.returncode == 2 and "--all" in bad.stderr
