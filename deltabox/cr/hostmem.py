"""The host's transparent huge page (THP) setting, which decides what a template costs.

A template, and every process restored from one, is a fork: the kernel copies the
process's page tables. Anonymous memory in 4 KiB pages costs one entry per page (200 MB:
51,200 entries, ~4.6 ms of one CPU here, on the checkpoint's critical path and again for
every fork child); in 2 MiB pages one entry per 2 MiB, and large folios are copied in
batches. Which pages a process gets is the host administrator's choice
(/sys/kernel/mm/transparent_hugepage); DeltaBox reports it and never changes it
(README: "Host tuning"). Under "madvise", a sandbox created with `huge_pages` has its
programs ask, through glibc's malloc (with_huge_pages).
"""

from __future__ import annotations

from pathlib import Path

THP_DIR = Path("/sys/kernel/mm/transparent_hugepage")


def selected(path: Path) -> str:
    """The bracketed choice of a sysfs selector ("always [madvise] never" -> "madvise"),
    or "unknown" if unreadable."""
    try:
        text = path.read_text()
    except OSError:
        return "unknown"
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return "unknown"


def unadvised_sizes(thp_dir: Path = THP_DIR) -> list[str]:
    """Large page sizes (e.g. "64kB", "2048kB") the kernel gives anonymous memory that no
    process asked for with madvise(MADV_HUGEPAGE): the ones that make forks cheap for
    every sandboxed program."""
    top = selected(thp_dir / "enabled")
    sizes = []
    for d in sorted(thp_dir.glob("hugepages-*kB"), key=lambda p: int(p.name[10:-2])):
        mode = selected(d / "enabled")
        if mode == "always" or (mode == "inherit" and top == "always"):
            sizes.append(d.name.removeprefix("hugepages-"))
    if not sizes and top == "always" and not any(thp_dir.glob("hugepages-*kB")):
        sizes.append("PMD-size")  # a kernel without per-size (mTHP) controls
    return sizes


def describe(thp_dir: Path = THP_DIR) -> str:
    """One line for `deltabox info`: the mode and what it means for templates."""
    top = selected(thp_dir / "enabled")
    if top == "unknown":
        return "unknown (no /sys/kernel/mm/transparent_hugepage)"
    sizes = unadvised_sizes(thp_dir)
    if sizes:
        return f"{top}: anonymous memory in large pages ({', '.join(sizes)})"
    return (f"{top}: anonymous memory in 4 KiB pages unless a process asks (a sandbox "
            "created with huge_pages asks); templates and forks copy a page-table entry per "
            "page (README: Host tuning)")


# glibc's malloc then asks for THP (madvise(MADV_HUGEPAGE)) on the memory it maps: a
# program of the sandbox gets 2 MiB pages under the host's "madvise" mode without asking
# itself (glibc >= 2.35; programs with another allocator are unaffected).
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb"


def with_huge_pages(env: dict[str, str], thp_dir: Path = THP_DIR) -> dict[str, str]:
    """`env` with glibc's malloc asking for huge pages (a sandbox created with
    huge_pages): added to GLIBC_TUNABLES, unless the caller set that tunable itself.
    Raises ValueError when the host gives no huge page to a process that asks."""
    mode = selected(thp_dir / "enabled")
    if mode not in ("madvise", "always"):
        raise ValueError(f"the host's transparent huge pages are {mode!r} "
                         f"({thp_dir / 'enabled'}): no program gets them even when it asks; "
                         "an administrator can set madvise (README: Host tuning)")
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    if not any(t.split("=")[0] == HUGE_PAGES_TUNABLE for t in tunables):
        tunables.append(f"{HUGE_PAGES_TUNABLE}=1")
    return {**env, "GLIBC_TUNABLES": ":".join(tunables)}
