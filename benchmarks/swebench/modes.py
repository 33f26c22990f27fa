"""The three ways a trajectory is replayed, and the seeded tree-search schedule.

The tree is built from prefixes of the trajectory: node 0 is the base state, and a node at
depth d is the state after actions 0..d-1 on its path; its "next action" is action d. An
expansion picks a node, rolls back to it unless it is the live state, runs its next action
and checkpoints the result as a new node (siblings re-run the same action from the same
state, as a search that samples a step several times would).

`mcts_schedule(n, E, R, seed)`, precisely: `random.Random(seed)` first draws the R steps
that roll back, `sample(range(1, E), R)` (step 0 always expands the root, the live state).
Then for step s = 0..E-1: the expanded node is the live node, unless s is a rollback step,
in which case it is `choice(C)` with C = the nodes made so far whose depth < n, other than
the live node, in id order. If the live node is at depth n (its path ran the whole
trajectory) on a step that was to continue, the step becomes a rollback ("forced") and the
next planned rollback step becomes a continue step, so the count stays R whenever a planned
one is left (else the extra rollback is counted in `forced_extra`). Expansion s makes node
s + 1. `linear` is the same loop with R = 0 and E = n: one path, a checkpoint after every
action.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Generator
from dataclasses import asdict, dataclass
from typing import Any

from .systems import CR_OPS, System

HASH_EVERY_LINEAR = 5      # linear: compare state hashes every 5 actions and at the end


@dataclass(frozen=True)
class Step:
    step: int
    parent: int          # node expanded
    rollback: bool       # the live state is not `parent`: roll back to it first
    forced: bool         # a rollback because the live path had reached the end
    action: int          # index of the action run (= depth of parent)
    node: int            # node made (= step + 1)
    depth: int           # of the node made


def mcts_schedule(n_actions: int, expansions: int, rollbacks: int, seed: int) -> list[Step]:
    """See the module docstring."""
    if rollbacks > max(0, expansions - 1):
        raise ValueError(f"{rollbacks} rollbacks need more than {expansions} expansions")
    rng = random.Random(seed)
    planned = sorted(rng.sample(range(1, expansions), rollbacks)) if rollbacks else []
    depth = [0]                        # depth of node i
    live = 0
    steps: list[Step] = []
    for s in range(expansions):
        jump = s in planned
        forced = False
        if not jump and depth[live] >= n_actions:
            jump = forced = True
            later = [p for p in planned if p > s]
            if later:
                planned.remove(later[0])
        if jump:
            cands = [i for i, d in enumerate(depth) if d < n_actions and i != live]
            if not cands:            # only the live node can grow (tiny trajectories)
                cands = [live]
            parent = rng.choice(cands)
        else:
            parent = live
        node = len(depth)
        depth.append(depth[parent] + 1)
        steps.append(Step(s, parent, parent != live, forced and parent != live,
                          depth[parent], node, depth[parent] + 1))
        live = node
    return steps


def linear_schedule(n_actions: int) -> list[Step]:
    return mcts_schedule(n_actions, n_actions, 0, 0)


def schedule_summary(steps: list[Step], rollbacks_planned: int) -> dict[str, Any]:
    n_rb = sum(s.rollback for s in steps)
    return {"expansions": len(steps), "rollbacks": n_rb, "rollbacks_planned": rollbacks_planned,
            "forced_rollbacks": sum(s.forced for s in steps),
            "forced_extra": max(0, n_rb - rollbacks_planned),
            "max_depth": max((s.depth for s in steps), default=0),
            "distinct_actions": len({s.action for s in steps})}


def _totals(ops: list[dict[str, Any]]) -> dict[str, float]:
    cr = sum(o["ms"] for o in ops if o["op"] in CR_OPS)
    act = sum(o["ms"] for o in ops if o["op"] == "action")
    return {"e2e_ms": cr + act, "cr_ms": cr, "action_ms": act}


def tree_replay(system: System, steps: list[Step],
                linear: bool) -> Generator[None, None, dict[str, Any]]:
    """Replay a schedule (linear or mcts) on one system, pausing (a `yield`) after its
    start and after every step; returns what results.json keeps of it (span_s: its
    start and end, epoch seconds)."""
    t_wall, t_begin = time.perf_counter(), time.time()
    codes: dict[int, Any] = {}
    hashes: dict[str, dict[str, str]] = {}
    system.start()
    try:
        system.checkpoint(0, [], step=-1)
        yield
        for s in steps:
            path = list(range(s.depth - 1))
            system.pause()               # decides where to go next: then rollback + action
            if s.rollback:
                system.rollback(s.parent, path, s.step)
            codes[s.step] = system.act_and_checkpoint(s.action, s.step, s.node,
                                                      list(range(s.depth)))
            if s.rollback:
                # After the action, not between the rollback and it: the hash reads every
                # file, which would warm the page cache for the action; and deltabox_turn
                # rolls back inside the action's call.
                hashes[f"step {s.step}: node {s.parent}, then its action"] = system.hash()
            if linear and (s.step + 1) % HASH_EVERY_LINEAR == 0:
                hashes[f"node {s.node}"] = system.hash()
            yield
        hashes["final"] = system.hash()
    finally:
        system.close()
    out = {"ops": system.ops, **_totals(system.ops), "codes": codes, "hashes": hashes,
           "wall_ms": (time.perf_counter() - t_wall) * 1000,
           "span_s": [t_begin, time.time()], "kills_untimed_ms": system.cleanup_ms}
    out.update(system.extras())
    return out


def run_tree(system: System, steps: list[Step], linear: bool) -> dict[str, Any]:
    """Replay a schedule on one system, from start to end."""
    replay = tree_replay(system, steps, linear)
    while True:
        try:
            next(replay)
        except StopIteration as done:
            return done.value


def run_trees_lockstep(systems: dict[str, System], steps: list[Step], linear: bool,
                       between: Callable[[], float]) -> tuple[dict[str, dict[str, Any]],
                                                              list[float]]:
    """Replay the schedule on every system at once, step by step: round r runs step r on
    each system in turn, starting one system further each round, and `between` (the
    runner's settle: sync, btrfs cleanup) runs after each system's step. A drift of the
    machine over the minutes of a run then weighs on every system alike, where one replay
    after another put it between them. Returns each system's result (as run_tree) and
    the time `between` took per round."""
    replays = {key: tree_replay(sys_, steps, linear) for key, sys_ in systems.items()}
    results: dict[str, dict[str, Any]] = {}
    settled: list[float] = []
    try:
        for r in itertools.count():
            keys = list(replays)
            if not keys:
                break
            spent = 0.0
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                try:
                    next(replays[key])
                except StopIteration as done:
                    results[key] = done.value
                    del replays[key]
                spent += between()
            settled.append(spent)
    finally:
        for replay in replays.values():     # a system failed: close the others' sandboxes
            replay.close()
    return {key: results[key] for key in systems}, settled


def run_fanout(system: System, mid: int, counts: list[int]) -> dict[str, Any]:
    """Run actions 0..mid-1, checkpoint, then for each N make N children in that state and run
    action `mid` in each (the floor runs it N times in its one sandbox)."""
    t_wall = time.perf_counter()
    path = list(range(mid))
    codes: dict[str, list[Any]] = {}
    hashes: dict[str, dict[str, str]] = {}
    system.start()
    try:
        system.tag = {"phase": "prefix"}
        for i in path:              # no C/R in the prefix: no pause needed either
            system.action(i, i)
        system.tag = {"phase": "checkpoint"}
        system.checkpoint(mid, path, mid)
        for n in counts:
            system.tag = {"phase": "fanout", "n": n}
            system.pause()               # one decision to fan out, then N children act
            if not system.forks:
                codes[str(n)] = [system.action(mid, mid, child=c) for c in range(n)]
                continue
            kids = system.children(mid, path, n, mid)
            try:
                codes[str(n)] = [system.action(mid, mid, sbx=k, child=c)
                                 for c, k in enumerate(kids)]
                for c in sorted({0, n - 1}):
                    hashes[f"n={n} child {c}"] = system.hash(kids[c])
            finally:
                for k in kids:
                    system._kill(k)
        system.tag = {}
    finally:
        system.close()
    per_n: dict[str, dict[str, float]] = {}
    fixed = [o for o in system.ops if o.get("phase") in ("prefix", "checkpoint")]
    for n in counts:
        mine = [o for o in system.ops if o.get("n") == n]
        per_n[str(n)] = {**_totals(fixed + mine), "phase_ms": _totals(mine)["e2e_ms"]}
    out = {"ops": system.ops, **_totals(system.ops), "per_n": per_n, "codes": codes,
           "hashes": hashes, "wall_ms": (time.perf_counter() - t_wall) * 1000,
           "kills_untimed_ms": system.cleanup_ms}
    out.update(system.extras())
    return out


def steps_json(steps: list[Step]) -> list[dict[str, Any]]:
    return [asdict(s) for s in steps]
