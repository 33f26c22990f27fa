"""After a rollback, the files the sandbox wrote before the checkpoint are already in the
page cache (deltabox/fs/prewarm.py): a btrfs clone's files start uncached, and the agent's
next command would read them from the store. Real daemon, real btrfs store; residency seen
from inside the sandbox with fincore (mincore on the sandbox's own view of the file)."""

from __future__ import annotations

import os
from pathlib import Path

from conftest import new_sandbox, private_daemon, wait_for

from deltabox import Sandbox
from deltabox.fs.prewarm import MAX_FILE_BYTES, prewarm

MIB = 1 << 20


def resident(sbx: Sandbox, path: str) -> tuple[int, int]:
    """(bytes in the page cache, size) of a file, seen from inside the sandbox."""
    r = sbx.exec(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE", path])
    assert r.exit_code == 0, r.stderr
    res, size = r.stdout.split()
    return int(res), int(size)


def cached(sbx: Sandbox, path: str) -> bool:
    res, size = resident(sbx, path)
    return res >= size   # whole pages


def test_a_rollback_finds_the_files_written_before_the_checkpoint_cached() -> None:
    with private_daemon("dbx-prewarm-") as d:
        d.start("--no-inspector", "--log-level", "DEBUG")
        with new_sandbox(d.socket) as sbx:
            r = sbx.exec(["bash", "-c",
                          "mkdir -p /root/pkg && "
                          "for i in $(seq 40); do head -c 20000 /dev/urandom > /root/pkg/m$i.py; done"
                          " && head -c 3M /dev/urandom > /root/pkg/small.bin"
                          " && head -c 12M /dev/urandom > /root/pkg/_ext.so"
                          " && head -c 12M /dev/urandom > /root/big.dat"])
            assert r.exit_code == 0, r.stderr
            cp = sbx.checkpoint()
            wait_for(lambda: "read ahead for" in d.log.read_text(), timeout=30,
                     what="the ready generation's files read ahead")
            sbx.rollback(cp)
            for path in ("/root/pkg/m1.py", "/root/pkg/m40.py", "/root/pkg/small.bin",
                         "/root/pkg/_ext.so"):
                wait_for(lambda: cached(sbx, path),
                         timeout=10, what=f"{path} in the page cache")
            # A data file over the bound is left to be read on demand: and it shows that
            # the clone's files start uncached (what the others were read ahead for).
            assert resident(sbx, "/root/big.dat") == (0, 12 * MIB)
            assert sbx.exec(["cmp", "-s", "/root/big.dat", "/root/big.dat"]).exit_code == 0


def test_the_read_ahead_is_bounded(tmp_path: Path) -> None:
    for i in range(10):
        (tmp_path / "d" / str(i % 3)).mkdir(parents=True, exist_ok=True)
        (tmp_path / "d" / str(i % 3) / f"f{i}").write_bytes(b"x" * 1000)
    (tmp_path / "empty").write_bytes(b"")
    big = tmp_path / "data.bin"
    big.write_bytes(b"\0" * (MAX_FILE_BYTES + 1))
    program = tmp_path / "tool"
    program.write_bytes(b"\0" * (MAX_FILE_BYTES + 1))
    os.chmod(program, 0o755)
    os.symlink("/etc/passwd", tmp_path / "link")   # not followed out of the layer

    got = prewarm(tmp_path)
    assert (got.files, got.bytes, got.skipped, got.truncated) == \
        (11, 10 * 1000 + MAX_FILE_BYTES + 1, 1, False)

    got = prewarm(tmp_path / "d", max_files=4)
    assert (got.files, got.truncated) == (4, True)

    got = prewarm(tmp_path / "d", max_bytes=2500)
    assert (got.files, got.bytes, got.truncated) == (2, 2000, True)

    assert prewarm(tmp_path / "missing").errors == 1
