"""Temporary switch probe: full scenario checkpoints alternated deferred / not (file /tmp/nodefer)."""
import json, os, statistics, sys, time
sys.path.insert(0, "/work/main")
from benchmarks.common import PrivateDaemon
from benchmarks.process_cr import Workload, make_tree, probe_path, CONFIGS, Timer
from deltabox import Sandbox

cfg = [c for c in CONFIGS if c.name == "full"][0]
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
res = {"defer": [], "nodefer": [], "defer_d": [], "nodefer_d": []}
with PrivateDaemon() as d:
    sbx = Sandbox.create(socket=d.socket)
    wl = Workload(sbx, cfg.size_mb, cfg.nproc, 0.2)
    wl.install()
    make_tree(sbx)
    probe = probe_path(cfg)
    sbx.files.write(probe, "base\n")
    wl.start()
    wl.settle()
    base = sbx.checkpoint(label="base")
    for rep in range(2 * reps):
        arm = "nodefer" if rep % 2 else "defer"
        if arm == "nodefer":
            open("/tmp/nodefer", "w").close()
        elif os.path.exists("/tmp/nodefer"):
            os.unlink("/tmp/nodefer")
        sbx.files.write(probe, f"rep {rep}\n")
        wl.dirty(1, rep % cfg.size_mb, 1 + rep % 97)
        wl.settle()
        with Timer() as tm:
            cp = sbx.checkpoint(label=f"rep {rep}")
        res[arm].append(tm.ms)
        res[arm + "_d"].append(cp.duration_ms)
        wl.dirty(1, (rep + 7) % cfg.size_mb, 101 + rep % 97)
        wl.settle()
        sbx.rollback(cp)
    if os.path.exists("/tmp/nodefer"):
        os.unlink("/tmp/nodefer")
    sbx.kill()
out = {k: statistics.median(v) for k, v in res.items()}
print(json.dumps(out))
