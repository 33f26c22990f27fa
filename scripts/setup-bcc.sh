#!/usr/bin/env bash
# Makes bcc (eBPF compiler collection) usable for DeltaBox's turn inspector. Idempotent and
# quick when everything is in place. Run as root (scripts/install-deps.sh calls it).
#
#   scripts/setup-bcc.sh [--venv DIR]
#
# 1. Debian's python3-bpfcc (bcc's Python binding + libbcc) if `bcc` is missing.
# 2. Kernel headers for the running kernel, which bcc compiles its programs against:
#    - /lib/modules/$(uname -r)/build already has headers (a normal host): nothing to do;
#    - else Debian's linux-headers-$(uname -r) if that package exists (a Debian kernel);
#    - else (a custom kernel, e.g. a Firecracker VM) Debian's current linux-headers for the
#      architecture, linked as /lib/modules/$(uname -r)/build (and `source` -> the -common
#      headers). The inspector reads syscall arguments only from tracepoint records, whose
#      layout bcc takes from the running kernel's tracefs, so it never depends on kernel
#      struct layouts these headers might get wrong.
# 3. tracefs at /sys/kernel/tracing and debugfs at /sys/kernel/debug (the daemon mounts them
#    again after a reboot: deltabox.inspector.setup.prepare_kernel_interfaces).
# 4. With --venv DIR: a symlink of just the `bcc` package into that virtualenv's
#    site-packages (deltabox.inspector also finds Debian's bcc without it).
#
# Exit status 0 when bcc is usable afterwards, 1 otherwise (with the reason on stderr).
set -uo pipefail

venv=""
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) venv="$2"; shift 2 ;;
    *) echo "setup-bcc: unknown argument $1" >&2; exit 2 ;;
  esac
done

say() { echo "setup-bcc: $*" >&2; }
kver=$(uname -r)
moddir=/lib/modules/$kver
BCC_PY=/usr/lib/python3/dist-packages/bcc

if [ "$(id -u)" != 0 ]; then
  say "need root"; exit 1
fi
export DEBIAN_FRONTEND=noninteractive
updated=0
apt_install() {
  apt-get install -y -q --no-install-recommends "$@" >/dev/null 2>&1 && return 0
  if [ $updated = 0 ]; then
    apt-get update -q >/dev/null 2>&1; updated=1
    apt-get install -y -q --no-install-recommends "$@" >/dev/null 2>&1 && return 0
  fi
  return 1
}
apt_has() {   # apt_has PKG: the package is known to apt (refreshes the lists once if not)
  [ -n "$(apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ && $2 != "(none)"')" ] && return 0
  if [ $updated = 0 ]; then apt-get update -q >/dev/null 2>&1; updated=1; fi
  [ -n "$(apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ && $2 != "(none)"')" ]
}

# 1. bcc
if [ ! -f "$BCC_PY/__init__.py" ]; then
  if ! command -v apt-get >/dev/null; then say "no apt-get: install bcc's python binding by hand"; exit 1; fi
  apt_install python3-bpfcc || { say "apt-get install python3-bpfcc failed"; exit 1; }
  say "installed python3-bpfcc"
fi

# 2. kernel headers
if [ ! -e "$moddir/build/include/linux/kconfig.h" ] && [ ! -e "$moddir/build/include/generated/autoconf.h" ]; then
  if apt_has "linux-headers-$kver"; then
    apt_install "linux-headers-$kver" || { say "apt-get install linux-headers-$kver failed"; exit 1; }
    say "installed linux-headers-$kver"
  else
    arch=$(dpkg --print-architecture)
    apt_install "linux-headers-$arch" || { say "apt-get install linux-headers-$arch failed"; exit 1; }
    # The newest installed flavour directory, e.g. /usr/src/linux-headers-6.1.0-50-amd64.
    hdr=$(ls -d /usr/src/linux-headers-*-"$arch" 2>/dev/null | sort -V | tail -n1)
    if [ -z "$hdr" ]; then say "no /usr/src/linux-headers-*-$arch after install"; exit 1; fi
    common=${hdr%-"$arch"}-common
    mkdir -p "$moddir"
    ln -sfn "$hdr" "$moddir/build"
    [ -d "$common" ] && ln -sfn "$common" "$moddir/source"
    say "kernel $kver has no headers package: linked $hdr as $moddir/build"
  fi
fi

# 3. tracefs / debugfs
mountpoint -q /sys/kernel/tracing || mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null \
  || say "cannot mount tracefs at /sys/kernel/tracing"
mountpoint -q /sys/kernel/debug || mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null \
  || say "cannot mount debugfs at /sys/kernel/debug"

# 4. the virtualenv
if [ -n "$venv" ] && [ -d "$venv" ]; then
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null)
  if [ -n "$site" ] && [ ! -e "$site/bcc" ]; then
    ln -s "$BCC_PY" "$site/bcc" && say "linked $BCC_PY into $site"
  fi
fi
exit 0
