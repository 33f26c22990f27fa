/* dbx-enter: run a command inside a sandbox.
 *
 *   dbx-enter --pidfd FD --mntfd FD [--userns] [--cgroup PROCS_FILE]... [--cwd DIR]
 *             [--env K=V]... -- ARGV...
 *
 * Joins the sandbox's cgroups, then its pid/net/uts/ipc/cgroup namespaces through a pidfd of
 * its init (setns with a pidfd joins them all at once), then the mount namespace of the
 * sandbox's current file-system generation (setns on a mount namespace also moves root and
 * cwd to that namespace's root). A process does not move into a pid namespace itself, only its
 * later children do, so the command runs in a forked child. The child gets a new session (its
 * own process group), so a timeout can kill everything the command started in the foreground.
 * The environment is exactly the --env list. The command runs confined: capabilities cut to the
 * sandbox's set, no_new_privs and the sandbox's seccomp filter (dbx_confine, common.c).
 *
 * With --userns (the sandbox has a user namespace, see dbx-init) the setns joins that too,
 * before the mount namespace (owned by it); the child becomes root inside it (uid/gid 0,
 * the sandbox's root, not host root) before anything else; the parent keeps its host
 * credentials, outside the sandbox's pid namespace where no sandbox process can reach it.
 *
 * The parent stays outside, waits, and exits with the command's exit code (128+N if killed by
 * signal N). SIGTERM/SIGINT/SIGHUP to the parent kill the child's whole process group; if the
 * parent dies the child gets SIGKILL (PDEATHSIG). Background jobs the command started with
 * `&` and detached from the group keep running, reaped by the sandbox's init.
 */
#include "common.h"

#include <errno.h>
#include <getopt.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_CGROUPS 16
#define MAX_ENV 512
#define TTY_FD 3	/* where a session shell finds its terminal (sandbox/session.py) */

struct enter_opts {
	int pidfd;
	int mntfd;
	int userns;
	const char *cgroups[MAX_CGROUPS];
	int n_cgroups;
	const char *cwd;
	int tty;	/* a pty slave: the command's controlling terminal, at TTY_FD (-1: none) */
	char *env[MAX_ENV + 1];
	int n_env;
	char **argv;
};

static volatile sig_atomic_t child_pgid;

static void parse_args(int argc, char **argv, struct enter_opts *o)
{
	static const struct option longopts[] = {
		{"pidfd", required_argument, NULL, 'p'},
		{"mntfd", required_argument, NULL, 'm'},
		{"cgroup", required_argument, NULL, 'c'},
		{"cwd", required_argument, NULL, 'd'},
		{"env", required_argument, NULL, 'e'},
		{"userns", no_argument, NULL, 'u'},
		{"tty", required_argument, NULL, 't'},
		{NULL, 0, NULL, 0},
	};
	int c;

	memset(o, 0, sizeof(*o));
	o->pidfd = o->mntfd = o->tty = -1;
	o->cwd = "/";
	while ((c = getopt_long(argc, argv, "+", longopts, NULL)) != -1) {
		switch (c) {
		case 'p':
			o->pidfd = dbx_parse_fd(optarg, "--pidfd");
			break;
		case 'm':
			o->mntfd = dbx_parse_fd(optarg, "--mntfd");
			break;
		case 'c':
			if (o->n_cgroups == MAX_CGROUPS)
				dbx_die("too many --cgroup (max %d)", MAX_CGROUPS);
			o->cgroups[o->n_cgroups++] = optarg;
			break;
		case 'd':
			o->cwd = optarg;
			break;
		case 'u':
			o->userns = 1;
			break;
		case 't':
			o->tty = dbx_parse_fd(optarg, "--tty");
			break;
		case 'e':
			if (o->n_env == MAX_ENV)
				dbx_die("too many --env (max %d)", MAX_ENV);
			if (!strchr(optarg, '='))
				dbx_die("--env wants K=V, got '%s'", optarg);
			o->env[o->n_env++] = optarg;
			break;
		default:
			dbx_die("usage: dbx-enter --pidfd FD --mntfd FD [--userns] [--cgroup F]... [--cwd D] "
				"[--env K=V]... [--tty FD] -- ARGV...");
		}
	}
	if (o->pidfd < 0 || o->mntfd < 0)
		dbx_die("--pidfd and --mntfd are required");
	if (optind >= argc)
		dbx_die("no command given after --");
	o->argv = &argv[optind];
}

static void enter_sandbox(const struct enter_opts *o)
{
	for (int i = 0; i < o->n_cgroups; i++)
		if (dbx_join_cgroup(o->cgroups[i]) < 0)
			dbx_die_errno("join cgroup %s", o->cgroups[i]);
	if (setns(o->pidfd, DBX_NS_FLAGS | (o->userns ? CLONE_NEWUSER : 0)) < 0)
		dbx_die_errno("setns into the namespaces of the sandbox init (pidfd %d%s)", o->pidfd,
			      o->userns ? ", with its user namespace" : "");
	if (setns(o->mntfd, CLONE_NEWNS) < 0)
		dbx_die_errno("setns into the sandbox mount namespace (fd %d)", o->mntfd);
	close(o->pidfd);
	close(o->mntfd);
}

/* The pty slave `fd` becomes the controlling terminal of the session we just led
 * (TIOCSCTTY: a session leader without one takes the terminal it names; its foreground
 * group is then ours), and the command's TTY_FD. */
static void take_tty(int fd)
{
	if (ioctl(fd, TIOCSCTTY, 0) < 0)
		dbx_die_errno("TIOCSCTTY on the session's terminal (fd %d)", fd);
	if (fd != TTY_FD) {
		if (dup2(fd, TTY_FD) < 0)
			dbx_die_errno("dup2 the session's terminal (fd %d) to fd %d", fd, TTY_FD);
		if (close(fd) < 0)
			dbx_die_errno("close fd %d", fd);
	}
}

/* In the child: from here on failures are the command's, reported like a shell would. */
static __attribute__((noreturn)) void exec_command(const struct enter_opts *o)
{
	extern char **environ;

	if (setsid() < 0)
		dbx_die_errno("setsid");
	if (o->tty >= 0)
		take_tty(o->tty);
	if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0)
		dbx_die_errno("PR_SET_PDEATHSIG");
	/* Our parent lives outside the sandbox's pid namespace, so getppid() is 0 while it is
	 * alive; once it died we were reparented to the sandbox init (1) and PDEATHSIG, set
	 * too late, will never come. */
	if (getppid() != 0)
		_exit(DBX_EXIT_SETUP);
	if (o->userns)
		dbx_become_userns_root();
	if (chdir(o->cwd) < 0) {
		fprintf(stderr, "dbx-enter: cannot change directory to %s: %s\n", o->cwd,
			strerror(errno));
		_exit(126);
	}
	/* Last: capabilities down to the sandbox's set, no_new_privs, the seccomp filter
	 * (common.c); nothing after this but the exec. */
	dbx_confine();
	environ = (char **)o->env;
	execvp(o->argv[0], o->argv);
	fprintf(stderr, "dbx-enter: %s: %s\n", o->argv[0], strerror(errno));
	_exit(errno == ENOENT ? 127 : 126);
}

static void kill_child_group(int sig)
{
	(void)sig;
	if (child_pgid > 0)
		kill(-child_pgid, SIGKILL);
}

static void forward_termination(void)
{
	struct sigaction sa;

	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = kill_child_group;
	sigemptyset(&sa.sa_mask);
	if (sigaction(SIGTERM, &sa, NULL) < 0 || sigaction(SIGINT, &sa, NULL) < 0 ||
	    sigaction(SIGHUP, &sa, NULL) < 0)
		dbx_die_errno("sigaction");
}

int main(int argc, char **argv)
{
	struct enter_opts o;
	pid_t child;
	int status;
	sigset_t all, old;

	dbx_set_progname("dbx-enter");
	parse_args(argc, argv, &o);
	enter_sandbox(&o);

	/* Block signals across fork so a SIGTERM cannot land between fork and recording the
	 * child's pid; the child restores the mask before exec. */
	sigfillset(&all);
	sigprocmask(SIG_BLOCK, &all, &old);
	child = fork();
	if (child < 0)
		dbx_die_errno("fork the command");
	if (child == 0) {
		sigprocmask(SIG_SETMASK, &old, NULL);
		exec_command(&o);
	}
	child_pgid = child;
	/* The terminal is the command's alone: a slave we kept would keep the pty open after
	 * the command's end. */
	if (o.tty >= 0 && close(o.tty) < 0)
		dbx_die_errno("close the session's terminal (fd %d)", o.tty);
	forward_termination();
	sigprocmask(SIG_SETMASK, &old, NULL);
	/* Reap every child, not only the command: processes restored into forks from the
	 * command's templates are our children too (a template's children take its parent). */
	for (;;) {
		pid_t r = waitpid(-1, &status, 0);

		if (r == child)
			break;
		if (r < 0 && errno != EINTR)
			dbx_die_errno("wait for command pid %d", child);
	}
	return dbx_exit_code(status);
}
