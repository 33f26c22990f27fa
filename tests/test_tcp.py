"""Remote workers: the same gRPC API on TCP, guarded by a token."""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path

import pytest

import deltabox
from conftest import DaemonProc, settle


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tcp_requires_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    base = Path(tempfile.mkdtemp(prefix="dbx-tcp-", dir="/var/tmp"))
    token = base / "token"
    token.write_text("s3cret-token\n")
    addr = f"127.0.0.1:{_free_port()}"
    d = DaemonProc(base / "state", str(base / "d.sock"), None, base / "daemon.log")
    try:
        d.start("--listen", addr, "--token-file", str(token))
        monkeypatch.setenv("DELTABOX_TOKEN", "wrong")
        with pytest.raises(deltabox.DeltaBoxError, match="token"):
            deltabox.info(socket=addr)
        monkeypatch.setenv("DELTABOX_TOKEN", "s3cret-token")
        with deltabox.Sandbox.create(socket=addr) as sbx:
            assert sbx.exec("echo remote").stdout == "remote\n"
    finally:
        d.stop()
        settle(base)
