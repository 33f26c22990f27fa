"""`make demo`: start deltaboxd on the embedded default store and walk through
create -> exec -> write files -> checkpoint -> change -> rollback -> fork, timing each step.

If a daemon already serves the socket, the demo uses it and leaves it running; otherwise it
starts one and stops it at the end (the store's files stay in the state dir).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import deltabox
from deltabox import Sandbox
from deltabox.daemon.main import DEFAULT_SOCKET, DEFAULT_STATE_DIR

T = TypeVar("T")


def step(what: str, fn: Callable[[], T]) -> T:
    t = time.perf_counter()
    result = fn()
    print(f"  {(time.perf_counter() - t) * 1000:8.1f} ms  {what}")
    return result


def start_daemon(socket: str) -> subprocess.Popen | None:
    try:
        deltabox.info(socket=socket)
        print(f"using the deltaboxd already serving {socket}")
        return None
    except deltabox.DeltaBoxError:
        pass
    log = open("/tmp/deltaboxd-demo.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "deltabox.daemon.main", "--state-dir",
                             DEFAULT_STATE_DIR, "--socket", socket], stdout=log, stderr=log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit("deltaboxd failed to start; see /tmp/deltaboxd-demo.log")
        try:
            deltabox.info(socket=socket)
            return proc
        except deltabox.DeltaBoxError:
            time.sleep(0.05)
    proc.kill()
    sys.exit("deltaboxd did not become ready in 60 s; see /tmp/deltaboxd-demo.log")


def demo(socket: str) -> None:
    info = deltabox.info(socket=socket)
    print(f"deltaboxd {info.version}: store {info.store_backend} at {info.store_path}, "
          f"cgroups {info.cgroup_version}\n")
    sbx = step("create a sandbox (host root, read-only, secrets hidden)",
               lambda: Sandbox.create(socket=socket))
    kids: list[Sandbox] = []
    try:
        r = step("exec: uname -r; id -u; hostname", lambda: sbx.exec("uname -r; id -u; hostname"))
        print("           ", r.stdout.strip().replace("\n", " | "))
        sh = sbx.session("main")
        step("session: cd /workspace/app && export STAGE=one",
             lambda: sh.run("mkdir -p app && cd app && export STAGE=one"))
        step("write 3 files", lambda: [sbx.files.write(f"app/file{i}.txt", f"version 1 of {i}\n")
                                       for i in range(3)])
        cp = step("checkpoint", lambda: sbx.checkpoint(label="good"))
        print(f"            {cp.id} ({cp.kind}); daemon-side {cp.duration_ms:.1f} ms")
        cp = sbx.get_checkpoint(cp)  # the counts come with the snapshot, after the answer
        print(f"            {', '.join(cp.reasons)}: {cp.files_changed} files, "
              f"{cp.bytes_changed} bytes changed")
        step("change: rm -rf app, write junk", lambda: sbx.exec(
            "rm -rf /workspace/app && echo junk > /workspace/junk"))
        print("            ls /workspace:", sbx.exec("ls /workspace").stdout.split())
        sh.run("cd / && export STAGE=two")
        res = step("rollback to the checkpoint", lambda: sbx.rollback(cp))
        print(f"            ls /workspace: {sbx.exec('ls /workspace').stdout.split()}; "
              f"processes {res.process_state} ({res.note})")
        r = sh.run("pwd; echo $STAGE")
        print(f"            the session continues: pwd={r.stdout.split()[0]} "
              f"STAGE={r.stdout.split()[1]}")
        print("            app/file1.txt:", sbx.files.read("app/file1.txt").decode().strip())
        kids = step("fork 4 sandboxes from the checkpoint", lambda: sbx.fork(cp, count=4))
        for i, k in enumerate(kids):
            k.files.write("app/who", f"child {i}\n")
        print("            each child sees its own file:",
              [k.files.read("app/who").decode().strip() for k in kids])
        cp2 = step("checkpoint child 0", lambda: kids[0].checkpoint())
        d = step("diff the two checkpoints", lambda: sbx.diff(cp, cp2))
        print(f"            added {d.added}, modified {d.modified}, deleted {d.deleted}")
    finally:
        for k in kids:
            k.kill()
        step("remove the sandbox (frees its layers and checkpoints)", sbx.kill)


def main() -> None:
    if os.geteuid() != 0:
        sys.exit("the demo starts deltaboxd, which needs root: run it as root")
    socket = os.environ.get("DELTABOX_SOCKET", DEFAULT_SOCKET)
    proc = start_daemon(socket)
    try:
        demo(socket)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
            print("\nstopped the demo's deltaboxd (state kept in /var/lib/deltabox)")


if __name__ == "__main__":
    main()
