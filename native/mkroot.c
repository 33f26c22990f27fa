/* dbx-mkroot: build one generation of a sandbox's file system in a new mount namespace.
 *
 *   dbx-mkroot --pidfd FD --lower DIR[:DIR...] --upper DIR --work DIR --mountpoint DIR
 *
 * Joins the sandbox's pid/net/... namespaces (through a pidfd of its init) and forks, so the
 * child is a process of the sandbox: /proc mounted by it shows the sandbox's pids and /sys its
 * network devices. The child unshares a mount namespace, mounts the overlay (lower = mask +
 * image, upper = the writable DeltaFS layer), mounts /proc (host-kernel knobs read-only,
 * kernel-revealing files masked), /sys (read-only, firmware and the like masked), a minimal
 * /dev and /dev/pts, pivots into the overlay and drops every host mount. It then prints "ready" and
 * waits for stdin to close: meanwhile deltaboxd opens /proc/<pid>/ns/mnt (to enter this
 * namespace later) and /proc/<pid>/root (the root of the files API). The namespace lives on
 * as long as deltaboxd holds those or a sandbox process is inside.
 *
 * The parent prints the child's host pid first, then waits and exits with its status.
 */
#include "common.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

struct mkroot_opts {
	int pidfd;
	const char *lower, *upper, *work, *mountpoint;
};

struct devnode {
	const char *name;
	unsigned int major, minor;
};

/* The usual device nodes of a container; nothing that reaches hardware. */
static const struct devnode devnodes[] = {
	{"null", 1, 3}, {"zero", 1, 5}, {"full", 1, 7},
	{"random", 1, 8}, {"urandom", 1, 9}, {"tty", 5, 0},
};

/* Parts of /proc that configure the host kernel: visible, not writable. */
static const char *const proc_readonly[] = {
	"sys", "sysrq-trigger", "irq", "bus", "fs",
};

/* Paths that show or touch the host kernel and hardware (runc's default masked paths and a
 * few more that leak kernel addresses or physical memory layout): a file is covered by a
 * bind of /dev/null, a directory by an empty read-only tmpfs. Sandbox code cannot unmount
 * them (the seccomp filter refuses umount2 and every other mount call). */
static const char *const masked_paths[] = {
	"proc/kcore", "proc/keys", "proc/key-users", "proc/timer_list", "proc/timer_stats",
	"proc/sched_debug", "proc/latency_stats", "proc/kallsyms", "proc/kpagecount",
	"proc/kpageflags", "proc/kpagecgroup", "proc/vmallocinfo", "proc/slabinfo",
	"proc/iomem", "proc/ioports", "proc/mtrr", "proc/kmsg", "proc/acpi", "proc/asound",
	"proc/scsi", "proc/driver", "proc/bootconfig",
	"sys/firmware", "sys/devices/virtual/powercap", "sys/kernel/debug",
	"sys/kernel/tracing", "sys/kernel/security", "sys/kernel/vmcoreinfo", "sys/fs/bpf",
	"sys/fs/cgroup",
};

static void parse_args(int argc, char **argv, struct mkroot_opts *o)
{
	static const struct option longopts[] = {
		{"pidfd", required_argument, NULL, 'p'},
		{"lower", required_argument, NULL, 'l'},
		{"upper", required_argument, NULL, 'u'},
		{"work", required_argument, NULL, 'w'},
		{"mountpoint", required_argument, NULL, 'm'},
		{NULL, 0, NULL, 0},
	};
	int c;

	memset(o, 0, sizeof(*o));
	o->pidfd = -1;
	while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
		switch (c) {
		case 'p': o->pidfd = dbx_parse_fd(optarg, "--pidfd"); break;
		case 'l': o->lower = optarg; break;
		case 'u': o->upper = optarg; break;
		case 'w': o->work = optarg; break;
		case 'm': o->mountpoint = optarg; break;
		default: dbx_die("usage: dbx-mkroot --pidfd FD --lower L --upper U --work W "
				 "--mountpoint M");
		}
	}
	if (o->pidfd < 0 || !o->lower || !o->upper || !o->work || !o->mountpoint)
		dbx_die("--pidfd, --lower, --upper, --work and --mountpoint are required");
}

/* nodev: device nodes in the image or the layer do not open (only /dev, a tmpfs of its own,
 * has devices). */
static void mount_overlay(const struct mkroot_opts *o)
{
	size_t len = strlen(o->lower) + strlen(o->upper) + strlen(o->work) + 64;
	char *data = malloc(len);

	if (!data)
		dbx_die("out of memory");
	snprintf(data, len, "lowerdir=%s,upperdir=%s,workdir=%s", o->lower, o->upper, o->work);
	if (mount("deltabox", o->mountpoint, "overlay", MS_NODEV, data) < 0)
		dbx_die_errno("mount overlay at %s (%s)", o->mountpoint, data);
	free(data);
}

static void mount_at(const char *src, const char *target, const char *fstype,
		     unsigned long flags, const char *data)
{
	if (mount(src, target, fstype, flags, data) < 0)
		dbx_die_errno("mount %s at %s", fstype ? fstype : src, target);
}

static void make_dev(void)
{
	for (size_t i = 0; i < sizeof(devnodes) / sizeof(devnodes[0]); i++) {
		char path[64];
		snprintf(path, sizeof(path), "dev/%s", devnodes[i].name);
		if (mknod(path, S_IFCHR | 0666, makedev(devnodes[i].major, devnodes[i].minor)) < 0)
			dbx_die_errno("mknod %s", path);
		if (chmod(path, 0666) < 0) /* mknod is subject to the umask */
			dbx_die_errno("chmod %s", path);
	}
	if (mkdir("dev/pts", 0755) < 0 || mkdir("dev/shm", 01777) < 0)
		dbx_die_errno("mkdir dev/pts, dev/shm");
	mount_at("devpts", "dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
		 "newinstance,ptmxmode=0666,mode=0620");
	mount_at("shm", "dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
	if (symlink("pts/ptmx", "dev/ptmx") < 0 || symlink("/proc/self/fd", "dev/fd") < 0 ||
	    symlink("/proc/self/fd/0", "dev/stdin") < 0 ||
	    symlink("/proc/self/fd/1", "dev/stdout") < 0 ||
	    symlink("/proc/self/fd/2", "dev/stderr") < 0)
		dbx_die_errno("symlinks in /dev");
}

/* A read-only bind of a path onto itself: MS_BIND first, then a remount that adds RDONLY
 * (the kernel ignores MS_RDONLY on the initial bind). */
static void bind_readonly(const char *path)
{
	if (mount(path, path, NULL, MS_BIND | MS_REC, NULL) < 0) {
		if (errno == ENOENT)
			return;
		dbx_die_errno("bind %s", path);
	}
	if (mount(NULL, path, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV,
		  NULL) < 0)
		dbx_die_errno("remount %s read-only", path);
}

static void mask_path(const char *path)
{
	struct stat st;

	if (lstat(path, &st) < 0) {
		if (errno == ENOENT)
			return;
		dbx_die_errno("stat %s", path);
	}
	if (S_ISDIR(st.st_mode)) {
		mount_at("dbx-mask", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
			 "size=0,mode=0555");
		return;
	}
	if (mount("dev/null", path, NULL, MS_BIND, NULL) < 0)
		dbx_die_errno("mask %s", path);
}

static void mount_pseudo_filesystems(void)
{
	char path[64];

	mount_at("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
	for (size_t i = 0; i < sizeof(proc_readonly) / sizeof(proc_readonly[0]); i++) {
		snprintf(path, sizeof(path), "proc/%s", proc_readonly[i]);
		bind_readonly(path);
	}
	mount_at("sysfs", "sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, NULL);
	mount_at("dev", "dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k");
	make_dev();
	for (size_t i = 0; i < sizeof(masked_paths) / sizeof(masked_paths[0]); i++)
		mask_path(masked_paths[i]);
}

static void pivot_into(const char *mountpoint)
{
	if (chdir(mountpoint) < 0)
		dbx_die_errno("chdir %s", mountpoint);
	if (syscall(SYS_pivot_root, ".", ".") < 0)
		dbx_die_errno("pivot_root into %s", mountpoint);
	if (umount2(".", MNT_DETACH) < 0)
		dbx_die_errno("detach the host root");
	if (chdir("/") < 0)
		dbx_die_errno("chdir /");
}

static __attribute__((noreturn)) void build_root(const struct mkroot_opts *o)
{
	char buf[64];
	ssize_t n;

	if (unshare(CLONE_NEWNS) < 0)
		dbx_die_errno("unshare mount namespace");
	if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
		dbx_die_errno("make mounts private");
	mount_overlay(o);
	if (chdir(o->mountpoint) < 0)
		dbx_die_errno("chdir %s", o->mountpoint);
	mount_pseudo_filesystems();
	pivot_into(o->mountpoint);
	if (dbx_write_all(STDOUT_FILENO, "ready\n", 6) < 0)
		dbx_die_errno("report ready");
	while ((n = read(STDIN_FILENO, buf, sizeof(buf))) != 0)
		if (n < 0 && errno != EINTR)
			dbx_die_errno("wait for stdin to close");
	_exit(0);
}

int main(int argc, char **argv)
{
	struct mkroot_opts o;
	pid_t child;
	int status;
	char line[32];

	dbx_set_progname("dbx-mkroot");
	parse_args(argc, argv, &o);
	if (setns(o.pidfd, DBX_NS_FLAGS) < 0)
		dbx_die_errno("setns into the namespaces of the sandbox init (pidfd %d)", o.pidfd);
	close(o.pidfd);
	child = fork();
	if (child < 0)
		dbx_die_errno("fork");
	if (child == 0)
		build_root(&o);
	snprintf(line, sizeof(line), "%d\n", child);
	if (dbx_write_all(STDOUT_FILENO, line, strlen(line)) < 0)
		dbx_die_errno("report pid %d", child);
	while (waitpid(child, &status, 0) < 0)
		if (errno != EINTR)
			dbx_die_errno("wait for %d", child);
	return dbx_exit_code(status);
}
