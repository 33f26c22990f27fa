"""The `deltabox` command: a thin shell over the SDK, one subcommand per API verb.

Every command takes `--json` for machine-readable output and `--socket` (or $DELTABOX_SOCKET)
for the daemon's address. Errors print `deltabox: error: <message>` and exit 1; usage errors
exit 2; `exec` exits with the command's own status.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

from deltabox import convert, errors
from deltabox.api import deltabox_pb2 as pb
from deltabox.client import Client, connect
from deltabox.models import (Checkpoint, DiffResult, ExecResult, RollbackResult, TurnReport,
                             WriteResult)
from deltabox.sdk import Sandbox

PROG = "deltabox"

# Options that take a value; the pre-parsing in `parse_args` must skip their values.
_GLOBAL_VALUE_OPTIONS = frozenset({"--socket"})
_EXEC_VALUE_OPTIONS = frozenset({"--socket", "--session", "--timeout", "--cwd", "--env",
                                 "--checkpoint", "--checkpoint-label", "--rollback-to"})


class UsageError(Exception):
    """A combination of arguments argparse cannot express; reported like argparse (exit 2)."""


# --- argument parsing ---------------------------------------------------------------------

def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _common() -> argparse.ArgumentParser:
    """Options every subcommand accepts; SUPPRESS keeps them from clobbering global ones."""
    common = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print machine-readable JSON on stdout")
    common.add_argument("--socket", metavar="PATH", default=argparse.SUPPRESS,
                        help="deltaboxd address: unix socket path or HOST:PORT")
    return common


def _add(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, summary: str,
         description: str, example: str, common: argparse.ArgumentParser
         ) -> argparse.ArgumentParser:
    return sub.add_parser(
        name, help=summary, description=description, parents=[common], allow_abbrev=False,
        epilog="example:\n" + "\n".join("  " + line for line in example.splitlines()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="DeltaBox: Linux sandboxes with millisecond checkpoint, rollback and fork.",
        epilog="example:\n  id=$(deltabox create)\n  cp=$(deltabox checkpoint $id)\n"
               "  deltabox exec $id -- rm -rf /workspace/src\n  deltabox rollback $id $cp",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", default=False,
                        help="print machine-readable JSON on stdout")
    parser.add_argument("--socket", metavar="PATH", default=None,
                        help="deltaboxd address: unix socket path or HOST:PORT "
                             "(default: $DELTABOX_SOCKET or /run/deltabox/deltabox.sock)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = _common()

    p = _add(sub, "daemon", "run deltaboxd in the foreground",
             "Run the DeltaBox daemon (deltaboxd) in the foreground. Needs root. Options not "
             "listed here are passed through to the daemon.",
             "sudo deltabox daemon --state-dir /var/lib/deltabox", common)
    p.add_argument("--state-dir", metavar="DIR", help="where sandboxes and checkpoints live")

    p = _add(sub, "create", "create a sandbox and print its id",
             "Create a sandbox and print its id. Without --image the sandbox sees the host's "
             "root read-only (secrets hidden) with a writable /workspace.",
             "deltabox create --image ./rootfs.tar --memory 1024 --env LANG=C.UTF-8", common)
    p.add_argument("--image", metavar="DIR|TAR", help="root filesystem: a directory or tarball")
    p.add_argument("--memory", metavar="MB", type=int, help="memory limit in MiB")
    p.add_argument("--pids", metavar="N", type=int, help="maximum number of processes")
    p.add_argument("--cpus", metavar="X", type=float, help="CPU limit, e.g. 1.5")
    p.add_argument("--disk", metavar="MB", type=int,
                   help="quota on what the sandbox writes (default: the daemon's)")
    p.add_argument("--hostname", help="hostname inside the sandbox (default: its id)")
    p.add_argument("--userns", action="store_true",
                   help="give the sandbox a user namespace: its root is an unprivileged "
                        "host id (deltaboxd --userns-range), not host root")
    p.add_argument("--huge-pages", action="store_true",
                   help="its programs' malloc memory in 2 MiB pages (glibc.malloc.hugetlb=1): "
                        "checkpoints, rollbacks and forks of large processes get cheaper; "
                        "needs host THP madvise or always")
    p.add_argument("--env", metavar="K=V", type=_env_pair, action="append", default=[],
                   help="environment variable for every command (repeatable)")

    p = _add(sub, "exec", "run a command in a sandbox",
             "Run a command in a sandbox, streaming its output, and exit with its exit code. "
             "Options go before the command; everything from the command on is passed "
             "verbatim (`--` may mark where it starts). A single argument containing "
             "spaces runs via `bash -c`. With --session, the words are joined into bash source "
             "and run in a persistent session (cwd, env and jobs survive between runs).",
             "deltabox exec $id -- ls -la /workspace\n"
             "deltabox exec $id 'make test 2>&1 | tail'\n"
             "deltabox exec $id --session main -- cd /tmp '&&' export X=1\n"
             "deltabox exec $id --checkpoint auto -- make   # prints the checkpoint id on stderr\n"
             "deltabox exec $id --rollback-to $cp --checkpoint auto -- make   # a search step",
             common)
    p.add_argument("id", metavar="ID", help="sandbox id")
    p.add_argument("--session", metavar="NAME", help="run in this persistent bash session")
    p.add_argument("-t", "--tty", action="store_true",
                   help="with --session: the session runs its commands on a pseudo-terminal "
                        "(chosen when it starts; output as a terminal shows it)")
    p.add_argument("--timeout", metavar="S", type=float, help="kill the command after S seconds")
    p.add_argument("--cwd", metavar="DIR", help="working directory (default /workspace)")
    p.add_argument("--env", metavar="K=V", type=_env_pair, action="append", default=[],
                   help="extra environment variable (repeatable)")
    p.add_argument("-i", "--stdin", action="store_true", help="send our stdin to the command")
    _step_options(p, "when the command ends", "the command does not run")
    p.add_argument("cmd", metavar="CMD", nargs="*",
                   help="command and its arguments (everything after ID's options)")

    p = _add(sub, "checkpoint", "checkpoint a sandbox and print the checkpoint id",
             "Capture a sandbox's state as a checkpoint you can roll back to or fork from. "
             "auto picks what is needed; fs captures files only; full also captures processes.",
             "cp=$(deltabox checkpoint $id --label before-install)", common)
    p.add_argument("id", metavar="ID", help="sandbox id")
    p.add_argument("--mode", choices=("auto", "fs", "full"), default="auto")
    p.add_argument("--label", default="", help="free-form note stored with the checkpoint")
    p.add_argument("--background", action="store_true",
                   help="print the id at once and take the checkpoint right after, before "
                   "any later operation on the sandbox (those naming it wait for it)")

    p = _add(sub, "rollback", "return a sandbox to a checkpoint",
             "Return a sandbox to one of its family's checkpoints. Changes made since are "
             "discarded.", "deltabox rollback $id $cp", common)
    p.add_argument("id", metavar="ID", help="sandbox id")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint id")

    p = _add(sub, "fork", "start new sandboxes from a checkpoint",
             "Start COUNT new sandboxes from a checkpoint and print their ids, one per line.",
             "for kid in $(deltabox fork $cp --count 4); do deltabox exec $kid -- ./try.sh; done",
             common)
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint id")
    p.add_argument("--count", metavar="N", type=int, default=1, help="how many (default 1)")
    p.add_argument("--shared-layer", action="store_true",
                   help="children use the checkpoint's files as a container uses its image: "
                        "read-only and shared under a layer of their own (reads share one "
                        "page cache; renaming a directory from the checkpoint fails with "
                        "EXDEV, and its hard links break when one is written)")

    _add(sub, "ls", "list sandboxes", "List the daemon's sandboxes as a table.",
         "deltabox ls --json", common)

    p = _add(sub, "checkpoints", "show a sandbox family's checkpoint tree",
             "Show the checkpoints of a sandbox's family as a tree; `*` marks the sandbox's "
             "head (the checkpoint it last took or rolled back to).",
             "deltabox checkpoints $id", common)
    p.add_argument("id", metavar="ID", help="sandbox id")

    p = _add(sub, "effects", "show what a sandbox's processes did in a turn",
             "Show what the sandbox's processes did since its last checkpoint or rollback (files "
             "written, created, deleted; processes forked, exited, run; sockets), as the eBPF "
             "inspector saw it, or with --checkpoint the turn that checkpoint closed and the "
             "policy's decision (skipped / fs / full and why).",
             "deltabox effects $id --json", common)
    p.add_argument("id", metavar="ID", help="sandbox id")
    p.add_argument("--checkpoint", default="", metavar="CP",
                   help="the turn this checkpoint closed (default: the current turn so far)")

    p = _add(sub, "diff", "show files that changed between two checkpoints",
             "List paths added (A), modified (M) and deleted (D) going from checkpoint A to B.",
             "deltabox diff $cp1 $cp2", common)
    p.add_argument("a", metavar="A", help="from checkpoint id")
    p.add_argument("b", metavar="B", help="to checkpoint id")

    p = _add(sub, "rm", "remove sandboxes",
             "Remove sandboxes, killing their processes and freeing checkpoints only they use. "
             "--all removes every sandbox of the daemon (those of other users of it too).",
             "deltabox rm $id1 $id2\ndeltabox rm --all", common)
    p.add_argument("ids", metavar="ID", nargs="*", help="sandbox id")
    p.add_argument("--all", action="store_true",
                   help="every sandbox the daemon has (`deltabox ls` lists them)")

    p = _add(sub, "rmcp", "delete checkpoints", "Delete checkpoints.",
             "deltabox rmcp $cp1 $cp2", common)
    p.add_argument("ids", metavar="CHECKPOINT", nargs="+", help="checkpoint id")

    _add(sub, "info", "show daemon information",
         "Show what the daemon runs on: store backend, cgroup version, counts, free space.",
         "deltabox info", common)

    p = _add(sub, "cp", "copy a file into or out of a sandbox",
             "Copy one file between this machine and a sandbox. Exactly one of SRC and DST is "
             "ID:PATH; `-` means stdin/stdout. A DST ending in / (or an existing local "
             "directory) receives the file under its own name.",
             "deltabox cp ./main.py $id:/workspace/\ndeltabox cp $id:/workspace/out.log -\n"
             "deltabox cp ./fix.py $id:/workspace/app.py --rollback-to $cp --checkpoint auto"
             "   # an edit as a search step\n"
             "deltabox cp $id:/workspace/app.py - --rollback-to $cp   # read it at node $cp",
             common)
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    _step_options(p, "once the file is written (upload only)",
                  "nothing is written or read")
    return parser


def _step_options(p: argparse.ArgumentParser, when: str, if_fails: str) -> None:
    """--checkpoint, --checkpoint-label and --rollback-to: a tree search's step in one call
    (exec, and cp's uploads)."""
    p.add_argument("--checkpoint", metavar="MODE", choices=("auto", "fs", "full"),
                   help=f"checkpoint the sandbox {when} (auto, fs or full), in the "
                   "background; its id is printed on stderr (in the JSON with --json)")
    p.add_argument("--checkpoint-label", metavar="TEXT", default="",
                   help="label of that checkpoint")
    p.add_argument("--rollback-to", metavar="CP",
                   help="roll the sandbox back to checkpoint CP first, in the same call (as "
                   f"`deltabox rollback`; if it fails, {if_fails})")


def _command_of(argv: Sequence[str]) -> int | None:
    """Index of the subcommand word, skipping global options (argparse cannot tell us)."""
    skip_value = False
    for i, word in enumerate(argv):
        if skip_value:
            skip_value = False
        elif word in _GLOBAL_VALUE_OPTIONS:
            skip_value = True
        elif word == "--":
            return None
        elif not word.startswith("-"):
            return i
    return None


def _split_exec(argv: list[str], start: int) -> tuple[list[str], list[str]]:
    """Split `exec [OPTIONS] ID [OPTIONS] [--] CMD...` before CMD, like `docker exec`: the first
    word after ID (or anything after `--`) starts the command, which is kept verbatim."""
    seen_id = False
    i = start
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return argv[:i], argv[i + 1:]
        if word.startswith("-") and word != "-":
            i += 2 if word in _EXEC_VALUE_OPTIONS else 1
            continue
        if seen_id:
            return argv[:i], argv[i:]
        seen_id = True
        i += 1
    return argv, []


def parse_args(argv: Sequence[str], parser: argparse.ArgumentParser | None = None
               ) -> argparse.Namespace:
    """Parse like argparse, plus: `exec ID ... CMD` keeps CMD verbatim (options included),
    and `daemon` passes unknown options through in `args.daemon_args`."""
    parser = parser or build_parser()
    argv = list(argv)
    at = _command_of(argv)
    command = argv[at] if at is not None else None
    if command == "exec" and at is not None:
        head, cmd = _split_exec(argv, at + 1)
        args = parser.parse_args(head)
        args.cmd = cmd
        return args
    if command == "daemon":
        args, extra = parser.parse_known_args(argv)
        args.daemon_args = extra
        return args
    args = parser.parse_args(argv)
    if command == "rm" and bool(args.ids) == args.all:
        parser.error("rm: give sandbox ids or --all (not both), e.g. `deltabox rm $id`")
    return args


# --- rendering (pure, so they are testable without a daemon) -------------------------------

def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in [list(headers), *rows]]


def _checkpoint_line(cp: Checkpoint, head_id: str | None, sandbox_id: str | None) -> str:
    parts = [cp.id + (" *" if cp.id == head_id else ""), cp.kind, _when(cp.created_at),
             f"{cp.files_changed} files, {human_bytes(cp.bytes_changed)}"]
    if cp.label:
        parts.append(repr(cp.label))
    if sandbox_id and cp.sandbox_id and cp.sandbox_id != sandbox_id:
        parts.append(f"[{cp.sandbox_id}]")
    return "  ".join(parts)


def render_tree(checkpoints: Sequence[Checkpoint], head_id: str | None = None,
                sandbox_id: str | None = None) -> list[str]:
    """A family's checkpoints as a box-drawing tree, `*` after the head's id.

    Checkpoints whose parent is missing (deleted) are shown as roots.
    """
    ids = {cp.id for cp in checkpoints}
    children: dict[str | None, list[Checkpoint]] = {}
    for cp in checkpoints:
        parent = cp.parent_id if cp.parent_id in ids else None
        children.setdefault(parent, []).append(cp)
    lines: list[str] = []
    seen: set[str] = set()

    def walk(cp: Checkpoint, prefix: str, branch: str, last: bool) -> None:
        if cp.id in seen:
            return
        seen.add(cp.id)
        lines.append(prefix + branch + _checkpoint_line(cp, head_id, sandbox_id))
        kids = children.get(cp.id, [])
        child_prefix = prefix + ("" if not branch else ("   " if last else "│  "))
        for i, kid in enumerate(kids):
            is_last = i == len(kids) - 1
            walk(kid, child_prefix, "└─ " if is_last else "├─ ", is_last)

    for root in children.get(None, []):
        walk(root, "", "", True)
    return lines


def render_diff(diff: DiffResult) -> list[str]:
    entries = ([("A", p) for p in diff.added] + [("M", p) for p in diff.modified]
               + [("D", p) for p in diff.deleted])
    return [f"{mark} {path}" for mark, path in sorted(entries, key=lambda e: (e[1], e[0]))]


def render_effects(rep: TurnReport) -> list[str]:
    """A turn's effects, one line per kind of effect that happened."""
    lines = [f"inspector: {rep.backend}"]
    if rep.kind:
        lines.append(f"decision: {rep.kind}" + (f" ({'; '.join(rep.reasons)})"
                                               if rep.reasons else ""))
    e = rep.effects
    if e is None:
        lines.append("not watched: the inspector did not see this turn")
        return lines
    if not e.complete or e.lost_events:
        lines.append("INCOMPLETE: " + "; ".join(
            e.incomplete_reasons or [f"{e.lost_events} events lost"]))

    def some(label: str, items: Sequence[object]) -> None:
        if items:
            shown = ", ".join(str(i) for i in items[:8])
            more = f" (+{len(items) - 8} more)" if len(items) > 8 else ""
            lines.append(f"{label}: {shown}{more}")

    for label, paths in (("written", e.files_written), ("created", e.files_created),
                         ("deleted", e.files_deleted), ("renamed", e.files_renamed),
                         ("chmod", e.files_chmodded), ("truncated", e.files_truncated),
                         ("attributes", e.files_attrs_changed),
                         ("transient", e.files_transient)):
        some(f"files {label}", paths)
    some("processes forked", [f"{p.pid} ({p.comm})" for p in e.processes_forked])
    some("processes execed", [p.filename for p in e.processes_execed])
    some("processes exited", [f"{p.pid} ({p.comm})" for p in e.processes_exited])
    some("processes ran", [f"{p.pid} ({p.comm}: {p.how})" for p in e.processes_ran])
    some("address spaces changed", [f"{a.pid} ({a.comm})" for a in e.address_space_changed])
    some("signals", [f"{s.signal} -> {s.pid} ({s.how})" for s in e.processes_signalled])
    some("sockets", [f"{s.op} {s.family} {s.address or ''}{':' if s.port is not None else ''}"
                     f"{s.port if s.port is not None else ''} ({s.comm})" for s in e.sockets])
    some("other", e.other_effects)
    some("entered from outside", e.outside_entries)
    if len(lines) == (2 if rep.kind else 1):
        lines.append("nothing recovery-relevant happened")
    return lines


def parse_cp_spec(spec: str) -> tuple[str | None, str]:
    """`ID:PATH` -> (ID, PATH); a local path (no colon, or a slash before it) -> (None, spec)."""
    head, sep, tail = spec.partition(":")
    if sep and head and "/" not in head:
        return head, tail
    return None, spec


def _to_jsonable(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_to_jsonable(o) for o in obj]
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json", exclude={"stdout_bytes", "stderr_bytes"})
    return obj


def _print_json(obj: Any) -> None:
    print(json.dumps(_to_jsonable(obj), indent=2))


def _exit_status(code: int) -> int:
    return code if 0 <= code <= 255 else 255


# --- commands ---------------------------------------------------------------------------

Handler = Callable[[argparse.Namespace, Client], int]


def _sandbox(client: Client, sandbox_id: str) -> Sandbox:
    return Sandbox(sandbox_id, client)


def cmd_create(args: argparse.Namespace, client: Client) -> int:
    image = args.image or ""
    if image and os.path.exists(image):
        image = os.path.abspath(image)  # the daemon does not share our cwd
    req = pb.CreateSandboxRequest(image=image, memory_mb=args.memory or 0,
                                  pids_max=args.pids or 0, cpus=args.cpus or 0.0,
                                  hostname=args.hostname or "", env=dict(args.env),
                                  disk_mb=args.disk or 0, user_namespace=args.userns,
                                  huge_pages=args.huge_pages)
    info = convert.sandbox_info(client.call("CreateSandbox", req))
    if args.json:
        _print_json(info)
    else:
        print(info.id)
    return 0


def _writer(stream: BinaryIO) -> Callable[[bytes], None]:
    def write(data: bytes) -> None:
        stream.write(data)
        stream.flush()
    return write


def cmd_exec(args: argparse.Namespace, client: Client) -> int:
    if not args.cmd:
        raise UsageError("exec needs a command, e.g. `deltabox exec ID -- ls -la`")
    sbx = _sandbox(client, args.id)
    if args.tty and not args.session:
        raise UsageError("--tty needs --session (a session on a pseudo-terminal)")
    if args.session:
        if args.cwd or args.env or args.stdin:
            raise UsageError("--cwd, --env and --stdin cannot be used with --session")
        session = sbx.session(args.session, tty=args.tty)
        result = session.run(" ".join(args.cmd), timeout=args.timeout,
                             checkpoint=args.checkpoint, checkpoint_label=args.checkpoint_label,
                             rollback_to=args.rollback_to)
        if not args.json:
            _writer(sys.stdout.buffer)(result.stdout_bytes)
            _writer(sys.stderr.buffer)(result.stderr_bytes)
    else:
        one_line = len(args.cmd) == 1 and any(c.isspace() for c in args.cmd[0])
        cmd = args.cmd[0] if one_line else list(args.cmd)
        stdin = sys.stdin.buffer.read() if args.stdin else None
        streams: dict[str, Any] = {} if args.json else {
            "on_stdout": _writer(sys.stdout.buffer), "on_stderr": _writer(sys.stderr.buffer)}
        result = sbx.exec(cmd, timeout=args.timeout, cwd=args.cwd, env=dict(args.env),
                          stdin=stdin, checkpoint=args.checkpoint,
                          checkpoint_label=args.checkpoint_label,
                          rollback_to=args.rollback_to, **streams)
    if args.json:
        _print_json(result)
        return _exit_status(result.exit_code)
    _report_step(result)
    return _exit_status(result.exit_code)


def _report_rollback(rolled: RollbackResult | None) -> None:
    """On stderr: the rollback a step asked for before it."""
    if rolled is not None:
        print(f"{PROG}: rolled back to {rolled.checkpoint_id} first "
              f"({rolled.process_state or 'files'}; {rolled.duration_ms:.1f} ms)",
              file=sys.stderr)


def _report_step(result: ExecResult | WriteResult) -> None:
    """On stderr: the rollback a step asked for, its note, the checkpoint it promised."""
    _report_rollback(result.rollback)
    if result.note:
        print(f"{PROG}: note: {result.note}", file=sys.stderr)
    if result.checkpoint_id:
        print(f"{PROG}: checkpoint {result.checkpoint_id} (taken in the background)",
              file=sys.stderr)


def cmd_checkpoint(args: argparse.Namespace, client: Client) -> int:
    cp = _sandbox(client, args.id).checkpoint(mode=args.mode, label=args.label,
                                              background=args.background)
    if args.json:
        _print_json(cp)
    else:
        print(cp.id)
    return 0


def cmd_rollback(args: argparse.Namespace, client: Client) -> int:
    res = _sandbox(client, args.id).rollback(args.checkpoint)
    if args.json:
        _print_json(res)
        return 0
    print(f"{res.sandbox_id} rolled back to {res.checkpoint_id} in {res.duration_ms:.1f} ms")
    if res.sessions_restarted:
        print(f"sessions restarted: {', '.join(res.sessions_restarted)}")
    if res.processes_killed:
        print(f"processes killed: {res.processes_killed}")
    return 0


def cmd_fork(args: argparse.Namespace, client: Client) -> int:
    if args.count < 1:
        raise UsageError("--count must be at least 1")
    resp = client.call("Fork", pb.ForkRequest(checkpoint_id=args.checkpoint, count=args.count,
                                              shared_layer=args.shared_layer))
    kids = [convert.sandbox_info(s) for s in resp.sandboxes]
    if args.json:
        _print_json(kids)
    else:
        for kid in kids:
            print(kid.id)
        if resp.note:  # to stderr: stdout stays a clean list of ids for scripts
            print(f"processes {resp.process_state}: {resp.note}", file=sys.stderr)
    return 0


def cmd_ls(args: argparse.Namespace, client: Client) -> int:
    resp = client.call("ListSandboxes", pb.ListSandboxesRequest())
    boxes = [convert.sandbox_info(s) for s in resp.sandboxes]
    if args.json:
        _print_json(boxes)
        return 0
    rows = [[b.id, b.state, b.head_checkpoint_id or "-", f"{b.memory_mb}M" if b.memory_mb
             else "-", str(b.pids_max or "-"), f"{b.cpus:g}" if b.cpus else "-",
             b.uid_map.split()[1] if b.uid_map else "0", _when(b.created_at),
             b.image or "(host)"] for b in boxes]
    # ROOT: the host uid of the sandbox's root (not 0 with a user namespace, --userns)
    for line in render_table(["ID", "STATE", "HEAD", "MEMORY", "PIDS", "CPUS", "ROOT",
                              "CREATED", "IMAGE"], rows):
        print(line)
    return 0


def cmd_checkpoints(args: argparse.Namespace, client: Client) -> int:
    sbx = _sandbox(client, args.id)
    head = sbx.info().head_checkpoint_id
    cps = sbx.checkpoints()
    if args.json:
        _print_json([{**_to_jsonable(cp), "head": cp.id == head} for cp in cps])
    elif not cps:
        print(f"{args.id} has no checkpoints", file=sys.stderr)
    else:
        for line in render_tree(cps, head, args.id):
            print(line)
    return 0


def cmd_effects(args: argparse.Namespace, client: Client) -> int:
    rep = _sandbox(client, args.id).turn_effects(args.checkpoint or None)
    if args.json:
        _print_json(rep)
        return 0
    for line in render_effects(rep):
        print(line)
    return 0


def cmd_diff(args: argparse.Namespace, client: Client) -> int:
    req = pb.DiffRequest(from_checkpoint_id=args.a, to_checkpoint_id=args.b)
    diff = convert.diff_result(client.call("Diff", req))
    if args.json:
        _print_json(diff)
    else:
        for line in render_diff(diff):
            print(line)
        if diff.note:
            print(f"deltabox: note: {diff.note}", file=sys.stderr)
    return 0


def _each(ids: Sequence[str], action: Callable[[str], Any], as_json: bool,
          key: str) -> int:
    """Apply `action` to every id, reporting failures and carrying on; exit 1 if any failed."""
    done: list[dict[str, Any]] = []
    failed = False
    for item in ids:
        try:
            value = action(item)
        except errors.DeltaBoxError as e:
            print(f"{PROG}: error: {item}: {e.message}", file=sys.stderr)
            failed = True
            continue
        done.append({"id": item, key: value})
        if not as_json:
            print(item)
    if as_json:
        _print_json(done)
    return 1 if failed else 0


def cmd_rm(args: argparse.Namespace, client: Client) -> int:
    ids = args.ids
    if args.all:
        resp = client.call("ListSandboxes", pb.ListSandboxesRequest())
        ids = [s.id for s in resp.sandboxes]
    return _each(ids, lambda i: _sandbox(client, i).kill(), args.json, "checkpoints_freed")


def cmd_rmcp(args: argparse.Namespace, client: Client) -> int:
    def delete(cp_id: str) -> bool:
        return bool(client.call("DeleteCheckpoint", pb.CheckpointRef(checkpoint_id=cp_id))
                    .layer_freed)
    return _each(args.ids, delete, args.json, "layer_freed")


def cmd_info(args: argparse.Namespace, client: Client) -> int:
    info = convert.daemon_info(client.call("Info", pb.InfoRequest()))
    if args.json:
        _print_json(info)
        return 0
    fields = info.model_dump()
    for name in ("store_bytes_total", "store_bytes_free"):
        fields[name] = human_bytes(fields[name])
    width = max(len(k) for k in fields)
    for key, value in fields.items():
        print(f"{key.ljust(width)}  {value}")
    return 0


def cmd_cp(args: argparse.Namespace, client: Client) -> int:
    src_id, src = parse_cp_spec(args.src)
    dst_id, dst = parse_cp_spec(args.dst)
    if (src_id is None) == (dst_id is None):
        raise UsageError("exactly one of SRC and DST must be ID:PATH")
    if dst_id is None and args.checkpoint:
        raise UsageError("--checkpoint goes with an upload (DST is ID:PATH)")
    if dst_id is not None:  # upload
        if src != "-" and os.path.isdir(src):
            raise UsageError(f"{src} is a directory; cp copies single files")
        data = sys.stdin.buffer.read() if src == "-" else _read_local(src)
        if dst.endswith("/") and src != "-":
            dst += os.path.basename(src)
        wrote = _sandbox(client, dst_id).files.write(
            dst, data, checkpoint=args.checkpoint, checkpoint_label=args.checkpoint_label,
            rollback_to=args.rollback_to)
        if args.json:
            _print_json(wrote)
        else:
            _report_step(wrote)
        return 0
    assert src_id is not None
    data = _sandbox(client, src_id).files.read(src, rollback_to=args.rollback_to)
    if not args.json:
        _report_rollback(data.rollback)
    if dst == "-":
        _writer(sys.stdout.buffer)(data)
        return 0
    if os.path.isdir(dst) or dst.endswith("/"):
        dst = os.path.join(dst, os.path.basename(src.rstrip("/")))
    with open(dst, "wb") as f:
        f.write(data)
    if args.json:
        rolled = getattr(data, "rollback", None)
        _print_json({"path": os.path.abspath(dst), "size": len(data),
                     **({"rollback": rolled.model_dump()} if rolled is not None else {})})
    return 0


def _read_local(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise errors.InvalidArgument(f"cannot read {path}: {e.strerror}") from None


def run_daemon(args: argparse.Namespace) -> int:
    """Hand over to deltaboxd's own entry point (imported only now: it is heavy and root-only)."""
    argv: list[str] = []
    if args.state_dir:
        argv += ["--state-dir", args.state_dir]
    socket = args.socket or os.environ.get("DELTABOX_SOCKET")
    if socket:
        argv += ["--socket", socket]
    argv += args.daemon_args
    try:
        daemon_main = importlib.import_module("deltabox.daemon.main")
    except ModuleNotFoundError as e:
        if e.name not in ("deltabox.daemon", "deltabox.daemon.main"):
            raise
        raise errors.Internal("this installation has no daemon (deltabox.daemon.main)") from e
    rc = daemon_main.main(argv)
    return rc if isinstance(rc, int) else 0


HANDLERS: dict[str, Handler] = {
    "create": cmd_create, "exec": cmd_exec, "checkpoint": cmd_checkpoint,
    "rollback": cmd_rollback, "fork": cmd_fork, "ls": cmd_ls, "checkpoints": cmd_checkpoints,
    "diff": cmd_diff, "effects": cmd_effects, "rm": cmd_rm, "rmcp": cmd_rmcp, "info": cmd_info, "cp": cmd_cp,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "daemon":
            return run_daemon(args)
        with connect(args.socket) as client:
            return HANDLERS[args.command](args, client)
    except UsageError as e:
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return 2
    except errors.DeltaBoxError as e:
        print(f"{PROG}: error: {e.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Reader went away (e.g. `| head`); keep Python from complaining at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
