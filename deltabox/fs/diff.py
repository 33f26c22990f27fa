"""What differs between two overlay views that share their lower layers, without mounting.

View X = overlay(upper_X over lowers[0] over lowers[1] ...). diff_layers resolves paths the
way overlayfs' lookup does (fs/overlayfs/namei.c), walking the layers top to bottom:

* a whiteout (character device 0:0) at a name hides that name in every layer below;
* a directory with xattr trusted.overlay.opaque == "y" hides the lower layers' children
  of that directory (the xattr is ignored on a layer's root, as overlayfs does);
* a non-directory hides everything below it; a non-directory *below* a directory found
  higher up is ignored, and ends the merge for that directory;
* directories found in several layers merge, top-most attributes win;
* a layer does not cross mount points below its root: overlayfs sees the directory a
  mount covers, which is empty here (we list it as empty; its attributes are read from
  the mounted root, the only ones visible from here).

Presence is lookup presence: a whiteout in a directory only one layer contributes to is
listed by overlayfs' readdir (as "c?????????") but cannot be looked up; it counts as absent.

Only paths present in upper_a or upper_b can differ (the lowers are shared), so the walk
visits the two upper trees and resolves each of their names in both stacks. diff_stacks
takes two whole stacks whose bottom layers are shared: there, every layer above the shared
ones is walked as the uppers are. Where the two
stacks' lower parts differ for a directory (opaque in one view only, hidden by a whiteout
in one view, replaced by a file in one view), the merged subtree is walked in both views,
so every descendant of a deleted or revealed lower directory is reported. That expansion
is capped (max_paths); directories whose lower-only content was not listed because of the
cap are returned in DiffResult.truncated, with a note.

Redirect and metacopy xattrs and xattr-based whiteouts are not produced by DeltaBox and
are not interpreted.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Iterator

from deltabox.errors import Internal, NotFound

__all__ = ["DiffResult", "diff_layers", "diff_stacks", "walk_upper", "DEFAULT_MAX_PATHS"]

OPAQUE_XATTR = "trusted.overlay.opaque"
DEFAULT_MAX_PATHS = 100_000
_CHUNK = 1 << 20


@dataclass(frozen=True)
class DiffResult:
    """Sorted absolute paths (relative to the merged root) that differ from view A to B."""

    added: list[str]
    modified: list[str]
    deleted: list[str]
    # Directories under which lower-layer-only entries were not listed (walk cap hit).
    truncated: list[str] = field(default_factory=list)
    note: str = ""


# --------------------------------------------------------------------------------------
# layer model
# --------------------------------------------------------------------------------------
class _Dir:
    """One layer's directory contributing to a merged directory."""

    __slots__ = ("layer", "path", "sealed")

    def __init__(self, layer: int, path: str, sealed: bool) -> None:
        self.layer = layer  # the layer root's index among both views' (_Differ.index)
        self.path = path
        self.sealed = sealed  # a mount point below the layer root: contents invisible

    def key(self) -> tuple[int, str]:
        return (self.layer, self.path)


class _Node:
    """The result of resolving one name in a layer stack."""

    __slots__ = ("layer", "path", "st", "stack")

    def __init__(self, layer: int, path: str, st: os.stat_result) -> None:
        self.layer = layer
        self.path = path
        self.st = st
        self.stack: tuple[_Dir, ...] | None = None  # merged dir: contributing dirs, top first

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.st.st_mode)


def _mountpoints_below(roots: list[str]) -> set[str]:
    """Mount points strictly below any of `roots` (canonical paths)."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    prefixes = tuple(r.rstrip("/") + "/" for r in roots)
    out: set[str] = set()
    for line in lines:
        parts = line.split(b" ", 5)
        if len(parts) < 5:
            continue
        mp = _unescape_mountinfo(parts[4])
        if mp.startswith(prefixes):  # a layer root under another layer seals it there
            out.add(mp)
    return out


def _unescape_mountinfo(raw: bytes) -> str:
    if b"\\" in raw:
        out = bytearray()
        i = 0
        while i < len(raw):
            if raw[i] == 0x5C and raw[i + 1:i + 4].isdigit() and len(raw[i + 1:i + 4]) == 3:
                out.append(int(raw[i + 1:i + 4], 8))
                i += 4
            else:
                out.append(raw[i])
                i += 1
        raw = bytes(out)
    return os.fsdecode(raw)


def _join(d: str, name: str) -> str:
    return d + name if d.endswith("/") else d + "/" + name


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _is_opaque(path: str) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False  # ENODATA (not set), ENOTSUP, a vanished dir: not opaque


def _canonical_dir(path: str, what: str) -> str:
    real = os.path.realpath(path)
    if not os.path.isdir(real):
        raise NotFound(f"diff: {what} {path!r} is not a directory")
    return real


def _root_node(roots: list[str], index: dict[str, int]) -> _Node:
    """The merged root of the view whose layer roots are `roots`, top first."""
    try:
        st = os.lstat(roots[0])
    except OSError as e:
        raise Internal(f"diff: cannot stat layer root {roots[0]!r}: {e}") from e
    node = _Node(index[roots[0]], roots[0], st)
    node.stack = tuple(_Dir(index[r], r, False) for r in roots)
    return node


class _Differ:
    def __init__(self, stack_a: list[str], stack_b: list[str], max_paths: int) -> None:
        if not stack_a or not stack_b:
            raise Internal("diff: a view needs at least one layer")
        self.stack_a = [_canonical_dir(p, f"stack_a[{i}]") for i, p in enumerate(stack_a)]
        self.stack_b = [_canonical_dir(p, f"stack_b[{i}]") for i, p in enumerate(stack_b)]
        # The bottom layers both views have in common are shared: only names present in
        # the others (each view's upper and the layers stacked under it) can differ.
        n = 0
        while (n < min(len(self.stack_a), len(self.stack_b)) - 1
               and self.stack_a[-1 - n] == self.stack_b[-1 - n]):
            n += 1
        shared = self.stack_a[len(self.stack_a) - n:]
        self.index = {r: i for i, r in enumerate(dict.fromkeys(
            [*self.stack_a, *self.stack_b]))}
        self.private = {self.index[r] for r in (*self.stack_a, *self.stack_b)
                        if r not in shared}
        self.mounts = _mountpoints_below(list(self.index))
        self.budget = max_paths
        self.max_paths = max_paths
        self.added: list[str] = []
        self.modified: list[str] = []
        self.deleted: list[str] = []
        self.truncated: list[str] = []

    # ---- directory listing and name resolution -------------------------------------
    def _list(self, d: _Dir, limit: int | None = None) -> tuple[dict[str, os.DirEntry], bool]:
        """The entries of one layer directory (at most `limit`), and whether that is all."""
        if d.sealed:
            return {}, True
        out: dict[str, os.DirEntry] = {}
        try:
            with os.scandir(d.path) as it:
                for e in it:
                    if limit is not None and len(out) >= limit:
                        return out, False
                    out[e.name] = e
        except (FileNotFoundError, NotADirectoryError):
            return {}, True
        except OSError as e:
            raise Internal(f"diff: cannot list {d.path!r}: {e}") from e
        return out, True

    def _resolve(self, stack: tuple[_Dir, ...], name: str,
                 listings: dict[tuple[int, str], dict[str, os.DirEntry]]) -> _Node | None:
        """Look `name` up in a merged directory, as ovl_lookup does."""
        found: _Node | None = None
        child: list[_Dir] = []
        last = len(stack) - 1
        for k, d in enumerate(stack):
            if d.sealed:
                continue
            entries = listings.get(d.key())
            try:
                if entries is not None:
                    e = entries.get(name)
                    if e is None:
                        continue
                    p = e.path
                    st = e.stat(follow_symlinks=False)
                else:
                    p = _join(d.path, name)
                    st = os.lstat(p)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as e:
                raise Internal(f"diff: cannot stat {_join(d.path, name)!r}: {e}") from e
            if _is_whiteout(st):
                break  # hides this name below; a directory found above stops merging
            if stat.S_ISDIR(st.st_mode):
                if found is None:
                    found = _Node(d.layer, p, st)
                sealed = p in self.mounts
                child.append(_Dir(d.layer, p, sealed))
                if k < last and not sealed and _is_opaque(p):
                    break
            else:
                if found is None:
                    found = _Node(d.layer, p, st)
                break  # a non-directory hides everything below (or is hidden by a dir above)
        if found is not None and found.is_dir:
            found.stack = tuple(child)
        return found

    # ---- comparison -------------------------------------------------------------------
    def _differs(self, a: _Node, b: _Node) -> bool:
        if a.layer == b.layer and a.path == b.path:
            return False  # the very same entry of a layer both views stack
        sa, sb = a.st, b.st
        if stat.S_IFMT(sa.st_mode) != stat.S_IFMT(sb.st_mode):
            return True
        if stat.S_IMODE(sa.st_mode) != stat.S_IMODE(sb.st_mode):
            return True
        fmt = stat.S_IFMT(sa.st_mode)
        if fmt == stat.S_IFDIR:
            return False  # mtime, nlink, size of directories do not matter
        if fmt == stat.S_IFLNK:
            try:
                return os.readlink(a.path) != os.readlink(b.path)
            except OSError as e:
                raise Internal(f"diff: cannot read link {a.path!r} / {b.path!r}: {e}") from e
        if fmt == stat.S_IFREG:
            if sa.st_size != sb.st_size:
                return True
            if (sa.st_ino == sb.st_ino and sa.st_mtime_ns == sb.st_mtime_ns
                    and sa.st_ctime_ns == sb.st_ctime_ns
                    and (sa.st_dev == sb.st_dev
                         or (a.layer in self.private and b.layer in self.private))):
                # Same inode (a hard link, or the same file in two btrfs snapshots of one
                # subvolume, which keep inode numbers and timestamps): same content.
                return False
            return not _same_content(a.path, b.path, sa.st_size)
        if fmt in (stat.S_IFCHR, stat.S_IFBLK):
            return sa.st_rdev != sb.st_rdev
        return False  # fifos, sockets: type and mode only

    # ---- the walk ---------------------------------------------------------------------
    def run(self) -> DiffResult:
        ra = _root_node(self.stack_a, self.index)
        rb = _root_node(self.stack_b, self.index)
        if self._differs(ra, rb):
            self.modified.append("/")
        todo: list[tuple[str, _Node | None, _Node | None]] = [("/", ra, rb)]
        while todo:
            rel, a, b = todo.pop()
            self._walk_dir(rel, a, b, todo)
        note = ""
        if self.truncated:
            note = (f"diff walk capped at {self.max_paths} lower-layer paths: entries that "
                    f"exist only in the lower layers under {len(self.truncated)} "
                    f"director{'y' if len(self.truncated) == 1 else 'ies'} (see truncated) "
                    f"are not listed")
        return DiffResult(added=sorted(self.added), modified=sorted(self.modified),
                          deleted=sorted(self.deleted), truncated=sorted(self.truncated),
                          note=note)

    def _walk_dir(self, rel: str, a: _Node | None, b: _Node | None,
                  todo: list[tuple[str, _Node | None, _Node | None]]) -> None:
        stack_a = a.stack if a is not None and a.stack is not None else ()
        stack_b = b.stack if b is not None and b.stack is not None else ()
        lower_a = [d.key() for d in stack_a if d.layer not in self.private]
        lower_b = [d.key() for d in stack_b if d.layer not in self.private]

        listings: dict[tuple[int, str], dict[str, os.DirEntry]] = {}
        names: set[str] = set()
        # The views' own layers' entries are always walked: they are what can differ.
        for d in (*stack_a, *stack_b):
            if d.layer in self.private and d.key() not in listings:
                listings[d.key()] = entries = self._list(d)[0]
                names.update(entries)
        if not (stack_a and stack_b and lower_a == lower_b):
            # The views merge different lower directories here (or the directory exists in
            # one view only): every name in the lower directories can differ too.
            for d in (*stack_a, *stack_b):
                if d.layer in self.private or d.key() in listings:
                    continue
                entries, complete = self._list(d, limit=max(self.budget, 0))
                before = len(names)
                names.update(entries)
                self.budget -= len(names) - before
                if not complete:
                    # Capped: the names read so far are still resolved exactly (a partial
                    # listing is not used for lookups), the rest are left out.
                    self.truncated.append(rel)
                    break
                listings[d.key()] = entries

        prefix = rel if rel.endswith("/") else rel + "/"
        subdirs = []
        for name in names:
            ca = self._resolve(stack_a, name, listings) if stack_a else None
            cb = self._resolve(stack_b, name, listings) if stack_b else None
            if ca is None and cb is None:
                continue
            path = prefix + name
            if ca is None:
                self.added.append(path)
            elif cb is None:
                self.deleted.append(path)
            elif self._differs(ca, cb):
                self.modified.append(path)
            if (ca is not None and ca.is_dir) or (cb is not None and cb.is_dir):
                subdirs.append((path, ca if ca is not None and ca.is_dir else None,
                                cb if cb is not None and cb.is_dir else None))
        todo.extend(subdirs)


def _read_full(f, view: memoryview) -> int:
    """Fill `view` from raw file `f` unless EOF comes first; bytes read."""
    total = 0
    while total < len(view):
        n = f.readinto(view[total:])
        if not n:
            break
        total += n
    return total


def _same_content(pa: str, pb: str, size: int) -> bool:
    """Byte-compare two files of the same `size`, 1 MiB at a time."""
    bufsize = min(size + 1, _CHUNK)  # small files: one read that also sees EOF
    va, vb = memoryview(bytearray(bufsize)), memoryview(bytearray(bufsize))
    try:
        with open(pa, "rb", buffering=0) as fa, open(pb, "rb", buffering=0) as fb:
            while True:
                na = _read_full(fa, va)
                nb = _read_full(fb, vb)
                if na != nb or va[:na] != vb[:nb]:
                    return False
                if na < bufsize:
                    return True
    except OSError as e:
        raise Internal(f"diff: cannot compare {pa!r} with {pb!r}: {e}") from e


def diff_layers(upper_a: str, upper_b: str, lowers: list[str], *,
                max_paths: int = DEFAULT_MAX_PATHS) -> DiffResult:
    """Paths added, modified and deleted from view A = overlay(upper_a, *lowers) to view
    B = overlay(upper_b, *lowers), exactly as two overlay mounts would show them.

    Modified = present in both, differing in file type, permission bits (07777), symlink
    target, device number, or regular-file content; directories whose only difference is
    metadata like mtime are not modified. Ownership and xattrs are not compared.
    """
    return diff_stacks([upper_a, *lowers], [upper_b, *lowers], max_paths=max_paths)


def diff_stacks(stack_a: list[str], stack_b: list[str], *,
                max_paths: int = DEFAULT_MAX_PATHS) -> DiffResult:
    """diff_layers for two views given as their whole layer stacks, top first, which may
    differ below their uppers too (a fork's children stack their source checkpoint's
    layer under their own). The layers at the bottom of both are shared."""
    return _Differ(list(stack_a), list(stack_b), max_paths).run()


def walk_upper(upper: str) -> Iterator[str]:
    """Every entry of an upper layer, as '/'-prefixed paths relative to its root, parents
    before children, names sorted. Whiteouts and opaque directories are included (they are
    the layer's record of deletions); symlinks are not followed, mount points not entered.
    """
    root = _canonical_dir(upper, "upper")
    mounts = _mountpoints_below([root])
    stack = [(_sorted_entries(root), "/")]
    while stack:
        entries, rel = stack[-1]
        e = next(entries, None)
        if e is None:
            stack.pop()
            continue
        path = (rel if rel.endswith("/") else rel + "/") + e.name
        yield path
        if e.is_dir(follow_symlinks=False) and e.path not in mounts:
            stack.append((_sorted_entries(e.path), path))


def _sorted_entries(real: str) -> Iterator[os.DirEntry]:
    try:
        with os.scandir(real) as it:
            return iter(sorted(it, key=lambda e: e.name))
    except (FileNotFoundError, NotADirectoryError):
        return iter(())
    except OSError as e:
        raise Internal(f"walk_upper: cannot list {real!r}: {e}") from e
