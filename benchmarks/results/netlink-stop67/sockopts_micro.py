"""Per-socket cost of reading the options a restore sets again (stop 67)."""
import json, socket, statistics, sys, time
sys.path.insert(0, ".")  # run from the repository root
from deltabox.cr import sockopts
a, b = socket.socketpair()
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen()
c = socket.create_connection(srv.getsockname()); s, _ = srv.accept()
out = {}
for name, sock, table in (("unix end", a, sockopts.UNIX), ("tcp connection end", c, sockopts.TCP_CONNECTION)):
    ts = []
    for _ in range(2000):
        t = time.perf_counter(); sockopts.differing(None, sock, table); ts.append(time.perf_counter() - t)
    out[name] = {"p50_us": statistics.median(ts) * 1e6, "n": len(ts)}
ts = []
for _ in range(2000):
    t = time.perf_counter(); sockopts.socket_filter(a); ts.append(time.perf_counter() - t)
out["filter read (none)"] = {"p50_us": statistics.median(ts) * 1e6, "n": len(ts)}
print(json.dumps(out, indent=1))
