"""deltaboxd's start: bad input is refused with a message that says what to do, and a start
that fails leaves nothing mounted (before stop 63 a missing --token-file, or a native library
older than the checkout, exited with a traceback and left the store's btrfs mounted on its
loop device)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import ROOT, settle


@pytest.fixture
def base() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="dbx-start-", dir="/var/tmp"))
    try:
        yield d
    finally:
        settle(d, "a failed start")


def _start(base: Path, *extra: str, env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deltabox.daemon.main", "--state-dir", str(base / "state"),
         "--socket", str(base / "d.sock"), "--store-size-gb", "2", "--no-inspector", *extra],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
        env={**os.environ, **(env or {})})


def test_a_missing_or_empty_token_file_is_refused(base: Path) -> None:
    r = _start(base, "--token-file", str(base / "nope"))
    assert r.returncode == 1, r
    assert "cannot read --token-file" in r.stderr and "Traceback" not in r.stderr, r.stderr
    (base / "token").write_text("\n")
    r = _start(base, "--token-file", str(base / "token"))
    assert r.returncode == 1, r
    assert "is empty" in r.stderr and "DELTABOX_TOKEN" in r.stderr, r.stderr
    assert not (base / "state" / "store.img").exists()   # refused before the store


def test_a_stale_native_library_is_named_and_the_store_released(base: Path) -> None:
    """A real library lacking the functions the checkout calls (built here from one
    function): the daemon mounts its store, then fails to bind; it says to rebuild and
    unmounts the store (the fixture checks for mounts and loop devices)."""
    (base / "old.c").write_text("int dbxcr_old_function(void) { return 0; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(base / "old.so"), str(base / "old.c")],
                   check=True)
    r = _start(base, env={"DELTABOX_LIBDBXCR": str(base / "old.so")})
    assert r.returncode == 1, r
    assert "make native" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert (base / "state" / "store.img").exists()   # it got as far as the store
