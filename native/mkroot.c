/* dbx-mkroot: build one generation of a sandbox's file system in a new mount namespace.
 *
 *   dbx-mkroot --pidfd FD --lower DIR[:DIR...] --upper DIR --work DIR --mountpoint DIR
 *              [--userns FD --root-id ID]
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
 *
 * With --userns (the sandbox has a user namespace, FD; ID is the host uid and gid of its
 * root), three things change. The layers are seen through idmapped mounts (a clone of each
 * layer's mount with MOUNT_ATTR_IDMAP of the sandbox's user namespace), so that their
 * on-disk ids stay the sandbox's own (a file of its root is owned by 0 on disk, by ID on the
 * host's view through the mount, by 0 inside). The clones are attached in a scratch tmpfs
 * under the mountpoint (overlayfs takes its layers by path; the overlay is then mounted on
 * top). The overlay is mounted with fsuid/fsgid ID: overlayfs creates upper files (copy-up,
 * whiteouts, new files) with its mounter's fsuid, which an idmapped upper layer must map, and
 * host 0 is not mapped. Last, once pivoted, the child joins the user namespace, becomes root
 * there and unshares a mount namespace once more: that one is owned by the sandbox's user
 * namespace, which the daemon's injected setns of a restored process needs, and the kernel
 * locks every mount copied into it (MNT_LOCKED), so nothing inside can uncover what the
 * masks hide even with the capabilities the sandbox has there.
 */
#include "common.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <linux/mount.h>
#include <linux/securebits.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/fsuid.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_LOWERS 8

struct mkroot_opts {
	int pidfd;
	const char *lower, *upper, *work, *mountpoint;
	int userns;	     /* --userns FD, or -1 */
	unsigned long root;  /* --root-id: host uid/gid of the sandbox's root */
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
		{"userns", required_argument, NULL, 'n'},
		{"root-id", required_argument, NULL, 'r'},
		{NULL, 0, NULL, 0},
	};
	char *end;
	int c;

	memset(o, 0, sizeof(*o));
	o->pidfd = o->userns = -1;
	while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
		switch (c) {
		case 'p': o->pidfd = dbx_parse_fd(optarg, "--pidfd"); break;
		case 'l': o->lower = optarg; break;
		case 'u': o->upper = optarg; break;
		case 'w': o->work = optarg; break;
		case 'm': o->mountpoint = optarg; break;
		case 'n': o->userns = dbx_parse_fd(optarg, "--userns"); break;
		case 'r':
			errno = 0;
			o->root = strtoul(optarg, &end, 10);
			if (errno || end == optarg || *end || o->root == 0 || o->root >= 0xffffffffUL)
				dbx_die("--root-id %s: not a host id > 0", optarg);
			break;
		default: dbx_die("usage: dbx-mkroot --pidfd FD --lower L --upper U --work W "
				 "--mountpoint M [--userns FD --root-id ID]");
		}
	}
	if (o->pidfd < 0 || !o->lower || !o->upper || !o->work || !o->mountpoint)
		dbx_die("--pidfd, --lower, --upper, --work and --mountpoint are required");
	if ((o->userns >= 0) != (o->root != 0))
		dbx_die("--userns and --root-id go together");
}

static void mount_at(const char *src, const char *target, const char *fstype,
		     unsigned long flags, const char *data)
{
	if (mount(src, target, fstype, flags, data) < 0)
		dbx_die_errno("mount %s at %s", fstype ? fstype : src, target);
}

/* nodev: device nodes in the image or the layer do not open (only /dev, a tmpfs of its own,
 * has devices). */
static void mount_overlay(const char *mountpoint, const char *lower, const char *upper,
			  const char *work)
{
	size_t len = strlen(lower) + strlen(upper) + strlen(work) + 64;
	char *data = malloc(len);

	if (!data)
		dbx_die("out of memory");
	snprintf(data, len, "lowerdir=%s,upperdir=%s,workdir=%s", lower, upper, work);
	if (mount("deltabox", mountpoint, "overlay", MS_NODEV, data) < 0)
		dbx_die_errno("mount overlay at %s (%s)", mountpoint, data);
	free(data);
}

/* Attach an idmapped clone of the mount at `src` (that directory as its root) at `dst`. */
static void attach_idmapped(const char *src, const char *dst, int userns)
{
	struct mount_attr attr = { .attr_set = MOUNT_ATTR_IDMAP, .userns_fd = (uint64_t)userns };
	int fd = (int)syscall(SYS_open_tree, AT_FDCWD, src, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);

	if (fd < 0)
		dbx_die_errno("clone the mount of %s", src);
	if (syscall(SYS_mount_setattr, fd, "", AT_EMPTY_PATH, &attr, sizeof(attr)) < 0)
		dbx_die_errno("idmap the mount of %s (its filesystem must support idmapped mounts "
			      "for sandboxes with a user namespace)", src);
	if (mkdir(dst, 0700) < 0)
		dbx_die_errno("mkdir %s", dst);
	if (syscall(SYS_move_mount, fd, "", AT_FDCWD, dst, MOVE_MOUNT_F_EMPTY_PATH) < 0)
		dbx_die_errno("attach the idmapped %s at %s", src, dst);
	close(fd);
}

/* fsuid and fsgid `id` (0: back to root), capabilities kept: SECBIT_NO_SETUID_FIXUP stops
 * the kernel from clearing the file capabilities when fsuid leaves 0. */
static void as_fsid(unsigned int id)
{
	if (prctl(PR_SET_SECUREBITS, id ? SECBIT_NO_SETUID_FIXUP : 0, 0, 0, 0) < 0)
		dbx_die_errno("PR_SET_SECUREBITS");
	setfsgid(id);
	setfsuid(id);
	if ((unsigned int)setfsuid((uid_t)-1) != id || (unsigned int)setfsgid((gid_t)-1) != id)
		dbx_die("setfsuid/setfsgid %u refused", id);
}

/* The overlay of a sandbox with a user namespace (see the file comment): idmapped clones of
 * the layer directory (upper and work must share one: overlayfs wants them on one mount)
 * and of each lower directory, attached under a scratch tmpfs on the mountpoint. */
static void mount_idmapped_overlay(const struct mkroot_opts *o)
{
	char path[PATH_MAX], upper[PATH_MAX], work[PATH_MAX], lowers[PATH_MAX];
	char *list, *save = NULL, *dir;
	const char *slash = strrchr(o->upper, '/');
	size_t dirlen = slash ? (size_t)(slash - o->upper) : 0, used;
	int n = 0;

	if (!slash || strncmp(o->upper, o->work, dirlen + 1) || strchr(o->work + dirlen + 1, '/'))
		dbx_die("--upper %s and --work %s must be in one directory", o->upper, o->work);
	mount_at("dbx-layers", o->mountpoint, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
		 "size=4k,mode=0700");
	snprintf(path, sizeof(path), "%.*s", (int)dirlen, o->upper);
	snprintf(upper, sizeof(upper), "%s/layer", o->mountpoint);
	attach_idmapped(path, upper, o->userns);
	snprintf(upper, sizeof(upper), "%s/layer/%s", o->mountpoint, slash + 1);
	snprintf(work, sizeof(work), "%s/layer/%s", o->mountpoint, o->work + dirlen + 1);
	list = strdup(o->lower);
	if (!list)
		dbx_die("out of memory");
	lowers[0] = 0;
	for (dir = strtok_r(list, ":", &save); dir; dir = strtok_r(NULL, ":", &save)) {
		if (n == MAX_LOWERS)
			dbx_die("--lower: more than %d directories", MAX_LOWERS);
		snprintf(path, sizeof(path), "%s/l%d", o->mountpoint, n);
		attach_idmapped(dir, path, o->userns);
		used = strlen(lowers);
		if ((size_t)snprintf(lowers + used, sizeof(lowers) - used, "%s%s/l%d",
				     n ? ":" : "", o->mountpoint, n) >= sizeof(lowers) - used)
			dbx_die("--mountpoint %s: path too long", o->mountpoint);
		n++;
	}
	free(list);
	as_fsid((unsigned int)o->root);
	mount_overlay(o->mountpoint, lowers, upper, work);
	as_fsid(0);
}

/* With a user namespace (root != 0), what mkroot creates in /dev belongs to the sandbox's
 * root (host id `root`), not to an id unmapped there (which shows as nobody). */
static void own(const char *path, unsigned long root)
{
	if (root && lchown(path, (uid_t)root, (gid_t)root) < 0)
		dbx_die_errno("chown %s to %lu", path, root);
}

static void make_dev(unsigned long root)
{
	static const char *const links[][2] = {
		{"pts/ptmx", "dev/ptmx"}, {"/proc/self/fd", "dev/fd"},
		{"/proc/self/fd/0", "dev/stdin"}, {"/proc/self/fd/1", "dev/stdout"},
		{"/proc/self/fd/2", "dev/stderr"},
	};
	char shm_opts[64];

	for (size_t i = 0; i < sizeof(devnodes) / sizeof(devnodes[0]); i++) {
		char path[64];
		snprintf(path, sizeof(path), "dev/%s", devnodes[i].name);
		if (mknod(path, S_IFCHR | 0666, makedev(devnodes[i].major, devnodes[i].minor)) < 0)
			dbx_die_errno("mknod %s", path);
		if (chmod(path, 0666) < 0) /* mknod is subject to the umask */
			dbx_die_errno("chmod %s", path);
		own(path, root);
	}
	if (mkdir("dev/pts", 0755) < 0 || mkdir("dev/shm", 01777) < 0)
		dbx_die_errno("mkdir dev/pts, dev/shm");
	own("dev/pts", root);
	mount_at("devpts", "dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
		 "newinstance,ptmxmode=0666,mode=0620");
	snprintf(shm_opts, sizeof(shm_opts), root ? "mode=1777,uid=%lu,gid=%lu" : "mode=1777",
		 root, root);
	mount_at("shm", "dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, shm_opts);
	for (size_t i = 0; i < sizeof(links) / sizeof(links[0]); i++) {
		if (symlink(links[i][0], links[i][1]) < 0)
			dbx_die_errno("symlink %s -> %s", links[i][1], links[i][0]);
		own(links[i][1], root);
	}
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

static void mount_pseudo_filesystems(unsigned long root)
{
	char path[64], dev_opts[64];

	mount_at("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
	for (size_t i = 0; i < sizeof(proc_readonly) / sizeof(proc_readonly[0]); i++) {
		snprintf(path, sizeof(path), "proc/%s", proc_readonly[i]);
		bind_readonly(path);
	}
	mount_at("sysfs", "sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, NULL);
	snprintf(dev_opts, sizeof(dev_opts),
		 root ? "mode=0755,size=64k,uid=%lu,gid=%lu" : "mode=0755,size=64k", root, root);
	mount_at("dev", "dev", "tmpfs", MS_NOSUID | MS_NOEXEC, dev_opts);
	make_dev(root);
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

/* See the file comment: the sandbox's mount namespace is owned by its user namespace. */
static void lock_in_userns(int userns)
{
	if (setns(userns, CLONE_NEWUSER) < 0)
		dbx_die_errno("join the sandbox's user namespace (fd %d)", userns);
	close(userns);
	dbx_become_userns_root();
	if (unshare(CLONE_NEWNS) < 0)
		dbx_die_errno("unshare the mount namespace in the sandbox's user namespace");
}

static __attribute__((noreturn)) void build_root(const struct mkroot_opts *o)
{
	char buf[64];
	ssize_t n;

	if (unshare(CLONE_NEWNS) < 0)
		dbx_die_errno("unshare mount namespace");
	if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
		dbx_die_errno("make mounts private");
	if (o->userns >= 0)
		mount_idmapped_overlay(o);
	else
		mount_overlay(o->mountpoint, o->lower, o->upper, o->work);
	if (chdir(o->mountpoint) < 0)
		dbx_die_errno("chdir %s", o->mountpoint);
	mount_pseudo_filesystems(o->root);
	pivot_into(o->mountpoint);
	if (o->userns >= 0)
		lock_in_userns(o->userns);
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
