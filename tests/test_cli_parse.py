"""CLI parsing, rendering and client error mapping: everything testable without a daemon."""

from __future__ import annotations

import socket as socketlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deltabox import cli, convert, errors
from deltabox.api import deltabox_pb2 as pb
from deltabox.client import Client, connect, default_socket, is_tcp
from deltabox.models import Checkpoint, DiffResult

COMMANDS = ["daemon", "create", "exec", "checkpoint", "rollback", "fork", "ls", "checkpoints",
            "diff", "rm", "rmcp", "info", "cp"]


# --- parsing ------------------------------------------------------------------------------

def test_exec_keeps_everything_after_double_dash() -> None:
    args = cli.parse_args(["exec", "sbx1", "--timeout", "3", "--cwd", "/tmp", "--env", "A=1",
                           "--", "sh", "-c", "echo --timeout"])
    assert args.command == "exec" and args.id == "sbx1"
    assert args.timeout == 3.0 and args.cwd == "/tmp" and args.env == [("A", "1")]
    assert args.cmd == ["sh", "-c", "echo --timeout"]


def test_exec_without_double_dash_and_session() -> None:
    args = cli.parse_args(["exec", "sbx1", "--session", "main", "ls", "/tmp"])
    assert args.session == "main" and args.cmd == ["ls", "/tmp"]


def test_exec_inner_double_dash_is_preserved() -> None:
    assert cli.parse_args(["exec", "x", "--", "echo", "--"]).cmd == ["echo", "--"]
    assert cli.parse_args(["exec", "x", "--", "--", "a"]).cmd == ["--", "a"]


def test_exec_command_options_without_double_dash() -> None:
    args = cli.parse_args(["--socket", "/s", "exec", "--timeout", "2", "x", "-i", "ls", "-la",
                           "--timeout", "9"])
    assert (args.socket, args.timeout, args.id, args.stdin) == ("/s", 2.0, "x", True)
    assert args.cmd == ["ls", "-la", "--timeout", "9"]


def test_exec_value_options_match_parser() -> None:
    subparsers = cli.build_parser()._subparsers
    assert subparsers is not None
    exec_parser = subparsers._group_actions[0].choices["exec"]  # type: ignore[index]
    takes_value = {opt for action in exec_parser._actions if action.nargs != 0
                   for opt in action.option_strings}
    assert takes_value == set(cli._EXEC_VALUE_OPTIONS)


@pytest.mark.parametrize("argv", [
    ["--json", "ls"], ["ls", "--json"], ["--json", "exec", "x", "--", "true"],
    ["exec", "x", "--json", "--", "true"],
])
def test_json_flag_global_or_per_command(argv: list[str]) -> None:
    assert cli.parse_args(argv).json is True


def test_json_defaults_off_and_socket_anywhere() -> None:
    args = cli.parse_args(["--socket", "/a.sock", "ls"])
    assert args.json is False and args.socket == "/a.sock"
    assert cli.parse_args(["ls", "--socket", "/b.sock"]).socket == "/b.sock"
    assert cli.parse_args(["ls"]).socket is None


def test_create_options() -> None:
    args = cli.parse_args(["create", "--image", "/img.tar", "--memory", "512", "--pids", "64",
                           "--cpus", "1.5", "--env", "A=1", "--env", "B=x=y"])
    assert (args.image, args.memory, args.pids, args.cpus) == ("/img.tar", 512, 64, 1.5)
    assert dict(args.env) == {"A": "1", "B": "x=y"}


def test_daemon_passes_unknown_options_through() -> None:
    args = cli.parse_args(["daemon", "--state-dir", "/s", "--socket", "/d.sock", "--verbose"])
    assert args.command == "daemon" and args.state_dir == "/s" and args.socket == "/d.sock"
    assert args.daemon_args == ["--verbose"]


@pytest.mark.parametrize("argv", [
    ["create", "--env", "NOEQUALS"], ["checkpoint", "x", "--mode", "bogus"], ["rollback", "x"],
    ["fork", "cp", "--count", "many"], ["rm"], ["rm", "a", "--all"], ["nosuchcommand"], [],
    ["ls", "--bogus"],
])
def test_usage_errors_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(argv)
    assert exc.value.code == 2


def test_multi_id_commands() -> None:
    assert cli.parse_args(["rm", "a", "b"]).ids == ["a", "b"]
    assert cli.parse_args(["rm", "--all"]).all
    assert cli.parse_args(["rmcp", "c1"]).ids == ["c1"]
    fork = cli.parse_args(["fork", "cp1", "--count", "4"])
    assert (fork.checkpoint, fork.count) == ("cp1", 4)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_help_has_an_example(command: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.parse_args([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "example:" in out and "deltabox" in out.split("example:")[1]


# --- rendering ----------------------------------------------------------------------------

def _cp(cp_id: str, parent: str | None, label: str = "", sandbox: str = "s1") -> Checkpoint:
    return Checkpoint(id=cp_id, parent_id=parent, sandbox_id=sandbox, family_id="f",
                      kind="fs", created_at=0.0, duration_ms=1.0, label=label)


def test_render_tree_branches_and_head() -> None:
    cps = [_cp("a", None), _cp("b", "a"), _cp("c", "b"), _cp("d", "a", label="alt"),
           _cp("e", "gone", sandbox="s2")]
    lines = cli.render_tree(cps, head_id="c", sandbox_id="s1")
    expected = ["a", "├─ b", "│  └─ c *", "└─ d", "e"]
    assert len(lines) == len(expected)
    for line, start in zip(lines, expected, strict=True):
        assert line.startswith(start + "  fs  "), line
    assert "'alt'" in lines[3]
    assert "[s2]" in lines[4] and "[s1]" not in lines[0]


def test_render_tree_empty() -> None:
    assert cli.render_tree([], None) == []


def test_render_diff_sorted_by_path() -> None:
    diff = DiffResult(added=["/z", "/a"], modified=["/m"], deleted=["/b"])
    assert cli.render_diff(diff) == ["A /a", "D /b", "M /m", "A /z"]


def test_render_table_aligns() -> None:
    lines = cli.render_table(["ID", "STATE"], [["sbx-long", "running"], ["s", "stopped"]])
    assert lines == ["ID        STATE", "sbx-long  running", "s         stopped"]


def test_human_bytes() -> None:
    assert cli.human_bytes(0) == "0 B"
    assert cli.human_bytes(1536) == "1.5 KiB"
    assert cli.human_bytes(3 << 30) == "3.0 GiB"
    assert cli.human_bytes(5 << 40) == "5.0 TiB"


@pytest.mark.parametrize("spec,expected", [
    ("sbx1:/workspace/a", ("sbx1", "/workspace/a")),
    ("sbx1:rel.txt", ("sbx1", "rel.txt")),
    ("./local:file", (None, "./local:file")),
    ("/abs/path", (None, "/abs/path")),
    ("plain.txt", (None, "plain.txt")),
    ("-", (None, "-")),
])
def test_parse_cp_spec(spec: str, expected: tuple[str | None, str]) -> None:
    assert cli.parse_cp_spec(spec) == expected


def test_exit_status_clamped() -> None:
    assert [cli._exit_status(c) for c in (0, 7, 137, 300, -1)] == [0, 7, 137, 255, 255]


# --- conversion ---------------------------------------------------------------------------

def test_convert_empty_ids_become_none_and_bytes_decode() -> None:
    cp = convert.checkpoint(pb.CheckpointInfo(id="c1", sandbox_id="s", kind="fs"))
    assert cp.parent_id is None
    info = convert.sandbox_info(pb.SandboxInfo(id="s"))
    assert info.head_checkpoint_id is None
    res = convert.exec_result(pb.ExecResponse(exit_code=1, stdout=b"ok\xff", stderr=b"e"))
    assert res.stdout == "ok\ufffd" and res.stdout_bytes == b"ok\xff" and not res.ok


# --- client -------------------------------------------------------------------------------

def test_default_socket_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DELTABOX_SOCKET", raising=False)
    assert default_socket() == "/run/deltabox/deltabox.sock"
    monkeypatch.setenv("DELTABOX_SOCKET", "/tmp/x.sock")
    assert default_socket() == "/tmp/x.sock"


def test_tcp_detection_and_token(monkeypatch: pytest.MonkeyPatch) -> None:
    assert is_tcp("localhost:7777") and is_tcp("[::1]:7777")
    assert not is_tcp("/run/x.sock") and not is_tcp("rel.sock") and not is_tcp("./a:b")
    monkeypatch.setenv("DELTABOX_TOKEN", "s3cret")
    with connect("127.0.0.1:1") as client:
        assert client._metadata == (("authorization", "Bearer s3cret"),)
    with connect(str(Path("/tmp/x.sock"))) as client:
        assert client._metadata == ()


def test_missing_socket_is_unavailable_quickly(tmp_path: Path) -> None:
    path = tmp_path / "missing.sock"
    start = time.monotonic()
    with Client(str(path)) as client, pytest.raises(errors.Unavailable) as exc:
        client.call("Info", pb.InfoRequest(), timeout=5)
    assert time.monotonic() - start < 3
    assert str(path) in exc.value.message and "deltabox daemon" in exc.value.message
    assert "DELTABOX_SOCKET" in exc.value.message


def test_stale_socket_is_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    sock = socketlib.socket(socketlib.AF_UNIX)
    sock.bind(str(path))
    sock.close()  # the file stays; nobody listens
    with Client(str(path)) as client, pytest.raises(errors.Unavailable) as exc:
        client.call("ListSandboxes", pb.ListSandboxesRequest(), timeout=5)
    assert "is it running?" in exc.value.message


def test_stream_maps_errors_too(tmp_path: Path) -> None:
    with Client(str(tmp_path / "none.sock")) as client, pytest.raises(errors.Unavailable):
        list(client.stream("ExecStream", pb.ExecRequest(sandbox_id="x", shell="true"),
                           timeout=5))


def test_unknown_rpc_name_is_a_programming_error(tmp_path: Path) -> None:
    with Client(str(tmp_path / "none.sock")) as client, pytest.raises(ValueError):
        client.call("NoSuchRpc", pb.InfoRequest())


def test_cli_reports_unreachable_daemon(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--socket", str(tmp_path / "none.sock"), "ls"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("deltabox: error: cannot reach deltaboxd at ")


def test_cli_usage_error_inside_command(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--socket", str(tmp_path / "none.sock"), "cp", "a", "b"]) == 2
    assert "exactly one of SRC and DST" in capsys.readouterr().err


def test_sdk_raises_package_errors(tmp_path: Path) -> None:
    import deltabox

    with pytest.raises(deltabox.Unavailable):
        deltabox.Sandbox.list(socket=str(tmp_path / "none.sock"))
    assert issubclass(deltabox.Unavailable, deltabox.DeltaBoxError)


def test_import_is_light() -> None:
    code = ("import sys, deltabox; "
            "print('pydantic' in sys.modules, 'deltabox.sdk' in sys.modules); "
            "from deltabox import Sandbox, Checkpoint, ExecResult, DeltaBoxError, info")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["False", "False"]


def test_exec_checkpoint_options_then_the_command() -> None:
    args = cli.parse_args(["exec", "x", "--checkpoint", "auto", "--checkpoint-label", "n 1",
                           "make", "--checkpoint", "full"])
    assert (args.checkpoint, args.checkpoint_label) == ("auto", "n 1")
    assert args.cmd == ["make", "--checkpoint", "full"]


def test_daemon_counts_refuse_negative_or_junk(capsys) -> None:
    """deltaboxd's count options (--fork-spares, --templates, --warm-generations,
    --prewarm-mb, --quiet-wait-ms) take 0 or more; anything else is refused at start with a message naming
    the option."""
    from deltabox.daemon import main as daemon_main

    assert daemon_main.parse_args(["--fork-spares", "0"]).fork_spares == 0
    assert daemon_main.parse_args([]).fork_spares == 32
    assert daemon_main.parse_args([]).prewarm_mb == 64
    assert daemon_main.parse_args([]).quiet_wait_ms == 1000
    for opt in ("--fork-spares", "--templates", "--warm-generations", "--prewarm-mb",
                "--quiet-wait-ms"):
        for bad in ("-1", "x", "2.5"):
            with pytest.raises(SystemExit):
                daemon_main.parse_args([opt, bad])
            assert f"argument {opt}: {bad!r}: want a whole number, 0 or more" in \
                capsys.readouterr().err
