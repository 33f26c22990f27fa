"""deltabox.fs.diff against the kernel: every expected diff comes from two real read-only
overlay mounts (lowerdir=upper:lower...:lower, no upperdir) made inside a private mount
namespace, walked in full; diff_layers must report exactly what those mounts show.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltabox.fs.diff import DiffResult, diff_layers, walk_upper


def _overlay_usable() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    with open("/proc/filesystems") as f:
        return any(line.split()[-1] == "overlay" for line in f if line.strip())


pytestmark = pytest.mark.skipif(not _overlay_usable(),
                                reason="needs root, unshare and overlayfs")

# Runs inside `unshare -m --propagation private`: the mounts die with the namespace even
# if this script crashes before unmounting.
_GROUND_TRUTH = r"""
import hashlib, json, os, stat, subprocess, sys

def describe(st, path):
    m = st.st_mode
    if stat.S_ISREG(m):
        with open(path, "rb") as f:
            return ["f", stat.S_IMODE(m), hashlib.sha256(f.read()).hexdigest()]
    if stat.S_ISDIR(m):
        return ["d", stat.S_IMODE(m), ""]
    if stat.S_ISLNK(m):
        return ["l", stat.S_IMODE(m), os.readlink(path)]
    if stat.S_ISCHR(m) or stat.S_ISBLK(m):
        return ["c" if stat.S_ISCHR(m) else "b", stat.S_IMODE(m), str(st.st_rdev)]
    return ["p" if stat.S_ISFIFO(m) else "s", stat.S_IMODE(m), ""]

def walk(mnt):
    out = {"/": describe(os.lstat(mnt), mnt)}
    todo = [(mnt, "/")]
    while todo:
        real, rel = todo.pop()
        for name in os.listdir(real):
            p = os.path.join(real, name)
            r = rel.rstrip("/") + "/" + name
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                # readdir of a directory only one layer contributes to lists that layer's
                # whiteouts, but lookup hides them: not present.
                continue
            out[r] = describe(st, p)
            if stat.S_ISDIR(st.st_mode):
                todo.append((p, r))
    return out

spec = json.loads(sys.argv[1])
result = {}
for mp in spec.pop("tmpfs", []):  # something mounted inside a layer
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", mp], check=True)
    with open(os.path.join(mp, "hidden"), "w") as f:
        f.write("only visible through the mount")
diff_args = spec.pop("diff", None)
if diff_args:  # diff_layers as seen from inside this mount namespace
    from deltabox.fs.diff import diff_layers
    d = diff_layers(*diff_args)
    result["diff"] = [d.added, d.modified, d.deleted]
for key, view in spec.items():
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                    "lowerdir=" + ":".join(view["layers"]), view["mnt"]], check=True)
    try:
        result[key] = walk(view["mnt"])
    finally:
        subprocess.run(["umount", view["mnt"]], check=True)
print(json.dumps(result))
"""


def overlay_truth(work: str, upper_a: str, upper_b: str, lowers: list[str],
                  tmpfs: list[str] = (), views_out: dict | None = None) -> DiffResult:
    """The diff as two real overlay mounts show it. `tmpfs`: directories to mount a tmpfs
    on (holding a file) first; then diff_layers also runs in that namespace, its result
    returned in views_out["diff"]."""
    spec: dict = {}
    for key, upper in (("a", upper_a), ("b", upper_b)):
        mnt = os.path.join(work, f"mnt-{key}")
        os.makedirs(mnt, exist_ok=True)
        spec[key] = {"mnt": mnt, "layers": [upper, *lowers]}
    if tmpfs:
        spec["tmpfs"] = list(tmpfs)
        spec["diff"] = [upper_a, upper_b, lowers]
    proc = subprocess.run(
        ["unshare", "-m", "--propagation", "private", sys.executable, "-c", _GROUND_TRUTH,
         json.dumps(spec)],
        capture_output=True, text=True, timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr
    views = json.loads(proc.stdout)
    if views_out is not None:
        views_out.update(views)
    a, b = views["a"], views["b"]
    return DiffResult(
        added=sorted(set(b) - set(a)),
        deleted=sorted(set(a) - set(b)),
        modified=sorted(p for p in set(a) & set(b) if a[p] != b[p]),
    )


def check(work: str, upper_a: str, upper_b: str, lowers: list[str]) -> DiffResult:
    got = diff_layers(upper_a, upper_b, lowers)
    want = overlay_truth(work, upper_a, upper_b, lowers)
    assert (got.added, got.modified, got.deleted) == (want.added, want.modified, want.deleted)
    assert got.truncated == [] and got.note == ""
    return got


@contextmanager
def scratch():
    d = tempfile.mkdtemp(prefix="dbx-diff-test-")
    try:
        yield d
    finally:
        # Mounts lived in a private namespace that is gone; nothing can be left mounted.
        shutil.rmtree(d, ignore_errors=True)


# ---- layer building helpers ----------------------------------------------------------
def mkfile(root: str, rel: str, data: bytes = b"", mode: int = 0o644) -> str:
    p = os.path.join(root, rel.lstrip("/"))
    os.makedirs(os.path.dirname(p), exist_ok=True)
    with open(p, "wb") as f:
        f.write(data)
    os.chmod(p, mode)
    return p


def mkdir(root: str, rel: str, mode: int = 0o755, opaque: bool = False) -> str:
    p = os.path.join(root, rel.lstrip("/"))
    os.makedirs(p, exist_ok=True)
    os.chmod(p, mode)
    if opaque:
        os.setxattr(p, "trusted.overlay.opaque", b"y")
    return p


def whiteout(root: str, rel: str) -> str:
    p = os.path.join(root, rel.lstrip("/"))
    os.makedirs(os.path.dirname(p), exist_ok=True)
    os.mknod(p, stat.S_IFCHR | 0o000, os.makedev(0, 0))
    return p


def symlink(root: str, rel: str, target: str) -> str:
    p = os.path.join(root, rel.lstrip("/"))
    os.makedirs(os.path.dirname(p), exist_ok=True)
    os.symlink(target, p)
    return p


@pytest.fixture
def layers():
    """(work, upper_a, upper_b, mask, image), with a small image tree."""
    with scratch() as work:
        dirs = [os.path.join(work, n) for n in ("upper_a", "upper_b", "mask", "image")]
        for d in dirs:
            os.mkdir(d)
            os.chmod(d, 0o755)
        image = dirs[3]
        mkfile(image, "etc/passwd", b"root:x:0:0\n")
        mkfile(image, "etc/hosts", b"127.0.0.1 localhost\n")
        mkfile(image, "bin/tool", b"#!/bin/sh\necho hi\n", 0o644)
        mkfile(image, "data/blob", b"aaaa")
        symlink(image, "lnk", "etc/passwd")
        mkfile(image, "usr/share/doc/a.txt", b"a")
        mkfile(image, "usr/share/doc/b.txt", b"b")
        mkfile(image, "usr/share/misc/c", b"c")
        mkfile(image, "usr/bin/prog", b"prog", 0o755)
        mkfile(image, "x", b"plain file")
        mkfile(image, "d/inner/leaf", b"leaf")
        mkfile(image, "secret/key", b"k")
        yield work, *dirs


def test_identical_views_have_no_diff(layers):
    work, ua, ub, mask, image = layers
    got = check(work, ua, ub, [mask, image])
    assert got == DiffResult([], [], [])


def test_add(layers):
    work, ua, ub, mask, image = layers
    mkfile(ub, "etc/new.conf", b"new")
    mkfile(ub, "opt/app/bin/run", b"run", 0o755)
    mkdir(ub, "opt/app/empty")
    symlink(ub, "opt/app/current", "bin")
    got = check(work, ua, ub, [mask, image])
    assert got.added == ["/etc/new.conf", "/opt", "/opt/app", "/opt/app/bin",
                         "/opt/app/bin/run", "/opt/app/current", "/opt/app/empty"]
    assert got.modified == [] and got.deleted == []


def test_modify_content_same_size(layers):
    work, ua, ub, mask, image = layers
    # A copied up unchanged (same bytes, another inode), B changed in place, same size and
    # even the same mtime: only the content tells them apart.
    pa = mkfile(ua, "data/blob", b"aaaa")
    pb = mkfile(ub, "data/blob", b"abba")
    st_a = os.stat(pa)
    os.utime(pb, ns=(st_a.st_atime_ns, st_a.st_mtime_ns))
    os.utime(os.path.join(ua, "data"), ns=(1, 1))  # directory mtime does not matter
    got = check(work, ua, ub, [mask, image])
    assert got == DiffResult([], ["/data/blob"], [])
    # Large files are compared chunk by chunk; a difference after the first MiB counts.
    big = os.urandom(3 << 20)
    mkfile(ua, "data/big", big)
    mkfile(ub, "data/big", big[:-1] + bytes([big[-1] ^ 1]))
    mkfile(ua, "data/same", big)
    mkfile(ub, "data/same", big)
    got = check(work, ua, ub, [mask, image])
    assert got.modified == ["/data/big", "/data/blob"]


def test_chmod(layers):
    work, ua, ub, mask, image = layers
    mkfile(ub, "bin/tool", b"#!/bin/sh\necho hi\n", 0o755)
    mkdir(ub, "usr/share/doc", 0o700)
    mkfile(ua, "etc/hosts", b"127.0.0.1 localhost\n", 0o4755)
    got = check(work, ua, ub, [mask, image])
    assert got == DiffResult([], ["/bin/tool", "/etc/hosts", "/usr/share/doc"], [])


def test_symlink_retarget(layers):
    work, ua, ub, mask, image = layers
    symlink(ua, "lnk", "etc/passwd")  # same target as the image: not modified
    symlink(ub, "lnk", "etc/hosts")
    got = check(work, ua, ub, [mask, image])
    assert got == DiffResult([], ["/lnk"], [])


def test_delete_lower_file_via_whiteout(layers):
    work, ua, ub, mask, image = layers
    whiteout(ub, "etc/passwd")
    whiteout(ub, "no/such/file")  # hides nothing (its parents are new, empty dirs)
    whiteout(ua, "x")
    got = check(work, ua, ub, [mask, image])
    assert got == DiffResult(["/no", "/no/such", "/x"], [], ["/etc/passwd"])


def test_whiteout_of_a_lower_directory_reports_descendants(layers):
    work, ua, ub, mask, image = layers
    whiteout(ub, "usr/share")
    got = check(work, ua, ub, [mask, image])
    assert got.deleted == ["/usr/share", "/usr/share/doc", "/usr/share/doc/a.txt",
                           "/usr/share/doc/b.txt", "/usr/share/misc", "/usr/share/misc/c"]
    # And the other way round: revealed again.
    got = check(work, ub, ua, [mask, image])
    assert got.added == ["/usr/share", "/usr/share/doc", "/usr/share/doc/a.txt",
                         "/usr/share/doc/b.txt", "/usr/share/misc", "/usr/share/misc/c"]


def test_rm_rf_then_mkdir_of_a_lower_dir(layers):
    work, ua, ub, mask, image = layers
    # B: `rm -rf /usr/share; mkdir -p /usr/share/doc; echo > /usr/share/doc/a.txt`
    mkdir(ub, "usr/share", opaque=True)
    mkfile(ub, "usr/share/doc/a.txt", b"A")
    # A: merged /usr/share, with a new file in it.
    mkfile(ua, "usr/share/extra", b"e")
    got = check(work, ua, ub, [mask, image])
    assert got.deleted == ["/usr/share/doc/b.txt", "/usr/share/extra", "/usr/share/misc",
                           "/usr/share/misc/c"]
    assert got.modified == ["/usr/share/doc/a.txt"]
    assert got.added == []
    # Opaque in both: only the uppers' contents matter.
    mkdir(ua, "usr/share", opaque=True)
    check(work, ua, ub, [mask, image])


def test_file_replaced_by_dir_and_dir_by_file(layers):
    work, ua, ub, mask, image = layers
    mkdir(ub, "x")  # over a lower file: the lower file is hidden even without opaque
    mkfile(ub, "x/child", b"c")
    mkfile(ub, "d", b"now a file")  # over a lower directory with contents
    got = check(work, ua, ub, [mask, image])
    assert got.modified == ["/d", "/x"]
    assert got.added == ["/x/child"]
    assert got.deleted == ["/d/inner", "/d/inner/leaf"]


def test_hard_links(layers):
    work, ua, ub, mask, image = layers
    pa = mkfile(ua, "h/one", b"shared")
    os.makedirs(os.path.join(ub, "h"))
    os.link(pa, os.path.join(ub, "h/one"))  # the same inode in both uppers
    os.link(os.path.join(ub, "h/one"), os.path.join(ub, "h/two"))
    pc = mkfile(ua, "h/three", b"3333")
    mkfile(ub, "h/three", b"3333")
    os.link(pc, os.path.join(ua, "h/four"))
    got = check(work, ua, ub, [mask, image])
    assert got == DiffResult(["/h/two"], [], ["/h/four"])


def test_mask_layer_and_devices(layers):
    work, ua, ub, mask, image = layers
    whiteout(mask, "secret")  # the image's /secret is masked for both views
    mkdir(mask, "usr/share/misc", opaque=True)
    mkfile(ub, "secret/key", b"recreated")  # B recreates what the mask hides
    os.mknod(os.path.join(ua, "null"), stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mknod(os.path.join(ub, "null"), stat.S_IFCHR | 0o666, os.makedev(1, 5))
    os.mkfifo(os.path.join(ub, "fifo"))
    got = check(work, ua, ub, [mask, image])
    assert got == DiffResult(["/fifo", "/secret", "/secret/key"], ["/null"], [])


def test_opaque_on_the_upper_root_is_ignored(layers):
    work, ua, ub, mask, image = layers
    os.setxattr(ub, "trusted.overlay.opaque", b"y")
    got = check(work, ua, ub, [mask, image])
    assert got == DiffResult([], [], [])


def test_mounts_inside_a_lower_are_not_crossed(layers):
    work, ua, ub, mask, image = layers
    mp = mkdir(image, "mp")
    mkdir(image, "keep")
    whiteout(ub, "mp")  # B deletes the mount point; overlay never saw the mount's files
    mkdir(ua, "keep", opaque=True)
    out: dict = {}
    want = overlay_truth(work, ua, ub, [mask, image], tmpfs=[mp], views_out=out)
    assert "/mp/hidden" not in out["a"]
    assert out["diff"] == [want.added, want.modified, want.deleted]
    assert want.deleted == ["/mp"]


def test_walk_cap(layers):
    work, ua, ub, mask, image = layers
    for i in range(50):
        mkfile(image, f"many/f{i:02d}", b"x")
    whiteout(ub, "many")
    mkfile(ub, "etc/new", b"n")
    got = diff_layers(ua, ub, [mask, image], max_paths=10)
    assert "/many" in got.deleted and "/etc/new" in got.added
    assert got.truncated == ["/many"] and "capped" in got.note
    full = diff_layers(ua, ub, [mask, image])
    assert len(full.deleted) == 51 and full.truncated == []


def test_walk_upper(layers):
    work, ua, ub, mask, image = layers
    mkfile(ua, "b/z", b"")
    mkfile(ua, "a/y/x", b"")
    whiteout(ua, "c")
    mkdir(ua, "b/o", opaque=True)
    symlink(ua, "b/l", "/etc")
    assert list(walk_upper(ua)) == ["/a", "/a/y", "/a/y/x", "/b", "/b/l", "/b/o", "/b/z",
                                    "/c"]


# ---- property test: random uppers over a random lower ------------------------------
_names = st.sampled_from(["a", "b", "c"])
_leaf = st.one_of(
    st.tuples(st.just("file"), st.sampled_from([b"", b"x", b"y", b"xy"]),
              st.sampled_from([0o644, 0o755])),
    st.tuples(st.just("link"), st.sampled_from(["a", "b", "../a"])),
    st.just(("wh",)),
    st.just(("fifo",)),
)


def _dirs(children):
    return st.tuples(st.just("dir"), st.booleans(), st.sampled_from([0o755, 0o700]),
                     st.dictionaries(_names, children, max_size=3))


_tree = st.dictionaries(_names, st.recursive(_leaf, _dirs, max_leaves=10), max_size=3)
_layer = st.tuples(st.booleans(), _tree)  # (opaque xattr on the layer root, children)


def _build(path: str, children: dict) -> None:
    for name, node in children.items():
        p = os.path.join(path, name)
        kind = node[0]
        if kind == "file":
            with open(p, "wb") as f:
                f.write(node[1])
            os.chmod(p, node[2])
        elif kind == "link":
            os.symlink(node[1], p)
        elif kind == "wh":
            os.mknod(p, stat.S_IFCHR | 0o000, os.makedev(0, 0))
        elif kind == "fifo":
            os.mkfifo(p)
        else:
            os.mkdir(p)
            _build(p, node[3])
            os.chmod(p, node[2])
            if node[1]:
                os.setxattr(p, "trusted.overlay.opaque", b"y")


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(upper_a=_layer, upper_b=_layer, mask=_layer, image=_tree)
def test_random_layers_match_a_real_overlay(upper_a, upper_b, mask, image):
    with scratch() as work:
        paths = {}
        for key, (root_opaque, tree) in (("upper_a", upper_a), ("upper_b", upper_b),
                                         ("mask", mask), ("image", (False, image))):
            p = paths[key] = os.path.join(work, key)
            os.mkdir(p)
            os.chmod(p, 0o755)
            _build(p, tree)
            if root_opaque:
                os.setxattr(p, "trusted.overlay.opaque", b"y")
        check(work, paths["upper_a"], paths["upper_b"], [paths["mask"], paths["image"]])
