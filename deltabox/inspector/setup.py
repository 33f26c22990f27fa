"""What the inspector needs from the host, checked (and where possible fixed) at load time.

- `prepare_kernel_interfaces()`: mounts tracefs and debugfs if missing (a reboot loses
  mounts; scripts/setup-bcc.sh mounts them at install time). Idempotent.
- `import_bcc()`: the `bcc` module, from the running Python's path or, failing that, from
  Debian's python3-bpfcc (/usr/lib/python3/dist-packages/bcc, a pure-Python package over
  libbcc.so) loaded by its path alone, so nothing else of Debian's site-packages leaks into
  the virtualenv.
- `kernel_headers_problem()`: bcc compiles against /lib/modules/$(uname -r)/build.
- `unified_cgroup_mount()` / `cgroup_id()`: where cgroup2 is mounted (/sys/fs/cgroup on a v2
  host, /sys/fs/cgroup/unified on a hybrid one) and the id bpf_get_current_cgroup_id()
  returns for a cgroup directory there (its inode number).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

DEBIAN_BCC = Path("/usr/lib/python3/dist-packages/bcc")
TRACEFS = Path("/sys/kernel/tracing")
DEBUGFS = Path("/sys/kernel/debug")


def _mounted(path: Path, fstype: str) -> bool:
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[1] == str(path) and parts[2] == fstype:
                return True
    except OSError:
        pass
    return False


def _mount(source: str, target: Path, fstype: str) -> str | None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                           ctypes.c_void_p]
    if not target.is_dir():
        return f"{target} does not exist (no {fstype} support in this kernel?)"
    if libc.mount(source.encode(), str(target).encode(), fstype.encode(), 0, None) != 0:
        err = ctypes.get_errno()
        if err == 16:   # EBUSY: mounted meanwhile
            return None
        return f"cannot mount {fstype} at {target}: {os.strerror(err)}"
    return None


def prepare_kernel_interfaces() -> list[str]:
    """Mount tracefs at /sys/kernel/tracing and debugfs at /sys/kernel/debug where missing.
    Returns the problems (empty when both are there). Needs CAP_SYS_ADMIN to mount."""
    problems = []
    if not _mounted(DEBUGFS, "debugfs"):
        p = _mount("debugfs", DEBUGFS, "debugfs")
        if p:
            problems.append(p)
    # debugfs automounts tracefs at /sys/kernel/debug/tracing; bcc uses /sys/kernel/tracing
    # when it exists, so mount it there too.
    if not _mounted(TRACEFS, "tracefs"):
        p = _mount("tracefs", TRACEFS, "tracefs")
        if p:
            problems.append(p)
    return problems


def kernel_headers_problem() -> str | None:
    build = Path("/lib/modules") / os.uname().release / "build"
    if not (build / "include").is_dir():
        return (f"kernel headers missing: {build} does not exist "
                f"(run scripts/setup-bcc.sh as root)")
    return None


def import_bcc() -> ModuleType:
    """The bcc Python module. Raises ImportError with a reason."""
    mod = sys.modules.get("bcc")
    if mod is not None:
        return mod
    try:
        import bcc  # noqa: F401
        return sys.modules["bcc"]
    except ImportError:
        pass
    init = DEBIAN_BCC / "__init__.py"
    if not init.is_file():
        raise ImportError("bcc not installed (Debian python3-bpfcc: run scripts/setup-bcc.sh)")
    spec = importlib.util.spec_from_file_location("bcc", init,
                                                  submodule_search_locations=[str(DEBIAN_BCC)])
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load bcc from {DEBIAN_BCC}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bcc"] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        sys.modules.pop("bcc", None)
        raise ImportError(f"bcc from {DEBIAN_BCC} does not load: {e}") from e
    return mod


def unified_cgroup_mount() -> Path | None:
    """Mount point of the cgroup2 hierarchy, or None."""
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "cgroup2":
                return Path(parts[1])
    except OSError:
        pass
    return None


def cgroup_id(path: str | os.PathLike[str]) -> int:
    """The cgroup id of a cgroup2 directory, as bpf_get_current_cgroup_id() reports it."""
    return os.stat(path).st_ino
