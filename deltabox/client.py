"""One gRPC channel to deltaboxd, shared by the SDK and the CLI.

Everything that crosses the wire goes through `Client.call` / `Client.stream`, so gRPC errors
become `deltabox.errors` exceptions in exactly one place and callers never see `grpc.RpcError`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import grpc

from deltabox import errors
from deltabox.api import deltabox_pb2_grpc as pb_grpc

DEFAULT_SOCKET = "/run/deltabox/deltabox.sock"
MAX_MESSAGE_BYTES = 512 * 1024 * 1024

_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A restarted daemon should be reachable again within a second, not after gRPC's
    # default exponential backoff (up to two minutes) on a long-lived SDK channel.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

# What gRPC says when it never got a connection (as opposed to the daemon raising UNAVAILABLE).
_CONNECT_FAILURE_HINTS = ("failed to connect", "connection refused", "no such file",
                          "connect failed", "socket closed", "permission denied")


def default_socket() -> str:
    """The daemon address to use when none is given: $DELTABOX_SOCKET or the system socket."""
    return os.environ.get("DELTABOX_SOCKET") or DEFAULT_SOCKET


def is_tcp(address: str) -> bool:
    """`host:port` (no slash, has a colon) means TCP; anything else is a unix socket path."""
    return "/" not in address and ":" in address


class Client:
    """A channel plus stub. Thread-safe; one per daemon address is plenty."""

    def __init__(self, address: str | None = None) -> None:
        self.address = address or default_socket()
        self._metadata: tuple[tuple[str, str], ...] = ()
        if is_tcp(self.address):
            target = self.address
            token = os.environ.get("DELTABOX_TOKEN")
            if token:
                self._metadata = (("authorization", f"Bearer {token}"),)
        else:
            target = "unix:" + os.path.abspath(self.address)
        self._channel = grpc.insecure_channel(target, options=_CHANNEL_OPTIONS)
        self._stub = pb_grpc.DeltaBoxStub(self._channel)

    def call(self, method_name: str, request: Any, timeout: float | None = None) -> Any:
        """Invoke a unary RPC by name (e.g. "CreateSandbox"); raise DeltaBoxError on failure."""
        method = self._method(method_name)
        try:
            return method(request, timeout=timeout, metadata=self._metadata,
                          wait_for_ready=False)
        except grpc.RpcError as e:
            raise self._translate(e) from None

    def stream(self, method_name: str, request: Any,
               timeout: float | None = None) -> Iterator[Any]:
        """Invoke a server-streaming RPC; yields messages. Closing the generator cancels it."""
        method = self._method(method_name)
        responses = method(request, timeout=timeout, metadata=self._metadata,
                           wait_for_ready=False)
        try:
            yield from responses
        except grpc.RpcError as e:
            raise self._translate(e) from None
        finally:
            responses.cancel()  # no-op once finished; stops the daemon side if we bail early

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.address!r})"

    def _method(self, method_name: str) -> Any:
        method = getattr(self._stub, method_name, None)
        if method is None or method_name.startswith("_"):
            raise ValueError(f"no such deltaboxd RPC: {method_name!r}")
        return method

    def _translate(self, e: grpc.RpcError) -> errors.DeltaBoxError:
        code: grpc.StatusCode = e.code()
        details: str = e.details() or ""
        if code == grpc.StatusCode.UNAVAILABLE and self._never_connected(details):
            return errors.Unavailable(self._unreachable_message(details))
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and details == "Deadline Exceeded":
            # gRPC's own client-side deadline, not the daemon reporting a command timeout.
            return errors.DeadlineExceeded(f"no answer from deltaboxd at {self.address} in time")
        return errors.from_status(code, details)

    def _never_connected(self, details: str) -> bool:
        if not is_tcp(self.address) and not os.path.exists(self.address):
            return True
        lowered = details.lower()
        return any(hint in lowered for hint in _CONNECT_FAILURE_HINTS)

    def _unreachable_message(self, details: str) -> str:
        if is_tcp(self.address):
            return (f"cannot reach deltaboxd at {self.address}: {details or 'unavailable'}; "
                    "is it running and listening there?")
        if "permission denied" in details.lower():
            return (f"permission denied on {self.address}: deltaboxd's socket is not "
                    "accessible to this user (run as root or fix the socket's group)")
        return (f"cannot reach deltaboxd at {self.address}: is it running? start it with "
                "`deltabox daemon` or set DELTABOX_SOCKET")


def connect(socket: str | None = None) -> Client:
    """A Client for `socket` (a unix socket path or `host:port`), default `default_socket()`."""
    return Client(socket)
