"""The floor of one call to deltaboxd on this machine: grpcio's own round trip.

A server built as deltaboxd builds its own (`daemon.server.make_server`: same options, same
thread pool, a unix socket), in a process of its own, whose GetSandbox answers at once
from the gRPC thread; a client channel as the SDK's. A benchmark times `call()` beside the
daemon's calls, after the same pauses: what a call costs before the daemon does anything
(no hop into its trio loop, no work), so a rollback's time splits into this floor and the
rest. On these VMs a call after a pause of 20 ms or more costs 2-3x one made right after
another (probe: stop 47, a bare socket ping-pong is not slowed so), so it must be timed
under the same pauses.

    with BareServer(tmpdir) as bare:
        ms = bare.call()

`python -m benchmarks.grpc_floor SOCKET` runs the server alone (what BareServer starts).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc

from deltabox.api import deltabox_pb2 as pb
from deltabox.api import deltabox_pb2_grpc as pb_grpc
from deltabox.client import _CHANNEL_OPTIONS
from deltabox.daemon.server import make_server

ROOT = Path(__file__).resolve().parent.parent


class _Nothing(pb_grpc.DeltaBoxServicer):
    def GetSandbox(self, request, context):  # noqa: N802
        return pb.SandboxInfo(id=request.sandbox_id)


class BareServer:
    """The bare server in a child process, and a channel to it."""

    def __init__(self, directory: str | Path) -> None:
        self.socket = str(Path(directory) / "bare-grpc.sock")
        self.proc: subprocess.Popen | None = None
        self.channel: grpc.Channel | None = None

    def __enter__(self) -> BareServer:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.grpc_floor",
                                      self.socket], env=env)
        try:
            self.channel = grpc.insecure_channel("unix:" + self.socket,
                                                 options=_CHANNEL_OPTIONS)
            grpc.channel_ready_future(self.channel).result(timeout=30)
            self.stub = pb_grpc.DeltaBoxStub(self.channel)
            self.call()   # connected, first-call costs paid
        except BaseException:
            self.__exit__()
            raise
        return self

    def call(self) -> float:
        """One GetSandbox round trip, in ms."""
        t = time.perf_counter()
        self.stub.GetSandbox(pb.SandboxRef(sandbox_id="x"), timeout=10)
        return (time.perf_counter() - t) * 1000

    def __exit__(self, *exc: object) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        Path(self.socket).unlink(missing_ok=True)


def main(socket_path: str) -> int:
    server = make_server(_Nothing(), socket_path, None)  # type: ignore[arg-type]
    server.start()
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
