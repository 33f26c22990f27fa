"""benchmarks.swebench's core on a tiny synthetic trajectory (no downloads, no venv): every
system must replay the same tree with the same exit codes and states, and results.json
must carry the runner's contract (every operation's latency, e2e per system, DeltaBox's
overhead_pct against the floor)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from benchmarks.common import make_settle, write_json
from benchmarks.swebench import core, env, report, trajectory
from benchmarks.swebench.modes import mcts_schedule
from conftest import new_sandbox

WORKDIR = "/testbed"
# Each command's exit code depends on the state it runs in, so a system that restores the
# wrong state (a file from a later step left behind, an edit not undone, a line appended
# twice) gets a different code than DeltaBox.
ACTIONS = [
    {"kind": "create", "path": "notes.txt", "content": "a\n"},
    {"kind": "shell", "cmd": "test ! -e made_later && echo one >> log.txt", "returncode": 0},
    {"kind": "edit", "path": "pkg/mod.py", "old": "VALUE = 1", "new": "VALUE = 2"},
    {"kind": "shell", "cmd": "python3 -c 'import pkg.mod as m; raise SystemExit(m.VALUE)'",
     "returncode": 2},
    {"kind": "shell", "cmd": "touch made_later && git status --porcelain | grep -c .",
     "returncode": 0},
    {"kind": "shell", "cmd": "test $(wc -l < log.txt) -eq 1 && ! grep -q 'VALUE = 1' pkg/mod.py",
     "returncode": 0},
]
SEED = 3
LINEAR = 4   # linear replays ACTIONS[:4]


def tiny_trajectory() -> trajectory.Trajectory:
    return trajectory.from_dict({
        "instance_id": "tiny-1", "agent": "test", "model": "none", "workdir": WORKDIR,
        "interpreter": ["bash", "-c"], "env": {"PAGER": "cat"},
        "pypi": {"name": "tinypkg", "version": "0.1"}, "actions": ACTIONS}, "tiny.json")


def tiny_package(root: Path) -> Path:
    tree = root / "tinypkg-0.1"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "__init__.py").write_text("")
    (tree / "pkg" / "mod.py").write_text("VALUE = 1\n")
    (tree / "README").write_text("tiny\n")
    return tree


def test_schedule_is_seeded_and_counts_rollbacks() -> None:
    a = mcts_schedule(len(ACTIONS), 10, 4, SEED)
    assert a == mcts_schedule(len(ACTIONS), 10, 4, SEED)
    assert sum(s.rollback for s in a) == 4
    assert [s.node for s in a] == list(range(1, 11))
    # the tree goes back before `touch made_later` after it ran: the test below is meaningful
    touched = next(s.step for s in a if s.action == 4)
    assert any(s.rollback and s.action <= 1 for s in a if s.step > touched)


def test_replay_agrees_across_systems(daemon, tmp_path: Path) -> None:
    traj = tiny_trajectory()
    host = env.HostEnv(tree=tiny_package(tmp_path), wheelhouse=None, source="local")
    plan = core.Plan(modes=("linear", "mcts"), expansions=10, rollbacks=4, seed=SEED,
                     timeout=30, think=0.0, warmup_actions=0, repeat_modes=("mcts",),
                     linear_actions=LINEAR)   # as --quick does, smaller
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    out = core.replay_trajectory(daemon.socket, daemon.state_dir, scratch, traj, host, plan)
    doc = core.results_doc([out], plan, "test", "test")
    path = write_json(tmp_path / "results.json", doc, {"cpu_model": "test"})
    doc = json.loads(path.read_text())

    runs = {r["mode"]: r for r in doc["trajectories"][0]["runs"]}
    assert set(runs) == {"linear", "mcts"}
    for mode, run in runs.items():
        s = run["summary"]
        assert s["codes_agree"], (mode, s["codes_vs_deltabox"])
        assert s["hashes_agree"], (mode, s["hashes_vs_deltabox"])
        for name, res in run["systems"].items():
            assert res["ops"] and all(o["ms"] >= 0 and o["op"] for o in res["ops"])
            timed = sum(o["ms"] for o in res["ops"])
            assert abs(res["e2e_ms"] - timed) < 1e-6 * max(1.0, timed), name
            assert isinstance(res["overhead_pct"], float)
        assert isinstance(run["systems"]["deltabox"]["overhead_pct"], float)
        assert isinstance(s["overhead_pct"], float)

    lin = runs["linear"]["systems"]
    assert set(lin) == {"floor", "deltabox", "deltabox_turn", "copytree", "docker_commit"}
    # the replayed codes are the states' real ones (the edit took effect, nothing leaked);
    # linear replays the plan's first actions, once per system (repeats: mcts only)
    assert lin["deltabox"]["codes"] == {str(i): c for i, c in enumerate([0, 0, 0, 2][:LINEAR])}
    assert sum(o["op"] == "checkpoint" for o in lin["deltabox"]["ops"]) == LINEAR + 1
    assert not runs["linear"]["repeats"] and set(runs["mcts"]["repeats"]) == {
        "floor", "deltabox", "deltabox_turn", "docker_commit"}
    # every system replayed in lockstep, step by step: each replay spans the others'
    for run in runs.values():
        spans = [r["span_s"] for r in [*run["systems"].values(), *run["repeats"].values()]]
        assert len(run["lockstep"]) == len(spans) and max(a for a, _ in spans) < min(
            b for _, b in spans), run["lockstep"]

    mcts = runs["mcts"]
    assert set(mcts["systems"]) == set(core.ORDER)
    assert mcts["schedule"]["rollbacks"] == 4
    dbx_rb = [o for o in mcts["systems"]["deltabox"]["ops"] if o["op"] == "rollback"]
    assert len(dbx_rb) == 4 and all(o["process_state"] for o in dbx_rb)
    steps = {st["step"]: st for st in mcts["steps"]}
    for name in ("deltabox_turn", "copytree", "docker_commit", "restart_replay"):
        assert mcts["systems"][name]["codes"] == mcts["systems"]["deltabox"]["codes"], name
    # deltabox_turn rolls back inside the next action's first call (exec, a create's
    # write, an edit's read of the file: rollback_to=); every tree system is compared with
    # DeltaBox after the action that follows each rollback (not in between: the hash
    # would warm the page cache)
    turn_rb = [o for o in mcts["systems"]["deltabox_turn"]["ops"] if o["op"] == "rollback"]
    assert len(turn_rb) == 4 and all(o["process_state"] for o in turn_rb)
    assert all(o.get("attached") and o["ms"] > 0 for o in turn_rb), turn_rb
    assert any(ACTIONS[st["action"]].get("kind") == "edit" for st in steps.values()
               if st["rollback"])     # the seed's schedule rolls back before an edit
    for name, cmp in mcts["summary"]["hashes_vs_deltabox"].items():
        assert cmp["compared"] == 4 + 1, name  # after each rollback's action, and the end
    # turn-boundary checkpoints (think=0: each is still pending when the next call comes)
    # are all taken, and resolved afterwards to what they were
    for run in runs.values():
        turn = [o for o in run["systems"]["deltabox_turn"]["ops"] if o["op"] == "checkpoint"]
        assert len(turn) == len([o for o in run["systems"]["deltabox"]["ops"]
                                 if o["op"] == "checkpoint"])
        assert all(o["kind"] in ("skipped", "fs", "full") for o in turn), turn
    for step, code in mcts["systems"]["deltabox"]["codes"].items():
        action = ACTIONS[steps[int(step)]["action"]]
        assert code == action.get("returncode", 0), (step, action, code)
    assert "mcts" in doc["summary"] and "targets" in doc
    assert "| tiny |" in report.markdown(doc | {"duration_s": 1.0}, "x")


def test_settle_does_not_wait_for_a_generation_templates_still_hold(daemon) -> None:
    """A checkpoint's templates keep the generation they were made in after rollbacks have
    left it: btrfs lists it deleted until they are released. The benchmarks' settle between
    runs must not wait for it (a CI run once waited its whole minute at every settle, and
    test_replay_agrees_across_systems timed out)."""
    settle = make_settle(daemon.socket)
    store = __import__("deltabox").info(socket=daemon.socket).store_path
    with new_sandbox(daemon.socket) as sbx:
        sh = sbx.session()
        sh.run("sleep 1000 &")
        cp = sbx.checkpoint()
        for i in range(2):
            sh.run(f"echo {i} > f{i}")
            assert sbx.rollback(cp).process_state == "restored"
        deadline = time.monotonic() + 10   # the left generation is retired in the background
        while time.monotonic() < deadline:
            held = subprocess.run(["btrfs", "subvolume", "list", "-d", store], check=True,
                                  capture_output=True, text=True).stdout.strip()
            if held:
                break
            time.sleep(0.1)
        assert held, "the first generation was dropped although its templates live"
        t0 = time.monotonic()
        settle()
        assert time.monotonic() - t0 < 20


def test_leakcheck_counts_other_processes_but_not_the_benchmark_itself() -> None:
    """A run started as `... --systems floor,deltabox` names deltabox on its own command
    line: its record must not call the machine unclean for that (stop 63's full run's
    RESULTS did), while a process it did not start still counts."""
    from benchmarks.common import leakcheck
    script = ("import subprocess, sys, time\n"
              "from benchmarks.common import leakcheck\n"
              "print(leakcheck()[0])\n"
              "p = subprocess.Popen(['bash', '-c', 'exec -a deltabox-probe-child sleep 30'])\n"
              "time.sleep(0.3)\n"
              "try:\n"
              "    clean, text = leakcheck()\n"
              "    print(clean, 'deltabox-probe-child' in text, 'deltabox-probe-run' in text)\n"
              "finally:\n"
              "    p.kill(); p.wait()\n")
    root = Path(__file__).resolve().parent.parent
    before = leakcheck()[0]
    r = subprocess.run(["bash", "-c", 'exec -a deltabox-probe-run "$0" -c "$1"',
                        str(root / ".venv" / "bin" / "python"), script],
                       cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.split("\n")[:2]
    assert second.split()[1:] == ["True", "False"], r.stdout   # the child named, the run not
    if before:   # (otherwise something else on this machine makes both unclean)
        assert (first, second.split()[0]) == ("True", "False"), r.stdout
