"""Temporary switch probe: auto fs checkpoints of a sandbox running an idle server, deferred or not."""
import json, os, statistics, sys, time
sys.path.insert(0, "/work/main")
from benchmarks.common import PrivateDaemon
from benchmarks.process_cr import make_tree, Timer
from deltabox import Sandbox

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
tree = len(sys.argv) > 2
res = {"defer": [], "nodefer": [], "defer_d": [], "nodefer_d": [], "kinds": []}
with PrivateDaemon() as d:
    import deltabox
    for _ in range(300):
        if deltabox.info(socket=d.socket).inspector_backend.startswith("ebpf"):
            break
        time.sleep(0.1)
    sbx = Sandbox.create(socket=d.socket)
    if tree:
        make_tree(sbx)
    sbx.exec("cd /tmp && nohup python3 -m http.server 8000 >/dev/null 2>&1 &")
    time.sleep(1)
    sbx.checkpoint(mode="full")
    for rep in range(2 * reps):
        arm = "nodefer" if rep % 2 else "defer"
        if arm == "nodefer":
            open("/tmp/nodefer", "w").close()
        elif os.path.exists("/tmp/nodefer"):
            os.unlink("/tmp/nodefer")
        sbx.files.write("/workspace/edit.py", f"x = {rep}\n" * 50)
        time.sleep(0.2)
        with Timer() as tm:
            cp = sbx.checkpoint()
        res["kinds"].append(cp.kind)
        res[arm].append(tm.ms)
        res[arm + "_d"].append(cp.duration_ms)
    if os.path.exists("/tmp/nodefer"):
        os.unlink("/tmp/nodefer")
    sbx.kill()
out = {k: statistics.median(v) for k, v in res.items() if k != "kinds"}
out["kinds"] = sorted(set(res["kinds"]))
print(json.dumps(out))
