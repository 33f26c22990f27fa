"""Private mappings of files the sandbox may write in place.

A template is a fork of the process, so its private mapping of a file is the same file: a
page the process never wrote is read from that file's page cache. Files of the image's
layers never change under it (overlayfs copies a file up before the first write), but a
file of the sandbox's writable layer can be written in place after the checkpoint: a
C extension rebuilt with `build_ext --inplace` (distutils opens the .so it replaces with
O_TRUNC), numpy.memmap in copy-on-write mode over a data file the agent then rewrites.
The restored process would see the new bytes in every page it had not written, beside
its own written ones: silently not the checkpoint's (and a fork's children would read the
source sandbox's later writes).

So the checkpoint lists each process's private mappings of files of the writable layer
(capture.private_in_writable_layer), and each restore looks whether such a file changed
since (its ctime, through the template's /proc/PID/map_files, which needs no path): for a
changed one the spawned child maps the restored tree's file again, and the pages the
original had written are copied from the template (native fork_template.c remap,
criu_incr.c copy_private_pages). An unchanged file costs one stat per restore. A carrier
made ahead (engine.DeltaCR.prespawn) maps again the files changed by then; one that a
later write made stale is not used (engine.Prespawned.stale). A template rebuilt from a
dump maps the files of the tree it was rebuilt in, looked at the same way from then on.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from .capture import ProcessRecord, SharedMapping, in_dev_shm
from .shm_files import ShmFile

# A file's ctime is the coarse clock's, which lags the time read at the capture by up to
# a tick: a write just after the checkpoint must not pass for one before it. A file
# written in this window before the checkpoint is mapped again needlessly (same bytes).
SLACK_NS = 50_000_000


def changed(rec: ProcessRecord, template_pid: int, since_ns: int) -> list[SharedMapping]:
    """rec's private mappings whose file changed since `since_ns` (the capture; 0: never
    look), as its template (`template_pid`) maps them. One stat per file; a file whose
    mapping cannot be looked at counts as changed (mapping it again is always right)."""
    if not rec.mapped_private or not since_ns:
        return []
    seen: dict[str, bool] = {}
    out = []
    for m in rec.mapped_private:
        if m.path not in seen:
            seen[m.path] = _changed(template_pid, m, since_ns)
        if seen[m.path]:
            out.append(m)
    return out


def copied_stale(rec: ProcessRecord, template_pid: int, since_ns: int,
                 shm: Sequence[ShmFile] = ()) -> str | None:
    """Why an image copied from rec's template (a process dump, an adoption's image)
    would not hold the checkpoint's bytes, or None: an image keeps every page of a
    /dev/shm file's mapping as the template reads it (criu_incr.c: each generation has its
    own /dev/shm, so nothing to map it from at restore), and a privately mapped one
    written since the checkpoint reads the new bytes in the pages the process never
    wrote. Look after the copy: a write after it does not matter. A file whose ctime is
    still the one `shm` (the checkpoint's copies) read was not written since: the slack
    that makes a write just before the checkpoint count as changed would fail its dump."""
    at_cp = {f.path: f.ctime_ns for f in shm if f.ctime_ns}
    for m in rec.mapped_private:
        if not in_dev_shm(m.path):
            continue
        ctime = _ctime(template_pid, m)
        if ctime is not None and (ctime < since_ns - SLACK_NS or ctime == at_cp.get(m.path)):
            continue
        return (f"pid {rec.nspid} ({rec.cmd}): {m.path}, mapped privately, was written "
                "after the checkpoint, before its image could copy it")
    return None


def _changed(template_pid: int, m: SharedMapping, since_ns: int) -> bool:
    ctime = _ctime(template_pid, m)
    return ctime is None or ctime >= since_ns - SLACK_NS


def _ctime(template_pid: int, m: SharedMapping) -> int | None:
    """The ctime of the file the template maps at m (None: it cannot be looked at)."""
    try:
        return os.stat(f"/proc/{template_pid}/map_files/{m.start:x}-{m.end:x}").st_ctime_ns
    except OSError:
        return None
