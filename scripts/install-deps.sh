#!/usr/bin/env bash
# Installs the Debian packages DeltaBox needs, once. Idempotent: does nothing when all present.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# bcc and kernel headers for the turn inspector (eBPF). Not fatal: without them the daemon
# runs with the conservative fallback (every checkpoint "full") and says why.
bcc() {
  bash "$here/setup-bcc.sh" --venv "$here/../.venv" ||
    echo "install-deps: warning: eBPF inspector not set up (see above); checkpoints will not be skipped" >&2
}
need=()
command -v mkfs.btrfs >/dev/null || need+=(btrfs-progs)
command -v losetup >/dev/null || need+=(mount)
command -v gcc >/dev/null || need+=(gcc libc6-dev)
command -v tar >/dev/null || need+=(tar)
command -v ip >/dev/null || need+=(iproute2)
# The tests' and benchmarks' agent workloads run the host's git and pip inside sandboxes.
command -v git >/dev/null || need+=(git)
/usr/bin/python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
# The fidelity catalog restores a node server (V8: many threads, a MADV_DONTFORK heap)
# and a tmux session (a pty's pair and its controlling terminal).
command -v node >/dev/null || need+=(nodejs)
command -v tmux >/dev/null || need+=(tmux)
# ... vim in a tmux pane (a glibc SIGEV_THREAD timer: a thread the timer signals)
command -v vim >/dev/null || need+=(vim)
# ... nginx (a root master whose workers run as nobody, all in its session; its pid file)
command -v nginx >/dev/null || need+=(nginx-light)
# ... PostgreSQL (a System V segment, 148 MiB of shared buffers, its own user); the
# package's own cluster is not made (nothing of it runs on the host)
ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || need+=(postgresql)
# ... MariaDB (InnoDB's threads, buffer pool and redo log; its AIO fallback in a sandbox)
command -v mariadbd >/dev/null || need+=(mariadb-server)
# ... Redis (its background threads; a client blocked in it over loopback TCP)
command -v redis-server >/dev/null || need+=(redis-server)
# The read-ahead's test sees a file's page cache from inside a sandbox (fincore).
command -v fincore >/dev/null || need+=(util-linux-extra)
# ... and a JVM (its NIO socket whose peer it closed, a few dozen threads).
command -v javac >/dev/null || need+=(default-jdk-headless)
# ... and headless Chromium (a dozen processes: Mojo socket pairs, shared memory, netlink).
command -v chromium >/dev/null || need+=(chromium)
if [ ${#need[@]} -eq 0 ]; then bcc; exit 0; fi
if [ "$(id -u)" != 0 ]; then
  echo "install-deps: need root to install ${need[*]} (apt-get)" >&2; exit 1
fi
export DEBIAN_FRONTEND=noninteractive
if [[ " ${need[*]} " == *" postgresql "* ]]; then
  mkdir -p /etc/postgresql-common/createcluster.d
  echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.d/deltabox.conf
fi
apt-get install -y -q "${need[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null; apt-get install -y -q "${need[@]}" >/dev/null; }
echo "install-deps: installed ${need[*]}"
bcc
