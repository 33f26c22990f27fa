"""Turn inspector: what a sandbox's processes did between two checkpoints (eBPF via bcc),
and the policy that turns it into a skipped / fs / full checkpoint.

    from deltabox.inspector import Inspector, InspectorUnavailable, decide
    insp = Inspector.load()                    # raises InspectorUnavailable(reason)
    insp.watch(sandbox_id, cgroup_id, pids=[...])
    insp.expect_entry(sandbox_id, helper_pid)  # the daemon's exec helper
    effects = insp.turn(sandbox_id)            # with the sandbox's cgroup frozen
    decision = decide(effects, parent_kind="full", processes_alive=True)

See core.py (mechanics), program.py (the eBPF side) and policy.py (rules).
"""

from .core import Inspector, InspectorUnavailable
from .effects import (AddressSpaceChange, ExecedProcess, ExitedProcess, ForkedProcess,
                      RanProcess, SignalledProcess, SocketOp, TurnEffects)
from .policy import (Decision, decide, process_changes, touched_processes,
                     untouched_processes)
from .setup import cgroup_id, prepare_kernel_interfaces, unified_cgroup_mount

__all__ = [
    "AddressSpaceChange", "Decision", "ExecedProcess", "ExitedProcess", "ForkedProcess",
    "Inspector", "InspectorUnavailable", "RanProcess", "SignalledProcess", "SocketOp",
    "TurnEffects", "cgroup_id", "decide", "prepare_kernel_interfaces", "process_changes",
    "touched_processes", "unified_cgroup_mount", "untouched_processes",
]
