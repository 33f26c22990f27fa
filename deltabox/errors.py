"""Exceptions with a meaning, each mapped once to a gRPC status code.

The daemon raises these; the servicer turns them into statuses; the SDK turns statuses back
into the same classes, so `except deltabox.NotFound` works on both sides of the wire.
"""

from __future__ import annotations

import grpc


class DeltaBoxError(Exception):
    """Base class. `code` is the gRPC status this error travels as."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(DeltaBoxError):
    code = grpc.StatusCode.NOT_FOUND


class InvalidArgument(DeltaBoxError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(DeltaBoxError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(DeltaBoxError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(DeltaBoxError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(DeltaBoxError):
    """The daemon cannot be reached (not running, wrong socket)."""

    code = grpc.StatusCode.UNAVAILABLE


class Internal(DeltaBoxError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[DeltaBoxError]] = {
    cls.code: cls
    for cls in (NotFound, InvalidArgument, FailedPrecondition, ResourceExhausted,
                DeadlineExceeded, Unavailable, Internal)
}


def from_status(code: grpc.StatusCode, message: str) -> DeltaBoxError:
    """The exception a client raises for a status the daemon returned."""
    return _BY_CODE.get(code, DeltaBoxError)(message)
