"""deltaboxd --cgroup-favordynmods: the host's cgroup hierarchy remounted with favordynmods,
its other options kept (a cgroup2 remount resets the options it is not given)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import deltabox
from deltabox.sandbox import cgroups

from conftest import private_daemon

V2_HOST = """\
sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0
cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate,memory_recursiveprot 0 0
"""
HYBRID = """\
cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,name=systemd 0 0
cgroup /sys/fs/cgroup/freezer cgroup rw,relatime,freezer 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""
V1_ONLY = """\
cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,name=systemd 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup /sys/fs/cgroup/freezer cgroup rw,relatime,freezer,favordynmods 0 0
"""


def test_the_hierarchy_to_remount():
    assert cgroups.dynmods_mount(V2_HOST) == (
        Path("/sys/fs/cgroup"), "rw,nosuid,nodev,noexec,relatime,nsdelegate,memory_recursiveprot")
    assert cgroups.dynmods_mount(HYBRID) == (Path("/sys/fs/cgroup/unified"), "rw,relatime")
    # v1 only: a controller's hierarchy, never the named (controller-less) systemd one
    assert cgroups.dynmods_mount(V1_ONLY) == (Path("/sys/fs/cgroup/memory"),
                                              "rw,relatime,memory")
    assert cgroups.dynmods_mount("proc /proc proc rw 0 0\n") is None
    assert not cgroups.favors_dynmods(V2_HOST) and not cgroups.favors_dynmods(HYBRID)
    assert cgroups.favors_dynmods(V1_ONLY)


def _options(mnt: Path) -> str:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        f = line.split()
        if f[1] == str(mnt) and f[2] in ("cgroup", "cgroup2"):
            return f[3]
    raise AssertionError(f"{mnt} is not mounted")


def test_daemon_remounts_with_favordynmods_and_keeps_other_options():
    """A real remount of this host's hierarchy. The option is put back as it was afterwards
    (on Linux 6.18 the kernel keeps its faster cgroup.procs writes until a reboot anyway:
    nothing else the suite checks depends on it)."""
    text = Path("/proc/self/mounts").read_text()
    target = cgroups.dynmods_mount(text)
    if target is None:
        pytest.skip("no cgroup hierarchy mounted")
    mnt, before = target
    try:
        with private_daemon("dbx-dynmods-") as d:
            d.start("--cgroup-favordynmods")
            with deltabox.Sandbox.create(socket=d.socket) as sb:  # a create moves init in
                assert sb.exec(["true"]).exit_code == 0
            after = _options(mnt).split(",")
            assert "favordynmods" in after
            assert set(before.split(",")) <= set(after), "the other options were lost"
            assert "cgroup favordynmods:" in d.log.read_text()
            assert deltabox.info(socket=d.socket).cgroup_favordynmods == "on"
    finally:
        if "favordynmods" not in before.split(","):
            subprocess.run(["mount", "--options-mode", "ignore", "-o", f"remount,{before}",
                            str(mnt)], check=True)
