"""A sandbox created with `huge_pages`: its programs' malloc memory comes in 2 MiB pages on a
host whose transparent huge pages are `madvise` (these machines), and DeltaCR brings such a
process back exactly, by rollback and in a fork, still in 2 MiB pages (a template and the
processes restored from it share them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltabox import Sandbox
from deltabox.cr import hostmem

from conftest import new_sandbox, wait_for
from test_cr import _ask
from test_hostmem import fake_thp

# 64 MiB of patterned memory; "poke" flips two bytes in different 2 MiB pages, "report" writes
# the CRC of all of it and the process's AnonHugePages (kB).
PROG = """\
import os, time, zlib
data = bytearray(os.urandom(4096)) * (64 * 256)
def huge():
    for line in open('/proc/self/smaps_rollup'):
        if line.startswith('AnonHugePages:'):
            return int(line.split()[1])
open('/workspace/ready', 'w').write('1')
while True:
    if os.path.exists('/workspace/poke'):
        data[12345] ^= 0xff; data[40 << 20] ^= 0xff
        os.remove('/workspace/poke')
    if os.path.exists('/workspace/report'):
        open('/workspace/state.tmp', 'w').write(f"{zlib.crc32(data)} {huge()}")
        os.rename('/workspace/state.tmp', '/workspace/state')
        os.remove('/workspace/report')
    time.sleep(0.01)
"""
HUGE = "glibc.malloc.hugetlb=1"


def _report(sbx: Sandbox) -> tuple[int, int]:
    """(CRC of the 64 MiB, AnonHugePages kB) of the program, as it is now."""
    if sbx.files.exists("state"):
        sbx.files.remove("state")
    _ask(sbx, "report")
    wait_for(lambda: sbx.files.exists("state"))
    crc, huge = sbx.files.read("state").split()
    return int(crc), int(huge)


@pytest.mark.parametrize("how", ["rollback", "fork"])
def test_process_in_huge_pages_comes_back_exactly(daemon, how: str) -> None:
    if hostmem.selected(hostmem.THP_DIR / "enabled") not in ("madvise", "always"):
        pytest.skip("the host gives no transparent huge page even on request")
    with new_sandbox(daemon.socket, huge_pages=True) as sbx:
        assert HUGE in sbx.exec("echo $GLIBC_TUNABLES").stdout
        sbx.files.write("prog.py", PROG)
        sbx.exec("nohup python3 /workspace/prog.py >/dev/null 2>&1 &")
        wait_for(lambda: sbx.files.exists("ready"))
        before = _report(sbx)
        assert before[1] >= 32 << 10, before          # most of the 64 MiB in 2 MiB pages
        cp = sbx.checkpoint()
        assert cp.kind == "full", cp.reasons
        _ask(sbx, "poke")
        assert _report(sbx)[0] != before[0]
        if how == "rollback":
            assert sbx.rollback(cp).process_state == "restored"
            target = sbx
        else:
            (target,) = sbx.fork(cp)
            assert target.process_state == "restored", target.fork_note
            assert HUGE in target.exec("echo $GLIBC_TUNABLES").stdout   # forks keep it
        try:
            crc, huge = _report(target)
            assert crc == before[0]                   # every byte as at the checkpoint
            assert huge >= 32 << 10, huge             # still 2 MiB pages, shared with the template
        finally:
            if target is not sbx:
                target.kill()


def test_callers_own_tunables_are_kept(daemon) -> None:
    if hostmem.selected(hostmem.THP_DIR / "enabled") not in ("madvise", "always"):
        pytest.skip("the host gives no transparent huge page even on request")
    with new_sandbox(daemon.socket, huge_pages=True,
                     env={"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) as sbx:
        got = sbx.exec("echo $GLIBC_TUNABLES").stdout.strip()
        assert got == f"glibc.malloc.arena_max=2:{HUGE}"
    off = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}   # asked explicitly: theirs wins
    assert hostmem.with_huge_pages(off) == off


def test_a_host_that_gives_none_refuses_clearly(tmp_path: Path) -> None:
    """At `never` the tunable would do nothing: the create is refused rather than silently
    giving 4 KiB pages (the daemon maps this ValueError to FAILED_PRECONDITION)."""
    with pytest.raises(ValueError, match="'never'.*madvise"):
        hostmem.with_huge_pages({}, fake_thp(tmp_path, "never", {}))
