/* dbx-init: start a sandbox.
 *
 *   dbx-init [--cgroup PROCS_FILE]... [--hostname NAME] [--nest-under PID]
 *
 * The launcher joins the sandbox's cgroups, unshares every namespace a sandbox has (mount,
 * pid, uts, ipc, net, cgroup), names the host, raises loopback and forks. The child is pid 1
 * of the new pid namespace: it parks itself in an empty read-only tmpfs root (so that
 * /proc/1/root, which any sandbox process can open, leads nowhere) and reaps orphans forever.
 * The sandbox's file system is not init's: each generation of it lives in a mount namespace
 * built by dbx-mkroot, so a rollback can replace it while init (and so the pid namespace)
 * stays alive.
 *
 * The launcher prints init's host pid on stdout once init is confined (see run_init) and then
 * waits for init, exiting with its status, so deltaboxd sees the sandbox die as its child
 * exiting.
 *
 * --nest-under PID makes the new pid namespace a child of PID's (a fork whose processes are
 * restored from templates living in that namespace: they can spawn only into it or below).
 * unshare(CLONE_NEWPID) requires the caller's pid namespace for children to be its active
 * one, so after setns() into PID's namespace a helper forked there does the unsharing and
 * creates init with CLONE_PARENT: init stays the launcher's child, found in
 * /proc/self/task/<tid>/children once the helper has exited.
 */
#include "common.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <net/if.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_CGROUPS 16

struct init_opts {
	const char *cgroups[MAX_CGROUPS];
	int n_cgroups;
	const char *hostname;
	pid_t nest_under;
};

static void parse_args(int argc, char **argv, struct init_opts *o)
{
	static const struct option longopts[] = {
		{"cgroup", required_argument, NULL, 'c'},
		{"hostname", required_argument, NULL, 'h'},
		{"nest-under", required_argument, NULL, 'n'},
		{NULL, 0, NULL, 0},
	};
	int c;

	memset(o, 0, sizeof(*o));
	while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
		switch (c) {
		case 'c':
			if (o->n_cgroups == MAX_CGROUPS)
				dbx_die("too many --cgroup (max %d)", MAX_CGROUPS);
			o->cgroups[o->n_cgroups++] = optarg;
			break;
		case 'h':
			o->hostname = optarg;
			break;
		case 'n':
			o->nest_under = (pid_t)atoi(optarg);
			if (o->nest_under <= 0)
				dbx_die("--nest-under %s: not a pid", optarg);
			break;
		default:
			dbx_die("usage: dbx-init [--cgroup PROCS_FILE]... [--hostname NAME] "
				"[--nest-under PID]");
		}
	}
}

/* A fresh net namespace has only "lo", and it is down. */
static void loopback_up(void)
{
	struct ifreq ifr;
	int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);

	if (fd < 0)
		dbx_die_errno("socket for loopback");
	memset(&ifr, 0, sizeof(ifr));
	strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
	if (ioctl(fd, SIOCGIFFLAGS, &ifr) < 0)
		dbx_die_errno("SIOCGIFFLAGS lo");
	ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
	if (ioctl(fd, SIOCSIFFLAGS, &ifr) < 0)
		dbx_die_errno("SIOCSIFFLAGS lo up");
	close(fd);
}

/* Give init an empty, read-only root. Runs in init's private mount namespace, so mounting a
 * tmpfs over the host's /tmp here changes nothing the host sees. pivot_root(".", ".") stacks
 * the old root under the new one; the lazy unmount of "." then drops it. */
static void park_in_empty_root(void)
{
	if (mount("dbx-init", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
		  "size=4k,mode=0555") < 0)
		dbx_die_errno("mount tmpfs for init's root");
	if (chdir("/tmp") < 0)
		dbx_die_errno("chdir to init's root");
	if (syscall(SYS_pivot_root, ".", ".") < 0)
		dbx_die_errno("pivot_root into init's root");
	if (umount2(".", MNT_DETACH) < 0)
		dbx_die_errno("detach the host root from init");
	if (chdir("/") < 0)
		dbx_die_errno("chdir /");
	if (mount(NULL, "/", NULL, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
		  NULL) < 0)
		dbx_die_errno("remount init's root read-only");
}

static void redirect_stdio_to_null(void)
{
	int fd = open("/dev/null", O_RDWR | O_CLOEXEC);

	if (fd < 0)
		dbx_die_errno("open /dev/null");
	for (int i = 0; i < 3; i++)
		if (dup2(fd, i) < 0)
			dbx_die_errno("dup2 /dev/null to %d", i);
	close(fd);
}

static void reap_all(void)
{
	while (waitpid(-1, NULL, WNOHANG) > 0)
		;
}

/* pid 1: the kernel delivers only signals it has handlers for (from inside the namespace),
 * so SIGCHLD and SIGTERM are taken synchronously with sigwaitinfo. SIGTERM from the host ends
 * the sandbox: when pid 1 exits, the kernel kills every process of the namespace. */
/* The sandbox's memory limit applies to init too; if the OOM killer chose init, the pid
 * namespace would die with every process in it. Sandbox processes are started by dbx-enter,
 * not forked from init, so they do not inherit this. Lowering the score needs
 * CAP_SYS_RESOURCE, which some hosts withhold even from root: then this is skipped, and
 * deltaboxd notices a dead init and stops the sandbox. */
static void protect_from_oom_killer(void)
{
	int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);

	if (fd < 0)
		return;
	if (dbx_write_all(fd, "-1000", 5) < 0 && errno != EACCES && errno != EPERM)
		dbx_die_errno("write /proc/self/oom_score_adj");
	close(fd);
}

/* `ready`: the write end of a pipe to the launcher, which reports init's pid only once a
 * byte arrives on it. Until init is confined it has more capabilities than the sandbox's
 * processes, and the kernel refuses their setns through init's pidfd (EPERM: ptrace access
 * to init), which processes restored into a fresh sandbox do at once. */
static __attribute__((noreturn)) void run_init(int ready)
{
	sigset_t set;
	siginfo_t info;

	if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0)
		dbx_die_errno("PR_SET_PDEATHSIG");
	protect_from_oom_killer();
	redirect_stdio_to_null();
	park_in_empty_root();
	/* Init is confined exactly like the sandbox's processes: with more capabilities than
	 * theirs, the kernel would refuse their (daemon-injected) setns through init's pidfd
	 * (validate_nsset checks ptrace access); with fewer, nothing changes for them. The
	 * seccomp filter keeps a sandbox process that ptraces init (it may: same credentials)
	 * from gaining anything; the filter itself refuses ptrace of pid 1. */
	dbx_confine();
	if (dbx_write_all(ready, "1", 1) < 0)
		dbx_die_errno("report readiness");
	close(ready);
	sigemptyset(&set);
	sigaddset(&set, SIGCHLD);
	sigaddset(&set, SIGTERM);
	sigaddset(&set, SIGINT);
	if (sigprocmask(SIG_BLOCK, &set, NULL) < 0)
		dbx_die_errno("sigprocmask");
	for (;;) {
		reap_all();
		if (sigwaitinfo(&set, &info) < 0) {
			if (errno == EINTR)
				continue;
			dbx_die_errno("sigwaitinfo");
		}
		if (info.si_signo == SIGTERM || info.si_signo == SIGINT)
			_exit(0);
	}
}

/* New namespaces for the sandbox, in the calling process (whose children will be born in
 * the new pid namespace). */
static void make_namespaces(const struct init_opts *o)
{
	if (unshare(CLONE_NEWNS | DBX_NS_FLAGS) < 0)
		dbx_die_errno("unshare namespaces");
	if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
		dbx_die_errno("make mounts private");
	if (o->hostname && sethostname(o->hostname, strlen(o->hostname)) < 0)
		dbx_die_errno("sethostname %s", o->hostname);
	loopback_up();
}

/* The nested case (see the file comment); returns init's pid as we see it. */
static pid_t start_nested_init(const struct init_opts *o, const int ready[2])
{
	char path[64], buf[64];
	int pidfd, status, fd;
	ssize_t n;
	pid_t helper, init;

	pidfd = (int)syscall(SYS_pidfd_open, o->nest_under, 0);
	if (pidfd < 0)
		dbx_die_errno("pidfd_open %d (--nest-under)", (int)o->nest_under);
	if (setns(pidfd, CLONE_NEWPID) < 0)
		dbx_die_errno("setns into the pid namespace of %d", (int)o->nest_under);
	close(pidfd);
	helper = fork();
	if (helper < 0)
		dbx_die_errno("fork namespace helper");
	if (helper == 0) {
		close(ready[0]);
		make_namespaces(o);
		init = (pid_t)syscall(SYS_clone, CLONE_PARENT | SIGCHLD, 0, 0, 0, 0);
		if (init < 0)
			dbx_die_errno("clone init (CLONE_PARENT)");
		if (init == 0)
			run_init(ready[1]);
		_exit(0);
	}
	while (waitpid(helper, &status, 0) < 0)
		if (errno != EINTR)
			dbx_die_errno("wait for namespace helper %d", (int)helper);
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
		dbx_die("namespace helper failed (status %#x)", status);
	snprintf(path, sizeof(path), "/proc/self/task/%d/children", (int)syscall(SYS_gettid));
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		dbx_die_errno("open %s", path);
	n = read(fd, buf, sizeof(buf) - 1);
	if (n < 0)
		dbx_die_errno("read %s", path);
	close(fd);
	buf[n] = 0;
	init = (pid_t)atoi(buf);
	if (init <= 0)
		dbx_die("init was not created (no child in %s)", path);
	return init;
}

/* Block until init reports it is confined (see run_init); die if it never does. */
static void wait_ready(int rfd, pid_t init)
{
	char c;
	ssize_t n;

	do
		n = read(rfd, &c, 1);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		dbx_die_errno("wait for init %d to be ready", (int)init);
	if (n == 0)
		dbx_die("init %d exited before it was ready", (int)init);
	close(rfd);
}

int main(int argc, char **argv)
{
	struct init_opts o;
	pid_t child;
	int status, ready[2];
	char line[32];

	dbx_set_progname("dbx-init");
	parse_args(argc, argv, &o);
	for (int i = 0; i < o.n_cgroups; i++)
		if (dbx_join_cgroup(o.cgroups[i]) < 0)
			dbx_die_errno("join cgroup %s", o.cgroups[i]);
	if (pipe2(ready, O_CLOEXEC) < 0)
		dbx_die_errno("pipe for init's readiness");
	if (o.nest_under) {
		child = start_nested_init(&o, ready);
	} else {
		make_namespaces(&o);
		child = fork();
		if (child < 0)
			dbx_die_errno("fork init");
		if (child == 0) {
			close(ready[0]);
			run_init(ready[1]);
		}
	}
	close(ready[1]);
	wait_ready(ready[0], child);

	snprintf(line, sizeof(line), "%d\n", child);
	if (dbx_write_all(STDOUT_FILENO, line, strlen(line)) < 0)
		dbx_die_errno("report init pid %d", child);
	close(STDOUT_FILENO);
	while (waitpid(child, &status, 0) < 0)
		if (errno != EINTR)
			dbx_die_errno("wait for init %d", child);
	return dbx_exit_code(status);
}
