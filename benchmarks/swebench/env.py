"""The task's environment: the repository (the package's sdist) and a Python environment.

Sandboxes have no network, so everything is downloaded on the host first, into a cache
(`<cache>/swebench/NAME-VERSION/`), with the sandbox's own interpreter (`/usr/bin/python3`,
so that environment markers and wheel tags match):

- `src/`: the sdist (`pip download --no-binary :all: --no-deps`), or, when that fails (requests
  2.0.1's setup.py does not run on Python 3.11), the wheel, whose files stand in for the repo;
- `tree/`: the unpacked sources;
- `wheelhouse/`: `pip download --prefer-binary` of the package with its dependencies, pytest,
  setuptools + wheel (for `pip install -e .` under build isolation) and whatever the
  trajectory's own `pip install` commands name.

Inside a sandbox (`build_base`): the tree goes to the trajectory's workdir, a venv is made with
`/usr/bin/python3 -m venv` (Debian's ensurepip brings pip), whose `pip.conf` points pip at the
uploaded wheelhouse with no index, so the agent's own `pip install X` works offline; pytest and
the package (editable) are installed; the workdir becomes a git repository with one commit; a
profile script puts the venv first on PATH for login shells (`bash -lc` resets PATH). The
sandbox is then checkpointed: that checkpoint is the "image" every system starts from.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import Timer, log

from .trajectory import Trajectory, pip_installed_names

SANDBOX_PYTHON = "/usr/bin/python3"
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ENV_ROOT = "/opt/swebench"
VENV = f"{ENV_ROOT}/venv"
WHEELHOUSE = f"{ENV_ROOT}/wheelhouse"
PROFILE_SCRIPT = "/etc/profile.d/zz-swebench-venv.sh"
BASE_PACKAGES = ("pytest", "setuptools", "wheel")
GIT_ID = ["-c", "user.name=swebench", "-c", "user.email=swebench@localhost"]


@dataclass
class HostEnv:
    """What the host prepared for one package version."""

    tree: Path                        # the sources to unpack at the workdir
    wheelhouse: Path | None           # None: no venv (tests' tiny local package)
    source: str                       # "sdist" | "wheel" | "local"
    package: str = ""                 # NAME==VERSION, installed editable or via a .pth
    extra: list[str] = field(default_factory=list)   # names from the agent's pip installs
    prepare_ms: float = 0.0


@dataclass
class SandboxEnv:
    """The base state every system starts from (a checkpoint of a prepared sandbox)."""

    workdir: str
    exec_env: dict[str, str]
    venv: str | None
    base_checkpoint: Any              # deltabox Checkpoint
    setup_sandbox: Any                # the sandbox it was taken in (kept until the run ends)
    info: dict[str, Any]


def _pip(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SANDBOX_PYTHON, "-m", "pip", *args], capture_output=True,
                          text=True, timeout=timeout)


def _download_source(traj: Trajectory, src: Path) -> tuple[Path, str]:
    """The sdist, else the wheel (see module docstring); (archive, kind)."""
    src.mkdir(parents=True, exist_ok=True)
    for kind, opts in (("sdist", ["--no-binary", ":all:"]), ("wheel", ["--only-binary", ":all:"])):
        failed = src / f".{kind}-failed"       # remembered: no new attempt on every run
        have = [p for p in src.iterdir() if _is_kind(p, kind)]
        if have:
            return have[0], kind
        if failed.exists():
            continue
        log(f"downloading {kind} of {traj.spec} ...")
        r = _pip(["download", "-q", *opts, "--no-deps", "--dest", str(src), traj.spec])
        have = [p for p in src.iterdir() if _is_kind(p, kind)]
        if have and r.returncode == 0:
            return have[0], kind
        log(f"{kind} of {traj.spec} not usable: {(r.stderr or r.stdout).strip()[-300:]}")
        for p in have:               # a failed sdist build may leave the archive behind
            p.unlink()
        failed.touch()
    raise RuntimeError(f"neither an sdist nor a wheel of {traj.spec} could be downloaded")


def _is_kind(p: Path, kind: str) -> bool:
    if kind == "wheel":
        return p.name.endswith(".whl")
    return p.name.endswith((".tar.gz", ".zip", ".tar.bz2"))


def _unpack(archive: Path, kind: str, dest: Path) -> Path:
    """Unpack once (a marker makes it idempotent); the directory that stands for the repo."""
    marker = dest / ".complete"
    if marker.exists():
        return next(p for p in dest.iterdir() if p.is_dir())
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    if kind == "wheel":
        top = dest / archive.name.split("-")[0]
        with zipfile.ZipFile(archive) as zf:
            for name in zf.namelist():
                if ".dist-info/" in name or name.endswith("/"):
                    continue   # metadata, not sources
                zf.extract(name, top)
    elif archive.name.endswith(".zip"):
        shutil.unpack_archive(str(archive), str(dest))
    else:
        with tarfile.open(archive) as tf:
            tf.extractall(dest, filter="data")
    tops = [p for p in dest.iterdir() if p.is_dir()]
    if len(tops) != 1:
        raise RuntimeError(f"{archive} did not unpack to one directory: {tops}")
    marker.touch()
    return tops[0]


def _wheelhouse(traj: Trajectory, dest: Path, extra: list[str]) -> None:
    """pip download of everything the sandbox may install; skipped when already complete
    for this requirement list."""
    reqs = [traj.spec, *BASE_PACKAGES, *extra]
    key = hashlib.sha256("\n".join(reqs).encode()).hexdigest()[:12]
    marker = dest / f".complete-{key}"
    if marker.exists():
        return
    dest.mkdir(parents=True, exist_ok=True)
    log(f"downloading a wheelhouse for {', '.join(reqs)} ...")
    r = _pip(["download", "-q", "--prefer-binary", "--dest", str(dest), *reqs])
    if r.returncode != 0:
        raise RuntimeError(f"pip download {' '.join(reqs)} failed:\n{r.stderr[-2000:]}")
    marker.touch()


def prepare_host(traj: Trajectory, cache_dir: Path) -> HostEnv:
    """Download and unpack (cached) what the sandbox needs for this trajectory."""
    with Timer() as tm:
        base = cache_dir / "swebench" / f"{traj.pypi_name}-{traj.pypi_version}"
        archive, kind = _download_source(traj, base / "src")
        tree = _unpack(archive, kind, base / f"tree-{kind}")
        extra = pip_installed_names(traj)
        _wheelhouse(traj, base / "wheelhouse", extra)
    return HostEnv(tree=tree, wheelhouse=base / "wheelhouse", source=kind, package=traj.spec,
                   extra=extra, prepare_ms=tm.ms)


def tar_of_contents(src: Path) -> bytes:
    """An uncompressed tar of the entries of `src` (relative names, no top directory), as
    `upload_tar(dest, ...)` expects."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for entry in sorted(os.listdir(src)):
            if entry.startswith(".complete"):
                continue
            tf.add(str(src / entry), arcname=entry)
    return buf.getvalue()


def exec_env(traj: Trajectory, venv: str | None) -> dict[str, str]:
    """The agent's environment plus the venv first on PATH (for `bash -c`; login shells get
    it from PROFILE_SCRIPT)."""
    env = dict(traj.env)
    if venv:
        env.update(PATH=f"{venv}/bin:{BASE_PATH}", VIRTUAL_ENV=venv)
    return env


def _setup_script(workdir: str, host: HostEnv) -> str:
    """Shell script run once in the setup sandbox (see module docstring)."""
    lines = ["set -e"]
    if host.wheelhouse is not None:
        pip = f"{VENV}/bin/pip"
        lines += [
            f"{SANDBOX_PYTHON} -m venv {VENV}",
            f"printf '[global]\\nno-index = true\\nfind-links = {WHEELHOUSE}\\n"
            f"disable-pip-version-check = true\\n' > {VENV}/pip.conf",
            f"{pip} install -q pytest",
            f"cd {workdir}",
            # editable install when the tree can be built; else deps + a .pth (wheel sources)
            "if [ -e setup.py ] || [ -e pyproject.toml ]; then "
            f"{pip} install -q -e .; else "
            f"{pip} install -q '{host.package}' && "
            f"{pip} uninstall -q -y '{host.package.split('==')[0]}' && "
            f"{VENV}/bin/python -c 'import site; print(site.getsitepackages()[0])' | "
            f"xargs -I{{}} sh -c 'echo {workdir} > {{}}/_swebench_workdir.pth'; fi",
            f"printf 'export VIRTUAL_ENV={VENV}\\nexport PATH={VENV}/bin:$PATH\\n' "
            f"> {PROFILE_SCRIPT}",
        ]
    lines += [
        f"cd {workdir}",
        "git init -q",
        "git add -A",
        f"git {' '.join(GIT_ID)} commit -q --no-verify -m base",
    ]
    return "\n".join(lines)


def build_base(socket: str, traj: Trajectory, host: HostEnv) -> SandboxEnv:
    """Prepare one sandbox with the repo and the venv, and checkpoint it (untimed setup)."""
    from deltabox import Sandbox

    info: dict[str, Any] = {"source": host.source, "package": host.package,
                            "agent_pip_installs": host.extra,
                            "host_prepare_ms": host.prepare_ms}
    sbx = Sandbox.create(socket=socket)
    try:
        with Timer() as tm:
            n = sbx.files.upload_tar(traj.workdir, tar_of_contents(host.tree))
            if host.wheelhouse is not None:
                sbx.files.upload_tar(WHEELHOUSE, tar_of_contents(host.wheelhouse))
        info.update(upload_ms=tm.ms, tree_entries=n)
        with Timer() as tm:
            r = sbx.exec(["bash", "-c", _setup_script(traj.workdir, host)], timeout=900)
        info.update(setup_ms=tm.ms, setup_exit=r.exit_code)
        if r.exit_code != 0:
            raise RuntimeError(f"environment setup failed ({r.exit_code}):\n"
                               f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
        venv = VENV if host.wheelhouse is not None else None
        env = exec_env(traj, venv)
        if venv:
            r = sbx.exec([f"{venv}/bin/pip", "list", "--format=freeze"], env=env, timeout=120)
            info["pip_freeze"] = r.stdout.split()
        cp = sbx.checkpoint(label="base")
        info["base_checkpoint"] = {"id": cp.id, "kind": cp.kind, "ms": cp.duration_ms,
                                   "files_changed": cp.files_changed}
        log(f"base environment ready: {n} repo entries, setup {info['setup_ms']:.0f} ms, "
            f"checkpoint {cp.id} ({cp.kind})")
        return SandboxEnv(workdir=traj.workdir, exec_env=env, venv=venv, base_checkpoint=cp,
                          setup_sandbox=sbx, info=info)
    except BaseException:
        sbx.kill()
        raise
