"""A minimal Chrome DevTools Protocol client (stdlib only, run inside a sandbox by
test_cr.py's Chromium case): evaluate an expression in the first page whose URL contains a
marker and print its value as JSON. Usage: python3 cdp_client.py PORT MARKER EXPRESSION"""
import base64, json, os, socket, struct, sys, urllib.request

def ws_connect(url):
    """A websocket to url (ws://host:port/path): the socket and what came after the
    handshake."""
    host, rest = url[len("ws://"):].split("/", 1)
    h, p = host.split(":")
    s = socket.create_connection((h, int(p)), timeout=10)
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall((f"GET /{rest} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
               f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
               "Sec-WebSocket-Version: 13\r\n\r\n").encode())
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += s.recv(4096)
    assert b" 101 " in buf.split(b"\r\n")[0], buf
    return s, buf.split(b"\r\n\r\n", 1)[1]

def send(s, text):
    """One masked text frame (a client's frames are masked)."""
    data = text.encode()
    mask = os.urandom(4)
    head = bytes([0x81])
    n = len(data)
    head += bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack("!H", n)
    s.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

def recv(s, pending):
    """One unfragmented frame's text, and the bytes read past it."""
    buf = pending
    def need(k):
        nonlocal buf
        while len(buf) < k:
            chunk = s.recv(65536)
            if not chunk:
                raise EOFError
            buf += chunk
    need(2)
    n = buf[1] & 0x7f
    off = 2
    if n == 126:
        need(4); n = struct.unpack("!H", buf[2:4])[0]; off = 4
    elif n == 127:
        need(10); n = struct.unpack("!Q", buf[2:10])[0]; off = 10
    need(off + n)
    return buf[off:off + n].decode(), buf[off + n:]

port, marker, expr = sys.argv[1], sys.argv[2], sys.argv[3]
pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
page = next(p for p in pages if marker in p["url"] and p["type"] == "page")
s, pending = ws_connect(page["webSocketDebuggerUrl"])
send(s, json.dumps({"id": 1, "method": "Runtime.evaluate",
                    "params": {"expression": expr, "returnByValue": True}}))
while True:
    msg, pending = recv(s, pending)
    m = json.loads(msg)
    if m.get("id") == 1:
        print(json.dumps(m["result"]["result"].get("value")))
        break
