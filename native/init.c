/* dbx-init: start a sandbox.
 *
 *   dbx-init [--cgroup PROCS_FILE]... [--hostname NAME] [--nest-under PID]
 *            [--userns BASE:COUNT]
 *
 * The launcher joins the sandbox's cgroups and forks a helper, which unshares every
 * namespace a sandbox has (mount, pid, uts, ipc, net, cgroup), names the host, raises
 * loopback and creates init with CLONE_PARENT, so that init is the launcher's child (found
 * in /proc/self/task/<tid>/children once the helper has exited) while the launcher itself
 * stays in the host's namespaces. Init is pid 1 of the new pid namespace: it parks itself
 * in an empty read-only tmpfs root (so that /proc/1/root, which any sandbox process can
 * open, leads nowhere) and reaps orphans forever.
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
 * one, so the launcher setns() into PID's namespace before forking the helper, which is then
 * born there.
 *
 * --userns BASE:COUNT gives the sandbox a user namespace mapping its uids and gids
 * 0..COUNT-1 to the host's BASE..BASE+COUNT-1, so that its root is not host root. It must
 * own the sandbox's other namespaces (the kernel checks a capability against the user
 * namespace that owns the object), so the helper makes it first: it unshares
 * CLONE_NEWUSER, the launcher writes its uid_map and gid_map (a map of more than one id
 * must be written from the parent namespace, with CAP_SETUID/CAP_SETGID there), the
 * helper becomes root inside, makes the other namespaces and creates init as above. With
 * --nest-under the helper joins PID's user namespace instead of making one: a fork family
 * shares it, because processes restored into a fork join the fork's namespaces with their
 * own credentials, which hold capabilities only in their own user namespace.
 */
#include "common.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <net/if.h>
#include <netinet/in.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
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
	unsigned long map_base, map_count; /* --userns; map_count 0: none */
};

/* BASE:COUNT, both decimal; host id 0 may not be mapped (that would make sandbox root host
 * root again) and the range must fit below the invalid id (uid_t)-1. */
static void parse_map(const char *arg, struct init_opts *o)
{
	char *end, *count;

	errno = 0;
	o->map_base = strtoul(arg, &end, 10);
	if (errno || end == arg || *end != ':')
		dbx_die("--userns %s: want BASE:COUNT", arg);
	count = end + 1;
	o->map_count = strtoul(count, &end, 10);
	if (errno || end == count || *end)
		dbx_die("--userns %s: want BASE:COUNT", arg);
	if (o->map_base == 0 || o->map_count == 0 || o->map_base + o->map_count > 0xffffffffUL ||
	    o->map_base + o->map_count < o->map_base)
		dbx_die("--userns %lu:%lu: BASE must be > 0, COUNT > 0, BASE+COUNT <= 4294967295",
			o->map_base, o->map_count);
}

static void parse_args(int argc, char **argv, struct init_opts *o)
{
	static const struct option longopts[] = {
		{"cgroup", required_argument, NULL, 'c'},
		{"hostname", required_argument, NULL, 'h'},
		{"nest-under", required_argument, NULL, 'n'},
		{"userns", required_argument, NULL, 'u'},
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
		case 'u':
			parse_map(optarg, o);
			break;
		default:
			dbx_die("usage: dbx-init [--cgroup PROCS_FILE]... [--hostname NAME] "
				"[--nest-under PID] [--userns BASE:COUNT]");
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

/* Append a route attribute to the netlink message at nh (of capacity cap bytes). */
static void add_attr(struct nlmsghdr *nh, size_t cap, unsigned short type, const void *data,
		     size_t len)
{
	struct rtattr *rta = (struct rtattr *)((char *)nh + NLMSG_ALIGN(nh->nlmsg_len));

	if (NLMSG_ALIGN(nh->nlmsg_len) + RTA_LENGTH(len) > cap)
		dbx_die("route attribute %u does not fit", type);
	rta->rta_type = type;
	rta->rta_len = RTA_LENGTH(len);
	memcpy(RTA_DATA(rta), data, len);
	nh->nlmsg_len = NLMSG_ALIGN(nh->nlmsg_len) + RTA_ALIGN(rta->rta_len);
}

/* IPv4 multicast over loopback: a route for 224.0.0.0/4 through lo, its source 127.0.0.1.
 * Without it a fresh namespace has no multicast route: a join on the wildcard interface
 * fails with ENODEV and a send that names no interface with ENETUNREACH, so only programs
 * naming lo worked (by address, or by index alone, which no getsockopt reads back for a
 * checkpoint: deltabox/cr/udp.py). lo takes the route without IFF_MULTICAST; IPv6
 * multicast over lo is not delivered even with one, so none is added. */
static void multicast_route(void)
{
	struct {
		struct nlmsghdr nh;
		struct rtmsg rt;
		char attrs[64];
	} req;
	struct {
		struct nlmsghdr nh;
		struct nlmsgerr err;
	} ack;
	struct sockaddr_nl kernel = { .nl_family = AF_NETLINK };
	uint32_t dst = htonl(0xe0000000u), src = htonl(INADDR_LOOPBACK);
	int oif = (int)if_nametoindex("lo"), fd;
	ssize_t n;

	if (oif == 0)
		dbx_die_errno("if_nametoindex lo");
	memset(&req, 0, sizeof(req));
	req.nh.nlmsg_len = NLMSG_LENGTH(sizeof(req.rt));
	req.nh.nlmsg_type = RTM_NEWROUTE;
	req.nh.nlmsg_flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL;
	req.rt.rtm_family = AF_INET;
	req.rt.rtm_dst_len = 4;
	req.rt.rtm_table = RT_TABLE_MAIN;
	req.rt.rtm_protocol = RTPROT_BOOT;
	req.rt.rtm_scope = RT_SCOPE_LINK;
	req.rt.rtm_type = RTN_UNICAST;
	add_attr(&req.nh, sizeof(req), RTA_DST, &dst, sizeof(dst));
	add_attr(&req.nh, sizeof(req), RTA_PREFSRC, &src, sizeof(src));
	add_attr(&req.nh, sizeof(req), RTA_OIF, &oif, sizeof(oif));
	fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE);
	if (fd < 0)
		dbx_die_errno("netlink socket for the multicast route");
	if (sendto(fd, &req, req.nh.nlmsg_len, 0, (struct sockaddr *)&kernel,
		   sizeof(kernel)) < 0)
		dbx_die_errno("send RTM_NEWROUTE 224.0.0.0/4 dev lo");
	n = recv(fd, &ack, sizeof(ack), 0);
	if (n < 0)
		dbx_die_errno("receive the answer to RTM_NEWROUTE");
	if ((size_t)n < sizeof(ack) || ack.nh.nlmsg_type != NLMSG_ERROR)
		dbx_die("RTM_NEWROUTE 224.0.0.0/4 dev lo: unexpected answer (%zd bytes, type %u)",
			n, ack.nh.nlmsg_type);
	if (ack.err.error) {
		errno = -ack.err.error;
		dbx_die_errno("add route 224.0.0.0/4 dev lo src 127.0.0.1");
	}
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

/* Raise the pid namespace's counter to the pid deltaboxd queued with DBX_SIG_PID_FLOOR (a
 * fork's restored processes keep their source's pids, but its counter starts at 1: its new
 * processes would take, one by one, pids the restored processes need back at a later
 * rollback). Writing ns_last_pid acts on the writer's active pid namespace, whatever proc
 * mount the file came from, so init, the only process always in it, does it through `fd`,
 * opened before it parked itself. Only raised, and only on a queued signal (the sandbox's
 * root may write the counter itself anyway). Init has no one to report a failure to: the
 * counter then stays where it was. */
static void raise_pid_floor(int fd, const siginfo_t *info)
{
	char buf[24];
	ssize_t n;
	long want = info->si_value.sival_int, cur;

	if (fd < 0 || info->si_code != SI_QUEUE || want <= 0)
		return;
	n = pread(fd, buf, sizeof(buf) - 1, 0);
	if (n <= 0)
		return;
	buf[n] = '\0';
	cur = strtol(buf, NULL, 10);
	if (cur >= want)
		return;
	n = snprintf(buf, sizeof(buf), "%ld", want);
	(void)!pwrite(fd, buf, (size_t)n, 0);	/* EPERM, EINVAL: left where it was (above) */
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
 * not forked from init, so they do not inherit this. The launcher sets it: lowering the score
 * needs CAP_SYS_RESOURCE in the initial user namespace, which init in a user namespace
 * lacks. Some hosts withhold it even from root: then this is skipped, and deltaboxd
 * notices a dead init and stops the sandbox. */
static void shield_from_oom_killer(pid_t init)
{
	char path[64];
	int fd;

	snprintf(path, sizeof(path), "/proc/%d/oom_score_adj", (int)init);
	fd = open(path, O_WRONLY | O_CLOEXEC);
	if (fd < 0)
		dbx_die_errno("open %s", path);
	if (dbx_write_all(fd, "-1000", 5) < 0 && errno != EACCES && errno != EPERM)
		dbx_die_errno("write %s", path);
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
	int last_pid;

	if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0)
		dbx_die_errno("PR_SET_PDEATHSIG");
	redirect_stdio_to_null();
	/* -1 if this host hides it: forks' counters then start low (raise_pid_floor). */
	last_pid = open("/proc/sys/kernel/ns_last_pid", O_RDWR | O_CLOEXEC);
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
	sigaddset(&set, DBX_SIG_PID_FLOOR);
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
		if (info.si_signo == DBX_SIG_PID_FLOOR)
			raise_pid_floor(last_pid, &info);
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
	multicast_route();
}

/* One byte over the launcher/helper socket; dies if the other side is gone. */
static void sync_send(int fd, const char *step)
{
	if (dbx_write_all(fd, "1", 1) < 0)
		dbx_die_errno("%s", step);
}

static void sync_wait(int fd, const char *step)
{
	char c;
	ssize_t n;

	do
		n = read(fd, &c, 1);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		dbx_die_errno("%s", step);
	if (n == 0)
		dbx_die("%s: the other side exited", step);
}

/* In the launcher: "0 BASE COUNT" into the helper's uid_map and gid_map. Written by a
 * process privileged in the parent namespace, the gid map leaves setgroups(2) allowed
 * inside, so sandbox root can drop supplementary groups as usual. */
static void write_id_maps(pid_t helper, const struct init_opts *o)
{
	static const char *const maps[] = { "uid_map", "gid_map" };
	char path[64], line[64];
	int fd, len;

	len = snprintf(line, sizeof(line), "0 %lu %lu\n", o->map_base, o->map_count);
	for (int i = 0; i < 2; i++) {
		snprintf(path, sizeof(path), "/proc/%d/%s", (int)helper, maps[i]);
		fd = open(path, O_WRONLY | O_CLOEXEC);
		if (fd < 0)
			dbx_die_errno("open %s", path);
		if (dbx_write_all(fd, line, (size_t)len) < 0)
			dbx_die_errno("write '0 %lu %lu' to %s", o->map_base, o->map_count, path);
		close(fd);
	}
}

/* In the helper: a fresh user namespace mapped by the launcher, or (nested) the one of the
 * sandbox we nest under; then root inside it. */
static void enter_user_namespace(const struct init_opts *o, int pidfd, int sync)
{
	if (o->nest_under) {
		if (setns(pidfd, CLONE_NEWUSER) < 0)
			dbx_die_errno("join the user namespace of %d", (int)o->nest_under);
	} else {
		if (unshare(CLONE_NEWUSER) < 0)
			dbx_die_errno("unshare the user namespace");
		sync_send(sync, "tell the launcher to write the id maps");
		sync_wait(sync, "wait for the id maps");
	}
	dbx_become_userns_root();
	/* The uid change made us (and init, which copies our mm) non-dumpable, and our mm
	 * belongs to the initial user namespace (dbx-init was exec'd there): ptrace access to
	 * init, which a setns through init's pidfd checks, would need CAP_SYS_PTRACE on the
	 * host, so processes the daemon restores into a fork could not join its namespaces.
	 * Dumpable again, init is what it is without a user namespace: reachable by processes
	 * with its credentials, i.e. the sandbox's own (run_init). */
	if (prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) < 0)
		dbx_die_errno("PR_SET_DUMPABLE");
}

/* The helper (see the file comment): namespaces, then init as the launcher's child. */
static __attribute__((noreturn)) void run_helper(const struct init_opts *o, int pidfd,
						 int sync, int ready)
{
	pid_t init;

	if (o->map_count)
		enter_user_namespace(o, pidfd, sync);
	if (pidfd >= 0)
		close(pidfd);
	if (sync >= 0)
		close(sync);
	make_namespaces(o);
	init = (pid_t)syscall(SYS_clone, CLONE_PARENT | SIGCHLD, 0, 0, 0, 0);
	if (init < 0)
		dbx_die_errno("clone init (CLONE_PARENT)");
	if (init == 0)
		run_init(ready);
	_exit(0);
}

/* Init's pid as we see it, once the helper that created it has exited. */
static pid_t find_init(void)
{
	char path[64], buf[64];
	ssize_t n;
	pid_t init;
	int fd;

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

/* Init, made by a forked helper (see the file comment); returns its pid as we see it. */
static pid_t start_init(const struct init_opts *o, const int ready[2])
{
	int pidfd = -1, status, sync[2] = { -1, -1 };
	int maps = o->map_count && !o->nest_under; /* a fresh user namespace: we map it */
	pid_t helper;

	if (o->nest_under) {
		pidfd = (int)syscall(SYS_pidfd_open, o->nest_under, 0);
		if (pidfd < 0)
			dbx_die_errno("pidfd_open %d (--nest-under)", (int)o->nest_under);
		if (setns(pidfd, CLONE_NEWPID) < 0)
			dbx_die_errno("setns into the pid namespace of %d", (int)o->nest_under);
	}
	if (maps && socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sync) < 0)
		dbx_die_errno("socketpair for the namespace helper");
	helper = fork();
	if (helper < 0)
		dbx_die_errno("fork namespace helper");
	if (helper == 0) {
		close(ready[0]);
		if (maps)
			close(sync[0]);
		run_helper(o, pidfd, sync[1], ready[1]);
	}
	if (pidfd >= 0)
		close(pidfd);
	if (maps) {
		close(sync[1]);
		sync_wait(sync[0], "wait for the helper's user namespace");
		write_id_maps(helper, o);
		sync_send(sync[0], "tell the helper the id maps are written");
		close(sync[0]);
	}
	while (waitpid(helper, &status, 0) < 0)
		if (errno != EINTR)
			dbx_die_errno("wait for namespace helper %d", (int)helper);
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
		dbx_die("namespace helper failed (status %#x)", status);
	return find_init();
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
	child = start_init(&o, ready);
	close(ready[1]);
	wait_ready(ready[0], child);
	shield_from_oom_killer(child);

	snprintf(line, sizeof(line), "%d\n", child);
	if (dbx_write_all(STDOUT_FILENO, line, strlen(line)) < 0)
		dbx_die_errno("report init pid %d", child);
	close(STDOUT_FILENO);
	while (waitpid(child, &status, 0) < 0)
		if (errno != EINTR)
			dbx_die_errno("wait for init %d", child);
	return dbx_exit_code(status);
}
