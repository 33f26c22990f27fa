import sys, time, statistics, collections, json
ROOT = sys.argv[1]
sys.path.insert(0, ROOT)
from benchmarks.common import PrivateDaemon
import deltabox
N = int(sys.argv[2]) if len(sys.argv) > 2 else 20
with PrivateDaemon() as d:
    sbx = deltabox.Sandbox.create(socket=d.socket)
    try:
        sbx.exec("cd /workspace && mkdir -p t && cd t && seq 10000 | xargs -n 500 touch")
        sbx.files.write("big.py", "import time\nb = bytearray(200 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint('ok', flush=True)\ntime.sleep(1e6)\n")
        s = sbx.session("main"); s.run("cd /workspace"); s.run("nohup python3 big.py > big.out 2>&1 &")
        while b"ok" not in sbx.files.read("/workspace/big.out"): time.sleep(0.1)
        s.run("cd /tmp && X=1")
        cp = sbx.checkpoint(mode="full")
        ts = []; ds = []; st = collections.Counter(); nx = []
        for i in range(N):
            time.sleep(0.3)
            t = time.perf_counter(); r = sbx.rollback(cp); t1 = time.perf_counter()
            out = s.run("echo $X; pwd"); t2 = time.perf_counter()
            assert out.stdout == "1\n/tmp\n", out
            ts.append((t1-t)*1000); ds.append(r.duration_ms); nx.append((t2-t1)*1000); st[r.process_state] += 1
        c = sbx.checkpoint()
        print(json.dumps({"root": ROOT, "client": round(statistics.median(ts), 2), "daemon": round(statistics.median(ds), 2), "next_call": round(statistics.median(nx), 2), "states": st, "cp_after": c.kind}))
    finally:
        sbx.kill()
