#!/usr/bin/env bash
# Installs the Debian packages DeltaBox needs, once. Idempotent: does nothing when all present.
set -euo pipefail
need=()
command -v mkfs.btrfs >/dev/null || need+=(btrfs-progs)
command -v losetup >/dev/null || need+=(mount)
command -v gcc >/dev/null || need+=(gcc libc6-dev)
command -v tar >/dev/null || need+=(tar)
command -v ip >/dev/null || need+=(iproute2)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "install-deps: need root to install ${need[*]} (apt-get)" >&2; exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q "${need[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null; apt-get install -y -q "${need[@]}" >/dev/null; }
echo "install-deps: installed ${need[*]}"
