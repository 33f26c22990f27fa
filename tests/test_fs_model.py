"""Model-based test of DeltaFS: random file-system histories with checkpoint, rollback, fork.

A hypothesis state machine drives ONE sandbox per example through random operations under
/workspace/m (files a-d, dirs x/y, dirs nested at most two deep): writes of random (binary)
bytes, appends, truncates, pwrites far into sparse 1 GiB files, renames of files and of
whole directories, unlink, mkdir, rmdir, rm -rf, relative/absolute/dangling symlinks, hard
links, chmod (0o000 .. 0o4755 and friends), plus writes through the Files API (which replace
the inode atomically). Every mutation is a real command run with `sbx.exec([...])` (or the
Files API); an in-memory model applies the same operation.

Each example starts from a tree with one of everything (dirs, a suid file, a hard-linked
pair, a symlink, a sticky dir, a sparse 1 GiB file), checkpointed, so rollbacks always have
something to restore. Interleaved with the mutations: `checkpoint` (the model is
snapshotted under the checkpoint id), `rollback` to any earlier checkpoint or to the newest
one (the model becomes that snapshot), and `fork` (1-2 children of a random checkpoint must
each equal that snapshot; a child is then changed and the parent and the other child must be
unaffected; the children are killed).

After every step the tree is read back with ONE exec of a small python3 script inside the
sandbox (the image is the host root, so /usr/bin/python3 is there) that walks /workspace/m
with lstat and prints, per path: type, permission bits (incl. suid/sgid/sticky), size, a
content hash, symlink target, inode number and link count. It must equal the model exactly;
hard-link identity is compared as the partition of paths by inode.

Content hashes are "block-sparse" so a 1 GiB file never crosses the wire or gets read in
full: sha256 over (index, bytes) of every non-zero 64 KiB block, the sandbox side finding
candidate blocks with SEEK_DATA/SEEK_HOLE, the model side from the blocks it wrote. Files of
at least 64 MiB must also stay sparse (allocation bounded by what was written).

Two deterministic tests pin the most important cases without hypothesis.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, initialize, invariant,
                                 precondition, rule, run_state_machine_as_test)

from deltabox import Sandbox

TOP = "/workspace/m"
B = 64 * 1024                 # hash block size
GiB = 1 << 30
FILE_NAMES = "abcd"
DIR_NAMES = "xy"
ALL_NAMES = FILE_NAMES + DIR_NAMES
MAX_DIR_DEPTH = 2             # x, x/y
MAX_DEPTH = 3                 # x/y/a
SPARSE_MIN = 64 << 20         # files this big must stay sparse

# ---- helpers run inside the sandbox ------------------------------------------------------

WRITE_PY = ("import os,sys\nos.umask(0o022)\n"
            "with open(sys.argv[1], sys.argv[2]) as f: f.write(sys.stdin.buffer.read())\n")
PWRITE_PY = ("import os,sys\nfd=os.open(sys.argv[1], os.O_WRONLY)\n"
             "d=memoryview(sys.stdin.buffer.read()); off=int(sys.argv[2])\n"
             "while d:\n n=os.pwrite(fd, d, off); d=d[n:]; off+=n\n"
             "os.close(fd)\n")
RENAME_PY = "import os,sys\nos.rename(sys.argv[1], sys.argv[2])\n"
TREE_PY = r'''
import errno, hashlib, json, os, stat, sys
B = 65536

def bhash(path, size):
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        idx, off = set(), 0
        while off < size:
            try:
                d = os.lseek(fd, off, os.SEEK_DATA)
            except OSError as e:
                if e.errno != errno.ENXIO:   # no SEEK_DATA: read everything
                    idx.update(range(off // B, (size + B - 1) // B))
                break
            if d >= size:
                break
            h = min(os.lseek(fd, d, os.SEEK_HOLE), size)
            idx.update(range(d // B, (h + B - 1) // B))
            off = h
        hs = hashlib.sha256()
        for i in sorted(idx):
            blk = os.pread(fd, B, i * B)
            if blk.count(0) != len(blk):
                hs.update(i.to_bytes(8, "little"))
                hs.update(blk)
        return hs.hexdigest()
    finally:
        os.close(fd)

out = {}
def rec(d, rel):
    for name in sorted(os.listdir(d)):
        p, r = os.path.join(d, name), rel + name
        st = os.lstat(p)
        m = stat.S_IMODE(st.st_mode)
        if stat.S_ISDIR(st.st_mode):
            out[r] = ["d", m]
            rec(p, r + "/")
        elif stat.S_ISLNK(st.st_mode):
            out[r] = ["l", os.readlink(p)]
        elif stat.S_ISREG(st.st_mode):
            out[r] = ["f", m, st.st_size, bhash(p, st.st_size), st.st_ino, st.st_nlink,
                      st.st_blocks * 512]
        else:
            out[r] = ["?", st.st_mode]
rec(sys.argv[1], "")
print(json.dumps(out))
'''

# ---- the model ---------------------------------------------------------------------------


@dataclass
class Inode:
    mode: int
    size: int = 0
    blocks: dict[int, bytes] = field(default_factory=dict)  # index -> <= B bytes, 0-padded

    def pwrite(self, off: int, data: bytes) -> None:
        pos = 0
        while pos < len(data):
            i, o = divmod(off + pos, B)
            n = min(B - o, len(data) - pos)
            cur = bytearray(self.blocks.get(i, b"").ljust(B, b"\0"))
            cur[o:o + n] = data[pos:pos + n]
            self.blocks[i] = bytes(cur)
            pos += n
        if data:
            self.size = max(self.size, off + len(data))

    def truncate(self, n: int) -> None:
        if n < self.size:
            self.blocks = {i: b for i, b in self.blocks.items() if i * B < n}
            i, o = divmod(n, B)
            if o and i in self.blocks:
                self.blocks[i] = self.blocks[i].ljust(B, b"\0")[:o]
        self.size = n  # bytes past the old size are zero: the invariant of `blocks`

    def replace(self, data: bytes) -> None:
        self.size, self.blocks = 0, {}
        self.pwrite(0, data)

    def digest(self) -> str:
        hs = hashlib.sha256()
        for i in sorted(self.blocks):
            if i * B >= self.size:
                continue
            blk = self.blocks[i].ljust(B, b"\0")[:min(B, self.size - i * B)]
            if blk.count(0) != len(blk):
                hs.update(i.to_bytes(8, "little"))
                hs.update(blk)
        return hs.hexdigest()


class Model:
    """entries: relpath -> ("d", mode) | ("f", inode id) | ("l", target)."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple] = {}
        self.inodes: dict[int, Inode] = {}
        self.next_ino = 0

    # queries
    def kind(self, p: str) -> str | None:
        if p == "":
            return "d"
        e = self.entries.get(p)
        return e[0] if e else None

    def dirs(self, include_root: bool = True) -> list[str]:
        return ([""] if include_root else []) + sorted(p for p, e in self.entries.items()
                                                       if e[0] == "d")

    def files(self) -> list[str]:
        return sorted(p for p, e in self.entries.items() if e[0] == "f")

    def nondirs(self) -> list[str]:
        return sorted(p for p, e in self.entries.items() if e[0] != "d")

    def all(self) -> list[str]:
        return sorted(self.entries)

    def subtree(self, p: str) -> list[str]:
        return sorted(q for q in self.entries if q.startswith(p + "/"))

    def empty_dirs(self) -> list[str]:
        return [d for d in self.dirs(False) if not self.subtree(d)]

    def free_paths(self, names: str, max_depth: int) -> list[str]:
        out = []
        for d in self.dirs():
            for n in names:
                p = f"{d}/{n}" if d else n
                if p not in self.entries and depth(p) <= max_depth:
                    out.append(p)
        return out

    def inode(self, p: str) -> Inode:
        return self.inodes[self.entries[p][1]]

    # mutations
    def new_file(self, p: str, mode: int = 0o644) -> Inode:
        self.next_ino += 1
        self.inodes[self.next_ino] = ino = Inode(mode)
        self.entries[p] = ("f", self.next_ino)
        return ino

    def unlink(self, p: str) -> None:
        e = self.entries.pop(p)
        if e[0] == "f" and not any(x == e for x in self.entries.values()):
            del self.inodes[e[1]]

    def rmtree(self, p: str) -> None:
        for q in self.subtree(p) + [p]:
            self.unlink(q)

    def rename(self, src: str, dst: str) -> None:
        if self.same_inode(src, dst):
            return  # rename(2) of two links to one inode does nothing
        if dst in self.entries:
            self.unlink(dst)  # rename_ok() guaranteed it is a non-dir or an empty dir
        moved = [src] + self.subtree(src)
        vals = {q: self.entries.pop(q) for q in moved}
        for q, v in vals.items():
            self.entries[dst + q[len(src):]] = v

    def rename_ok(self, src: str, dst: str) -> bool:
        if src == dst or dst.startswith(src + "/") or self.kind(parent(dst)) != "d":
            return False
        ks, kd = self.kind(src), self.kind(dst)
        if ks == "d":
            if kd is not None and (kd != "d" or self.subtree(dst)):
                return False
            return all(depth(dst + q[len(src):]) <= (MAX_DIR_DEPTH if self.kind(q) == "d"
                                                     else MAX_DEPTH)
                       for q in [src] + self.subtree(src))
        if kd == "d":
            return False
        return depth(dst) <= MAX_DEPTH

    def same_inode(self, p: str, q: str) -> bool:
        return self.kind(p) == "f" and self.entries.get(q) == self.entries[p]

    def mkdir(self, p: str) -> None:
        mode = 0o755
        if self.kind(parent(p)) == "d" and parent(p) and self.entries[parent(p)][1] & 0o2000:
            mode |= 0o2000  # the kernel: a subdirectory of a setgid directory inherits it
        self.entries[p] = ("d", mode)

    def chmod(self, p: str, mode: int) -> None:
        e = self.entries[p]
        if e[0] == "d":
            self.entries[p] = ("d", mode)
        else:
            self.inodes[e[1]].mode = mode

    def expected(self) -> dict[str, list]:
        groups: dict[int, list[str]] = {}
        for p, e in self.entries.items():
            if e[0] == "f":
                groups.setdefault(e[1], []).append(p)
        out: dict[str, list] = {}
        for p, e in self.entries.items():
            if e[0] == "d":
                out[p] = ["d", e[1]]
            elif e[0] == "l":
                out[p] = ["l", e[1]]
            else:
                ino = self.inodes[e[1]]
                out[p] = ["f", ino.mode, ino.size, ino.digest(), min(groups[e[1]]),
                          len(groups[e[1]])]
        return out

    def max_alloc(self, p: str) -> int:
        return (len(self.inode(p).blocks) + 4) * B * 2


def depth(p: str) -> int:
    return p.count("/") + 1


def parent(p: str) -> str:
    return p.rpartition("/")[0]


def full(p: str) -> str:
    return f"{TOP}/{p}" if p else TOP


# ---- sandbox side ------------------------------------------------------------------------

_created: list[Sandbox] = []  # every sandbox this module made, killed at the end for sure


def _kill(s: Sandbox) -> None:
    try:
        s.kill()
    except Exception:
        pass


def run(s: Sandbox, argv: list[str], stdin: bytes = b"") -> str:
    r = s.exec(argv, stdin=stdin, timeout=120)
    assert r.exit_code == 0, f"{argv[:4]} failed ({r.exit_code}): {r.stderr}{r.stdout}"
    return r.stdout


def read_tree(s: Sandbox) -> dict[str, list]:
    return json.loads(run(s, ["python3", "-c", TREE_PY, TOP]))


def check_tree(s: Sandbox, model: Model, what: str) -> None:
    actual = read_tree(s)
    by_ino: dict[int, list[str]] = {}
    for p, v in actual.items():
        if v[0] == "f":
            by_ino.setdefault(v[4], []).append(p)
    got: dict[str, list] = {}
    problems = []
    for p, v in actual.items():
        if v[0] == "f":
            got[p] = ["f", v[1], v[2], v[3], min(by_ino[v[4]]), v[5]]
            if v[2] >= SPARSE_MIN and p in model.entries and model.kind(p) == "f" \
                    and v[6] > model.max_alloc(p):
                problems.append(f"  {p}: {v[2]}-byte file has {v[6]} bytes allocated "
                                f"(no longer sparse)")
        else:
            got[p] = v
    want = model.expected()
    for p in sorted(set(want) | set(got)):
        if want.get(p) != got.get(p):
            problems.append(f"  {p}: expected {fmt(want.get(p))}, found {fmt(got.get(p))}")
    assert not problems, f"{what}: tree of {s.id} differs from the model:\n" + "\n".join(problems)


def fmt(v: list | None) -> str:
    if v is None:
        return "nothing"
    if v[0] == "d":
        return f"dir {v[1]:o}"
    if v[0] == "l":
        return f"symlink -> {v[1]!r}"
    if v[0] == "f":
        return (f"file {v[1]:o} size={v[2]} hash={v[3][:12]} links-group={v[4]!r} "
                f"nlink={v[5]}")
    return repr(v)


# Operations: each runs the real command in `s` and applies the same change to `m`.

def op_write(s: Sandbox, m: Model, p: str, data: bytes) -> None:
    run(s, ["python3", "-c", WRITE_PY, full(p), "wb"], stdin=data)
    (m.inode(p) if p in m.entries else m.new_file(p)).replace(data)


def op_append(s: Sandbox, m: Model, p: str, data: bytes) -> None:
    run(s, ["python3", "-c", WRITE_PY, full(p), "ab"], stdin=data)
    ino = m.inode(p)
    ino.pwrite(ino.size, data)


def op_pwrite(s: Sandbox, m: Model, p: str, off: int, data: bytes) -> None:
    run(s, ["python3", "-c", PWRITE_PY, full(p), str(off)], stdin=data)
    m.inode(p).pwrite(off, data)


def op_truncate(s: Sandbox, m: Model, p: str, size: int) -> None:
    run(s, ["truncate", "-s", str(size), full(p)])
    m.inode(p).truncate(size)


def op_api_write(s: Sandbox, m: Model, p: str, data: bytes, mode: int | None) -> None:
    """Files API write: a new inode renamed over the path (hard links to the old one keep the
    old content); mode: given, else the old file's, else 0o644. A symlink is replaced."""
    s.files.write(full(p), data, mode=mode)
    old = m.entries.get(p)
    keep = m.inodes[old[1]].mode if old and old[0] == "f" else 0o644
    if old:
        m.unlink(p)
    m.new_file(p, keep if mode is None else mode).replace(data)


def op_rename(s: Sandbox, m: Model, src: str, dst: str) -> None:
    if dst in m.entries and ("l" in (m.kind(src), m.kind(dst)) or m.same_inode(src, dst)):
        # mv refuses these ("are the same file" when one is a link to the other, or both are
        # hard links of one inode): plain rename(2), which replaces resp. does nothing.
        run(s, ["python3", "-c", RENAME_PY, full(src), full(dst)])
    else:
        run(s, ["mv", "-f", "-T", full(src), full(dst)])
    m.rename(src, dst)


def op_chmod(s: Sandbox, m: Model, p: str, mode: int) -> None:
    # Five octal digits: GNU chmod keeps a directory's setuid/setgid bits on a plain "0755".
    run(s, ["chmod", f"0{mode:04o}", full(p)])
    m.chmod(p, mode)


def op_rmtree(s: Sandbox, m: Model, p: str) -> None:
    run(s, ["rm", "-rf", full(p)])
    m.rmtree(p)


# ---- strategies --------------------------------------------------------------------------

payloads = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda n, seed: random.Random(seed).randbytes(n),
              st.integers(0, 64 * 1024), st.integers(0, 1 << 16)),
    st.builds(lambda n, b: bytes([b]) * n, st.integers(0, 64 * 1024), st.sampled_from([0, 255])),
)
small_payloads = st.binary(min_size=1, max_size=256)
file_modes = st.sampled_from([0o644, 0o000, 0o4755, 0o600, 0o755, 0o2755, 0o444, 0o1777,
                              0o6711, 0o7777, 0o640, 0o111])
dir_modes = st.sampled_from([0o755, 0o000, 0o700, 0o1777, 0o2755, 0o4755, 0o500, 0o7777])
api_modes = st.one_of(st.none(), st.sampled_from([0o600, 0o4755, 0o640, 0o7777]))
sparse_offsets = st.one_of(st.integers(0, 3 * B),
                           st.sampled_from([B - 1, 1 << 20, (1 << 29) + 12345, GiB - 5, GiB,
                                            GiB + B + 7]))
link_targets = st.sampled_from([
    "a", "../a", "x/b", "../../m/x", "nowhere", ".", "..", "x/y/../../c",  # relative
    f"{TOP}/a", f"{TOP}/x/y", "/etc/hostname", "/nonexistent/dangling",   # absolute
])

# DELTABOX_FS_MODEL_EXAMPLES=400 for a longer bug hunt (~2 s an example); the default keeps
# the file at about a minute.
EXAMPLES = int(os.environ.get("DELTABOX_FS_MODEL_EXAMPLES", "25"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=30, deadline=None,
    suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
)


def pick(data, choices: list[str], label: str) -> str | None:
    """A state-dependent choice; None (the step does nothing) when there is none."""
    return data.draw(st.sampled_from(choices), label) if choices else None


class FsMachine(RuleBasedStateMachine):
    socket: str | None = None
    checkpoints = Bundle("checkpoints")

    def __init__(self) -> None:
        super().__init__()
        self.model = Model()
        self.snapshots: dict[str, Model] = {}
        self.sbx: Sandbox | None = None

    @initialize(target=checkpoints, payload=payloads)
    def start(self, payload) -> str:
        """A fresh sandbox with a starting tree that has one of everything (so directory
        operations and rollbacks have something to work on), checkpointed."""
        self.sbx = s = Sandbox.create(socket=self.socket)
        _created.append(s)
        m = self.model
        run(s, ["mkdir", "-p", "-m", "0755", TOP])
        for d in ("x", "x/y", "y"):
            run(s, ["mkdir", "-m", "0755", full(d)])
            m.mkdir(d)
        op_write(s, m, "a", payload)
        op_write(s, m, "x/b", b"x/b")
        op_write(s, m, "x/y/c", payload[::-1])
        run(s, ["ln", "-T", full("x/y/c"), full("y/d")])
        m.entries["y/d"] = m.entries["x/y/c"]
        run(s, ["ln", "-s", "-T", "../a", full("x/a")])
        m.entries["x/a"] = ("l", "../a")
        op_chmod(s, m, "a", 0o4755)
        op_chmod(s, m, "y", 0o1777)
        run(s, ["truncate", "-s", "1G", full("b")])
        m.new_file("b").truncate(GiB)
        op_pwrite(s, m, "b", (1 << 29) + 3, b"in the middle of a sparse file")
        return self.checkpoint()

    def teardown(self) -> None:
        if self.sbx is not None:
            _kill(self.sbx)

    # --- file contents

    @rule(data=st.data(), payload=payloads)
    def write(self, data, payload):
        p = pick(data, self.model.free_paths(FILE_NAMES, MAX_DEPTH) + self.model.files(),
                 "path")
        if p is None:
            return
        op_write(self.sbx, self.model, p, payload)

    @precondition(lambda self: self.model.files())
    @rule(data=st.data(), payload=payloads)
    def append(self, data, payload):
        p = data.draw(st.sampled_from(self.model.files()), "path")
        op_append(self.sbx, self.model, p, payload)

    @precondition(lambda self: self.model.files())
    @rule(data=st.data())
    def truncate(self, data):
        p = data.draw(st.sampled_from(self.model.files()), "path")
        size = self.model.inode(p).size
        new = data.draw(st.one_of(
            st.sampled_from(sorted({0, size // 2, max(size - 1, 0), size + 1, size + B + 3,
                                    GiB})),
            st.integers(0, 2 * size + B)), "size")
        op_truncate(self.sbx, self.model, p, new)

    @precondition(lambda self: self.model.files())
    @rule(data=st.data(), off=sparse_offsets, payload=small_payloads)
    def pwrite(self, data, off, payload):
        p = data.draw(st.sampled_from(self.model.files()), "path")
        op_pwrite(self.sbx, self.model, p, off, payload)

    @rule(data=st.data(), off=sparse_offsets, payload=small_payloads)
    def sparse_file(self, data, off, payload):
        """truncate -s 1G a new file, then write into it at an offset."""
        p = pick(data, self.model.free_paths(FILE_NAMES, MAX_DEPTH), "path")
        if p is None:
            return
        run(self.sbx, ["truncate", "-s", "1G", full(p)])
        self.model.new_file(p).truncate(GiB)
        op_pwrite(self.sbx, self.model, p, off, payload)

    @rule(data=st.data(), payload=payloads, mode=api_modes)
    def api_write(self, data, payload, mode):
        p = pick(data, self.model.free_paths(FILE_NAMES, MAX_DEPTH) + self.model.nondirs(),
                 "path")
        if p is None:
            return
        op_api_write(self.sbx, self.model, p, payload, mode)

    # --- names

    @precondition(lambda self: self.model.entries)
    @rule(data=st.data())
    def rename(self, data):
        m = self.model
        src = data.draw(st.sampled_from(m.all()), "src")
        dst = pick(data, [d for d in m.free_paths(ALL_NAMES, MAX_DEPTH) + m.all()
                          if m.rename_ok(src, d)], "dst")
        if dst is None:
            return
        op_rename(self.sbx, m, src, dst)

    @precondition(lambda self: self.model.dirs(False))
    @rule(data=st.data())
    def rename_dir(self, data):
        m = self.model
        src = data.draw(st.sampled_from(m.dirs(False)), "src")
        dst = pick(data, [d for d in m.free_paths(ALL_NAMES, MAX_DEPTH) + m.dirs(False)
                          if m.rename_ok(src, d)], "dst")
        if dst is None:
            return
        op_rename(self.sbx, m, src, dst)

    @precondition(lambda self: self.model.nondirs())
    @rule(data=st.data())
    def unlink(self, data):
        p = data.draw(st.sampled_from(self.model.nondirs()), "path")
        run(self.sbx, ["rm", "-f", full(p)])
        self.model.unlink(p)

    @rule(data=st.data())
    def mkdir(self, data):
        p = pick(data, self.model.free_paths(DIR_NAMES, MAX_DIR_DEPTH), "path")
        if p is None:
            return
        run(self.sbx, ["mkdir", "-m", "0755", full(p)])
        self.model.mkdir(p)

    @precondition(lambda self: self.model.empty_dirs())
    @rule(data=st.data())
    def rmdir(self, data):
        p = data.draw(st.sampled_from(self.model.empty_dirs()), "path")
        run(self.sbx, ["rmdir", full(p)])
        self.model.unlink(p)

    @precondition(lambda self: self.model.dirs(False))
    @rule(data=st.data())
    def rm_rf(self, data):
        p = data.draw(st.sampled_from(self.model.dirs(False)), "path")
        op_rmtree(self.sbx, self.model, p)

    @rule(data=st.data(), link=link_targets)
    def symlink(self, data, link):
        p = pick(data, self.model.free_paths(FILE_NAMES, MAX_DEPTH), "path")
        if p is None:
            return
        run(self.sbx, ["ln", "-s", "-T", link, full(p)])
        self.model.entries[p] = ("l", link)

    @precondition(lambda self: self.model.files())
    @rule(data=st.data())
    def hardlink(self, data):
        m = self.model
        src = data.draw(st.sampled_from(m.files()), "src")
        dst = pick(data, m.free_paths(ALL_NAMES, MAX_DEPTH), "dst")
        if dst is None:
            return
        run(self.sbx, ["ln", "-T", full(src), full(dst)])
        m.entries[dst] = m.entries[src]

    @precondition(lambda self: self.model.files() or self.model.dirs(False))
    @rule(data=st.data())
    def chmod(self, data):
        p = data.draw(st.sampled_from(self.model.files() + self.model.dirs(False)), "path")
        mode = data.draw(dir_modes if self.model.kind(p) == "d" else file_modes, "mode")
        op_chmod(self.sbx, self.model, p, mode)

    # --- checkpoint / rollback / fork

    @rule(target=checkpoints)
    def checkpoint(self):
        cp = self.sbx.checkpoint()
        self.snapshots[cp.id] = copy.deepcopy(self.model)
        return cp.id

    @rule(cp=checkpoints)
    def rollback(self, cp):
        self.sbx.rollback(cp)
        self.model = copy.deepcopy(self.snapshots[cp])
        check_tree(self.sbx, self.model, f"after rollback to {cp}")

    @precondition(lambda self: self.snapshots)
    @rule()
    def rollback_to_last_checkpoint(self):
        """The usual agent move: undo everything since the newest checkpoint."""
        self.rollback(next(reversed(self.snapshots)))

    @rule(cp=checkpoints, count=st.integers(1, 2))
    def fork(self, cp, count):
        snap = self.snapshots[cp]
        children = self.sbx.fork(cp, count=count)
        _created.extend(children)
        try:
            for i, c in enumerate(children):
                check_tree(c, snap, f"fork child {i} of {cp}")
            c, cm = children[0], copy.deepcopy(snap)
            # Change the child: a new file, an in-place append to a file it shares with the
            # checkpoint (and the parent), a chmod, and removing a whole directory.
            op_write(c, cm, "zz", b"child\0" * 100)
            if cm.files():
                f = cm.files()[0]
                op_append(c, cm, f, b"child-append")
                op_chmod(c, cm, f, 0o4700)
            if cm.dirs(False):
                op_rmtree(c, cm, cm.dirs(False)[0])
            check_tree(c, cm, f"fork child 0 of {cp} after changing it")
            for i, other in enumerate(children[1:], 1):
                check_tree(other, snap, f"fork child {i} of {cp} after its sibling changed")
            check_tree(self.sbx, self.model, f"parent after its fork child of {cp} changed")
        finally:
            for c in children:
                _kill(c)

    @invariant()
    def tree_matches_model(self):
        if self.sbx is not None:
            check_tree(self.sbx, self.model, "after the last step")


@pytest.mark.timeout(600 + 5 * EXAMPLES)
def test_fs_model_state_machine(daemon, monkeypatch):
    FsMachine.socket = daemon.socket
    # Every example drives a real sandbox (~1-2 s), so shrinking a failure is slow: cap it at
    # 2 minutes instead of hypothesis' 5 (a private knob; harmless if it goes away).
    from hypothesis.internal.conjecture import engine
    if hasattr(engine, "MAX_SHRINKING_SECONDS"):
        monkeypatch.setattr(engine, "MAX_SHRINKING_SECONDS", 120)
    try:
        run_state_machine_as_test(FsMachine, settings=SETTINGS)
    finally:
        for s in _created:
            _kill(s)
        _created.clear()


# ---- deterministic cases -----------------------------------------------------------------

def test_renamed_dir_comes_back_after_delete_and_rollback(sbx):
    m = Model()
    run(sbx, ["mkdir", "-p", "-m", "0755", TOP])
    run(sbx, ["mkdir", "-m", "0755", f"{TOP}/x"])
    m.mkdir("x")
    run(sbx, ["mkdir", "-m", "0755", f"{TOP}/x/y"])
    m.mkdir("x/y")
    op_write(sbx, m, "x/a", bytes(range(256)) * 300)
    op_chmod(sbx, m, "x/a", 0o4755)
    op_write(sbx, m, "x/y/b", b"\0\1\2 binary \xff" * 10)
    op_chmod(sbx, m, "x/y/b", 0o600)
    op_chmod(sbx, m, "x/y", 0o700)
    run(sbx, ["mv", "-T", f"{TOP}/x", f"{TOP}/y"])
    m.rename("x", "y")
    check_tree(sbx, m, "after renaming x to y")
    cp = sbx.checkpoint()
    op_rmtree(sbx, m, "y")
    assert read_tree(sbx) == {}
    sbx.rollback(cp)
    m = Model()
    m.mkdir("y")
    m.entries["y/y"] = ("d", 0o700)
    m.new_file("y/a", 0o4755).replace(bytes(range(256)) * 300)
    m.new_file("y/y/b", 0o600).replace(b"\0\1\2 binary \xff" * 10)
    check_tree(sbx, m, "after rolling back the delete")
    assert sbx.files.read(f"{TOP}/y/a") == bytes(range(256)) * 300
    assert sbx.files.stat(f"{TOP}/y/a").mode == 0o4755


def test_hard_link_pair_survives_checkpoint_and_rollback(sbx):
    m = Model()
    run(sbx, ["mkdir", "-p", "-m", "0755", TOP])
    op_write(sbx, m, "a", b"shared")
    run(sbx, ["ln", f"{TOP}/a", f"{TOP}/b"])
    m.entries["b"] = m.entries["a"]
    cp = sbx.checkpoint()
    run(sbx, ["rm", f"{TOP}/b"])
    m.unlink("b")
    op_append(sbx, m, "a", b" and changed")
    check_tree(sbx, m, "before the rollback")
    sbx.rollback(cp)
    m = Model()
    m.new_file("a").replace(b"shared")
    m.entries["b"] = m.entries["a"]
    check_tree(sbx, m, "after the rollback")
    tree = read_tree(sbx)
    assert tree["a"][4] == tree["b"][4] and tree["a"][5] == 2, tree
    # Still one inode: a write through one name shows through the other.
    run(sbx, ["python3", "-c", WRITE_PY, f"{TOP}/a", "ab"], stdin=b"!")
    assert sbx.files.read(f"{TOP}/b") == b"shared!"
