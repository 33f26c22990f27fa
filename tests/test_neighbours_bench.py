"""benchmarks.neighbours' accounting: the neighbour's samples count for the phase whose
window they fall in, and the probe (a real process calling a real daemon) calls only
between "run" and "pause", so no sample lands in a settling pause."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from benchmarks import neighbours


def test_summary_assigns_samples_to_their_phase_windows() -> None:
    windows = [
        {"phase": "idle", "start": 10.0, "end": 11.0, "op_ms": []},
        {"phase": "fs_checkpoint", "start": 12.0, "end": 13.0, "op_ms": [30.0, 34.0]},
        {"phase": "idle", "start": 20.0, "end": 21.0, "op_ms": []},
        {"phase": "fs_checkpoint", "start": 22.0, "end": 23.0, "op_ms": [32.0]},
    ]
    samples = [(10.5, 2.0), (10.9, 4.0), (20.2, 2.0), (20.4, 4.0),   # idle, two rounds
               (12.1, 10.0), (12.5, 30.0), (22.5, 20.0),              # fs, two rounds
               (11.5, 500.0), (15.0, 900.0)]                          # settling: ignored
    s = neighbours.summarize(windows, samples, ["idle", "fs_checkpoint"])
    assert s["idle"]["neighbour"]["n"] == 4
    assert s["idle"]["neighbour"]["max"] == 4.0
    assert s["fs_checkpoint"]["neighbour"]["n"] == 3
    assert s["fs_checkpoint"]["neighbour"]["p50"] == 20.0
    assert s["fs_checkpoint"]["neighbour"]["max"] == 30.0
    assert s["fs_checkpoint"]["over_idle"]["p50"] == pytest.approx(20.0 / 3.0)
    assert s["fs_checkpoint"]["operation"]["p50"] == 32.0
    assert s["idle"]["operation"]["n"] == 0


def test_probe_calls_only_while_running(sbx, daemon) -> None:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=neighbours.probe, args=(daemon.socket, sbx.id, child),
                       daemon=True)
    proc.start()
    try:
        assert parent.poll(60) and parent.recv() == "ready"
        time.sleep(0.2)                  # paused from the start: no call
        parent.send("run")
        t_run = time.monotonic()
        time.sleep(0.3)
        parent.send("pause")
        t_pause = time.monotonic()
        time.sleep(0.3)                  # paused again
        parent.send("stop")
        assert parent.poll(30)
        samples = parent.recv()
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
    assert len(samples) >= 5
    # A call begun before the pause arrived ends at most one call later.
    last_call = max(ms for _, ms in samples) / 1000
    assert all(t_run <= t <= t_pause + last_call + 0.05 for t, _ in samples)
    assert all(ms > 0 for _, ms in samples)
