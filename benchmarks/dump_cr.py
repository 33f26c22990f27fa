"""Process images on disk (native/criu_incr.c): incremental dump size and speed, restore
from disk latency.  No daemon: it drives deltabox.cr.native directly on real processes.

  python -m benchmarks.dump_cr [--quick] [--out DIR]

1. Dump bytes per checkpoint vs pages dirtied since the parent checkpoint: one python
   process holding S MiB of patterned memory dirties D MiB (one byte per page) between
   checkpoints; each checkpoint is dumped incrementally against the previous image *and*
   fully (same template, same run).  Target: incremental bytes <= 1.2x bytes dirtied.
2. Dump throughput: full-dump MB/s (written to the page cache of --img-dir's file system)
   and the scan rate of an incremental dump with nothing dirtied (read + hash only).
3. Restore-from-disk latency vs RSS (10, 200, 1024 MiB; quick: 10, 200): restore_template
   into a host process, with the image files in the page cache (warm) and evicted with
   posix_fadvise(DONTNEED) (cold), beside a fresh start of the same process (interpreter
   start + building the same memory) and beside a spawn from the in-memory template.
   Target: warm restore of a 200 MB process <= 150 ms.
4. Through the daemon (a private deltaboxd, `--templates 1`, a bash session + a 200 MB
   python process in the sandbox), client-side SDK latency of: a rollback whose templates
   were evicted (restored from disk) beside a rollback to the same checkpoint from its
   templates; and a rollback issued right after a full checkpoint, while that checkpoint's
   process dump is being written, beside the same rollback with no dump in flight (dumps
   copy pages off the ptrace thread and outside the sandbox's lock).
Writes <out>/dump_cr.json and <out>/dump_cr.png.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (DEFAULT_OUT, PrivateDaemon, log, machine_info, ratio, stats,
                               wait_for_file, write_json)

PROGRAM = r"""
import hashlib, json, os, sys
MB = int(sys.argv[1])
buf = bytearray(MB << 20)
for i in range(MB):
    buf[i << 20:(i + 1) << 20] = hashlib.sha256(i.to_bytes(4, "little")).digest() * 32768
state = {"counter": 0}
def send(o):
    os.write(1, (json.dumps(o) + "\n").encode())
send({"ready": True})
while True:
    line = sys.stdin.buffer.readline()
    if not line or line == b"quit\n":
        break
    state["counter"] += 1
    cmd = line.split()
    if cmd[0] == b"hash":
        send({"hash": hashlib.sha256(buf).hexdigest(), **state})
    elif cmd[0] == b"mutate":
        a, b, v = int(cmd[1]), int(cmd[2]), int(cmd[3])
        for off in range(a << 20, b << 20, 4096):
            buf[off] = (buf[off] + v) & 255
        send({"ok": True})
    elif cmd[0] == b"ping":
        send({"ok": True})
"""

HOST = ("import os, time\n"
        "while True:\n"
        "    try:\n"
        "        os.wait()\n"
        "    except ChildProcessError:\n"
        "        time.sleep(0.05)\n")


class Proc:
    def __init__(self, pid: int, w: int, r: int, popen: subprocess.Popen | None = None):
        self.pid, self.w, self.r, self.popen, self.buf = pid, w, r, popen, b""

    def line(self, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.r], [], [], left)[0]:
                raise TimeoutError(f"pid {self.pid}: no answer")
            chunk = os.read(self.r, 65536)
            if not chunk:
                raise EOFError(f"pid {self.pid} closed its stdout")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def ask(self, cmd: str, timeout: float = 120) -> dict:
        os.write(self.w, (cmd + "\n").encode())
        return self.line(timeout)

    def kill(self) -> None:
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass
        if self.popen is not None:
            self.popen.wait()
        for fd in (self.w, self.r):
            try:
                os.close(fd)
            except OSError:
                pass


def start(mb: int) -> tuple[Proc, float]:
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-c", PROGRAM, str(mb)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)
    proc = Proc(p.pid, os.dup(p.stdin.fileno()), os.dup(p.stdout.fileno()), p)
    p.stdin.close()
    p.stdout.close()
    proc.line(300)
    return proc, (time.perf_counter() - t0) * 1000


def blocked_in_read(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    seen = 0
    while time.monotonic() < deadline:
        try:
            nr = Path(f"/proc/{pid}/syscall").read_text().split()[0]
        except (FileNotFoundError, IndexError):
            nr = ""
        seen = seen + 1 if nr == "0" else 0
        if seen >= 2:
            return
        time.sleep(0.01)
    raise TimeoutError(f"pid {pid} never blocked in read")


def spawn(tpl: Any) -> Proc:
    r_in, w_in = os.pipe()
    r_out, w_out = os.pipe()
    try:
        pid = tpl.spawn(fds={0: r_in, 1: w_out})
    except BaseException:
        os.close(w_in)
        os.close(r_out)
        raise
    finally:
        os.close(r_in)
        os.close(w_out)
    return Proc(pid, w_in, r_out)


def evict(img: Path) -> None:
    """Drop the image chain's files from the page cache (they were fsync'ed)."""
    for f in img.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.iterdir())


def run_incremental(native: Any, work: Path, size_mb: int, dirties: list[int],
                    cleanup: list) -> dict[str, Any]:
    proc, _ = start(size_mb)
    cleanup.append(proc.kill)
    rows: list[dict[str, Any]] = []
    prev: Path | None = None
    off = 0
    for i, d in enumerate([0] + dirties):
        if d:
            if off + d > size_mb:
                off = 0
            proc.ask(f"mutate {off} {off + d} {i}")
            off += d
        else:
            proc.ask("ping")
        blocked_in_read(proc.pid)
        tpl = native.make_template(proc.pid)
        try:
            inc_dir = work / f"inc{i}"
            inc = native.dump(tpl, inc_dir, parent=prev, max_chain=64)
            full = native.dump(tpl, work / f"full{i}")
        finally:
            tpl.release()
        row = {"checkpoint": i, "dirtied_mb": d if prev is not None else None,
               "incremental": inc.__dict__, "full": full.__dict__,
               "incremental_bytes_on_disk": dir_bytes(inc_dir)}
        if prev is not None and d:
            row["ratio_to_dirtied"] = inc.bytes_written / (d << 20)
        rows.append(row)
        log(f"checkpoint {i}: dirtied {d} MiB -> incremental {inc.bytes_written / 1e6:.2f} MB "
            f"in {inc.ms:.0f} ms (depth {inc.depth}), full {full.bytes_written / 1e6:.1f} MB "
            f"in {full.ms:.0f} ms")
        shutil.rmtree(work / f"full{i}")
        prev = inc_dir
    proc.kill()
    fulls = [r["full"] for r in rows]
    scans = [r["incremental"] for r in rows[1:] if r["dirtied_mb"] == 0]
    return {
        "size_mb": size_mb, "rows": rows,
        "full_dump_mb_per_s": stats([f["bytes_written"] / 1e6 / (f["ms"] / 1e3) for f in fulls]),
        "full_dump_ms": stats([f["ms"] for f in fulls]),
        "scan_only_mb_per_s": stats([(s["pages_total"] * 4096) / 1e6 / (s["ms"] / 1e3)
                                     for s in scans]) if scans else None,
    }


def hash_rate(native: Any) -> float:
    """GB/s of the page hash alone (ctypes call on a 64 MiB buffer, 4 KiB at a time)."""
    import ctypes
    lib = native._load_images()
    lib.dbxcr_hash128.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                                  ctypes.POINTER(ctypes.c_uint64)]
    n = 64 << 20
    buf = ctypes.create_string_buffer(b"\x5a" * n, n)
    out = (ctypes.c_uint64 * 2)()
    t0 = time.perf_counter()
    lib.dbxcr_hash128(buf, n, out)      # one call: the loop is the same per byte
    return n / 1e9 / (time.perf_counter() - t0)


def run_restore(native: Any, work: Path, sizes: list[int], reps: int,
                cleanup: list) -> list[dict[str, Any]]:
    out = []
    host = subprocess.Popen([sys.executable, "-c", HOST])
    cleanup.append(lambda: (host.kill(), host.wait()))
    time.sleep(0.2)
    for mb in sizes:
        fresh = []
        proc = None
        for _ in range(reps):
            p, ms = start(mb)
            fresh.append(ms)
            if proc is None:
                proc = p
            else:
                p.kill()
        cleanup.append(proc.kill)
        want = proc.ask("hash", 300)["hash"]
        blocked_in_read(proc.pid)
        tpl = native.make_template(proc.pid)
        img = work / f"r{mb}"
        st = native.dump(tpl, img, fsync=True)
        mem_spawn = []
        for _ in range(reps):
            t0 = time.perf_counter()
            c = spawn(tpl)
            mem_spawn.append((time.perf_counter() - t0) * 1000)
            c.kill()
        tpl.release()
        proc.kill()
        warm, cold, spawn_ms, first_answer = [], [], [], []
        for rep in range(reps * 2):
            is_cold = rep % 2 == 1
            if is_cold:
                evict(img)
            else:
                for f in img.iterdir():     # warm: read once into the page cache
                    f.read_bytes()
            t0 = time.perf_counter()
            r = native.restore_template(host.pid, img, "/")
            ms = (time.perf_counter() - t0) * 1000
            (cold if is_cold else warm).append(ms)
            try:
                t0 = time.perf_counter()
                c = spawn(r)
                spawn_ms.append((time.perf_counter() - t0) * 1000)
                t0 = time.perf_counter()
                got = c.ask("hash", 300)
                first_answer.append((time.perf_counter() - t0) * 1000)
                if got["hash"] != want:
                    raise AssertionError(f"{mb} MiB: restored memory differs")
                c.kill()
            finally:
                r.release()
        row = {"rss_mb": mb, "image_bytes": st.bytes_written, "dump_ms": st.ms,
               "restore_warm_ms": stats(warm), "restore_cold_ms": stats(cold),
               "spawn_after_restore_ms": stats(spawn_ms),
               "fresh_start_ms": stats(fresh), "spawn_from_memory_template_ms": stats(mem_spawn),
               "hash_answer_ms": stats(first_answer)}
        row["ratio_warm_restore_to_fresh_start"] = (row["restore_warm_ms"]["p50"] /
                                                    row["fresh_start_ms"]["p50"])
        row["ratio_cold_restore_to_fresh_start"] = (row["restore_cold_ms"]["p50"] /
                                                    row["fresh_start_ms"]["p50"])
        out.append(row)
        log(f"{mb} MiB: restore warm p50 {row['restore_warm_ms']['p50']:.1f} ms, cold p50 "
            f"{row['restore_cold_ms']['p50']:.1f} ms; fresh start p50 "
            f"{row['fresh_start_ms']['p50']:.0f} ms; spawn from memory template p50 "
            f"{row['spawn_from_memory_template_ms']['p50']:.1f} ms")
        shutil.rmtree(img)
    return out


SANDBOX_PROGRAM = """
import hashlib, time
buf = bytearray({mb} << 20)
for i in range({mb}):
    buf[i << 20:(i + 1) << 20] = hashlib.sha256(i.to_bytes(4, "little")).digest() * 32768
open("/workspace/ready", "w").close()
while True:
    time.sleep(0.05)
"""


def _dump_done(sbx: Any, cp_id: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cp = next(c for c in sbx.checkpoints() if c.id == cp_id)
        line = next((r for r in cp.reasons if r.startswith("process dump:")), "")
        if "complete" in line:
            return
        if "failed" in line:
            raise RuntimeError(f"{cp_id}: {line}")
        time.sleep(0.02)
    raise TimeoutError(f"the dump of {cp_id} did not complete")


def _timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    r = fn()
    return (time.perf_counter() - t0) * 1000, r


def _start_program(sbx: Any, mb: int) -> None:
    """A bash session and a python process holding `mb` MiB of patterned memory."""
    sbx.session("s").run("X=1; cd /tmp")
    sbx.files.write("prog.py", SANDBOX_PROGRAM.format(mb=mb))
    sbx.exec("nohup python3 /workspace/prog.py >/dev/null 2>&1 &")
    wait_for_file(sbx, "ready", 120, "the sandbox program did not start")


def run_daemon(mb: int, reps: int, tmp_parent: Path) -> dict[str, Any]:
    """Section 4: restore from disk and rollbacks during dumps, through a real daemon."""
    from deltabox import Sandbox
    disk, tpl, during, idle = [], [], [], []
    with PrivateDaemon(parent=tmp_parent, extra_args=["--no-inspector", "--templates", "1"]
                       ) as d:
        sbx = Sandbox.create(socket=d.socket)
        try:
            _start_program(sbx, mb)
            cps = []
            for _ in range(2):  # the second evicts the first's templates (dump complete)
                cps.append(sbx.checkpoint(mode="full"))
                _dump_done(sbx, cps[-1].id)
            # Alternating pairs: the first rollback to a checkpoint rebuilds its templates
            # from disk (the other one's were evicted: one template set kept), the second
            # uses them. Each is classified by the path the response names.
            for i in range(reps):
                cp = cps[i % 2]
                for _ in range(2):
                    ms, r = _timed(lambda: sbx.rollback(cp))
                    if r.process_state != "restored":
                        raise RuntimeError(f"processes not restored: {r.note}")
                    (disk if "from disk" in r.note else tpl).append(ms)
            if not disk or not tpl:
                raise RuntimeError(f"no samples: {len(disk)} from disk, {len(tpl)} templates")
        finally:
            sbx.kill()
    # Rollbacks during dumps: default template count, so `base` keeps its templates.
    with PrivateDaemon(parent=tmp_parent, extra_args=["--no-inspector"]) as d:
        sbx = Sandbox.create(socket=d.socket)
        try:
            _start_program(sbx, mb)
            base = sbx.checkpoint(mode="full")
            _dump_done(sbx, base.id)
            for _ in range(reps):
                new = sbx.checkpoint(mode="full")
                ms, r = _timed(lambda: sbx.rollback(base))  # the dump of `new` is running
                during.append(ms)
                _dump_done(sbx, new.id)
                sbx.rollback(base)
                new = sbx.checkpoint(mode="full")
                _dump_done(sbx, new.id)
                ms, r = _timed(lambda: sbx.rollback(base))
                idle.append(ms)
        finally:
            sbx.kill()
    out = {"rss_mb": mb, "rollback_from_disk_ms": stats(disk),
           "rollback_from_templates_ms": stats(tpl),
           "rollback_during_dump_ms": stats(during), "rollback_no_dump_ms": stats(idle)}
    out["ratio_disk_to_templates"] = ratio(out["rollback_from_disk_ms"]["p50"],
                                           out["rollback_from_templates_ms"]["p50"])
    out["ratio_during_dump_to_no_dump"] = ratio(out["rollback_during_dump_ms"]["p50"],
                                                out["rollback_no_dump_ms"]["p50"])
    log(f"daemon, {mb} MiB: rollback from disk p50 {out['rollback_from_disk_ms']['p50']:.1f} ms"
        f" vs from templates {out['rollback_from_templates_ms']['p50']:.1f} ms; during a dump "
        f"{out['rollback_during_dump_ms']['p50']:.1f} ms vs no dump "
        f"{out['rollback_no_dump_ms']['p50']:.1f} ms")
    return out


def plot(doc: dict[str, Any], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(17, 4.5))
    rows = [r for r in doc["incremental"]["rows"] if r["dirtied_mb"] is not None]
    xs = [r["dirtied_mb"] for r in rows]
    a1.plot(xs, [r["incremental"]["bytes_written"] / 2**20 for r in rows], "o-",
            label="incremental dump")
    a1.plot(xs, [r["full"]["bytes_written"] / 2**20 for r in rows], "s-", label="full dump")
    hi = max(xs) if xs else 1
    a1.plot([0, hi], [0, hi], "k:", label="bytes dirtied")
    a1.plot([0, hi], [0, 1.2 * hi], "r--", label="target 1.2x dirtied")
    a1.set_xlabel("MiB dirtied since parent checkpoint")
    a1.set_ylabel("MiB written per checkpoint")
    a1.set_yscale("symlog")
    a1.set_title(f"dump size, {doc['incremental']['size_mb']} MiB python process")
    a1.legend(fontsize=8)
    rr = doc["restore"]
    sz = [r["rss_mb"] for r in rr]
    for key, lab, m in (("restore_warm_ms", "restore from disk (warm cache)", "o-"),
                        ("restore_cold_ms", "restore from disk (cold cache)", "v-"),
                        ("fresh_start_ms", "fresh process start", "s--"),
                        ("spawn_from_memory_template_ms", "spawn from in-memory template", "d:")):
        a2.plot(sz, [r[key]["p50"] for r in rr], m, label=lab)
    a2.axhline(150, color="r", ls="--", lw=0.8, label="target 150 ms @ 200 MB")
    a2.set_xscale("log")
    a2.set_yscale("log")
    a2.set_xlabel("process RSS (MiB)")
    a2.set_ylabel("latency p50 (ms)")
    a2.set_title("restore from disk")
    a2.legend(fontsize=8)
    dm = doc.get("daemon")
    if dm:
        keys = [("rollback_from_templates_ms", "from templates"),
                ("rollback_from_disk_ms", "from disk\n(evicted)"),
                ("rollback_no_dump_ms", "no dump\nin flight"),
                ("rollback_during_dump_ms", "during a\ndump")]
        a3.bar([lab for _, lab in keys], [dm[k]["p50"] for k, _ in keys],
               color=["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"])
        a3.axhline(150, color="r", ls="--", lw=0.8, label="target 150 ms (from disk)")
        a3.set_ylabel("rollback latency p50 (ms, SDK)")
        a3.set_title(f"through the daemon, bash + {dm['rss_mb']} MiB python")
        a3.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small run (< 2 minutes)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT / "dump_cr")
    ap.add_argument("--img-dir", type=Path, default=Path("/var/tmp"),
                    help="where images are written (its file system is measured)")
    ap.add_argument("--reps", type=int, default=0)
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("benchmarks.dump_cr: run as root (ptrace)", file=sys.stderr)
        return 1
    from deltabox.cr import native
    reps = args.reps or (3 if args.quick else 7)
    inc_size = 200 if args.quick else 512
    dirties = [1, 10, 0, 50, 0, 100] if args.quick else [1, 5, 10, 0, 25, 50, 0, 100, 200]
    sizes = [10, 200] if args.quick else [10, 200, 1024]
    work = Path(tempfile.mkdtemp(prefix="dbx-dump-bench-", dir=args.img_dir))
    cleanup: list = []
    t0 = time.time()
    try:
        # First: the gRPC client must not live in a process that later forks (run_restore).
        dmn = run_daemon(200, reps * 2, args.img_dir)
        hr = hash_rate(native)
        log(f"page hash: {hr:.2f} GB/s")
        inc = run_incremental(native, work, inc_size, dirties, cleanup)
        rest = run_restore(native, work, sizes, reps, cleanup)
    finally:
        for fn in reversed(cleanup):
            try:
                fn()
            except Exception:
                pass
        shutil.rmtree(work, ignore_errors=True)
    ratios = [r["ratio_to_dirtied"] for r in inc["rows"] if "ratio_to_dirtied" in r
              and r["dirtied_mb"] >= 1]
    r200 = next((r for r in rest if r["rss_mb"] == 200), None)
    targets = {
        "incremental_bytes_le_1.2x_dirtied": {"max_ratio": max(ratios) if ratios else None,
                                               "ok": bool(ratios) and max(ratios) <= 1.2},
        "restore_200mb_le_150ms": {
            "warm_p50_ms": r200["restore_warm_ms"]["p50"] if r200 else None,
            "cold_p50_ms": r200["restore_cold_ms"]["p50"] if r200 else None,
            "ok": bool(r200) and r200["restore_warm_ms"]["p50"] <= 150},
        "daemon_rollback_from_disk_200mb_le_150ms": {
            "p50_ms": dmn["rollback_from_disk_ms"]["p50"],
            "ok": dmn["rollback_from_disk_ms"]["p50"] <= 150},
    }
    doc = {"benchmark": "dump_cr", "quick": args.quick, "seconds": time.time() - t0,
           "img_dir": str(args.img_dir), "hash_gb_per_s": hr, "incremental": inc,
           "restore": rest, "daemon": dmn, "targets": targets}
    args.out.mkdir(parents=True, exist_ok=True)
    jp = write_json(args.out / "dump_cr.json", doc, machine_info())
    png = args.out / "dump_cr.png"
    plot(doc, png)
    print(json.dumps(targets, indent=1))
    print(f"wrote {jp} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
