import sys, time, statistics, json
sys.path.insert(0, "/work/main")
from benchmarks.common import PrivateDaemon
import deltabox
EXTRA = sys.argv[1:]
with PrivateDaemon(extra_args=EXTRA) as d:
    sbx = deltabox.Sandbox.create(socket=d.socket)
    try:
        s = sbx.session("main"); s.run("cd /workspace && X=1")
        sbx.files.write("a.py", "x = 1\n" * 100)
        cp = sbx.checkpoint()
        def edit(b, tag):
            t0 = time.perf_counter(); txt = b.files.read("a.py"); t1 = time.perf_counter()
            b.files.write("a.py", txt.replace(b"x = 1", b"x = 2", 1)); t2 = time.perf_counter()
            return round((t1 - t0) * 1000, 2), round((t2 - t1) * 1000, 2)
        out = {"parent": [edit(sbx, "p") for _ in range(3)]}
        for shared in (False, True):
            kids = sbx.fork(cp, count=4, shared_layer=shared)
            out["shared" if shared else "clone"] = [[edit(k, "k") for _ in range(2)] for k in kids]
            for k in kids: k.kill()
        base = sbx.checkpoint()
        kids = [deltabox.Sandbox.fork_from(base, socket=d.socket, shared_layer=True)[0] for _ in range(4)]
        out["fresh_each"] = [[edit(k, "k") for _ in range(2)] for k in kids]
        for k in kids: k.kill()
        print(json.dumps({k: [v[0] if isinstance(v[0], list) and isinstance(v[0][0], list) else v[0]] for k, v in out.items()}))
    finally:
        sbx.kill()
