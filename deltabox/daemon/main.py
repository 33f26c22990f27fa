"""deltaboxd: the privileged daemon that owns every sandbox, layer and checkpoint."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import logging
import os
import shutil
import signal
import sys
from pathlib import Path

import trio

from ..errors import DeltaBoxError, InvalidArgument
from ..fs.store import Store, close_store, open_store
from ..sandbox.cgroups import CgroupDriver, favor_dynmods, favordynmods_state, parent_name
from ..sandbox.reaper import become_subreaper, reap_orphans
from ..sandbox.runtime import raise_fd_limit
from ..sandbox.userns import IdMap
from ..background import GuardedNursery
from ..cr import hostmem
from ..cr.engine import DeltaCR
from ..cr.native import CRError
from ..cr.worker import PtraceWorker
from .db import Database
from .idlegc import IdleCollector
from .memreport import log_report
from .server import Servicer, make_server
from .service import Config, Daemon

DEFAULT_STATE_DIR = "/var/lib/deltabox"
DEFAULT_SOCKET = "/run/deltabox/deltabox.sock"
log = logging.getLogger("deltaboxd")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="deltaboxd", description="DeltaBox daemon: sandboxes with millisecond "
        "checkpoint, rollback and fork. Runs as root; clients talk gRPC on a unix socket.",
        epilog="example: deltaboxd --state-dir /var/lib/deltabox --socket "
        "/run/deltabox/deltabox.sock")
    p.add_argument("--state-dir", default=DEFAULT_STATE_DIR,
                   help=f"metadata, layers and the store image (default {DEFAULT_STATE_DIR})")
    p.add_argument("--socket", default=os.environ.get("DELTABOX_SOCKET", DEFAULT_SOCKET),
                   help=f"unix socket to serve on (default $DELTABOX_SOCKET or {DEFAULT_SOCKET})")
    p.add_argument("--listen", metavar="HOST:PORT",
                   help="also serve on TCP for remote workers (requires --token-file)")
    p.add_argument("--token-file", help="file holding the token TCP clients must send")
    p.add_argument("--store", choices=("auto", "btrfs", "copy"), default="auto",
                   help="layer store backend (default auto: btrfs in place or on a loop image, "
                   "else copy)")
    p.add_argument("--loop-io", choices=["buffered", "direct"], default="buffered",
                   help="I/O mode of the embedded loop store's device. buffered (default): "
                   "through the host's page cache, fastest in short sessions; direct: "
                   "late checkpoints of sessions that keep dozens of them are faster (15-17 "
                   "instead of 18-23 ms after 50 here), at ~1.2x per checkpoint and ~1.6x per "
                   "create in fresh ones")
    p.add_argument("--durable", action="store_true",
                   help="keep cache flushes on the embedded loop store: checkpoints then also "
                   "survive a host crash, at ~5 ms more per checkpoint (without it they survive "
                   "any crash or kill of the daemon, but a power loss right after a checkpoint "
                   "can lose it)")
    p.add_argument("--store-size-gb", type=int, default=64,
                   help="size of the sparse btrfs image when the state dir is not btrfs")
    p.add_argument("--default-memory-mb", type=int, default=4096)
    p.add_argument("--default-pids-max", type=int, default=4096)
    p.add_argument("--default-disk-mb", type=int, default=None, metavar="MB",
                   help="quota on what a sandbox writes into each writable layer, on the "
                   "embedded btrfs store (default: 10240, at most half the store; 0: none)")
    p.add_argument("--warm-generations", type=_count, default=32, metavar="N",
                   help="per sandbox, how many recent checkpoints keep a mounted clone ready, "
                   "so a rollback to them skips the snapshot and the mount (default 32; 0 "
                   "disables; measured ~0.6 MiB kernel memory per checkpoint, all included)")
    p.add_argument("--prewarm-mb", type=_count, default=64, metavar="MB",
                   help="per ready generation (--warm-generations), how many MiB of the files "
                   "the sandbox wrote before the checkpoint to read into the page cache while "
                   "it waits, so the commands after a rollback do not read them from the "
                   "store (a clone's files start uncached; default 64, files over 8 MiB "
                   "and past 4096 files left out; 0 disables)")
    p.add_argument("--quiet-wait-ms", type=_count, default=1000, metavar="MS",
                   help="how long the work a rollback leaves behind (preparing the next "
                   "rollback, tearing down the killed processes, unmounting the old tree) "
                   "waits for the command the agent runs next to end, so as not to slow it "
                   "(default 1000; 0: that work starts after a few milliseconds, during "
                   "the command)")
    p.add_argument("--fork-spares", type=_count, default=32, metavar="N",
                   help="per sandbox that forks with processes, how many sandbox inits to "
                   "boot ahead for its next fork (as many as its last fork had children, at "
                   "most N; default 32; 0 disables). A spare is an idle init: two small "
                   "processes and a network namespace")
    p.add_argument("--templates", type=_count, default=32, metavar="N",
                   help="per sandbox, how many checkpoints keep their process templates "
                   "(least recently used out; default 32). A template costs the pages its "
                   "process dirtied since the checkpoint")
    p.add_argument("--template-memory-mb", type=int, default=None, metavar="MB",
                   help="host-wide memory budget for process templates: over it, the least "
                   "recently used checkpoints' templates are released (their rollbacks then "
                   "restart processes). Default: a quarter of RAM; 0: no limit")
    p.add_argument("--userns-range", type=_id_map, default=IdMap(100000, 65536),
                   metavar="BASE:COUNT",
                   help="host uids and gids for sandboxes created with a user namespace "
                   "(`deltabox create --userns`): their ids 0..COUNT-1 are the host's "
                   "BASE..BASE+COUNT-1 (default 100000:65536, as /etc/subuid ranges go)")
    p.add_argument("--no-fork-lanes", action="store_true",
                   help="fork every child of a fan-out from the one template (by default a "
                   "fork into 4 or more sandboxes also spawns from a copy of each large "
                   "template on a second tracer thread, the two threads pinned to two CPUs "
                   "for the fork's duration)")
    p.add_argument("--cgroup-favordynmods", action="store_true",
                   help="remount the host's cgroup hierarchy with favordynmods at start: "
                   "moving a process into a cgroup (each sandbox create and fork child, each "
                   "exec) then skips a kernel RCU grace period (5-8 ms on the VMs measured). "
                   "Host-wide, and on Linux 6.18 permanent until reboot (README 'Host tuning')")
    p.add_argument("--no-inspector", action="store_true",
                   help="do not load the eBPF turn inspector: every auto checkpoint is then "
                   "full (the conservative fallback, also used when bcc cannot load)")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def _count(text: str) -> int:
    """A count option: a whole number, 0 or more."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: want a whole number, 0 or more")
    return n


def _id_map(text: str) -> IdMap:
    try:
        return IdMap.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


M_ARENA_MAX = -8   # mallopt parameter (glibc malloc.h)


def cap_malloc_arenas() -> None:
    """At most one malloc arena per CPU (glibc's default: 8), unless MALLOC_ARENA_MAX
    says otherwise. Each thread that meets another in malloc gets an arena of its own
    and keeps its freed pages; the dump and I/O threads' arenas made much of the daemon's
    RSS growth: in 16 x 500 soaks peak RSS 320 MB with this cap, 321 / 322 with
    MALLOC_ARENA_MAX=2, 401 / 403 without (from 225), at 35.4, 33.6 / 34.7 and 35.6 / 36.1
    cycles/s (benchmarks/results/malloc-arenas-stop75/). Before any thread of ours: a cap
    applies to arenas made after it."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return
    try:
        ctypes.CDLL(None).mallopt(M_ARENA_MAX, max(2, os.cpu_count() or 2))
    except (OSError, AttributeError):   # not glibc
        pass


def main(argv: list[str] | None = None) -> int:
    cap_malloc_arenas()
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s deltaboxd %(levelname)s %(message)s")
    if os.geteuid() != 0:
        print("deltaboxd: must run as root (it mounts, makes namespaces and cgroups)",
              file=sys.stderr)
        return 1
    if args.listen and not args.token_file:
        print("deltaboxd: --listen needs --token-file (TCP clients must authenticate)",
              file=sys.stderr)
        return 2
    try:
        trio.run(serve, args)
    except DeltaBoxError as e:
        print(f"deltaboxd: {e.message}", file=sys.stderr)
        return 1
    except CRError as e:   # at start: the native library (missing, stale)
        print(f"deltaboxd: {e}", file=sys.stderr)
        return 1
    return 0


async def _reap_forever(daemon: Daemon) -> None:
    """Orphaned sandbox processes become our zombies (we are a subreaper): reap them."""
    while True:
        reap_orphans(skip=daemon.own_children())
        await trio.sleep(0.2)


async def _memory_reports() -> None:
    """A line of what the daemon's memory is made of at each SIGUSR1 (memreport.py)."""
    with trio.open_signal_receiver(signal.SIGUSR1) as signals:
        async for _ in signals:
            log_report()


async def _load_inspector(daemon: Daemon, background: GuardedNursery, idle: IdleCollector,
                          enabled: bool) -> None:
    """Load the turn inspector; its programs and tables live as long as the daemon: out of
    the garbage collector's sight too (idlegc)."""
    await daemon.turns.load(background, enabled)
    idle.freeze_soon()


def _template_budget(mb: int | None) -> int:
    if mb is not None:
        return max(mb, 0)
    total_kb = int(next(line.split()[1] for line in open("/proc/meminfo")
                        if line.startswith("MemTotal:")))
    return total_kb // 1024 // 4


def _read_token(path: str | None) -> str | None:
    """The token TCP clients must send (--token-file), or None without one."""
    if not path:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise InvalidArgument(f"cannot read --token-file {path}: {e.strerror}")
    if not token:
        raise InvalidArgument(f"--token-file {path} is empty: write the token TCP clients "
                              "will send (DELTABOX_TOKEN) into it")
    return token


def _lock_state_dir(state_dir: Path) -> int:
    """One daemon per state dir: a second one would fight over mounts and cgroups."""
    fd = os.open(state_dir / "daemon.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SystemExit(f"deltaboxd: another daemon is using {state_dir}")
    return fd


async def serve(args: argparse.Namespace) -> None:
    become_subreaper()
    raise_fd_limit()
    if args.cgroup_favordynmods:
        log.info("%s", favor_dynmods())
    elif favordynmods_state() == "off":
        log.info("cgroup: moving a process into a cgroup waits for an RCU grace period on "
                 "this host (each sandbox create, fork child and exec); deltaboxd "
                 "--cgroup-favordynmods avoids that (README 'Host tuning')")
    state_dir = Path(args.state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock_fd = _lock_state_dir(state_dir)
    cfg = Config(state_dir=state_dir, socket=args.socket, store_size_gb=args.store_size_gb,
                 store_backend=args.store, default_memory_mb=args.default_memory_mb,
                 default_pids_max=args.default_pids_max,
                 default_disk_mb=(min(10240, args.store_size_gb * 512)
                                  if args.default_disk_mb is None else args.default_disk_mb),
                 warm_per_sandbox=args.warm_generations, prewarm_mb=args.prewarm_mb,
                 quiet_wait_ms=args.quiet_wait_ms,
                 durable=args.durable,
                 fork_spares=args.fork_spares,
                 templates_per_sandbox=args.templates,
                 template_budget_mb=_template_budget(args.template_memory_mb),
                 userns=args.userns_range)
    token = _read_token(args.token_file)   # bad input: refused before anything is mounted
    store = open_store(state_dir, args.store_size_gb, args.store, args.durable,
                       direct_io=args.loop_io == "direct")
    try:
        await _serve_store(args, cfg, state_dir, store, token)
    finally:   # a start that failed before the daemon held the store leaves it mounted
        close_store(store)   # (nothing left to do after the daemon's shutdown)
    os.close(lock_fd)


async def _serve_store(args: argparse.Namespace, cfg: Config, state_dir: Path, store: Store,
                       token: str | None) -> None:
    """The daemon on its mounted store, until SIGTERM or SIGINT."""
    db = Database(state_dir / "deltabox.db")
    sock = Path(args.socket)
    sock.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    sock.unlink(missing_ok=True)
    # Images of the processes restores adopt (cr/adoption.py): kept only while the
    # checkpoints live in this daemon, so whatever a previous run left goes.
    images_dir = state_dir / "run" / "images"
    shutil.rmtree(images_dir, ignore_errors=True)
    lanes = contextlib.nullcontext() if args.no_fork_lanes else PtraceWorker("deltabox-lane")
    async with PtraceWorker() as ptrace, lanes as lane, trio.open_nursery() as nursery:
        background = GuardedNursery(nursery)
        daemon = Daemon(cfg, store, db, CgroupDriver(parent_name(str(state_dir))), background,
                        DeltaCR(ptrace, lane, str(images_dir)))
        nursery.start_soon(_reap_forever, daemon)
        try:
            await daemon.recover()
            idle = IdleCollector()
            daemon.spares.quiet = idle.quiet  # spares boot once the calls have stopped
            server = make_server(Servicer(daemon, trio.lowlevel.current_trio_token(), token,
                                          idle), str(sock), args.listen)
            idle.install()
            server.start()
            os.chmod(sock, 0o660)
            nursery.start_soon(idle.run)
            nursery.start_soon(_load_inspector, daemon, background, idle,
                               not args.no_inspector)
            nursery.start_soon(daemon.enforce_template_budget)
            nursery.start_soon(daemon.sweep_keepers)
            nursery.start_soon(daemon.clean_store)
            nursery.start_soon(_memory_reports)
            log.info("serving on unix:%s%s (store %s at %s)", sock,
                     f" and {args.listen}" if args.listen else "", store.backend, store.root)
            if not hostmem.unadvised_sizes():
                log.info("transparent huge pages: %s", hostmem.describe())
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("%s: shutting down", signal.Signals(signum).name)
                    break
            stopped = server.stop(grace=2)
            await trio.to_thread.run_sync(stopped.wait)
        finally:
            await daemon.shutdown()
            sock.unlink(missing_ok=True)
            nursery.cancel_scope.cancel()


if __name__ == "__main__":
    sys.exit(main())
