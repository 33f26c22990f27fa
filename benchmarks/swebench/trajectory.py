"""Agent trajectories in the format of ../shared/trajectories/README.md, loaded once and
validated, so that the replay code never has to guess about a field."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_WORKDIR = "/testbed"          # where mini-swe-agent's SWE-bench images keep the repo
DEFAULT_INTERPRETER = ("bash", "-c")
TRAJECTORY_DIR = Path(__file__).resolve().parents[3] / "shared" / "trajectories"


@dataclass(frozen=True)
class Action:
    """One step of the agent: a shell command, an in-place edit or a file creation."""

    kind: str                         # "shell" | "edit" | "create"
    cmd: str = ""                     # shell
    returncode: int | None = None     # shell: what the original run got
    path: str = ""                    # edit / create
    old: str = ""                     # edit
    new: str = ""                     # edit
    content: str = ""                 # create

    def label(self, limit: int = 60) -> str:
        """A one-line description for logs and reports."""
        text = self.cmd if self.kind == "shell" else f"{self.kind} {self.path}"
        text = " ".join(text.split())
        return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass(frozen=True)
class Trajectory:
    path: str
    name: str
    instance_id: str
    agent: str
    model: str
    pypi_name: str
    pypi_version: str
    workdir: str
    interpreter: tuple[str, ...]
    env: dict[str, str]
    actions: tuple[Action, ...]
    notes: list[str] = field(default_factory=list)

    @property
    def spec(self) -> str:
        return f"{self.pypi_name}=={self.pypi_version}"

    def describe(self) -> dict[str, Any]:
        """What results.json records about the trajectory."""
        kinds: dict[str, int] = {}
        for a in self.actions:
            kinds[a.kind] = kinds.get(a.kind, 0) + 1
        return {"file": self.path, "name": self.name, "instance_id": self.instance_id,
                "agent": self.agent, "model": self.model, "pypi": self.spec,
                "workdir": self.workdir, "interpreter": list(self.interpreter),
                "env": self.env, "actions": len(self.actions), "kinds": kinds,
                "notes": self.notes}


def _action(raw: dict[str, Any], i: int, where: str) -> Action:
    kind = raw.get("kind")
    if kind == "shell":
        if not isinstance(raw.get("cmd"), str):
            raise ValueError(f"{where}: action {i}: shell without a cmd string")
        rc = raw.get("returncode")
        return Action("shell", cmd=raw["cmd"], returncode=rc if isinstance(rc, int) else None)
    if kind == "edit":
        for k in ("path", "old", "new"):
            if not isinstance(raw.get(k), str):
                raise ValueError(f"{where}: action {i}: edit without {k!r}")
        return Action("edit", path=raw["path"], old=raw["old"], new=raw["new"])
    if kind == "create":
        for k in ("path", "content"):
            if not isinstance(raw.get(k), str):
                raise ValueError(f"{where}: action {i}: create without {k!r}")
        return Action("create", path=raw["path"], content=raw["content"])
    raise ValueError(f"{where}: action {i}: unknown kind {kind!r}")


def from_dict(doc: dict[str, Any], path: str = "<dict>") -> Trajectory:
    """Validate one trajectory document. A workdir that is not an absolute path (moatless
    says "<repo root>") becomes /testbed; a missing interpreter is `bash -c`."""
    pypi = doc.get("pypi") or {}
    if not pypi.get("name") or not pypi.get("version"):
        raise ValueError(f"{path}: no pypi name/version")
    actions = tuple(_action(a, i, path) for i, a in enumerate(doc.get("actions") or []))
    if not actions:
        raise ValueError(f"{path}: no actions")
    workdir = doc.get("workdir") or ""
    if not (isinstance(workdir, str) and workdir.startswith("/")):
        workdir = DEFAULT_WORKDIR
    interp = doc.get("interpreter") or list(DEFAULT_INTERPRETER)
    notes = doc.get("notes") or []
    return Trajectory(
        path=path, name=Path(path).stem, instance_id=str(doc.get("instance_id", "")),
        agent=str(doc.get("agent", "")), model=str(doc.get("model", "")),
        pypi_name=str(pypi["name"]), pypi_version=str(pypi["version"]),
        workdir=workdir.rstrip("/") or "/", interpreter=tuple(map(str, interp)),
        env={str(k): str(v) for k, v in (doc.get("env") or {}).items()},
        actions=actions, notes=[notes] if isinstance(notes, str) else list(notes))


def load(path: str | Path) -> Trajectory:
    p = Path(path)
    return from_dict(json.loads(p.read_text()), str(p))


def all_files(directory: Path = TRAJECTORY_DIR) -> list[Path]:
    return sorted(directory.glob("*.json"))


_PIP_INSTALL = re.compile(r"\bpip3?\s+install\s+([^;&|<>\n]*)")
_PIP_OPTS_WITH_ARG = {"-e", "--editable", "-r", "--requirement", "-c", "--constraint",
                      "-t", "--target", "--prefix", "--root", "-i", "--index-url",
                      "--extra-index-url", "-f", "--find-links", "--src", "--upgrade-strategy"}


def pip_installed_names(traj: Trajectory) -> list[str]:
    """Requirements the agent's own `pip install` commands name (not paths or options):
    the sandbox has no network, so they must be in its local wheelhouse."""
    out: list[str] = []
    for a in traj.actions:
        if a.kind != "shell":
            continue
        for m in _PIP_INSTALL.finditer(a.cmd):
            try:
                words = shlex.split(m.group(1))
            except ValueError:
                words = m.group(1).split()
            skip = False
            for w in words:
                if skip:
                    skip = False
                    continue
                if w in _PIP_OPTS_WITH_ARG:
                    skip = True
                    continue
                if w.startswith("-") or "/" in w or w.startswith(".") or "=" == w[:1]:
                    continue
                if re.match(r"^[A-Za-z][A-Za-z0-9._\-\[\],<>=!~]*$", w) and w not in out:
                    out.append(w)
    return out
