"""DeltaBox: Linux sandboxes with millisecond checkpoint, rollback and fork.

    from deltabox import Sandbox
    with Sandbox.create() as sbx:
        cp = sbx.checkpoint()
        sbx.exec("rm -rf /workspace/*")
        sbx.rollback(cp)

The SDK and models load on first use (PEP 562), so the daemon and CLI importing
`deltabox.errors` do not pay for pydantic and the SDK.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deltabox.errors import (DeadlineExceeded, DeltaBoxError, FailedPrecondition, Internal,
                             InvalidArgument, NotFound, ResourceExhausted, Unavailable)

if TYPE_CHECKING:
    from deltabox.models import (Checkpoint, DaemonInfo, DiffResult, ExecResult, FileInfo,
                                 ReadBytes, RollbackResult, SandboxInfo, WriteResult)
    from deltabox.sdk import Files, Sandbox, Session, info

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "Sandbox": "deltabox.sdk",
    "Session": "deltabox.sdk",
    "Files": "deltabox.sdk",
    "info": "deltabox.sdk",
    "Checkpoint": "deltabox.models",
    "ExecResult": "deltabox.models",
    "RollbackResult": "deltabox.models",
    "DiffResult": "deltabox.models",
    "FileInfo": "deltabox.models",
    "WriteResult": "deltabox.models",
    "ReadBytes": "deltabox.models",
    "SandboxInfo": "deltabox.models",
    "DaemonInfo": "deltabox.models",
}

__all__ = [
    "DeadlineExceeded", "DeltaBoxError", "FailedPrecondition", "Internal", "InvalidArgument",
    "NotFound", "ResourceExhausted", "Unavailable",
    "Sandbox", "Session", "Files", "info",
    "Checkpoint", "ExecResult", "RollbackResult", "DiffResult", "FileInfo", "WriteResult",
    "ReadBytes", "SandboxInfo", "DaemonInfo",
]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'deltabox' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
