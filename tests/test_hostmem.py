"""The host's transparent huge page setting, as `deltabox info` reports it.

The parsing cases use a copy of the sysfs layout in a temporary directory: the other host
configurations are real kernel settings, but a test must not change the host's memory
policy under the rest of the suite (and the daemons of other tests)."""

from __future__ import annotations

from pathlib import Path

import deltabox
from deltabox.cr import hostmem


def fake_thp(tmp_path: Path, top: str, sizes: dict[str, str]) -> Path:
    modes = ["always", "madvise", "never"]
    (tmp_path / "enabled").write_text(" ".join(f"[{m}]" if m == top else m for m in modes))
    for size, mode in sizes.items():
        d = tmp_path / f"hugepages-{size}"
        d.mkdir()
        choices = ["always", "inherit", "madvise", "never"]
        (d / "enabled").write_text(" ".join(f"[{m}]" if m == mode else m for m in choices))
    return tmp_path


def test_madvise_host_gives_4k_pages_to_sandboxed_programs(tmp_path: Path) -> None:
    thp = fake_thp(tmp_path, "madvise", {"2048kB": "inherit", "64kB": "never"})
    assert hostmem.unadvised_sizes(thp) == []
    assert hostmem.describe(thp).startswith("madvise: anonymous memory in 4 KiB pages")


def test_always_or_a_per_size_always_gives_large_pages(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    top = fake_thp(tmp_path / "a", "always", {"2048kB": "inherit", "64kB": "always",
                                              "16kB": "never"})
    assert hostmem.unadvised_sizes(top) == ["64kB", "2048kB"]
    mthp = fake_thp(tmp_path / "b", "madvise", {"2048kB": "inherit", "64kB": "always"})
    assert hostmem.unadvised_sizes(mthp) == ["64kB"]
    assert hostmem.describe(mthp) == "madvise: anonymous memory in large pages (64kB)"


def test_unreadable_setting_is_unknown(tmp_path: Path) -> None:
    assert hostmem.selected(tmp_path / "missing") == "unknown"
    assert hostmem.describe(tmp_path).startswith("unknown")


def test_info_reports_the_hosts_mode(daemon) -> None:
    mode = hostmem.selected(hostmem.THP_DIR / "enabled")
    text = deltabox.info(socket=daemon.socket).transparent_hugepages
    assert text.split(":")[0] == mode, text
