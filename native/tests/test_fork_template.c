/* Tests for native/fork_template.c on real processes (needs root and ptrace).
 * Built with ASan/UBSan by native/tests/run.sh; exits non-zero if any check fails. */
#include "../fork_template.h"
#include "../dbxcr_internal.h"	/* batch.c's interface: linked in from the sources */
#include "test_util.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <mqueue.h>
#include <sys/mman.h>
#include <sys/shm.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/rseq.h>
#include <netinet/in.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <linux/filter.h>
#include <linux/netlink.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int failures;
static const char *current_test = "";

#define CHECK(cond, ...)                                                            \
	do {                                                                        \
		if (!(cond)) {                                                      \
			failures++;                                                 \
			fprintf(stderr, "FAIL %s:%d [%s] %s: ", __FILE__, __LINE__, \
				current_test, #cond);                               \
			fprintf(stderr, __VA_ARGS__);                               \
			fputc('\n', stderr);                                        \
		}                                                                   \
	} while (0)

/* ---------- helpers ---------- */

static long long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms)
{
	struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };

	while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
		;
}

static long current_syscall(pid_t pid)
{
	char buf[256];

	if (proc_read(pid, "syscall", buf, sizeof(buf)) < 0 || buf[0] < '0' || buf[0] > '9')
		return -1;	/* "running" or gone */
	return strtol(buf, NULL, 10);
}

/* Wait until pid is blocked in system call nr (first field of /proc/pid/syscall), seen
 * twice 20 ms apart so a short non-blocking call (ASan's runtime reads files) is not
 * mistaken for the blocking one. */
static int wait_in_syscall(pid_t pid, long nr)
{
	for (int i = 0; i < 400; i++) {
		if (current_syscall(pid) == nr) {
			sleep_ms(20);
			if (current_syscall(pid) == nr)
				return 0;
		}
		sleep_ms(5);
	}
	return -1;
}

/* Read exactly len bytes with a timeout; returns 0, or -1 on timeout/EOF. */
static int read_timeout(int fd, void *buf, size_t len, int ms)
{
	size_t got = 0;

	while (got < len) {
		struct pollfd p = { fd, POLLIN, 0 };
		ssize_t n;

		if (poll(&p, 1, ms) <= 0)
			return -1;
		n = read(fd, (char *)buf + got, len - got);
		if (n <= 0)
			return -1;
		got += (size_t)n;
	}
	return 0;
}

static bool readable_now(int fd, int ms)
{
	struct pollfd p = { fd, POLLIN, 0 };

	return poll(&p, 1, ms) > 0;
}

static int reap(pid_t pid)
{
	int status;

	while (waitpid(pid, &status, __WALL) < 0)
		if (errno != EINTR)
			return -1;
	return status;
}

static void kill_reap(pid_t pid)
{
	if (pid > 0) {
		kill(pid, SIGKILL);
		reap(pid);
	}
}

static long long fd_pos(pid_t pid, int fd)
{
	char name[32], buf[256];

	snprintf(name, sizeof(name), "fdinfo/%d", fd);
	if (proc_read(pid, name, buf, sizeof(buf)) < 0)
		return -1;
	return strtoll(buf + strlen("pos:"), NULL, 10);
}

static int count_zombie_children(void)
{
	DIR *d = opendir("/proc");
	struct dirent *de;
	int n = 0;

	if (!d)
		return -1;
	while ((de = readdir(d)) != NULL) {
		char path[300], buf[512], *p;
		int f, ppid;
		char state;
		ssize_t r;

		if (de->d_name[0] < '0' || de->d_name[0] > '9')
			continue;
		snprintf(path, sizeof(path), "/proc/%s/stat", de->d_name);
		f = open(path, O_RDONLY);
		if (f < 0)
			continue;
		r = read(f, buf, sizeof(buf) - 1);
		close(f);
		if (r <= 0)
			continue;
		buf[r] = '\0';
		p = strrchr(buf, ')');
		if (p && sscanf(p + 2, "%c %d", &state, &ppid) == 2 && ppid == getpid() &&
		    state == 'Z')
			n++;
	}
	closedir(d);
	return n;
}

static long getpid_in(pid_t pid, struct dbxcr_error *err)
{
	long args[6] = { 0 }, ret = -1;

	if (dbxcr_inject_syscall(pid, SYS_getpid, args, &ret, err) < 0)
		return -1000;
	return ret;
}

/* ---------- 1. getpid injected into blocked system calls ---------- */

struct sleep_report {
	int rc, err;
	long long elapsed_ms;
};

static void test_inject_nanosleep(void)
{
	int rep[2];
	pid_t pid;
	struct dbxcr_error err;
	struct sleep_report r;

	current_test = "inject-nanosleep";
	if (pipe(rep) < 0)
		abort();
	pid = fork();
	if (pid == 0) {
		struct timespec ts = { 0, 600 * 1000000L };
		long long t0 = now_ms();

		r.rc = nanosleep(&ts, NULL);
		r.err = r.rc ? errno : 0;
		r.elapsed_ms = now_ms() - t0;
		if (write(rep[1], &r, sizeof(r)) < 0)
			_exit(2);
		_exit(0);
	}
	close(rep[1]);
	CHECK(wait_in_syscall(pid, SYS_clock_nanosleep) == 0, "child never slept");
	sleep_ms(100);
	for (int i = 0; i < 3; i++) {
		long got = getpid_in(pid, &err);

		CHECK(got == pid, "getpid returned %ld: %s", got, err.msg);
	}
	CHECK(read_timeout(rep[0], &r, sizeof(r), 5000) == 0, "no report");
	CHECK(r.rc == 0, "nanosleep returned %d errno %d (EINTR leaked?)", r.rc, r.err);
	CHECK(r.elapsed_ms >= 595, "slept only %lld ms of 600", r.elapsed_ms);
	CHECK(r.elapsed_ms < 1500, "slept %lld ms (restarted from scratch?)", r.elapsed_ms);
	CHECK(WIFEXITED(reap(pid)), "child did not exit cleanly");
	close(rep[0]);
}

struct read_report {
	ssize_t n;
	int err;
	char data[16];
};

/* A child blocked in read() on a pipe, reporting what it read (struct read_report): the
 * caller writes to cmd[1] and reads rep[0]. */
static pid_t start_reader(int cmd[2], int rep[2])
{
	struct read_report r;
	pid_t pid;

	if (pipe(cmd) < 0 || pipe(rep) < 0)
		abort();
	pid = fork();
	if (pid == 0) {
		memset(&r, 0, sizeof(r));
		r.n = read(cmd[0], r.data, sizeof(r.data) - 1);
		r.err = r.n < 0 ? errno : 0;
		if (write(rep[1], &r, sizeof(r)) < 0)
			_exit(2);
		_exit(0);
	}
	close(rep[1]);
	close(cmd[0]);
	return pid;
}

static void test_inject_read(void)
{
	int cmd[2], rep[2];
	pid_t pid;
	struct dbxcr_error err;
	struct read_report r;
	struct dbxcr_info info;

	current_test = "inject-read";
	pid = start_reader(cmd, rep);
	CHECK(wait_in_syscall(pid, SYS_read) == 0, "child never blocked in read");
	CHECK(getpid_in(pid, &err) == pid, "getpid: %s", err.msg);
	CHECK(getpid_in(pid, &err) == pid, "getpid again: %s", err.msg);
	CHECK(!readable_now(rep[0], 100), "read returned early after injection");
	CHECK(dbxcr_describe(pid, &info, &err) == 0, "describe: %s", err.msg);
	CHECK(info.tracer_pid == 0 && info.threads == 1, "tracer %d threads %d",
	      info.tracer_pid, info.threads);
	CHECK(write(cmd[1], "hello", 5) == 5, "write");
	CHECK(read_timeout(rep[0], &r, sizeof(r), 5000) == 0, "no report");
	CHECK(r.n == 5 && strcmp(r.data, "hello") == 0, "read gave %zd '%s' errno %d", r.n,
	      r.data, r.err);
	CHECK(WIFEXITED(reap(pid)), "child did not exit cleanly");
	close(rep[0]);
	close(cmd[1]);
}

/* The address ranges of pid's mappings ("start-end\n" each) into buf; its length. */
static size_t maps_ranges(pid_t pid, char *buf, size_t len)
{
	char path[64], line[512];
	size_t n = 0;
	FILE *f;

	buf[0] = '\0';
	snprintf(path, sizeof(path), "/proc/%d/maps", (int)pid);
	f = fopen(path, "r");
	if (!f)
		return 0;
	while (fgets(line, sizeof(line), f) && n + 64 < len) {
		char *sp = strchr(line, ' ');

		if (sp) {
			memcpy(buf + n, line, (size_t)(sp - line));
			n += (size_t)(sp - line);
			buf[n++] = '\n';
		}
	}
	buf[n] = '\0';
	fclose(f);
	return n;
}

/* How many of pid's mappings start in [lo, hi). */
static int maps_in(pid_t pid, unsigned long lo, unsigned long hi)
{
	static char buf[65536];
	int n = 0;

	maps_ranges(pid, buf, sizeof(buf));
	for (char *p = buf; *p; p = strchr(p, '\n') + 1) {
		unsigned long s = strtoul(p, NULL, 16);

		n += s >= lo && s < hi;
	}
	return n;
}

/* The umask /proc/PID/status shows, or -1. */
static long status_umask(pid_t pid)
{
	char path[64], line[256];
	FILE *f;
	long m = -1;

	snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
	f = fopen(path, "r");
	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f))
		if (strncmp(line, "Umask:", 6) == 0)
			m = strtol(line + 6, NULL, 8);
	fclose(f);
	return m;
}

/* A batch of calls (batch.c) in a process blocked in read(): more calls than a table
 * holds run in order, each mmap where it was asked; the first failure stops the rest and
 * names its step; a result other than the one expected is an error; and the process
 * then finishes its read as if nothing had happened. */
static void test_inject_batch(void)
{
	const unsigned long page = 4096, base = 0x3e0000000000UL;
	const int nmaps = BATCH_MAX + 22;
	int cmd[2], rep[2];
	pid_t pid;
	struct dbxcr_error err;
	struct read_report r;
	struct tracee t;
	struct batch *b = calloc(1, sizeof(*b));
	long a[6] = { 0 }, code, scratch;

	current_test = "inject-batch";
	if (!b)
		abort();
	pid = start_reader(cmd, rep);
	CHECK(wait_in_syscall(pid, SYS_read) == 0, "child never blocked in read");
	if (attach(&t, pid, &err) < 0) {
		CHECK(0, "attach: %s", err.msg);
		kill_reap(pid);
		free(b);
		return;
	}
	a[1] = (long)page;
	a[2] = PROT_READ | PROT_WRITE;
	a[3] = MAP_PRIVATE | MAP_ANONYMOUS;
	a[4] = -1;
	code = rsys(&t, SYS_mmap, a, &err, "mmap code");
	a[1] = SCRATCH_LEN;
	scratch = rsys(&t, SYS_mmap, a, &err, "mmap scratch");
	CHECK(code > 0 && scratch > 0, "mmap: %s", err.msg);
	CHECK(mem_write(pid, (unsigned long)code, batch_loop, BATCH_LOOP_LEN, &err) == 0,
	      "write the loop: %s", err.msg);
	a[0] = code;
	a[1] = (long)page;
	a[2] = PROT_READ | PROT_EXEC;
	CHECK(rsys(&t, SYS_mprotect, a, &err, "mprotect code") == 0, "%s", err.msg);
	batch_init(b, &t, (unsigned long)code, (unsigned long)scratch + BATCH_TABLE_OFF);

	for (int i = 0; i < nmaps; i++) {
		a[0] = (long)(base + 2 * page * (unsigned long)i);
		a[1] = (long)page;
		a[2] = PROT_READ;
		a[3] = MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE;
		CHECK(batch_add(b, SYS_mmap, a, (unsigned long)a[0], &err, "mmap %d", i) == 0,
		      "add %d: %s", i, err.msg);
	}
	CHECK(b->n == (size_t)(nmaps - BATCH_MAX), "a full table runs at once: %zu left", b->n);
	CHECK(batch_run(b, &err) == 0, "run: %s", err.msg);
	CHECK(maps_in(pid, base, base + 2 * page * (unsigned long)nmaps) == nmaps,
	      "%d of %d mappings made", maps_in(pid, base, base + 2 * page * nmaps), nmaps);

	memset(a, 0, sizeof(a));
	a[0] = 077;
	batch_add(b, SYS_umask, a, 0, &err, "umask 077");
	a[0] = 12345;
	batch_add(b, SYS_close, a, 0, &err, "close %d", 12345);
	a[0] = 0;
	batch_add(b, SYS_umask, a, 0, &err, "umask 0");
	CHECK(batch_run(b, &err) < 0 && err.code == EBADF && strstr(err.msg, "close 12345"),
	      "a failing call: code %d, %s", err.code, err.msg);
	CHECK(status_umask(pid) == 077, "calls after the failure ran: umask %lo",
	      status_umask(pid));

	a[0] = (long)base;	/* taken: a hint only, so the kernel maps elsewhere */
	a[1] = (long)page;
	a[2] = PROT_READ;
	a[3] = MAP_PRIVATE | MAP_ANONYMOUS;
	a[4] = -1;
	batch_add(b, SYS_mmap, a, base, &err, "mmap over mmap 0");
	CHECK(batch_run(b, &err) < 0 && err.code == EEXIST && strstr(err.msg, "landed at"),
	      "an unexpected result: code %d, %s", err.code, err.msg);

	CHECK(restore_and_detach(&t, &err) == 0, "detach: %s", err.msg);
	tracee_free(&t);
	CHECK(write(cmd[1], "batch", 5) == 5, "write");
	CHECK(read_timeout(rep[0], &r, sizeof(r), 5000) == 0, "no report");
	CHECK(r.n == 5 && strcmp(r.data, "batch") == 0, "read gave %zd '%s' errno %d", r.n,
	      r.data, r.err);
	CHECK(WIFEXITED(reap(pid)), "child did not exit cleanly");
	close(rep[0]);
	close(cmd[1]);
	free(b);
}

static volatile sig_atomic_t usr1_count, usr2_seen;

static void on_usr1(int sig)
{
	(void)sig;
	usr1_count++;
}

static void on_usr2(int sig)
{
	(void)sig;
	usr2_seen = 1;
}

/* pause() returns -ERESTARTNOHAND at our stop: after restore it must keep waiting, and a
 * later signal with a (non-SA_RESTART) handler must make it return EINTR. */
static void test_inject_pause(void)
{
	int rep[2];
	pid_t pid;
	struct dbxcr_error err;
	int r[3];

	current_test = "inject-pause";
	if (pipe(rep) < 0)
		abort();
	pid = fork();
	if (pid == 0) {
		struct sigaction sa = { .sa_handler = on_usr1 };

		sigaction(SIGUSR1, &sa, NULL);
		r[0] = pause();
		r[1] = errno;
		r[2] = usr1_count;
		if (write(rep[1], r, sizeof(r)) < 0)
			_exit(2);
		_exit(0);
	}
	close(rep[1]);
	CHECK(wait_in_syscall(pid, SYS_pause) == 0, "child never paused");
	CHECK(getpid_in(pid, &err) == pid, "getpid: %s", err.msg);
	CHECK(!readable_now(rep[0], 100), "pause returned after injection");
	kill(pid, SIGUSR1);
	CHECK(read_timeout(rep[0], r, sizeof(r), 5000) == 0, "no report");
	CHECK(r[0] == -1 && r[1] == EINTR && r[2] == 1, "pause %d errno %d handler ran %d",
	      r[0], r[1], r[2]);
	CHECK(WIFEXITED(reap(pid)), "child did not exit cleanly");
	close(rep[0]);
}

/* A signal sent just before we attach (possibly reported as a signal-delivery-stop) must be
 * delivered exactly once; the child is busy in user code, not in a syscall. */
static void test_inject_pending_signal(void)
{
	int rep[2];
	pid_t pid;
	struct dbxcr_error err;
	int count = -1;

	current_test = "inject-pending-signal";
	if (pipe(rep) < 0)
		abort();
	pid = fork();
	if (pid == 0) {
		struct sigaction sa = { .sa_handler = on_usr1 };
		struct sigaction sb = { .sa_handler = on_usr2 };
		volatile unsigned long spin = 0;

		sigaction(SIGUSR1, &sa, NULL);
		sigaction(SIGUSR2, &sb, NULL);
		if (write(rep[1], "R", 1) < 0)
			_exit(2);
		while (!usr2_seen)
			spin++;
		count = usr1_count;
		if (write(rep[1], &count, sizeof(count)) < 0)
			_exit(2);
		_exit(0);
	}
	close(rep[1]);
	char c;
	CHECK(read_timeout(rep[0], &c, 1, 5000) == 0, "child not ready");
	for (int i = 0; i < 5; i++) {
		kill(pid, SIGUSR1);
		CHECK(getpid_in(pid, &err) == pid, "getpid: %s", err.msg);
		sleep_ms(10);
	}
	kill(pid, SIGUSR2);
	CHECK(read_timeout(rep[0], &count, sizeof(count), 5000) == 0, "no report");
	/* Standard signals coalesce while pending, so 5 sends give 1..5 deliveries; what
	 * must not happen is 0 (lost). */
	CHECK(count >= 1 && count <= 5, "SIGUSR1 handler ran %d times", count);
	CHECK(WIFEXITED(reap(pid)), "child did not exit cleanly");
	close(rep[0]);
}

static void test_inject_wait4(void)
{
	int rep[2];
	pid_t pid;
	struct dbxcr_error err;
	int r[3];

	current_test = "inject-wait4";
	if (pipe(rep) < 0)
		abort();
	pid = fork();
	if (pid == 0) {
		pid_t g = fork();
		int st = 0;

		if (g == 0) {
			sleep_ms(400);
			_exit(7);
		}
		r[0] = (int)waitpid(g, &st, 0);
		r[1] = r[0] < 0 ? errno : 0;
		r[2] = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
		r[0] = r[0] == g;
		if (write(rep[1], r, sizeof(r)) < 0)
			_exit(2);
		_exit(0);
	}
	close(rep[1]);
	CHECK(wait_in_syscall(pid, SYS_wait4) == 0, "child never waited");
	CHECK(getpid_in(pid, &err) == pid, "getpid: %s", err.msg);
	CHECK(read_timeout(rep[0], r, sizeof(r), 5000) == 0, "no report");
	CHECK(r[0] == 1 && r[1] == 0 && r[2] == 7, "waitpid ok=%d errno=%d status=%d", r[0],
	      r[1], r[2]);
	CHECK(WIFEXITED(reap(pid)), "child did not exit cleanly");
	close(rep[0]);
}

/* ---------- a released template, unseen by its parent ---------- */

static volatile sig_atomic_t sigchlds;

static void count_sigchld(int sig)
{
	(void)sig;
	sigchlds++;
}

/* The parent of the test's templated process: counts its SIGCHLDs and, on each command
 * byte, reports {SIGCHLDs so far, waitpid(-1, WNOHANG) twice (0: only live children)} --
 * a program that reaps any child, as a shell or postmaster does.  It is a child
 * subreaper (a supervisor, `tini -s`), so the template, an orphan (orphan.c), becomes its
 * child.  `pending`: a first child has exited while SIGCHLD was blocked (its SIGCHLD
 * pending), unblocked at the first command. */
static void chld_counting_parent(int cmd, int rep, bool pending)
{
	struct sigaction sa = { .sa_handler = count_sigchld };
	sigset_t chld;
	int r[3];
	pid_t child;
	char c;

	sigaction(SIGCHLD, &sa, NULL);
	if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0)
		_exit(2);
	sigemptyset(&chld);
	sigaddset(&chld, SIGCHLD);
	if (pending) {
		sigprocmask(SIG_BLOCK, &chld, NULL);
		if (fork() == 0)
			_exit(0);
		for (;;) {	/* until that child's SIGCHLD is pending */
			sigset_t now;

			if (sigpending(&now) == 0 && sigismember(&now, SIGCHLD))
				break;
			sleep_ms(5);
		}
	}
	child = fork();
	if (child == 0) {
		for (;;)
			pause();
	}
	if (write(rep, &child, sizeof(child)) < 0)
		_exit(2);
	for (;;) {
		ssize_t n = read(cmd, &c, 1);

		if (n < 0 && errno == EINTR)
			continue;	/* a SIGCHLD we were meant not to see */
		if (n <= 0)
			_exit(0);
		sigprocmask(SIG_UNBLOCK, &chld, NULL);
		r[0] = sigchlds;
		r[1] = (int)waitpid(-1, NULL, WNOHANG);
		r[2] = (int)waitpid(-1, NULL, WNOHANG);
		if (write(rep, r, sizeof(r)) < 0)
			_exit(2);
	}
}

static int ask_parent(int cmd, int rep, int r[3])
{
	return write(cmd, "r", 1) == 1 ? read_timeout(rep, r, 3 * sizeof(int), 5000) : -1;
}

/* A template whose parent is a live process, released: the parent sees nothing of it
 * (`pending`: nor loses the SIGCHLD of its child that exited before). */
static void release_unseen(bool pending)
{
	int cmd[2], rep[2], r[3] = { 0 };
	struct dbxcr_error err;
	struct dbxcr_template *tpl;
	struct dbxcr_info info;
	pid_t parent, child = -1, tpid;

	current_test = pending ? "release-unseen-pending" : "release-unseen";
	if (pipe2(cmd, O_CLOEXEC) < 0 || pipe2(rep, O_CLOEXEC) < 0)
		abort();
	parent = fork();
	if (parent == 0) {
		close(cmd[1]), close(rep[0]);
		chld_counting_parent(cmd[0], rep[1], pending);
	}
	CHECK(read_timeout(rep[0], &child, sizeof(child), 5000) == 0, "no child");
	CHECK(wait_in_syscall(parent, SYS_read) == 0, "parent never read");
	tpl = child > 0 ? dbxcr_make_template(child, &err) : NULL;
	CHECK(tpl != NULL, "make_template: %s", err.msg);
	if (!tpl)
		goto out;
	tpid = dbxcr_template_pid(tpl);
	CHECK(dbxcr_describe(tpid, &info, &err) == 0 && info.ppid == parent,
	      "template %d: parent %d, not %d", tpid, info.ppid, parent);
	CHECK(dbxcr_release_template(tpl, &err) == 0, "release: %s", err.msg);
	/* Gone for good: no zombie left with the parent, no SIGCHLD, nothing to reap. */
	CHECK(dbxcr_describe(tpid, &info, &err) < 0, "template %d still there (state %c)",
	      tpid, info.state);
	if (pending)	/* its first child's SIGCHLD, once, and that child only */
		CHECK(ask_parent(cmd[1], rep[0], r) == 0 && r[0] == 1 && r[1] > 0 && r[1] != tpid &&
		      r[2] == 0, "the parent's pending SIGCHLD: %d SIGCHLD, waitpid(-1) = %d "
		      "then %d (template %d)", r[0], r[1], r[2], tpid);
	else
		CHECK(ask_parent(cmd[1], rep[0], r) == 0 && r[0] == 0 && r[1] == 0,
		      "the parent saw the template end: %d SIGCHLD, waitpid(-1) = %d", r[0], r[1]);
	/* ... while it does see its own child end. */
	kill(child, SIGKILL);
	for (int i = 0; i < 100 && dbxcr_describe(child, &info, &err) == 0 && info.state != 'Z';
	     i++)
		sleep_ms(10);
	CHECK(ask_parent(cmd[1], rep[0], r) == 0 && r[0] == 1 + pending && r[1] == child,
	      "its own child's end: %d SIGCHLD, waitpid(-1) = %d (child %d)", r[0], r[1],
	      child);
	child = -1;
out:
	if (child > 0)
		kill(child, SIGKILL);
	close(cmd[1]);
	reap(parent);
	close(cmd[0]), close(rep[0]), close(rep[1]);
}

/* The original of test_template_orphan: blocked in a read of `go` with a sigaltstack of
 * its own; once it reads a byte, reports {its sigaltstack's base and size, whether it has
 * an rseq registration (-1: unknown)} on `rep`. */
static char orphan_altstack[65536];

/* An unregistration with glibc's area and length and a wrong signature: EPERM if this
 * thread is registered (with that area), EINVAL if not (-1: glibc did not register). */
static long rseq_registered(void)
{
	if (__rseq_size == 0)
		return -1;
	if (syscall(SYS_rseq, (char *)__builtin_thread_pointer() + __rseq_offset, 32,
		    RSEQ_FLAG_UNREGISTER, 0) == 0)
		return -1;	/* cannot happen with signature 0; unknown if it did */
	return errno == EPERM ? 1 : errno == EINVAL ? 0 : -1;
}

static void orphan_original(int go, int rep)
{
	stack_t ss = { .ss_sp = orphan_altstack, .ss_size = sizeof(orphan_altstack) };
	long r[3];
	char c;

	if (sigaltstack(&ss, NULL) < 0 || read(go, &c, 1) != 1 || sigaltstack(NULL, &ss) < 0)
		_exit(2);
	r[0] = (long)ss.ss_sp;
	r[1] = (long)ss.ss_size;
	r[2] = rseq_registered();
	_exit(write(rep, r, sizeof(r)) == sizeof(r) ? 0 : 3);
}

/* Field k (1-based, as in proc(5)) of /proc/pid/stat; -1 if none. */
static long stat_field(pid_t pid, int k)
{
	char buf[2048], *p, *save = NULL;
	int field = 3;

	if (proc_read(pid, "stat", buf, sizeof(buf)) < 0 || !(p = strrchr(buf, ')')))
		return -1;
	for (char *tok = strtok_r(p + 1, " ", &save); tok; tok = strtok_r(NULL, " ", &save))
		if (field++ == k)
			return strtol(tok, NULL, 10);
	return -1;
}

/* /proc/pid/task/pid/children into buf ("pid pid ... "); -1 if unreadable. */
static int children_of(pid_t pid, char *buf, size_t len)
{
	char path[64];
	ssize_t n = -1;
	int fd;

	snprintf(path, sizeof(path), "/proc/%d/task/%d/children", (int)pid, (int)pid);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd >= 0) {
		n = read(fd, buf, len - 1);
		close(fd);
	}
	buf[n > 0 ? n : 0] = '\0';
	return n < 0 ? -1 : 0;
}

/* A process whose parent is another live process (neither the caller nor an init): its
 * template is forked through an intermediate (orphan.c) and is the nearest subreaper's
 * child (this test's, made one for it) with exit signal SIGCHLD, not its parent's; no
 * intermediate is left with the original; the parent's wait for any child ends once its
 * own child is gone (with a sibling template it waited for as long as the template
 * lived); a child spawned from the template has the original's sigaltstack and rseq
 * registration. */
static void test_template_orphan(void)
{
	int cmd[2], rep[2], go[2], krep[2], r[2] = { -1, -1 };
	long k[3] = { 0, 0, -2 }, was = rseq_registered();
	struct dbxcr_error err;
	struct dbxcr_template *tpl = NULL;
	struct dbxcr_info info;
	pid_t parent, child = -1, tpid = -1, kid = -1;
	char kids[64] = "";

	current_test = "template-orphan";
	if (pipe2(cmd, O_CLOEXEC) < 0 || pipe2(rep, O_CLOEXEC) < 0 || pipe(go) < 0 ||
	    pipe(krep) < 0 || prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0)
		abort();
	parent = fork();
	if (parent == 0) {
		int n = 0;
		char c;

		child = fork();
		if (child == 0)
			orphan_original(go[0], krep[1]);
		if (write(rep[1], &child, sizeof(child)) != sizeof(child) ||
		    read(cmd[0], &c, 1) != 1)
			_exit(2);
		while (wait(NULL) > 0)	/* any child, until there is none */
			n++;
		r[0] = n;
		r[1] = errno;
		_exit(write(rep[1], r, sizeof(r)) == sizeof(r) ? 0 : 3);
	}
	close(go[0]);
	close(krep[1]);
	CHECK(read_timeout(rep[0], &child, sizeof(child), 5000) == 0, "no child");
	CHECK(wait_in_syscall(child, SYS_read) == 0, "the original never blocked in read");
	tpl = child > 0 ? dbxcr_make_template(child, &err) : NULL;
	CHECK(tpl != NULL, "make_template: %s", err.msg);
	if (!tpl)
		goto out;
	tpid = dbxcr_template_pid(tpl);
	CHECK(dbxcr_describe(tpid, &info, &err) == 0 && info.ppid == getpid(),
	      "template %d: parent %d, not the subreaper %d", tpid, info.ppid, getpid());
	CHECK(stat_field(tpid, 38) == SIGCHLD, "template's exit signal %ld",
	      stat_field(tpid, 38));
	children_of(parent, kids, sizeof(kids));
	CHECK(atoi(kids) == child && strchr(kids, ' ') == kids + strlen(kids) - 1,
	      "the parent's children: '%s' (want only %d)", kids, child);
	CHECK(children_of(child, kids, sizeof(kids)) == 0 && kids[0] == '\0',
	      "the original's children: '%s' (its intermediate left?)", kids);
	kid = dbxcr_spawn(tpl, NULL, &err);
	CHECK(kid > 0, "spawn: %s", err.msg);
	kill(child, SIGKILL);
	CHECK(write(cmd[1], "w", 1) == 1, "tell the parent");
	CHECK(read_timeout(rep[0], r, sizeof(r), 5000) == 0 && r[0] == 1 && r[1] == ECHILD,
	      "the parent's wait for any child: reaped %d, then errno %d (a template held it?)",
	      r[0], r[1]);
	if (kid > 0) {
		CHECK(write(go[1], "g", 1) == 1, "go");
		CHECK(read_timeout(krep[0], k, sizeof(k), 5000) == 0, "no report from the spawn");
		CHECK(k[0] == (long)orphan_altstack && k[1] == (long)sizeof(orphan_altstack),
		      "the spawn's sigaltstack %#lx+%ld, not %p+%zu", k[0], k[1],
		      (void *)orphan_altstack, sizeof(orphan_altstack));
		CHECK(was != 1 || k[2] == 1, "the spawn's rseq registration: %ld", k[2]);
		CHECK(reap(kid) == 0, "the spawn's exit status");
		kid = -1;
	}
	CHECK(dbxcr_release_template(tpl, &err) == 0, "release: %s", err.msg);
	tpl = NULL;
	reap(tpid);	/* the template's zombie: ours, as its subreaper */
out:
	if (tpl)
		dbxcr_release_template(tpl, &err);
	kill_reap(kid);
	if (child > 0)
		kill(child, SIGKILL);
	kill_reap(parent);
	prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0);
	while (waitpid(-1, NULL, __WALL | WNOHANG) > 0)
		;	/* orphans that came to us meanwhile */
	close(cmd[0]), close(cmd[1]), close(rep[0]), close(rep[1]), close(go[1]), close(krep[0]);
}

static void test_release_unseen(void)
{
	release_unseen(false);
}

static void test_release_unseen_pending(void)
{
	release_unseen(true);
}

/* ---------- 2. templates and children ---------- */

#define BUF_SIZE (1 << 20)
#define CMD_FD 10
#define REP_FD 11
#define FILE_FD 12
static const char file_text[] = "0123456789abcdefghijklmnopqrstuvwxyz";

struct state_report {
	int pid, ppid, counter, eintr;
	uint64_t checksum;
	long long off;
	char data[8];
	int shm;	/* the first int of shm_page */
	char priv[2];	/* the first byte of each page of priv_pages */
};

static unsigned char *shared_buf;	/* mapped before fork: same address in every copy */
static int *shm_page;			/* MAP_SHARED | MAP_ANONYMOUS, one page */
/* Two pages of priv_path ("A..." and "B..."), MAP_PRIVATE: 'm' writes the first. */
static char *priv_pages;
static char priv_path[64];
static int prog_counter;

static uint64_t checksum(const unsigned char *b, size_t n)
{
	uint64_t h = 1469598103934665603ULL;

	for (size_t i = 0; i < n; i++)
		h = (h ^ b[i]) * 1099511628211ULL;
	return h;
}

static void fill_pattern(unsigned char *b, int seed)
{
	for (size_t i = 0; i < BUF_SIZE; i++)
		b[i] = (unsigned char)(i * 7 + (size_t)seed);
}

/* The "program" checkpointed by the template tests: a command loop on CMD_FD. */
static void program(void)
{
	int eintr = 0;

	for (;;) {
		char c;
		ssize_t n = read(CMD_FD, &c, 1);
		struct state_report r;

		if (n < 0 && errno == EINTR) {
			eintr++;
			continue;
		}
		if (n <= 0)
			_exit(3);
		memset(&r, 0, sizeof(r));
		switch (c) {
		case 'm':	/* mutate memory and advance the file */
			prog_counter++;
			fill_pattern(shared_buf, 100 + prog_counter);
			shm_page[0]++;
			priv_pages[0] = 'w';
			if (read(FILE_FD, r.data, 5) != 5)
				_exit(4);
			break;
		case 'f':	/* read 5 bytes of the file */
			r.off = read(FILE_FD, r.data, 5);
			/* fallthrough */
		case 'r':
			r.pid = getpid();
			r.ppid = getppid();
			r.counter = prog_counter;
			r.eintr = eintr;
			r.checksum = checksum(shared_buf, BUF_SIZE);
			r.shm = shm_page[0];
			r.priv[0] = priv_pages[0];
			r.priv[1] = priv_pages[4096];
			if (c == 'f')
				r.off = lseek(FILE_FD, 0, SEEK_CUR);
			if (write(REP_FD, &r, sizeof(r)) != sizeof(r))
				_exit(5);
			break;
		case 'q':
			_exit(0);
		}
	}
}

struct proc {
	pid_t pid;
	int cmd, rep;	/* our ends */
};

static int ask(struct proc *p, char c, struct state_report *r)
{
	if (write(p->cmd, &c, 1) != 1)
		return -1;
	if (c == 'm' || c == 'q')
		return 0;
	return read_timeout(p->rep, r, sizeof(*r), 5000);
}

static char file_path[64];

static struct proc start_program(void)
{
	int cmd[2], rep[2];
	struct proc p;

	if (pipe2(cmd, O_CLOEXEC) < 0 || pipe2(rep, O_CLOEXEC) < 0)
		abort();
	p.pid = fork();
	if (p.pid == 0) {
		int f = open(file_path, O_RDONLY);
		char skip[5];

		if (f < 0 || dup2(f, FILE_FD) < 0 || dup2(cmd[0], CMD_FD) < 0 ||
		    dup2(rep[1], REP_FD) < 0)
			_exit(6);
		close(f);
		if (read(FILE_FD, skip, 5) != 5 || read(FILE_FD, skip, 5) != 5)	/* offset 10 */
			_exit(6);
		if (write(REP_FD, "R", 1) != 1)	/* ready: only the command loop is left */
			_exit(6);
		program();
	}
	close(cmd[0]);
	close(rep[1]);
	p.cmd = cmd[1];
	p.rep = rep[0];
	{
		char c;

		if (read_timeout(p.rep, &c, 1, 5000) < 0)
			abort();
	}
	return p;
}

static void stop_program(struct proc *p)
{
	if (p->pid > 0)
		kill_reap(p->pid);
	close(p->cmd);
	close(p->rep);
	p->pid = -1;
}

/* Spawn from tpl with fresh command/report pipes at CMD_FD/REP_FD and the file reopened
 * at offset 10. */
/* A child of tpl (or, with `carrier`, a carrier of it: *carrier set) spawned with opts `o`
 * plus fresh command/report pipes at CMD_FD/REP_FD (our ends in the result) and the file
 * reopened at offset 10.  pid < 0 with err on failure. */
static struct proc program_from(struct dbxcr_template *tpl, struct dbxcr_spawn_opts *o,
				struct dbxcr_carrier **carrier, struct dbxcr_error *err)
{
	int cmd[2], rep[2];
	struct proc p;
	struct dbxcr_fdmap fds[2];
	struct dbxcr_file file = { FILE_FD, O_RDONLY, 10, file_path };

	if (pipe2(cmd, O_CLOEXEC) < 0 || pipe2(rep, O_CLOEXEC) < 0)
		abort();
	fds[0] = (struct dbxcr_fdmap){ cmd[0], CMD_FD, 0 };
	fds[1] = (struct dbxcr_fdmap){ rep[1], REP_FD, 0 };
	o->files = &file;
	o->nfiles = 1;
	o->fds = fds;
	o->nfds = 2;
	p.pid = carrier ? dbxcr_spawn_carrier(tpl, o, carrier, err) : dbxcr_spawn(tpl, o, err);
	o->files = NULL;	/* both point into this frame */
	o->fds = NULL;
	close(cmd[0]);
	close(rep[1]);
	p.cmd = cmd[1];
	p.rep = rep[0];
	return p;
}

static struct proc spawn_program(struct dbxcr_template *tpl, const pid_t *set_tid,
				 size_t n_tid, int mntns_fd, const char *cwd,
				 struct dbxcr_error *err)
{
	struct dbxcr_spawn_opts o = { 0 };

	o.mntns_fd = mntns_fd;
	o.cwd = cwd;
	o.set_tid = set_tid;
	o.set_tid_size = n_tid;
	return program_from(tpl, &o, NULL, err);
}

static bool same_link(const char *a, const char *b)
{
	char x[PATH_MAX], y[PATH_MAX];
	ssize_t n = readlink(a, x, sizeof(x) - 1), m = readlink(b, y, sizeof(y) - 1);

	if (n < 0 || m < 0)
		return false;
	x[n] = y[m] = '\0';
	return strcmp(x, y) == 0;
}

static bool same_mtime(const char *path, const struct timespec *want)
{
	struct stat st;

	return stat(path, &st) == 0 && st.st_mtim.tv_sec == want->tv_sec &&
	       st.st_mtim.tv_nsec == want->tv_nsec;
}

/* A cwd removed since the process entered it: the child makes the stand-ins it is given,
 * enters the innermost and removes them again, so its cwd reads "(deleted)"; the directory
 * they were made in keeps its times; a failing step leaves nothing behind either. */
static void test_spawn_deleted_cwd(void)
{
	static const struct timespec old[2] = { { 1000000000, 5 }, { 1000000000, 7 } };
	char dir[] = "/tmp/dbx-cwd-XXXXXX", a[64], ab[80], proc[64], link[PATH_MAX],
	     want[PATH_MAX];
	const char *made[2] = { a, ab };
	struct dbxcr_spawn_opts o = { .mntns_fd = -1, .pidns_fd = -1, .ns_pidfd = -1 };
	struct dbxcr_error err;
	struct dbxcr_template *tpl;
	struct proc orig, kid;
	ssize_t n;

	current_test = "spawn-deleted-cwd";
	if (!mkdtemp(dir) || utimensat(AT_FDCWD, dir, old, 0) < 0)
		abort();
	snprintf(a, sizeof(a), "%s/a", dir);
	snprintf(ab, sizeof(ab), "%s/a/b", dir);
	orig = start_program();
	tpl = dbxcr_make_template(orig.pid, &err);
	CHECK(tpl != NULL, "make_template: %s", err.msg);
	if (!tpl) {
		stop_program(&orig);
		rmdir(dir);
		return;
	}
	o.cwd = ab;
	o.cwd_made = made;
	o.ncwd_made = 2;
	kid = program_from(tpl, &o, NULL, &err);
	CHECK(kid.pid > 0, "spawn: %s", err.msg);
	snprintf(proc, sizeof(proc), "/proc/%d/cwd", kid.pid);
	snprintf(want, sizeof(want), "%s (deleted)", ab);
	n = kid.pid > 0 ? readlink(proc, link, sizeof(link) - 1) : -1;
	if (n >= 0)
		link[n] = '\0';
	CHECK(n >= 0 && strcmp(link, want) == 0, "child's cwd %s, want %s",
	      n >= 0 ? link : "?", want);
	CHECK(access(a, F_OK) < 0 && errno == ENOENT, "stand-in %s left", a);
	CHECK(same_mtime(dir, &old[1]), "%s's mtime changed", dir);
	stop_program(&kid);

	/* chdir fails (a cwd that is not the innermost stand-in): refused, nothing left */
	o.cwd = "/nonexistent-dbx";
	kid = program_from(tpl, &o, NULL, &err);
	CHECK(kid.pid < 0 && err.code == ENOENT && strstr(err.msg, "chdir /nonexistent-dbx"),
	      "a failed chdir: pid %d, %s", kid.pid, err.msg);
	stop_program(&kid);
	CHECK(access(a, F_OK) < 0 && errno == ENOENT, "stand-in %s left after a failure", a);
	CHECK(same_mtime(dir, &old[1]), "%s's mtime changed by a failure", dir);

	CHECK(dbxcr_release_template(tpl, &err) == 0, "release: %s", err.msg);
	stop_program(&orig);
	if (rmdir(dir) < 0)
		CHECK(false, "rmdir %s: %s", dir, strerror(errno));
}

/* A template (a fork) shares MAP_SHARED memory with the original: a child spawned from it
 * sees the original's later writes unless the mapping is replaced (dbxcr_remap). */
static void test_shared_remap(void)
{
	struct dbxcr_error err;
	struct dbxcr_template *tpl;
	struct proc orig, plain, kid;
	struct state_report r;
	int cmd[2], rep[2], saved;
	struct dbxcr_fdmap fds[2];
	struct dbxcr_remap rm;
	struct dbxcr_spawn_opts o = { 0 };

	current_test = "shared-remap";
	shm_page[0] = 7;
	orig = start_program();
	tpl = dbxcr_make_template(orig.pid, &err);
	CHECK(tpl != NULL, "make_template: %s", err.msg);
	if (!tpl) {
		stop_program(&orig);
		return;
	}
	CHECK(ask(&orig, 'm', &r) == 0 && ask(&orig, 'm', &r) == 0 && ask(&orig, 'r', &r) == 0 &&
	      r.shm == 9, "original's shared int %d, want 9", r.shm);
	plain = spawn_program(tpl, NULL, 0, -1, NULL, &err);
	CHECK(plain.pid > 0 && ask(&plain, 'r', &r) == 0 && r.shm == 9,
	      "a child without the remap sees the original's writes: %d", r.shm);
	stop_program(&plain);

	/* What the daemon does: a copy saved at the checkpoint, mapped in place. */
	saved = memfd_create("saved", MFD_CLOEXEC);
	if (saved < 0 || ftruncate(saved, 4096) < 0 || pwrite(saved, &(int){ 7 }, 4, 0) != 4)
		abort();
	if (pipe2(cmd, O_CLOEXEC) < 0 || pipe2(rep, O_CLOEXEC) < 0)
		abort();
	fds[0] = (struct dbxcr_fdmap){ cmd[0], CMD_FD, 0 };
	fds[1] = (struct dbxcr_fdmap){ rep[1], REP_FD, 0 };
	rm = (struct dbxcr_remap){ .start = (unsigned long)shm_page,
				   .end = (unsigned long)shm_page + 4096,
				   .prot = PROT_READ | PROT_WRITE, .src = saved };
	o.mntns_fd = -1;
	o.fds = fds;
	o.nfds = 2;
	o.remaps = &rm;
	o.nremaps = 1;
	kid.pid = dbxcr_spawn(tpl, &o, &err);
	close(cmd[0]);
	close(rep[1]);
	kid.cmd = cmd[1];
	kid.rep = rep[0];
	CHECK(kid.pid > 0, "spawn with a remap: %s", err.msg);
	if (kid.pid > 0) {
		int now = 0;

		CHECK(ask(&kid, 'r', &r) == 0 && r.shm == 7, "child's shared int %d, want 7",
		      r.shm);
		CHECK(ask(&kid, 'm', &r) == 0 && ask(&kid, 'r', &r) == 0 && r.shm == 8 &&
		      pread(saved, &now, 4, 0) == 4 && now == 8,
		      "the child's write is not in the new object: %d", now);
		CHECK(ask(&orig, 'r', &r) == 0 && r.shm == 9, "the original's shared int %d, "
		      "want 9 (untouched by the child)", r.shm);
	}
	rm.end = rm.start;
	o.nfds = 0;
	CHECK(dbxcr_spawn(tpl, &o, &err) < 0 && err.code == EINVAL, "an empty remap: %s",
	      err.msg);
	stop_program(&kid);
	close(saved);
	dbxcr_release_template(tpl, &err);
	stop_program(&orig);
}

/* More descriptors than one SCM_RIGHTS message carries (SCM_MAX_FD, 253): a spawn hands
 * them over in several (transfer_fds), each at its target number.  (A Chromium browser
 * process restored into a fork gets ~165 descriptors and ~150 shared mappings.) */
#define MANY_FDS 300
#define MANY_FIRST 100

static void test_spawn_many_fds(void)
{
	struct dbxcr_error err;
	struct dbxcr_template *tpl;
	struct proc orig, kid = { 0 };
	struct state_report r;
	int cmd[2], rep[2], null;
	struct dbxcr_fdmap fds[MANY_FDS + 2];
	struct dbxcr_spawn_opts o = { 0 };
	char path[64], target[64];
	ssize_t len;

	current_test = "spawn-many-fds";
	orig = start_program();
	tpl = dbxcr_make_template(orig.pid, &err);
	CHECK(tpl != NULL, "make_template: %s", err.msg);
	if (!tpl) {
		stop_program(&orig);
		return;
	}
	null = open("/dev/null", O_RDONLY | O_CLOEXEC);
	if (null < 0 || pipe2(cmd, O_CLOEXEC) < 0 || pipe2(rep, O_CLOEXEC) < 0)
		abort();
	fds[0] = (struct dbxcr_fdmap){ cmd[0], CMD_FD, 0 };
	fds[1] = (struct dbxcr_fdmap){ rep[1], REP_FD, 0 };
	for (int i = 0; i < MANY_FDS; i++)
		fds[2 + i] = (struct dbxcr_fdmap){ null, MANY_FIRST + i, 1 };
	o.mntns_fd = -1;
	o.fds = fds;
	o.nfds = MANY_FDS + 2;
	kid.pid = dbxcr_spawn(tpl, &o, &err);
	close(cmd[0]);
	close(rep[1]);
	kid.cmd = cmd[1];
	kid.rep = rep[0];
	CHECK(kid.pid > 0, "spawn with %d descriptors: %s", MANY_FDS + 2, err.msg);
	if (kid.pid > 0) {
		CHECK(ask(&kid, 'r', &r) == 0, "the child does not answer");
		for (int i = 0; i < MANY_FDS; i += MANY_FDS - 1) {
			snprintf(path, sizeof(path), "/proc/%d/fd/%d", kid.pid, MANY_FIRST + i);
			len = readlink(path, target, sizeof(target) - 1);
			target[len > 0 ? len : 0] = '\0';
			CHECK(strcmp(target, "/dev/null") == 0, "fd %d of the child: '%s'",
			      MANY_FIRST + i, target);
		}
		stop_program(&kid);
	} else {
		close(cmd[1]);
		close(rep[0]);
	}
	close(null);
	dbxcr_release_template(tpl, &err);
	stop_program(&orig);
}

/* Fill the two pages of the file fd with `first` and `second` (in place). */
static void fill_pages(int fd, char first, char second)
{
	char page[4096];

	memset(page, first, sizeof(page));
	if (pwrite(fd, page, 4096, 0) != 4096)
		abort();
	memset(page, second, sizeof(page));
	if (pwrite(fd, page, 4096, 4096) != 4096)
		abort();
}

static void rewrite_priv(char first, char second)
{
	int fd = open(priv_path, O_WRONLY | O_CLOEXEC);

	if (fd < 0)
		abort();
	fill_pages(fd, first, second);
	close(fd);
}

/* A template's private file mapping is the file itself: a page the original never wrote
 * shows the file's later in-place writes in every child, unless the mapping is made
 * again (private_map) from a file with the checkpoint's bytes, the written page copied
 * from the template. */
static void test_private_remap(void)
{
	struct dbxcr_error err;
	struct dbxcr_template *tpl;
	struct proc orig, plain, kid;
	struct state_report r;
	struct dbxcr_remap rm;
	struct dbxcr_spawn_opts o = { 0 };
	int saved;

	current_test = "private-remap";
	rewrite_priv('A', 'B');
	orig = start_program();
	CHECK(ask(&orig, 'm', &r) == 0 && ask(&orig, 'r', &r) == 0 && r.priv[0] == 'w' &&
	      r.priv[1] == 'B', "original's pages %c %c, want w B", r.priv[0], r.priv[1]);
	tpl = dbxcr_make_template(orig.pid, &err);
	CHECK(tpl != NULL, "make_template: %s", err.msg);
	if (!tpl) {
		stop_program(&orig);
		return;
	}
	rewrite_priv('X', 'X');
	plain = spawn_program(tpl, NULL, 0, -1, NULL, &err);
	CHECK(plain.pid > 0 && ask(&plain, 'r', &r) == 0 && r.priv[0] == 'w' && r.priv[1] == 'X',
	      "a child without the remap: %c %c, want w X (the file's new bytes)", r.priv[0],
	      r.priv[1]);
	stop_program(&plain);

	/* What the daemon does: the restored tree's file, with the checkpoint's bytes. */
	saved = memfd_create("checkpoint", MFD_CLOEXEC);
	if (saved < 0)
		abort();
	fill_pages(saved, 'A', 'B');
	rm = (struct dbxcr_remap){ .start = (unsigned long)priv_pages,
				   .end = (unsigned long)priv_pages + 8192,
				   .prot = PROT_READ | PROT_WRITE, .src = saved, .private_map = 1 };
	o.mntns_fd = -1;
	o.remaps = &rm;
	o.nremaps = 1;
	kid = program_from(tpl, &o, NULL, &err);
	CHECK(kid.pid > 0, "spawn with a private remap: %s", err.msg);
	if (kid.pid > 0)
		CHECK(ask(&kid, 'r', &r) == 0 && r.priv[0] == 'w' && r.priv[1] == 'B',
		      "child's pages %c %c, want w B (its own write, the checkpoint's bytes)",
		      r.priv[0], r.priv[1]);
	stop_program(&kid);
	close(saved);
	dbxcr_release_template(tpl, &err);
	stop_program(&orig);
}

static void test_templates(void)
{
	struct dbxcr_error err;
	struct dbxcr_template *tpl;
	struct proc orig, c1, c2, c3;
	struct state_report r;
	struct dbxcr_info info;
	uint64_t sum_a;
	pid_t tpid, orig_pid;
	unsigned char *copy = malloc(BUF_SIZE);

	current_test = "templates";
	fill_pattern(shared_buf, 1);
	sum_a = checksum(shared_buf, BUF_SIZE);
	orig = start_program();
	CHECK(wait_in_syscall(orig.pid, SYS_read) == 0, "program never blocked in read");

	tpl = dbxcr_make_template(orig.pid, &err);
	CHECK(tpl != NULL, "make_template: %s", err.msg);
	if (!tpl) {
		stop_program(&orig);
		free(copy);
		return;
	}
	tpid = dbxcr_template_pid(tpl);
	CHECK(dbxcr_template_origin(tpl) == orig.pid, "origin");
	CHECK(dbxcr_describe(tpid, &info, &err) == 0, "describe template: %s", err.msg);
	CHECK(info.state == 't' && info.tracer_pid == getpid() && info.ppid == getpid(),
	      "template state %c tracer %d ppid %d (want t, %d, %d: a sibling)", info.state,
	      info.tracer_pid, info.ppid, getpid(), getpid());
	CHECK(dbxcr_describe(orig.pid, &info, &err) == 0 && info.tracer_pid == 0,
	      "original still traced");
	{
		char t[32];

		/* named from the start (ps tells it from the program), its command line empty
		 * (pgrep -f / pkill -f do not match it) while the original keeps its own */
		CHECK(strcmp(comm_of(tpid, t), "dbx-template") == 0, "template named '%s'", t);
		CHECK(cmdline_of(tpid, t, sizeof(t)) == 0, "template command line not empty");
		CHECK(cmdline_of(orig.pid, t, sizeof(t)) > 0, "original lost its command line");
	}

	/* The original goes on: its read restarted, it mutates memory and the file offset. */
	CHECK(ask(&orig, 'r', &r) == 0 && r.counter == 0 && r.checksum == sum_a &&
	      r.eintr == 0, "original before mutation: counter %d eintr %d", r.counter, r.eintr);
	ask(&orig, 'm', NULL);
	CHECK(ask(&orig, 'r', &r) == 0 && r.counter == 1 && r.checksum != sum_a,
	      "original after mutation: counter %d", r.counter);
	CHECK(fd_pos(orig.pid, FILE_FD) == 15, "original offset %lld", fd_pos(orig.pid, FILE_FD));

	/* The template's memory is the original's at template time. */
	{
		struct iovec l = { copy, BUF_SIZE }, rm = { shared_buf, BUF_SIZE };

		CHECK(process_vm_readv(tpid, &l, 1, &rm, 1, 0) == BUF_SIZE, "read template: %s",
		      strerror(errno));
		CHECK(checksum(copy, BUF_SIZE) == sum_a, "template memory changed");
	}

	/* Two children: both continue from the checkpoint with the old memory, their own
	 * file offsets and fresh pipes; they are siblings of the original. */
	c1 = spawn_program(tpl, NULL, 0, -1, NULL, &err);
	CHECK(c1.pid > 0, "spawn 1: %s", err.msg);
	c2 = spawn_program(tpl, NULL, 0, -1, NULL, &err);
	CHECK(c2.pid > 0, "spawn 2: %s", err.msg);
	if (c1.pid > 0 && c2.pid > 0) {
		CHECK(ask(&c1, 'r', &r) == 0 && r.pid == c1.pid && r.ppid == getpid() &&
		      r.counter == 0 && r.checksum == sum_a && r.eintr == 0,
		      "child 1 state: pid %d (c1 %d orig %d) ppid %d counter %d eintr %d", r.pid,
		      c1.pid, orig.pid, r.ppid, r.counter, r.eintr);
		CHECK(ask(&c1, 'f', &r) == 0 && memcmp(r.data, "abcde", 5) == 0 && r.off == 15,
		      "child 1 file: '%.5s' off %lld", r.data, r.off);
		CHECK(ask(&c2, 'f', &r) == 0 && memcmp(r.data, "abcde", 5) == 0 && r.off == 15,
		      "child 2 file: '%.5s' off %lld (offset shared?)", r.data, r.off);
		CHECK(ask(&c2, 'r', &r) == 0 && r.counter == 0 && r.checksum == sum_a,
		      "child 2 state: counter %d", r.counter);
		ask(&c1, 'm', NULL);
		CHECK(ask(&c1, 'r', &r) == 0 && r.counter == 1, "child 1 mutation");
		CHECK(ask(&c2, 'r', &r) == 0 && r.counter == 0 && r.checksum == sum_a,
		      "child 2 saw child 1's mutation");
		CHECK(fd_pos(orig.pid, FILE_FD) == 15 && fd_pos(tpid, FILE_FD) == 15,
		      "children moved the original's offset: %lld",
		      fd_pos(orig.pid, FILE_FD));
		{
			char a[32], b[32], t[32];

			/* ps tells the template from the program; its children are the program */
			CHECK(strcmp(comm_of(tpid, t), "dbx-template") == 0 &&
			      strcmp(comm_of(c1.pid, a), comm_of(orig.pid, b)) == 0 && a[0],
			      "names: template '%s', child '%s', original '%s'", t, a, b);
			CHECK(same_cmdline(c1.pid, orig.pid) && same_cmdline(c2.pid, orig.pid),
			      "children's command lines differ from the original's");
			CHECK(cmdline_of(tpid, t, sizeof(t)) == 0,
			      "template command line not empty after spawning");
		}
	}
	{
		struct iovec l = { copy, BUF_SIZE }, rm = { shared_buf, BUF_SIZE };

		CHECK(process_vm_readv(tpid, &l, 1, &rm, 1, 0) == BUF_SIZE &&
		      checksum(copy, BUF_SIZE) == sum_a, "template memory changed by children");
	}
	ask(&c1, 'q', NULL);
	ask(&c2, 'q', NULL);
	CHECK(c1.pid <= 0 || WIFEXITED(reap(c1.pid)), "child 1 exit");
	CHECK(c2.pid <= 0 || WIFEXITED(reap(c2.pid)), "child 2 exit");
	close(c1.cmd), close(c1.rep), close(c2.cmd), close(c2.rep);

	/* set_tid: a taken pid is refused clearly. */
	{
		pid_t mine = getpid();

		c3 = spawn_program(tpl, &mine, 1, -1, NULL, &err);
		CHECK(c3.pid < 0 && err.code == EEXIST && strstr(err.msg, "in use"),
		      "set_tid on a live pid: pid %d, %s", c3.pid, err.msg);
		close(c3.cmd), close(c3.rep);
	}

	/* Rollback: kill the original, reap it, fork a child with its pid. */
	orig_pid = orig.pid;
	stop_program(&orig);
	c3 = spawn_program(tpl, &orig_pid, 1, -1, "/tmp", &err);
	CHECK(c3.pid == orig_pid, "rollback child pid %d want %d: %s", c3.pid, orig_pid, err.msg);
	if (c3.pid > 0) {
		char a[64];

		CHECK(ask(&c3, 'r', &r) == 0 && r.pid == orig_pid && r.counter == 0 &&
		      r.checksum == sum_a, "rollback child state: pid %d counter %d", r.pid,
		      r.counter);
		snprintf(a, sizeof(a), "/proc/%d/cwd", c3.pid);
		{
			char cwd[PATH_MAX];
			ssize_t n = readlink(a, cwd, sizeof(cwd) - 1);

			cwd[n > 0 ? n : 0] = '\0';
			CHECK(strcmp(cwd, "/tmp") == 0, "cwd %s", cwd);
		}
		stop_program(&c3);
	}

	CHECK(dbxcr_release_template(tpl, &err) == 0, "release: %s", err.msg);
	CHECK(kill(tpid, 0) < 0 && errno == ESRCH, "template still exists");
	CHECK(count_zombie_children() == 0, "zombies left: %d", count_zombie_children());
	free(copy);
}

/* A running test program blocked in read, templated; its memory patterned with `pattern`
 * (*sum: its checksum), then mutated so the template alone holds the checkpoint.  NULL
 * (the program stopped) if the template could not be made. */
static struct dbxcr_template *templated_program(int pattern, struct proc *orig, uint64_t *sum)
{
	struct dbxcr_error err;
	struct dbxcr_template *tpl;

	fill_pattern(shared_buf, pattern);
	*sum = checksum(shared_buf, BUF_SIZE);
	*orig = start_program();
	CHECK(wait_in_syscall(orig->pid, SYS_read) == 0, "program never blocked in read");
	tpl = dbxcr_make_template(orig->pid, &err);
	CHECK(tpl != NULL, "make_template: %s", err.msg);
	if (!tpl) {
		stop_program(orig);
		return NULL;
	}
	ask(orig, 'm', NULL);	/* the original moves on from the checkpoint */
	return tpl;
}

/* A template copy driven by a second thread: it adopts the copy, spawns a child from it
 * while the first thread spawns from the original template, and both children continue
 * from the checkpoint; the copy is another sibling named like a template. */
struct lane_job {
	struct dbxcr_template *copy;
	struct proc child;
	int adopt_rc, release_rc;
	int go[2];		/* a byte here: release the copy (on its own thread) */
	struct dbxcr_error err, release_err;
};

static void *lane_thread(void *arg)
{
	struct lane_job *j = arg;
	char c;

	j->adopt_rc = dbxcr_template_adopt(j->copy, &j->err);
	if (j->adopt_rc == 0)
		j->child = spawn_program(j->copy, NULL, 0, -1, NULL, &j->err);
	/* A tracer thread must outlive its tracees' use (they are killed at its exit). */
	if (read(j->go[0], &c, 1) != 1)
		c = 0;
	j->release_rc = dbxcr_release_template(j->copy, &j->release_err);
	return NULL;
}

static void test_template_copy(void)
{
	struct dbxcr_error err;
	struct dbxcr_template *tpl, *spare;
	struct lane_job j = { 0 };
	struct state_report r;
	struct dbxcr_info info;
	struct proc orig, c1;
	uint64_t sum_a;
	pthread_t th;
	pid_t cpid, spid;
	char name[32];

	current_test = "template-copy";
	tpl = templated_program(3, &orig, &sum_a);
	if (!tpl)
		return;

	j.copy = dbxcr_template_copy(tpl, &err);
	CHECK(j.copy != NULL, "template_copy: %s", err.msg);
	if (!j.copy)
		goto out;
	cpid = dbxcr_template_pid(j.copy);
	CHECK(cpid != dbxcr_template_pid(tpl) && dbxcr_template_origin(j.copy) == orig.pid,
	      "copy pid %d origin %d", cpid, dbxcr_template_origin(j.copy));
	/* Handed over: asleep, untraced, until the other thread adopts it. */
	CHECK(dbxcr_describe(cpid, &info, &err) == 0 && info.tracer_pid == 0 &&
	      info.ppid == getpid(), "copy before adoption: tracer %d ppid %d",
	      info.tracer_pid, info.ppid);
	CHECK(strcmp(comm_of(cpid, name), "dbx-template") == 0, "copy named '%s'", name);
	c1.pid = -1;
	j.child.pid = -1;
	if (pipe2(j.go, O_CLOEXEC) < 0)
		abort();
	CHECK(pthread_create(&th, NULL, lane_thread, &j) == 0, "pthread_create");
	c1 = spawn_program(tpl, NULL, 0, -1, NULL, &err);
	CHECK(c1.pid > 0, "spawn from the template: %s", err.msg);
	/* wait until the lane thread has spawned (its child answers) */
	for (int i = 0; i < 500 && j.child.pid <= 0 && j.adopt_rc == 0; i++)
		usleep(10000);
	CHECK(j.adopt_rc == 0, "adopt: %s", j.err.msg);
	CHECK(j.child.pid > 0, "spawn from the copy: %s", j.err.msg);
	if (c1.pid > 0 && j.child.pid > 0) {
		CHECK(ask(&c1, 'r', &r) == 0 && r.counter == 0 && r.checksum == sum_a,
		      "child of the template: counter %d", r.counter);
		CHECK(ask(&j.child, 'r', &r) == 0 && r.counter == 0 && r.checksum == sum_a &&
		      r.ppid == getpid() && r.eintr == 0,
		      "child of the copy: counter %d ppid %d eintr %d", r.counter, r.ppid, r.eintr);
		CHECK(ask(&j.child, 'f', &r) == 0 && memcmp(r.data, "abcde", 5) == 0 && r.off == 15,
		      "child of the copy, file: '%.5s' off %lld", r.data, r.off);
		CHECK(same_cmdline(j.child.pid, orig.pid), "copy's child command line differs");
	}
	/* Only the adopting thread may drive the copy. */
	{
		struct proc bad = spawn_program(j.copy, NULL, 0, -1, NULL, &err);

		CHECK(bad.pid < 0 && err.code == EPERM, "spawn from a thread that does not own "
		      "the copy: pid %d, %s", bad.pid, err.msg);
		close(bad.cmd), close(bad.rep);
	}
	ask(&c1, 'q', NULL);
	CHECK(c1.pid <= 0 || WIFEXITED(reap(c1.pid)), "template's child exit");
	close(c1.cmd), close(c1.rep);
	if (j.child.pid > 0) {
		ask(&j.child, 'q', NULL);
		CHECK(WIFEXITED(reap(j.child.pid)), "copy's child exit");
		close(j.child.cmd), close(j.child.rep);
	}
	if (write(j.go[1], "x", 1) != 1)
		abort();
	pthread_join(th, NULL);
	close(j.go[0]), close(j.go[1]);
	CHECK(j.release_rc == 0, "release the copy on its thread: %s", j.release_err.msg);
	CHECK(kill(cpid, 0) < 0 && errno == ESRCH, "copy still exists");

	/* A copy never adopted is released from any thread. */
	spare = dbxcr_template_copy(tpl, &err);
	CHECK(spare != NULL, "second copy: %s", err.msg);
	if (spare) {
		spid = dbxcr_template_pid(spare);
		CHECK(dbxcr_release_template(spare, &err) == 0, "release unadopted copy: %s",
		      err.msg);
		CHECK(waitpid(spid, NULL, __WALL) == spid && kill(spid, 0) < 0,
		      "unadopted copy not gone");
	}
out:
	CHECK(dbxcr_release_template(tpl, &err) == 0, "release: %s", err.msg);
	stop_program(&orig);
	CHECK(count_zombie_children() == 0, "zombies left: %d", count_zombie_children());
}

static int count_fds(pid_t pid)
{
	char path[64];
	DIR *d;
	struct dirent *de;
	int n = 0;

	snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
	d = opendir(path);
	if (!d)
		return -1;
	while ((de = readdir(d)) != NULL)
		n += de->d_name[0] != '.';
	closedir(d);
	return n;
}

/* A carrier of tpl as spawn_program spawns a child (pipes in *c), in cwd if given: its
 * pid, or -1 with err. */
static pid_t spawn_test_carrier(struct dbxcr_template *tpl, const char *cwd,
				struct dbxcr_carrier **k, struct proc *c, struct dbxcr_error *err)
{
	/* Shared locks on the reopened file, which its birth takes (several births may). */
	static const struct dbxcr_lock locks[] = {
		{ FILE_FD, DBXCR_LOCK_POSIX, F_RDLCK, 0, 5 },
		{ FILE_FD, DBXCR_LOCK_FLOCK, F_RDLCK, 0, 0 },
	};
	struct dbxcr_spawn_opts o = { .mntns_fd = -1, .pidns_fd = -1, .ns_pidfd = -1,
				      .locks = locks, .nlocks = 2 };

	o.cwd = cwd;
	*c = program_from(tpl, &o, k, err);
	return c->pid;
}

/* Who holds a lock conflicting with a write lock on bytes 0-4 of the test file: POSIX
 * (F_GETLK: its pid, 0 if none) and whether a flock would wait. */
static pid_t posix_holder(bool *flocked)
{
	struct flock fl = { .l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 5 };
	int fd = open(file_path, O_RDWR | O_CLOEXEC);

	if (fd < 0)
		return -1;
	if (fcntl(fd, F_GETLK, &fl) < 0)
		fl.l_pid = -1;
	*flocked = flock(fd, LOCK_EX | LOCK_NB) < 0 && errno == EWOULDBLOCK;
	close(fd);
	return fl.l_type == F_UNLCK ? 0 : fl.l_pid;
}

/* Carriers: spawned ahead (template released meanwhile), born with the original's pid
 * once it is free, continuing from the checkpoint; the carrier then keeps the address
 * space, holding no descriptor (so the process's pipes see EOF when it exits). */
static void test_carriers(void)
{
	struct dbxcr_error err;
	struct dbxcr_template *tpl;
	struct dbxcr_carrier *k = NULL;
	struct dbxcr_info info;
	struct state_report r;
	struct proc orig, c = { -1, -1, -1 };
	uint64_t sum_a;
	pid_t kpid, orig_pid, child;
	char byte;

	current_test = "carriers";
	tpl = templated_program(3, &orig, &sum_a);
	if (!tpl)
		return;

	kpid = spawn_test_carrier(tpl, "/tmp", &k, &c, &err);
	CHECK(kpid > 0 && k && dbxcr_carrier_pid(k) == kpid, "spawn_carrier: %s", err.msg);
	CHECK(dbxcr_release_template(tpl, &err) == 0, "release: %s", err.msg);
	if (kpid <= 0) {
		stop_program(&orig);
		close(c.cmd), close(c.rep);
		return;
	}
	CHECK(dbxcr_describe(kpid, &info, &err) == 0 && info.state == 't' &&
	      info.tracer_pid == getpid(), "carrier not held: state %c tracer %d", info.state,
	      info.tracer_pid);
	{
		char a[32];

		CHECK(strcmp(comm_of(kpid, a), "dbx-carrier") == 0, "carrier named '%s'", a);
	}

	CHECK(dbxcr_carrier_keep(k, &err) < 0 && err.code == EINVAL, "keep before birth: %s",
	      err.msg);
	{	/* a descriptor given before the birth (a queue the rollback made): it gets it */
		int gift = memfd_create("carrier-gift", MFD_CLOEXEC), target = 77, cloexec = 1;

		CHECK(gift >= 0 && dbxcr_carrier_install_fds(k, &gift, &target, &cloexec, 1,
							     &err) == 0, "install_fds: %s", err.msg);
		close(gift);
	}
	/* The original still holds its pid: refused, and the carrier stays usable. */
	orig_pid = orig.pid;
	child = dbxcr_carrier_birth(k, &orig_pid, 1, 0, &err);
	CHECK(child < 0 && err.code == EEXIST, "birth on a live pid: %d, %s", child, err.msg);

	{
		char name[32];

		char args[4096], kargs[16], maps[16384];
		ssize_t nargs = cmdline_of(orig.pid, args, sizeof(args));

		comm_of(orig.pid, name);
		maps_ranges(orig.pid, maps, sizeof(maps));
		/* A carrier is a template's child: disguised until its birth. */
		CHECK(cmdline_of(kpid, kargs, sizeof(kargs)) == 0, "carrier command line not empty");
		stop_program(&orig);
		child = dbxcr_carrier_birth(k, &orig_pid, 1, 0, &err);
		CHECK(child == orig_pid, "birth pid %d want %d: %s", child, orig_pid, err.msg);
		CHECK(child < 0 || dbxcr_carrier_keep(k, &err) == 0, "keep: %s", err.msg);
		c.pid = child;
		if (child > 0) {
			char a[32], b[32];

			CHECK(strcmp(comm_of(child, a), name) == 0 &&
			      strcmp(comm_of(kpid, b), "dbx-carrier") == 0,
			      "born named '%s' (want '%s'), keeper '%s'", a, name, b);
			{
				char got[4096], born_maps[16384];

				CHECK(nargs > 0 && cmdline_of(child, got, sizeof(got)) == nargs &&
				      memcmp(got, args, (size_t)nargs) == 0,
				      "born process's command line is not the original's");
				/* no scratch area or batch loop page left behind */
				maps_ranges(child, born_maps, sizeof(born_maps));
				CHECK(strcmp(born_maps, maps) == 0, "born mappings:\n%s\nwant:\n%s",
				      born_maps, maps);
			}
		}
	}
	if (child > 0) {
		CHECK(ask(&c, 'r', &r) == 0 && r.pid == orig_pid && r.counter == 0 &&
		      r.checksum == sum_a && r.eintr == 0,
		      "born: pid %d counter %d eintr %d checksum ok %d", r.pid, r.counter, r.eintr,
		      r.checksum == sum_a);
		CHECK(ask(&c, 'f', &r) == 0 && memcmp(r.data, "abcde", 5) == 0 && r.off == 15,
		      "born file: '%.5s' off %lld", r.data, r.off);
		CHECK(count_fds(kpid) == 0, "keeper holds %d descriptors", count_fds(kpid));
		{	/* its locks, taken by the birth, stay once the keeper closed its copies */
			bool flocked = false;
			pid_t holder = posix_holder(&flocked);

			CHECK(holder == child && flocked, "POSIX lock held by %d (want %d), "
			      "flock taken %d", holder, child, flocked);
		}
		CHECK(dbxcr_describe(kpid, &info, &err) == 0 && info.state == 't',
		      "keeper state %c", info.state);
		{
			char a[64], cwd[PATH_MAX];
			ssize_t n;

			snprintf(a, sizeof(a), "/proc/%d/cwd", child);
			n = readlink(a, cwd, sizeof(cwd) - 1);
			cwd[n > 0 ? n : 0] = '\0';
			CHECK(strcmp(cwd, "/tmp") == 0, "born cwd %s", cwd);
			snprintf(a, sizeof(a), "/proc/%d/fd/77", child);
			n = readlink(a, cwd, sizeof(cwd) - 1);
			cwd[n > 0 ? n : 0] = '\0';
			CHECK(strncmp(cwd, "/memfd:carrier-gift", 19) == 0, "fd 77: '%s'", cwd);
			snprintf(a, sizeof(a), "/proc/%d/fdinfo/77", child);
			FILE *fi = fopen(a, "re");
			unsigned int fl = 0;
			CHECK(fi && fscanf(fi, "pos: %*d flags: %o", &fl) == 1 && (fl & O_CLOEXEC),
			      "fd 77's flags %o", fl);
			if (fi)
				fclose(fi);
		}
		{
			int fd = 0, target = 78, cloexec = 0;

			CHECK(dbxcr_carrier_install_fds(k, &fd, &target, &cloexec, 1, &err) < 0 &&
			      err.code == EINVAL, "install_fds after the birth: %s", err.msg);
		}
		CHECK(dbxcr_carrier_birth(k, NULL, 0, 0, &err) < 0 && err.code == EINVAL,
		      "second birth: %s", err.msg);
		/* It quits: its report pipe reaches EOF (no copy left in the keeper). */
		ask(&c, 'q', NULL);
		CHECK(readable_now(c.rep, 2000) && read(c.rep, &byte, 1) == 0,
		      "report pipe not at EOF after the process quit");
		CHECK(WIFEXITED(reap(child)), "born process exit");
	}
	CHECK(dbxcr_carrier_kill(k, &err) == 0, "carrier_kill: %s", err.msg);
	CHECK(kill(kpid, 0) < 0 && errno == ESRCH, "keeper still exists");
	close(c.cmd), close(c.rep);
	CHECK(count_zombie_children() == 0, "zombies left: %d", count_zombie_children());
}

/* The ptrace thread's job queue: births posted as data run on the waiting thread in the
 * order posted, between the Python jobs (markers) that make dbxcr_jobs_wait return; a
 * births job waits for its victims to exit (and reaps them) before it takes their pids,
 * reports each carrier's outcome, and signals its eventfd once done. */
static void test_jobs(void)
{
	struct dbxcr_error err, errs[1];
	struct dbxcr_template *tpl;
	struct dbxcr_carrier *k = NULL;
	struct dbxcr_jobs *q;
	struct state_report r;
	struct proc orig, c = { -1, -1, -1 };
	int victim, done, pgid = 0;
	struct dbxcr_births b = { 0 };
	uint64_t sum_a;
	pid_t kpid, orig_pid, born = 0;
	eventfd_t n;

	current_test = "jobs";
	tpl = templated_program(3, &orig, &sum_a);
	if (!tpl)
		return;
	kpid = spawn_test_carrier(tpl, NULL, &k, &c, &err);
	CHECK(kpid > 0, "spawn_carrier: %s", err.msg);
	CHECK(dbxcr_release_template(tpl, &err) == 0, "release: %s", err.msg);
	q = dbxcr_jobs_new(&err);
	CHECK(q != NULL, "jobs_new: %s", err.msg);
	if (kpid <= 0 || !q) {
		stop_program(&orig);
		close(c.cmd), close(c.rep);
		dbxcr_jobs_free(q);
		return;
	}
	/* The original is killed but not reaped: its pid stays taken until the job reaps it. */
	orig_pid = orig.pid;
	victim = (int)syscall(SYS_pidfd_open, orig_pid, 0);
	done = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (victim < 0 || done < 0)
		abort();
	kill(orig_pid, SIGKILL);
	b = (struct dbxcr_births){ .n = 1, .carriers = &k, .set_tid = &orig_pid, .pgid = &pgid,
				   .victims = &victim, .n_victims = 1, .timeout_ms = 2000,
				   .done_fd = done, .born = &born, .errs = errs };
	CHECK(dbxcr_jobs_post(q, NULL, &err) == 0 && dbxcr_jobs_post(q, &b, &err) == 0 &&
	      dbxcr_jobs_post(q, NULL, &err) == 0, "post: %s", err.msg);
	CHECK(dbxcr_jobs_wait(q, &err) == 1, "first wait: not the Python job: %s", err.msg);
	CHECK(!readable_now(done, 0), "births ran before the Python job posted ahead of them");
	CHECK(dbxcr_jobs_wait(q, &err) == 1, "second wait: %s", err.msg);
	CHECK(readable_now(done, 0) && eventfd_read(done, &n) == 0 && n == 1,
	      "births done but not signalled");
	CHECK(born == orig_pid, "born %d want %d: %s", born, orig_pid, errs[0].msg);
	if (born == orig_pid) {
		CHECK(ask(&c, 'r', &r) == 0 && r.pid == orig_pid && r.checksum == sum_a,
		      "born: pid %d checksum ok %d", r.pid, r.checksum == sum_a);
		/* A second birth fails, reported per carrier; the queue goes on. */
		CHECK(dbxcr_jobs_post(q, &b, &err) == 0 && dbxcr_jobs_post(q, NULL, &err) == 0,
		      "post again: %s", err.msg);
		CHECK(dbxcr_jobs_wait(q, &err) == 1, "third wait: %s", err.msg);
		CHECK(born == -1 && errs[0].code == EINVAL && strstr(errs[0].msg, "birth"),
		      "second birth: %d, %s", born, errs[0].msg);
		ask(&c, 'q', NULL);
		CHECK(WIFEXITED(reap(orig_pid)), "born process exit");
	}
	CHECK(dbxcr_carrier_kill(k, &err) == 0, "carrier_kill: %s", err.msg);
	dbxcr_jobs_free(q);
	close(victim), close(done), close(c.cmd), close(c.rep);
	close(orig.cmd), close(orig.rep);
	CHECK(count_zombie_children() == 0, "zombies left: %d", count_zombie_children());
}

/* Children can be put into another mount namespace (the caller passes its fd). */
static void test_spawn_mntns(void)
{
	struct dbxcr_error err;
	struct dbxcr_template *tpl;
	struct proc orig, c;
	int ready[2], nsfd;
	pid_t holder;
	char path[64], a[64], b[64];
	struct state_report r;

	current_test = "spawn-mntns";
	if (pipe(ready) < 0)
		abort();
	holder = fork();
	if (holder == 0) {
		if (unshare(CLONE_NEWNS) < 0)
			_exit(1);
		if (write(ready[1], "x", 1) < 0)
			_exit(1);
		pause();
		_exit(0);
	}
	close(ready[1]);
	char x;
	CHECK(read_timeout(ready[0], &x, 1, 5000) == 0, "holder not ready");
	close(ready[0]);
	snprintf(path, sizeof(path), "/proc/%d/ns/mnt", (int)holder);
	nsfd = open(path, O_RDONLY | O_CLOEXEC);
	CHECK(nsfd >= 0, "open %s", path);

	orig = start_program();
	CHECK(wait_in_syscall(orig.pid, SYS_read) == 0, "program never blocked in read");
	tpl = dbxcr_make_template(orig.pid, &err);
	CHECK(tpl != NULL, "make_template: %s", err.msg);
	if (tpl && nsfd >= 0) {
		c = spawn_program(tpl, NULL, 0, nsfd, "/tmp", &err);
		CHECK(c.pid > 0, "spawn into mntns: %s", err.msg);
		if (c.pid > 0) {
			snprintf(a, sizeof(a), "/proc/%d/ns/mnt", (int)c.pid);
			snprintf(b, sizeof(b), "/proc/%d/ns/mnt", (int)orig.pid);
			CHECK(same_link(a, path), "child not in the holder's mount namespace");
			CHECK(!same_link(b, path), "original moved");
			CHECK(ask(&c, 'f', &r) == 0 && memcmp(r.data, "abcde", 5) == 0,
			      "child in new mntns: file '%.5s'", r.data);
			stop_program(&c);
		}
	}
	if (tpl)
		CHECK(dbxcr_release_template(tpl, &err) == 0, "release: %s", err.msg);
	stop_program(&orig);
	if (nsfd >= 0)
		close(nsfd);
	kill_reap(holder);
}

/* A template taken during nanosleep: children finish the sleep (to the original deadline)
 * without EINTR. */
/* A process blocked in read() inside a signal handler that runs on an alternate stack in a
 * MAP_SHARED mapping: its stack pointer is in memory other processes see. The template is not
 * named through that memory (a write there would show); it is named at its first spawn. */
static int shared_stack_pipe = -1;

static void on_shared_stack(int sig)
{
	char c;

	(void)sig;
	/* Raw system calls: the sanitizers' interceptors inspect the thread's stack bounds,
	 * which a child cloned by injection (stale cached tid) cannot look up. */
	while (syscall(SYS_read, shared_stack_pipe, &c, 1) < 0 && errno == EINTR)
		;
	syscall(SYS_exit_group, 0);
}

static void test_template_shared_stack(void)
{
	size_t len = 256 * 1024;
	unsigned char *stk = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
				  -1, 0);
	int go[2];
	pid_t pid, child = -1;
	struct dbxcr_error err;
	struct dbxcr_template *tpl;
	char name[32], before[32];

	current_test = "template-shared-stack";
	if (stk == MAP_FAILED || pipe(go) < 0)
		abort();
	pid = fork();
	if (pid == 0) {
		stack_t ss = { .ss_sp = stk, .ss_size = len, .ss_flags = 0 };
		struct sigaction sa;

		close(go[1]);
		memset(&sa, 0, sizeof(sa));
		sa.sa_handler = on_shared_stack;
		sa.sa_flags = SA_ONSTACK;
		shared_stack_pipe = go[0];
		if (sigaltstack(&ss, NULL) < 0 || sigaction(SIGUSR1, &sa, NULL) < 0)
			_exit(2);
		raise(SIGUSR1);
		_exit(3);
	}
	close(go[0]);
	CHECK(wait_in_syscall(pid, SYS_read) == 0, "child never blocked in read");
	comm_of(pid, before);
	tpl = dbxcr_make_template(pid, &err);
	CHECK(tpl != NULL, "make_template: %s", err.msg);
	if (tpl) {
		pid_t tpid = dbxcr_template_pid(tpl);

		CHECK(strcmp(comm_of(tpid, name), before) == 0,
		      "template named '%s' through its shared stack (want '%s' until its first use)",
		      name, before);
		/* As a rollback would: the original goes first (two processes cannot run on one
		 * shared stack). */
		kill_reap(pid);
		pid = -1;
		child = dbxcr_spawn(tpl, NULL, &err);
		CHECK(child > 0, "spawn: %s", err.msg);
		CHECK(strcmp(comm_of(tpid, name), "dbx-template") == 0,
		      "template after its first spawn named '%s'", name);
		CHECK(child <= 0 || strcmp(comm_of(child, name), before) == 0,
		      "child named '%s', want '%s'", name, before);
	}
	close(go[1]);	/* EOF: the child returns from read in the handler and exits */
	if (pid > 0)
		kill_reap(pid);
	if (child > 0) {
		int st = reap(child);

		CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child exit status %#x", st);
	}
	if (tpl)
		CHECK(dbxcr_release_template(tpl, &err) == 0, "release: %s", err.msg);
	munmap(stk, len);
}

static void test_template_nanosleep(void)
{
	int rep[2];
	pid_t pid, child = -1;
	struct dbxcr_error err;
	struct dbxcr_template *tpl;
	struct sleep_report r;

	current_test = "template-nanosleep";
	if (pipe(rep) < 0)
		abort();
	pid = fork();
	if (pid == 0) {
		struct timespec ts = { 0, 500 * 1000000L };
		long long t0 = now_ms();

		r.rc = nanosleep(&ts, NULL);
		r.err = r.rc ? errno : 0;
		r.elapsed_ms = now_ms() - t0;
		if (write(rep[1], &r, sizeof(r)) < 0)
			_exit(2);
		_exit(0);
	}
	close(rep[1]);
	CHECK(wait_in_syscall(pid, SYS_clock_nanosleep) == 0, "child never slept");
	sleep_ms(100);
	tpl = dbxcr_make_template(pid, &err);
	CHECK(tpl != NULL, "make_template: %s", err.msg);
	if (tpl) {
		child = dbxcr_spawn(tpl, NULL, &err);
		CHECK(child > 0, "spawn: %s", err.msg);
	}
	for (int i = 0; i < (child > 0 ? 2 : 1); i++) {
		CHECK(read_timeout(rep[0], &r, sizeof(r), 5000) == 0, "no report %d", i);
		CHECK(r.rc == 0, "report %d: nanosleep %d errno %d", i, r.rc, r.err);
		CHECK(r.elapsed_ms >= 495 && r.elapsed_ms < 1500, "report %d: slept %lld ms", i,
		      r.elapsed_ms);
	}
	CHECK(WIFEXITED(reap(pid)), "original exit");
	if (child > 0)
		CHECK(WIFEXITED(reap(child)), "child exit");
	if (tpl)
		CHECK(dbxcr_release_template(tpl, &err) == 0, "release: %s", err.msg);
	close(rep[0]);
}

/* prctl state no /proc file shows: read from a template by injected calls (the origin's
 * dumpable flag cleared, THP refused), and set in it (a template rebuilt from an image is
 * its host's fork, which has the host's). */
static void test_template_prctls(void)
{
	pid_t pid;
	struct dbxcr_error err;
	struct dbxcr_template *tpl;
	struct dbxcr_prctls p, want;

	current_test = "template-prctls";
	pid = fork();
	if (pid == 0) {
		if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0 || prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) < 0)
			_exit(2);
		pause();
		_exit(0);
	}
	CHECK(wait_in_syscall(pid, SYS_pause) == 0, "child never paused");
	tpl = dbxcr_make_template(pid, &err);
	CHECK(tpl != NULL, "make_template: %s", err.msg);
	if (tpl) {
		CHECK(dbxcr_template_prctls(tpl, &p, &err) == 0, "read: %s", err.msg);
		CHECK(p.dumpable == 0 && p.thp_disable == 1 && p.mce_kill == PR_MCE_KILL_DEFAULT,
		      "read dumpable %d thp %d mce %d", p.dumpable, p.thp_disable, p.mce_kill);
		want = p;
		want.dumpable = 1;
		want.thp_disable = 0;
		want.mce_kill = PR_MCE_KILL_EARLY;
		want.no_new_privs = 1;
		CHECK(dbxcr_template_set_prctls(tpl, &want, &err) == 0, "set: %s", err.msg);
		CHECK(dbxcr_template_prctls(tpl, &p, &err) == 0, "read again: %s", err.msg);
		CHECK(p.dumpable == 1 && p.thp_disable == 0 && p.mce_kill == PR_MCE_KILL_EARLY &&
		      p.no_new_privs == 1, "after set: dumpable %d thp %d mce %d nnp %d",
		      p.dumpable, p.thp_disable, p.mce_kill, p.no_new_privs);
		/* once set, no_new_privs cannot be cleared: refused, naming it */
		want.no_new_privs = 0;
		CHECK(dbxcr_template_set_prctls(tpl, &want, &err) < 0 && err.code == EPERM &&
		      strstr(err.msg, "no_new_privs"), "clearing no_new_privs: %s", err.msg);
		CHECK(dbxcr_release_template(tpl, &err) == 0, "release: %s", err.msg);
	}
	kill(pid, SIGKILL);
	reap(pid);
}

/* What fork drops: the parent-death signal and the child-subreaper flag, read from the
 * original when its template is made.  A spawn (the template's sibling, not born of a
 * restored parent) gets the flag back and not the signal; a rebuilt template's are set. */
struct death_report {
	pid_t pid;
	int subreaper, pdeathsig;
};

static void report_parent_death(int rep)
{
	struct death_report r = { getpid(), -1, -1 };

	if (prctl(PR_GET_CHILD_SUBREAPER, &r.subreaper, 0, 0, 0) < 0 ||
	    prctl(PR_GET_PDEATHSIG, &r.pdeathsig, 0, 0, 0) < 0 ||
	    write(rep, &r, sizeof(r)) != sizeof(r))
		_exit(2);
}

static void test_template_parent_death(void)
{
	int go[2], rep[2], sig = -1, sub = -1;
	pid_t pid, child = -1, child2 = -1;
	struct dbxcr_error err;
	struct dbxcr_template *tpl;
	struct death_report r;
	bool seen_orig = false, seen_child = false, seen_child2 = false;

	current_test = "template-parent-death";
	if (pipe(go) < 0 || pipe(rep) < 0)
		abort();
	pid = fork();
	if (pid == 0) {
		char c;

		close(go[1]);
		if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0 ||
		    prctl(PR_SET_PDEATHSIG, SIGUSR1, 0, 0, 0) < 0)
			_exit(2);
		if (read(go[0], &c, 1) < 0)
			_exit(3);
		report_parent_death(rep[1]);
		_exit(0);
	}
	close(go[0]);
	close(rep[1]);
	CHECK(wait_in_syscall(pid, SYS_read) == 0, "child never blocked in read");
	tpl = dbxcr_make_template(pid, &err);
	CHECK(tpl != NULL, "make_template: %s", err.msg);
	if (tpl) {
		dbxcr_template_parent_death(tpl, &sig, &sub);
		CHECK(sig == SIGUSR1 && sub == 1, "read pdeathsig %d subreaper %d", sig, sub);
		child = dbxcr_spawn(tpl, NULL, &err);
		CHECK(child > 0, "spawn: %s", err.msg);
		CHECK(dbxcr_template_set_parent_death(tpl, 65, 0, &err) < 0 && err.code == EINVAL,
		      "signal 65 accepted: %s", err.msg);
		CHECK(dbxcr_template_set_parent_death(tpl, 0, 0, &err) == 0, "set: %s", err.msg);
		child2 = dbxcr_spawn(tpl, NULL, &err);
		CHECK(child2 > 0, "second spawn: %s", err.msg);
	}
	close(go[1]);	/* EOF: each reports and exits */
	for (int i = 0; i < 1 + (child > 0) + (child2 > 0); i++) {
		CHECK(read_timeout(rep[0], &r, sizeof(r), 5000) == 0, "no report %d", i);
		if (r.pid == pid) {
			seen_orig = true;
			CHECK(r.subreaper == 1 && r.pdeathsig == SIGUSR1, "original: %d %d",
			      r.subreaper, r.pdeathsig);
		} else if (r.pid == child) {
			seen_child = true;
			CHECK(r.subreaper == 1 && r.pdeathsig == 0, "spawn: subreaper %d pdeathsig %d "
			      "(want 1 0)", r.subreaper, r.pdeathsig);
		} else if (r.pid == child2) {
			seen_child2 = true;
			CHECK(r.subreaper == 0 && r.pdeathsig == 0, "spawn after set: %d %d",
			      r.subreaper, r.pdeathsig);
		}
	}
	CHECK(seen_orig && seen_child == (child > 0) && seen_child2 == (child2 > 0),
	      "reports: original %d spawn %d second %d", seen_orig, seen_child, seen_child2);
	reap(pid);
	if (child > 0)
		reap(child);
	if (child2 > 0)
		reap(child2);
	if (tpl)
		CHECK(dbxcr_release_template(tpl, &err) == 0, "release: %s", err.msg);
	close(rep[0]);
}

/* The value of "name:" in /proc/pid/status, tabs turned to spaces ("" if none). */
static const char *status_line(pid_t pid, const char *name, char *out, size_t len)
{
	char buf[4096], *at;
	size_t n = strlen(name);

	out[0] = '\0';
	if (proc_read(pid, "status", buf, sizeof(buf)) < 0)
		return out;
	for (at = buf; at; at = strchr(at, '\n')) {
		if (*at == '\n')
			at++;
		if (!strncmp(at, name, n) && at[n] == ':') {
			size_t i = 0;

			for (at += n + 2; *at && *at != '\n' && i + 1 < len; at++)
				out[i++] = *at == '\t' ? ' ' : *at;
			while (i && out[i - 1] == ' ')
				i--;
			out[i] = '\0';
			break;
		}
	}
	return out;
}

/* Credentials set on a root's template (creds.c): its child runs with them, in every
 * field /proc shows; a bounding set with a capability root's lacks fails the spawn, naming
 * it; more groups than are given back are refused. */
static void test_template_creds(void)
{
	struct dbxcr_creds c = { .uid = { 1000, 1001, 1002, 1003 },
				 .gid = { 2000, 2001, 2002, 2003 }, .ngroups = 2,
				 .groups = { 5, 7 } };
	struct dbxcr_error err;
	struct dbxcr_template *tpl;
	char line[128], want[64];
	uint64_t bnd;
	pid_t pid, child;

	current_test = "template-creds";
	pid = fork();
	if (pid == 0) {
		pause();
		_exit(0);
	}
	CHECK(wait_in_syscall(pid, SYS_pause) == 0, "child never paused");
	bnd = strtoull(status_line(pid, "CapBnd", line, sizeof(line)), NULL, 16);
	tpl = dbxcr_make_template(pid, &err);
	CHECK(tpl != NULL, "make_template: %s", err.msg);
	if (!tpl)
		goto out;
	c.cap_prm = c.cap_eff = c.cap_inh = c.cap_amb = 1ull << 10;	/* NET_BIND_SERVICE */
	c.cap_bnd = bnd & ~(1ull << 13);				/* without NET_RAW */
	CHECK(dbxcr_template_set_creds(tpl, &c, &err) == 0, "set: %s", err.msg);
	child = dbxcr_spawn(tpl, NULL, &err);
	CHECK(child > 0, "spawn: %s", err.msg);
	if (child > 0) {
		CHECK(!strcmp(status_line(child, "Uid", line, sizeof(line)), "1000 1001 1002 1003"),
		      "Uid: %s", line);
		CHECK(!strcmp(status_line(child, "Gid", line, sizeof(line)), "2000 2001 2002 2003"),
		      "Gid: %s", line);
		CHECK(!strcmp(status_line(child, "Groups", line, sizeof(line)), "5 7"),
		      "Groups: %s", line);
		CHECK(!strcmp(status_line(child, "CapEff", line, sizeof(line)), "0000000000000400") &&
		      !strcmp(status_line(child, "CapAmb", line, sizeof(line)), "0000000000000400"),
		      "CapEff/CapAmb: %s", line);
		snprintf(want, sizeof(want), "%016llx", (unsigned long long)c.cap_bnd);
		CHECK(!strcmp(status_line(child, "CapBnd", line, sizeof(line)), want),
		      "CapBnd: %s, not %s", line, want);
		kill(child, SIGKILL);
		reap(child);
	}
	/* a bounding set wider than root's here: refused at the spawn, the child gone */
	c.cap_bnd = bnd | 1ull << 62;
	CHECK(dbxcr_template_set_creds(tpl, &c, &err) == 0, "set: %s", err.msg);
	CHECK(dbxcr_spawn(tpl, NULL, &err) < 0 && err.code == EPERM &&
	      strstr(err.msg, "bounding set"), "a wider bounding set: %s", err.msg);
	c.ngroups = DBXCR_MAX_GROUPS + 1;
	CHECK(dbxcr_template_set_creds(tpl, &c, &err) < 0 && err.code == EINVAL,
	      "too many groups: %s", err.msg);
	CHECK(dbxcr_release_template(tpl, &err) == 0, "release: %s", err.msg);
out:
	kill(pid, SIGKILL);
	reap(pid);
}

/* The ids /proc/PID/timers lists, in order, as "0 2 ..." (at most len bytes). */
static void timer_ids(pid_t pid, char *out, size_t len)
{
	char buf[2048], *line, *save = NULL;
	size_t n = 0;

	out[0] = '\0';
	if (proc_read(pid, "timers", buf, sizeof(buf)) < 0)
		return;
	for (line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
		int id;

		if (sscanf(line, "ID: %d", &id) == 1 && n + 12 < len)
			n += (size_t)snprintf(out + n, len - n, "%s%d", n ? " " : "", id);
	}
}

/* POSIX timers: a template reads them (ids with a gap, clocks, notifications, the time
 * left of an armed one); its child gets them made again with the same ids, and the armed
 * one, aimed at the main thread by SIGEV_THREAD_ID, signals the child after the time it
 * had left. */
static void test_template_ptimers(void)
{
	int rep[2];
	pid_t pid, child = -1;
	struct dbxcr_error err;
	struct dbxcr_template *tpl;
	long t[4 * DBXCR_PTIMER_FIELDS];
	char ids[64];
	int n;

	current_test = "template-ptimers";
	if (pipe(rep) < 0)
		abort();
	pid = fork();
	if (pid == 0) {
		struct sigevent none = { .sigev_notify = SIGEV_NONE };
		struct sigevent sig = { .sigev_notify = SIGEV_SIGNAL | SIGEV_THREAD_ID,
					.sigev_signo = SIGUSR1 };
		struct itimerspec spec = { { 7, 0 }, { 60, 0 } };
		struct itimerspec soon = { { 0, 0 }, { 1, 0 } };
		timer_t a, b, c;
		sigset_t usr1;
		siginfo_t si;

		sig.sigev_value.sival_int = 77;
		sig._sigev_un._tid = (pid_t)syscall(SYS_gettid);
		sigemptyset(&usr1);
		sigaddset(&usr1, SIGUSR1);
		sigprocmask(SIG_BLOCK, &usr1, NULL);
		if (timer_create(CLOCK_MONOTONIC, &none, &a) || timer_create(CLOCK_MONOTONIC,
		    &none, &b) || timer_create(CLOCK_REALTIME, &sig, &c) || timer_delete(b) ||
		    timer_settime(a, 0, &spec, NULL) || timer_settime(c, 0, &soon, NULL))
			_exit(3);
		/* A stop (ours) ends sigwaitinfo with EINTR, as SIGSTOP/SIGCONT would:
		 * signal(7); a program waits again. */
		while (sigwaitinfo(&usr1, &si) < 0)
			if (errno != EINTR)
				_exit(4);
		if (write(rep[1], &si.si_value.sival_int, sizeof(int)) < 0)
			_exit(2);
		_exit(0);
	}
	close(rep[1]);
	CHECK(wait_in_syscall(pid, SYS_rt_sigtimedwait) == 0, "child never waited");
	tpl = dbxcr_make_template(pid, &err);
	CHECK(tpl != NULL, "make_template: %s", err.msg);
	if (tpl) {
		n = dbxcr_template_ptimers(tpl, t, 4);
		CHECK(n == 2, "%d timers", n);
		for (int i = 0; i < n && n == 2; i++) {	/* /proc lists the newest first */
			const long *v = t + i * DBXCR_PTIMER_FIELDS;

			if (v[0] == 0)
				CHECK(v[1] == CLOCK_MONOTONIC && v[2] == SIGEV_NONE && v[5] == 7 &&
				      v[6] == 0 && v[7] >= 58 && v[7] < 60, "timer 0: clock %ld notify "
				      "%ld every %ld.%09ld left %ld", v[1], v[2], v[5], v[6], v[7]);
			else
				CHECK(v[0] == 2 && v[1] == CLOCK_REALTIME && v[2] == (SIGEV_SIGNAL |
				      SIGEV_THREAD_ID) && v[3] == SIGUSR1 && (int)v[4] == 77 &&
				      v[7] == 0 && v[8] > 500000000 && v[9] == 0, "timer %ld: clock "
				      "%ld notify %ld signal %ld value %ld left %ld.%09ld thread %ld",
				      v[0], v[1], v[2], v[3], v[4], v[7], v[8], v[9]);
		}
		child = dbxcr_spawn(tpl, NULL, &err);
		CHECK(child > 0, "spawn: %s", err.msg);
	}
	if (child > 0) {
		timer_ids(child, ids, sizeof(ids));
		CHECK(!strcmp(ids, "0 2"), "child's timers: '%s'", ids);
	}
	for (int i = 0; i < (child > 0 ? 2 : 1); i++) {
		int got = 0;

		CHECK(read_timeout(rep[0], &got, sizeof(got), 5000) == 0, "no signal %d", i);
		CHECK(got == 77, "signal %d: sigev_value %d", i, got);
	}
	CHECK(WIFEXITED(reap(pid)), "original exit");
	if (child > 0)
		CHECK(WIFEXITED(reap(child)), "child exit");
	if (tpl)
		CHECK(dbxcr_release_template(tpl, &err) == 0, "release: %s", err.msg);
	close(rep[0]);
}

static char proc_state(pid_t pid)
{
	struct dbxcr_info info;
	struct dbxcr_error err;

	return dbxcr_describe(pid, &info, &err) == 0 ? info.state : '?';
}

/* A job-control-stopped process stays stopped after an injection and continues on
 * SIGCONT; its parent sees no extra stop/continue reports from us. */
static void test_inject_group_stopped(void)
{
	int rep[2];
	pid_t pid;
	struct dbxcr_error err;
	int status, n = 0;

	current_test = "inject-group-stopped";
	if (pipe(rep) < 0)
		abort();
	pid = fork();
	if (pid == 0) {
		char c = 'x';

		raise(SIGSTOP);
		if (write(rep[1], &c, 1) < 0)
			_exit(2);
		_exit(0);
	}
	close(rep[1]);
	CHECK(waitpid(pid, &status, WUNTRACED) == pid && WIFSTOPPED(status), "not stopped");
	CHECK(getpid_in(pid, &err) == pid, "getpid: %s", err.msg);
	sleep_ms(50);
	CHECK(proc_state(pid) == 'T', "state %c after injection, want T", proc_state(pid));
	CHECK(!readable_now(rep[0], 50), "ran while stopped");
	CHECK(waitpid(pid, &status, WNOHANG | WUNTRACED | WCONTINUED) == 0,
	      "parent saw a stop/continue report caused by the injection (status %#x)", status);
	kill(pid, SIGCONT);
	CHECK(read_timeout(rep[0], &n, 1, 5000) == 0, "did not continue after SIGCONT");
	CHECK(WIFEXITED(reap(pid)), "child did not exit cleanly");
	close(rep[0]);
}

/* A multi-threaded process (native/threads.c), in a pid namespace of its own so that its
 * tids are free again once it is killed: templated, killed, spawned back with its pid. */
struct thr_report {
	pid_t pid;
	pid_t tids[2];
	long count[2];
	int tls[2];
	char names[2][16];
	int joined;
};

static volatile long thr_count[2];
static volatile int thr_stop;
static volatile pid_t thr_tid[2];
static volatile int thr_tls_seen[2];
static char thr_names[2][16];
static __thread int thr_tls;

static void *counting_thread(void *arg)
{
	int i = (int)(long)arg;
	char name[16];

	thr_tls = 100 + i;
	snprintf(name, sizeof(name), "worker%d", i);
	prctl(PR_SET_NAME, name);
	thr_tid[i] = (pid_t)syscall(SYS_gettid);
	while (!thr_stop) {
		thr_count[i]++;
		thr_tls_seen[i] = thr_tls;
		prctl(PR_GET_NAME, thr_names[i]);
		usleep(1000);	/* nanosleep: run again from the start in a restored thread */
	}
	return NULL;
}

static void threads_program(int cmd, int rep)
{
	pthread_t t[2];

	for (long i = 0; i < 2; i++)
		if (pthread_create(&t[i], NULL, counting_thread, (void *)i) != 0)
			_exit(1);
	while (!thr_count[0] || !thr_count[1])
		usleep(100);
	if (write(rep, "R", 1) != 1)
		_exit(1);
	for (;;) {
		struct thr_report r;
		char c;

		if (read(cmd, &c, 1) != 1)
			_exit(0);
		if (c == 'j') {		/* pthread_join: the threads' clear_child_tid */
			thr_stop = 1;
			for (int i = 0; i < 2; i++)
				pthread_join(t[i], NULL);
		}
		memset(&r, 0, sizeof(r));
		r.pid = getpid();
		for (int i = 0; i < 2; i++) {
			r.tids[i] = thr_tid[i];
			r.count[i] = thr_count[i];
			r.tls[i] = thr_tls_seen[i];
			memcpy(r.names[i], thr_names[i], sizeof(r.names[i]));
		}
		r.joined = thr_stop;
		if (write(rep, &r, sizeof(r)) != sizeof(r))
			_exit(1);
	}
}

/* outer: unshare a pid namespace; its first child (pid 1 there) starts the program and
 * reaps whatever becomes its child (the template and its children: CLONE_PARENT). */
static void threads_namespace(int cmd, int rep, int ready)
{
	pid_t init;

	if (unshare(CLONE_NEWPID) < 0)
		_exit(2);
	init = fork();
	if (init < 0)
		_exit(3);
	if (init == 0) {
		if (fork() == 0)
			threads_program(cmd, rep);
		for (;;)
			if (waitpid(-1, NULL, __WALL) < 0 && errno == ECHILD)
				pause();
	}
	if (write(ready, &init, sizeof(init)) != sizeof(init))
		_exit(4);
	reap(init);
	_exit(0);
}

static pid_t first_child(pid_t pid)
{
	char path[64], buf[256] = "";
	int fd;
	ssize_t n;

	snprintf(path, sizeof(path), "/proc/%d/task/%d/children", (int)pid, (int)pid);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	return n > 0 ? (pid_t)atoi(buf) : -1;
}

static int thr_ask(int cmd, int rep, char c, struct thr_report *r)
{
	if (write(cmd, &c, 1) != 1)
		return -1;
	return read_timeout(rep, r, sizeof(*r), 5000);
}

static void test_threads(void)
{
	struct dbxcr_error err;
	struct dbxcr_template *tpl = NULL;
	struct thr_report r0, r1, r2, r3;
	int cmd[2], rep[2], ready[2];
	pid_t outer, init = -1, target = -1, child = -1;
	char c;

	current_test = "threads-recreated";
	if (pipe(cmd) < 0 || pipe(rep) < 0 || pipe(ready) < 0)
		abort();
	outer = fork();
	if (outer == 0)
		threads_namespace(cmd[0], rep[1], ready[1]);
	close(cmd[0]);
	close(rep[1]);
	close(ready[1]);
	if (read_timeout(ready[0], &init, sizeof(init), 5000) < 0 ||
	    read_timeout(rep[0], &c, 1, 5000) < 0 || (target = first_child(init)) <= 0) {
		CHECK(false, "the program in its pid namespace did not start");
		goto out;
	}
	CHECK(thr_ask(cmd[1], rep[0], 'r', &r0) == 0, "report");
	tpl = dbxcr_make_template(target, &err);
	CHECK(tpl != NULL, "template of a 3-thread process: %s", err.msg);
	if (!tpl)
		goto out;
	/* The original and its threads run on, untouched. */
	sleep_ms(20);
	CHECK(thr_ask(cmd[1], rep[0], 'r', &r1) == 0, "report");
	CHECK(r1.count[0] > r0.count[0] && r1.count[1] > r0.count[1], "the original's threads "
	      "stopped counting: %ld %ld -> %ld %ld", r0.count[0], r0.count[1], r1.count[0],
	      r1.count[1]);
	/* Without its tids it is refused; with them (once the original is gone) it comes back. */
	{
		struct dbxcr_spawn_opts o = { 0 };

		o.mntns_fd = -1;
		CHECK(dbxcr_spawn(tpl, &o, &err) < 0 && err.code == ENOTSUP &&
		      strstr(err.msg, "its own pid"), "spawn without set_tid: %s", err.msg);
		kill(target, SIGKILL);
		for (int i = 0; i < 500 && kill(target, 0) == 0; i++)
			sleep_ms(2);	/* its init reaps it */
		o.set_tid = &r0.pid;
		o.set_tid_size = 1;
		/* kill(pid, 0) fails once the task is unhashed, but release_task() frees the
		 * pid numbers a moment later: EEXIST until then, as the engine knows (it retries). */
		for (int i = 0; i < 500; i++) {
			child = dbxcr_spawn(tpl, &o, &err);
			if (child > 0 || err.code != EEXIST)
				break;
			sleep_ms(2);
		}
		CHECK(child > 0, "spawn with set_tid: %s", err.msg);
	}
	if (child <= 0)
		goto out;
	CHECK(thr_ask(cmd[1], rep[0], 'r', &r2) == 0, "report from the child");
	CHECK(r2.pid == r0.pid && r2.tids[0] == r0.tids[0] && r2.tids[1] == r0.tids[1],
	      "pid/tids %d %d %d, were %d %d %d", r2.pid, r2.tids[0], r2.tids[1], r0.pid,
	      r0.tids[0], r0.tids[1]);
	CHECK(r2.tls[0] == 100 && r2.tls[1] == 101, "thread-local values %d %d", r2.tls[0],
	      r2.tls[1]);
	sleep_ms(20);
	CHECK(thr_ask(cmd[1], rep[0], 'r', &r3) == 0, "report from the child");
	CHECK(r3.count[0] > r2.count[0] && r3.count[1] > r2.count[1] &&
	      r2.count[0] >= r0.count[0] && r2.count[0] <= r1.count[0],
	      "counts %ld..%ld at the checkpoint, %ld then %ld after", r0.count[0], r1.count[0],
	      r2.count[0], r3.count[0]);
	CHECK(strcmp(r3.names[0], "worker0") == 0 && strcmp(r3.names[1], "worker1") == 0,
	      "thread names %s %s", r3.names[0], r3.names[1]);
	CHECK(thr_ask(cmd[1], rep[0], 'j', &r3) == 0 && r3.joined,
	      "pthread_join of the restored threads did not return");
out:
	if (tpl)
		dbxcr_release_template(tpl, &err);
	if (init > 0)
		kill(init, SIGKILL);	/* its namespace goes with it */
	reap(outer);
	close(cmd[1]);
	close(rep[0]);
	close(ready[0]);
}

/* ---------- 3. stopping a frozen process tree at one instant ---------- */

#define CG_FREEZER "/sys/fs/cgroup/freezer"

static char cg_dir[128];

static int cg_write(const char *file, const char *val)
{
	char path[256];
	int fd, rc = -1;

	snprintf(path, sizeof(path), "%s/%s", cg_dir, file);
	fd = open(path, O_WRONLY | O_CLOEXEC);
	if (fd >= 0) {
		rc = write(fd, val, strlen(val)) == (ssize_t)strlen(val) ? 0 : -1;
		close(fd);
	}
	return rc;
}

static int cg_add(pid_t pid)
{
	char v[32];

	snprintf(v, sizeof(v), "%d", (int)pid);
	return cg_write("cgroup.procs", v);
}

/* Set freezer.state and wait until the cgroup reports it (FREEZING -> FROZEN). */
static int cg_set(const char *state)
{
	char path[256], buf[64];

	if (cg_write("freezer.state", state) < 0)
		return -1;
	snprintf(path, sizeof(path), "%s/freezer.state", cg_dir);
	for (int i = 0; i < 400; i++) {
		int fd = open(path, O_RDONLY | O_CLOEXEC);
		ssize_t n = fd >= 0 ? read(fd, buf, sizeof(buf) - 1) : -1;

		if (fd >= 0)
			close(fd);
		if (n > 0) {
			buf[n] = '\0';
			if (strncmp(buf, state, strlen(state)) == 0)
				return 0;
		}
		sleep_ms(5);
	}
	return -1;
}

static int cg_create(void)
{
	unsigned int r;

	if (getrandom(&r, sizeof(r), 0) != sizeof(r))
		r = (unsigned int)now_ms();
	snprintf(cg_dir, sizeof(cg_dir), CG_FREEZER "/dbx-test-%d-%08x", (int)getpid(), r);
	return mkdir(cg_dir, 0755);
}

/* Thaw and remove the cgroup; its tasks must have been killed. */
static void cg_remove(void)
{
	if (!cg_dir[0])
		return;
	cg_write("freezer.state", "THAWED");
	for (int i = 0; i < 200 && rmdir(cg_dir) < 0 && errno == EBUSY; i++)
		sleep_ms(10);
	CHECK(access(cg_dir, F_OK) < 0, "cgroup %s not removed", cg_dir);
	cg_dir[0] = '\0';
}

struct tree_report {
	int who;	/* 1: the sleeper, 2: the reader */
	int pid, rc, err, marker;
	long long elapsed_ms;
	char data[16];
};

#define TREE_CMD_FD 20		/* the reader's pipe */
#define TREE_REP_FD 21		/* reports from sleeper and reader */
#define TREE_CNT_FD 22		/* the counter file, O_APPEND */
#define TREE_SLEEP_MS 1200

static volatile long tree_counter;	/* same address in every copy */
static volatile int tree_marker;

static long long now_us(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
}

static void tree_report_send(struct tree_report *r)
{
	r->pid = getpid();
	r->marker = tree_marker;
	if (write(TREE_REP_FD, r, sizeof(*r)) != sizeof(*r))
		_exit(5);
}

/* The tree: the parent forks a sleeper and a reader, then appends its counter (8 bytes)
 * to the counter file once per millisecond, spinning in user mode in between. */
static void tree_parent(int go, int info)
{
	pid_t kids[2];
	char c;

	if (read(go, &c, 1) != 1)
		_exit(1);
	signal(SIGCHLD, SIG_IGN);	/* sleeper, reader and their copies are auto-reaped */
	kids[0] = fork();
	if (kids[0] == 0) {
		struct timespec ts = { TREE_SLEEP_MS / 1000, (TREE_SLEEP_MS % 1000) * 1000000L };
		struct tree_report r = { .who = 1 };
		long long t0;

		tree_marker = 111;
		t0 = now_ms();
		r.rc = nanosleep(&ts, NULL);
		r.err = r.rc ? errno : 0;
		r.elapsed_ms = now_ms() - t0;
		tree_report_send(&r);
		_exit(0);
	}
	kids[1] = fork();
	if (kids[1] == 0) {
		struct tree_report r = { .who = 2 };

		tree_marker = 222;
		r.rc = (int)read(TREE_CMD_FD, r.data, sizeof(r.data) - 1);
		r.err = r.rc < 0 ? errno : 0;
		tree_report_send(&r);
		_exit(0);
	}
	close(TREE_CMD_FD);
	close(TREE_REP_FD);
	if (write(info, kids, sizeof(kids)) != sizeof(kids))
		_exit(1);
	for (long long next = now_us();; next += 1000) {
		while (now_us() < next)
			;
		tree_counter++;
		if (write(TREE_CNT_FD, (const void *)&tree_counter, 8) != 8)
			_exit(2);
	}
}

/* Read the counter file; returns the number of records, *seq_ok = records are 1..n. */
static long read_counter_file(const char *path, long **out, bool *seq_ok)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	long cap = 1 << 16, n = 0;
	long *v = malloc((size_t)cap * sizeof(long));
	ssize_t r;

	*seq_ok = false;
	if (fd < 0 || !v) {
		if (fd >= 0)
			close(fd);
		free(v);
		return -1;
	}
	while ((r = read(fd, v + n, (size_t)(cap - n) * sizeof(long))) > 0) {
		n += r / (ssize_t)sizeof(long);
		if (n == cap) {
			long *nv = realloc(v, (size_t)(cap *= 2) * sizeof(long));

			if (!nv)
				break;
			v = nv;
		}
	}
	close(fd);
	*seq_ok = true;
	for (long i = 0; i < n; i++)
		if (v[i] != i + 1)
			*seq_ok = false;
	if (out)
		*out = v;
	else
		free(v);
	return n;
}

static off_t file_size(const char *path)
{
	struct stat st;

	return stat(path, &st) == 0 ? st.st_size : -1;
}

static int copy_file(const char *from, const char *to)
{
	char buf[65536];
	int a = open(from, O_RDONLY | O_CLOEXEC), b = open(to, O_WRONLY | O_CREAT | O_TRUNC |
							O_CLOEXEC, 0644);
	ssize_t n;
	int rc = (a >= 0 && b >= 0) ? 0 : -1;

	while (rc == 0 && (n = read(a, buf, sizeof(buf))) > 0)
		if (write(b, buf, (size_t)n) != n)
			rc = -1;
	if (a >= 0)
		close(a);
	if (b >= 0)
		close(b);
	return rc;
}

/* Wait for a tree report from pid (reports of other pids are kept for later calls). */
static struct tree_report pending_reports[8];
static int npending;

static int tree_report_from(int fd, pid_t pid, struct tree_report *out, int ms)
{
	long long deadline = now_ms() + ms;

	for (;;) {
		for (int i = 0; i < npending; i++) {
			if (pending_reports[i].pid == pid) {
				*out = pending_reports[i];
				pending_reports[i] = pending_reports[--npending];
				return 0;
			}
		}
		if (now_ms() >= deadline || npending == 8)
			return -1;
		if (read_timeout(fd, &pending_reports[npending], sizeof(*out),
				 (int)(deadline - now_ms())) < 0)
			return -1;
		npending++;
	}
}

static bool wait_file_grows(const char *path, off_t beyond, int ms)
{
	for (int i = 0; i < ms / 5; i++) {
		if (file_size(path) > beyond)
			return true;
		sleep_ms(5);
	}
	return false;
}

static void test_stop_frozen_tree(void)
{
	struct dbxcr_error err;
	struct dbxcr_stop *st[3] = { 0 };
	struct dbxcr_template *tpl[3] = { 0 };
	pid_t pids[3] = { -1, -1, -1 }, extra[3] = { -1, -1, -1 };
	int go[2], info[2], cmd[2], rep[2], cfd;
	char cnt_path[64], snap_path[80];
	long last = -1, n_snap;
	bool seq;
	off_t snap_size, frozen_size;

	current_test = "stop-frozen-tree";
	npending = 0;
	snprintf(cnt_path, sizeof(cnt_path), "/tmp/dbxcr-tree-XXXXXX");
	cfd = mkstemp(cnt_path);
	snprintf(snap_path, sizeof(snap_path), "%s.snap", cnt_path);
	if (cfd < 0 || pipe2(go, O_CLOEXEC) < 0 || pipe2(info, O_CLOEXEC) < 0 ||
	    pipe2(cmd, O_CLOEXEC) < 0 || pipe2(rep, O_CLOEXEC) < 0)
		abort();
	close(cfd);
	if (cg_create() < 0) {
		CHECK(0, "mkdir freezer cgroup: %s", strerror(errno));
		cg_dir[0] = '\0';
		goto out;
	}
	pids[0] = fork();
	if (pids[0] == 0) {
		int f = open(cnt_path, O_WRONLY | O_APPEND);

		if (f < 0 || dup2(f, TREE_CNT_FD) < 0 || dup2(cmd[0], TREE_CMD_FD) < 0 ||
		    dup2(rep[1], TREE_REP_FD) < 0)
			_exit(6);
		tree_parent(go[0], info[1]);
	}
	close(cmd[0]);
	close(rep[1]);
	close(info[1]);
	close(go[0]);
	CHECK(cg_add(pids[0]) == 0, "move tree parent into the cgroup");
	CHECK(write(go[1], "g", 1) == 1, "go");
	{
		pid_t kids[2];

		if (read_timeout(info[0], kids, sizeof(kids), 5000) < 0) {
			CHECK(0, "tree parent did not start its children");
			goto out;
		}
		pids[1] = kids[0];
		pids[2] = kids[1];
	}
	CHECK(wait_in_syscall(pids[1], SYS_clock_nanosleep) == 0, "sleeper never slept");
	CHECK(wait_in_syscall(pids[2], SYS_read) == 0, "reader never blocked in read");
	CHECK(wait_file_grows(cnt_path, 8 * 50, 5000), "counter not counting");

	/* 1-2: freeze, then seize + interrupt without waiting. */
	CHECK(cg_set("FROZEN") == 0, "freeze");
	frozen_size = file_size(cnt_path);
	{
		long long t0 = now_ms();

		for (int i = 0; i < 3; i++)
			CHECK(dbxcr_stop_begin(pids[i], &st[i], &err) == 0, "stop_begin %d: %s", i,
			      err.msg);
		CHECK(now_ms() - t0 < 500, "stop_begin waited (%lld ms)", now_ms() - t0);
		sleep_ms(30);
		CHECK(file_size(cnt_path) == frozen_size, "counter ran while frozen");
		for (int i = 0; i < 3; i++) {
			struct dbxcr_stop_info si;

			if (!st[i])
				continue;
			dbxcr_stop_get_info(st[i], &si);
			CHECK(si.kind == DBXCR_STOP_NONE && !si.done, "%d stopped while frozen", i);
		}
	}
	/* 3-4: thaw; every task goes from the refrigerator into the interrupt stop. */
	CHECK(cg_set("THAWED") == 0, "thaw");
	for (int i = 0; i < 3; i++) {
		struct dbxcr_stop_info si;

		if (!st[i])
			continue;
		CHECK(dbxcr_stop_wait(st[i], 3000, &err) == 0, "stop_wait %d: %s", i, err.msg);
		dbxcr_stop_get_info(st[i], &si);
		CHECK(si.kind == DBXCR_STOP_INTERRUPT && si.pid == pids[i], "%d: stop kind %d", i,
		      si.kind);
		CHECK(proc_state(pids[i]) == 't', "%d: state %c, want t", i, proc_state(pids[i]));
	}
	/* 5: every task is stopped: the file does not change; snapshot it. */
	snap_size = file_size(cnt_path);
	CHECK(snap_size == frozen_size, "user code ran between thaw and stop (%lld -> %lld)",
	      (long long)frozen_size, (long long)snap_size);
	sleep_ms(30);
	CHECK(file_size(cnt_path) == snap_size, "counter ran while stopped (%lld -> %lld)",
	      (long long)snap_size, (long long)file_size(cnt_path));
	CHECK(copy_file(cnt_path, snap_path) == 0, "snapshot copy");
	n_snap = read_counter_file(snap_path, NULL, &seq);
	CHECK(n_snap > 0 && seq, "snapshot has %ld records, sequential %d", n_snap, seq);
	last = n_snap;
	/* 6: templates: all three forks started, then collected in the other order. */
	for (int i = 0; i < 3; i++)
		CHECK(!st[i] || dbxcr_template_start(st[i], &err) == 0, "start template %d: %s", i,
		      err.msg);
	for (int i = 2; i >= 0; i--) {
		if (!st[i])
			continue;
		tpl[i] = dbxcr_template_finish(st[i], &err);
		CHECK(tpl[i] != NULL, "template %d: %s", i, err.msg);
	}
	if (tpl[0]) {
		long mem = -1;
		struct iovec l = { &mem, sizeof(mem) }, r = { (void *)&tree_counter, sizeof(mem) };

		CHECK(process_vm_readv(dbxcr_template_pid(tpl[0]), &l, 1, &r, 1, 0) ==
		      sizeof(mem), "read template counter: %s", strerror(errno));
		/* Stopped either after a write (== last) or between ++ and write (last + 1). */
		CHECK(mem == last || mem == last + 1, "template counter %ld, file's last %ld", mem,
		      last);
	}
	/* 7: resume the originals. */
	for (int i = 0; i < 3; i++) {
		if (!st[i])
			continue;
		CHECK(dbxcr_stop_resume(st[i], &err) == 0, "resume %d: %s", i, err.msg);
		dbxcr_stop_abort(st[i]);
		st[i] = NULL;
		CHECK(proc_state(pids[i]) != 't', "%d still traced", i);
	}
	/* The originals continue correctly. */
	CHECK(wait_file_grows(cnt_path, snap_size + 8 * 20, 3000), "counter stopped counting");
	CHECK(read_counter_file(cnt_path, NULL, &seq) > last && seq,
	      "original counter file not sequential after resume");
	CHECK(write(cmd[1], "after", 5) == 5, "write to reader");
	{
		struct tree_report r;

		CHECK(tree_report_from(rep[0], pids[2], &r, 3000) == 0 && r.rc == 5 &&
		      memcmp(r.data, "after", 5) == 0 && r.marker == 222,
		      "reader: rc %d errno %d '%.5s' marker %d", r.rc, r.err, r.data, r.marker);
		CHECK(tree_report_from(rep[0], pids[1], &r, 3000) == 0 && r.rc == 0 &&
		      r.elapsed_ms >= TREE_SLEEP_MS - 5 && r.elapsed_ms < TREE_SLEEP_MS + 1500,
		      "sleeper: rc %d errno %d after %lld ms", r.rc, r.err, r.elapsed_ms);
	}
	/* Children of the templates hold the state of the stop instant. */
	if (tpl[0]) {
		struct dbxcr_file f = { TREE_CNT_FD, O_WRONLY | O_APPEND, 0, snap_path };
		struct dbxcr_spawn_opts o = { .mntns_fd = -1, .files = &f, .nfiles = 1 };
		long *v = NULL, n;

		extra[0] = dbxcr_spawn(tpl[0], &o, &err);
		CHECK(extra[0] > 0, "spawn counter: %s", err.msg);
		if (extra[0] > 0) {
			CHECK(wait_file_grows(snap_path, snap_size + 8 * 20, 3000),
			      "counter child does not count");
			kill_reap(extra[0]);
			extra[0] = -1;
			n = read_counter_file(snap_path, &v, &seq);
			CHECK(n > last + 20 && seq, "counter child: %ld records, sequential %d "
			      "(first new record %ld, want %ld)", n, seq, v && n > last ? v[last] : -1,
			      last + 1);
			free(v);
		}
	}
	if (tpl[1]) {
		struct tree_report r;

		extra[1] = dbxcr_spawn(tpl[1], NULL, &err);
		CHECK(extra[1] > 0, "spawn sleeper: %s", err.msg);
		CHECK(extra[1] > 0 && tree_report_from(rep[0], extra[1], &r, 5000) == 0 &&
		      r.rc == 0 && r.marker == 111 && r.elapsed_ms >= TREE_SLEEP_MS - 5 &&
		      r.elapsed_ms < TREE_SLEEP_MS + 2500,
		      "sleeper child: rc %d errno %d marker %d after %lld ms", r.rc, r.err,
		      r.marker, r.elapsed_ms);
	}
	if (tpl[2]) {
		int p2[2];
		struct dbxcr_fdmap m;
		struct dbxcr_spawn_opts o = { .mntns_fd = -1, .fds = &m, .nfds = 1 };
		struct tree_report r;

		if (pipe2(p2, O_CLOEXEC) < 0)
			abort();
		m = (struct dbxcr_fdmap){ p2[0], TREE_CMD_FD, 0 };
		extra[2] = dbxcr_spawn(tpl[2], &o, &err);
		close(p2[0]);
		CHECK(extra[2] > 0, "spawn reader: %s", err.msg);
		CHECK(write(p2[1], "tpl", 3) == 3, "write to reader child");
		CHECK(extra[2] > 0 && tree_report_from(rep[0], extra[2], &r, 3000) == 0 &&
		      r.rc == 3 && memcmp(r.data, "tpl", 3) == 0 && r.marker == 222,
		      "reader child: rc %d errno %d '%.3s' marker %d", r.rc, r.err, r.data,
		      r.marker);
		close(p2[1]);
	}
out:
	for (int i = 0; i < 3; i++) {
		dbxcr_stop_abort(st[i]);
		if (tpl[i])
			CHECK(dbxcr_release_template(tpl[i], &err) == 0, "release %d: %s", i,
			      err.msg);
	}
	cg_write("freezer.state", "THAWED");
	for (int i = 2; i >= 0; i--) {
		if (extra[i] > 0)
			kill(extra[i], SIGKILL);
		if (pids[i] > 0)
			kill(pids[i], SIGKILL);
	}
	if (extra[0] > 0)
		reap(extra[0]);
	if (pids[0] > 0)
		reap(pids[0]);
	cg_remove();
	CHECK(dbxcr_stop_sweep(0) == 0, "stop handles left in limbo");
	close(go[1]), close(info[0]), close(cmd[1]), close(rep[0]);
	unlink(cnt_path);
	unlink(snap_path);
}

static volatile sig_atomic_t usr1_hits;

static void count_usr1(int sig)
{
	(void)sig;
	usr1_hits++;
}

/* A frozen group-stopped process, one that dies while frozen, one with a signal sent while
 * frozen, and an aborted handle that had not stopped yet. */
static void test_stop_frozen_edge_cases(void)
{
	struct dbxcr_error err;
	struct dbxcr_stop *sg = NULL, *se = NULL, *ss = NULL, *sa = NULL;
	struct dbxcr_template *tg = NULL, *ts = NULL;
	pid_t g = -1, e = -1, sp = -1, a = -1;
	int gp[2], sigp[2], status;

	current_test = "stop-frozen-edge-cases";
	if (pipe2(gp, O_CLOEXEC) < 0 || pipe2(sigp, O_CLOEXEC) < 0)
		abort();
	if (cg_create() < 0) {
		CHECK(0, "mkdir freezer cgroup: %s", strerror(errno));
		cg_dir[0] = '\0';
		goto out;
	}
	g = fork();
	if (g == 0) {
		raise(SIGSTOP);
		if (write(gp[1], "x", 1) < 0)
			_exit(2);
		_exit(0);
	}
	e = fork();
	if (e == 0)
		for (;;)
			pause();
	sp = fork();
	if (sp == 0) {
		struct sigaction sa_ = { .sa_handler = count_usr1 };

		sigaction(SIGUSR1, &sa_, NULL);
		for (;;) {
			pause();
			int n = usr1_hits;

			if (write(sigp[1], &n, sizeof(n)) < 0)
				_exit(2);
		}
	}
	a = fork();
	if (a == 0)
		for (;;)
			pause();
	close(gp[1]);
	close(sigp[1]);
	CHECK(waitpid(g, &status, WUNTRACED) == g && WIFSTOPPED(status), "g not stopped");
	CHECK(wait_in_syscall(e, SYS_pause) == 0 && wait_in_syscall(sp, SYS_pause) == 0 &&
	      wait_in_syscall(a, SYS_pause) == 0, "children not paused");
	CHECK(cg_add(g) == 0 && cg_add(e) == 0 && cg_add(sp) == 0 && cg_add(a) == 0,
	      "move into cgroup");
	CHECK(cg_set("FROZEN") == 0, "freeze");
	CHECK(dbxcr_stop_begin(g, &sg, &err) == 0, "begin group-stopped: %s", err.msg);
	CHECK(dbxcr_stop_begin(e, &se, &err) == 0, "begin doomed: %s", err.msg);
	CHECK(dbxcr_stop_begin(sp, &ss, &err) == 0, "begin signalled: %s", err.msg);
	CHECK(dbxcr_stop_begin(a, &sa, &err) == 0, "begin aborted: %s", err.msg);
	/* A handle that cannot be detached yet goes to limbo. */
	dbxcr_stop_abort(sa);
	sa = NULL;
	CHECK(dbxcr_stop_sweep(0) == 1, "aborted unstopped handle not pending");
	kill(e, SIGKILL);
	kill(sp, SIGUSR1);
	sleep_ms(20);
	{
		/* Waiting while frozen times out clearly. */
		long long t0 = now_ms();

		CHECK(ss && dbxcr_stop_wait(ss, 50, &err) < 0 && err.code == ETIMEDOUT &&
		      strstr(err.msg, "no stop within"), "wait while frozen: %s", err.msg);
		CHECK(now_ms() - t0 < 1000, "timeout took %lld ms", now_ms() - t0);
	}
	CHECK(cg_set("THAWED") == 0, "thaw");
	CHECK(dbxcr_stop_sweep(2000) == 0, "limbo handle not detached after thaw");
	CHECK(wait_in_syscall(a, SYS_pause) == 0, "aborted process state %c, not in pause",
	      proc_state(a));
	{
		struct dbxcr_info info;

		CHECK(dbxcr_describe(a, &info, &err) == 0 && info.tracer_pid == 0,
		      "aborted process still traced by %d", info.tracer_pid);
	}
	if (se) {
		CHECK(dbxcr_stop_wait(se, 2000, &err) < 0 && err.code == ESRCH &&
		      strstr(err.msg, "killed by signal 9"), "killed process: %s", err.msg);
		e = -1;	/* reaped by the wait (we are its parent and tracer) */
	}
	if (sg) {
		struct dbxcr_stop_info si;

		CHECK(dbxcr_stop_wait(sg, 2000, &err) == 0, "wait group-stopped: %s", err.msg);
		dbxcr_stop_get_info(sg, &si);
		CHECK(si.kind == DBXCR_STOP_GROUP && si.signal == SIGSTOP, "kind %d signal %d",
		      si.kind, si.signal);
		tg = dbxcr_template_stopped(sg, &err);
		CHECK(tg != NULL, "template of group-stopped: %s", err.msg);
		CHECK(dbxcr_stop_resume(sg, &err) == 0, "resume group-stopped: %s", err.msg);
		sleep_ms(50);
		CHECK(proc_state(g) == 'T', "group-stopped process state %c, want T",
		      proc_state(g));
		CHECK(!readable_now(gp[0], 0), "group-stopped process ran");
		CHECK(waitpid(g, &status, WNOHANG | WUNTRACED | WCONTINUED) == 0,
		      "parent saw a stop/continue report (status %#x)", status);
		kill(g, SIGCONT);
		{
			char c;

			CHECK(read_timeout(gp[0], &c, 1, 3000) == 0, "no output after SIGCONT");
		}
	}
	if (ss) {
		struct dbxcr_stop_info si;
		int n = -1;

		CHECK(dbxcr_stop_wait(ss, 2000, &err) == 0, "wait signalled: %s", err.msg);
		dbxcr_stop_get_info(ss, &si);
		CHECK(si.kind == DBXCR_STOP_INTERRUPT || si.kind == DBXCR_STOP_SIGNAL,
		      "kind %d", si.kind);
		CHECK(!readable_now(sigp[0], 30), "signal handled while stopped");
		ts = dbxcr_template_stopped(ss, &err);
		CHECK(ts != NULL, "template of signalled: %s", err.msg);
		CHECK(dbxcr_stop_resume(ss, &err) == 0, "resume signalled: %s", err.msg);
		CHECK(read_timeout(sigp[0], &n, sizeof(n), 3000) == 0 && n == 1,
		      "SIGUSR1 handler ran %d times, want 1", n);
		CHECK(!readable_now(sigp[0], 50), "signal delivered twice");
		/* The template's children get the signal that was pending at the stop. */
		if (ts) {
			pid_t c = dbxcr_spawn(ts, NULL, &err);

			n = -1;
			CHECK(c > 0, "spawn signalled: %s", err.msg);
			CHECK(c > 0 && read_timeout(sigp[0], &n, sizeof(n), 3000) == 0 && n == 1,
			      "child: SIGUSR1 handler ran %d times, want 1", n);
			CHECK(!readable_now(sigp[0], 50), "child: signal delivered twice");
			kill_reap(c);
		}
	}
out:
	dbxcr_stop_abort(sg);
	dbxcr_stop_abort(se);
	dbxcr_stop_abort(ss);
	dbxcr_stop_abort(sa);
	if (tg)
		CHECK(dbxcr_release_template(tg, &err) == 0, "release: %s", err.msg);
	if (ts)
		CHECK(dbxcr_release_template(ts, &err) == 0, "release: %s", err.msg);
	cg_write("freezer.state", "THAWED");
	kill_reap(g);
	kill_reap(e);
	kill_reap(sp);
	kill_reap(a);
	cg_remove();
	CHECK(dbxcr_stop_sweep(0) == 0, "stop handles left in limbo");
	CHECK(count_zombie_children() == 0, "zombies left: %d", count_zombie_children());
	close(gp[0]);
	close(sigp[0]);
}

/* The number of children of this process (every thread's), zombies included. */
static int count_children(void)
{
	char path[300], buf[4096];
	DIR *d = opendir("/proc/self/task");
	struct dirent *de;
	int n = 0;

	if (!d)
		return -1;
	while ((de = readdir(d)) != NULL) {
		int fd;
		ssize_t len;

		if (de->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "/proc/self/task/%s/children", de->d_name);
		fd = open(path, O_RDONLY | O_CLOEXEC);
		if (fd < 0)
			continue;
		len = read(fd, buf, sizeof(buf) - 1);
		close(fd);
		for (ssize_t i = 0; i < len; i++)
			n += buf[i] == ' ';
	}
	closedir(d);
	return n;
}

/* A template started and never finished (the checkpoint failed elsewhere): resume waits
 * for its fork and kills the child, and the process goes on as if nothing happened.
 * Misuse (start twice, finish without start) is refused. */
static void test_template_start_abandoned(void)
{
	struct dbxcr_error err;
	struct dbxcr_stop *s = NULL;
	struct dbxcr_template *tpl = NULL;
	pid_t p;
	int children;

	current_test = "template-start-abandoned";
	p = fork();
	if (p == 0)
		for (;;)
			pause();
	CHECK(wait_in_syscall(p, SYS_pause) == 0, "child not paused");
	children = count_children();
	CHECK(dbxcr_stop_begin(p, &s, &err) == 0, "stop_begin: %s", err.msg);
	if (!s)
		goto out;
	CHECK(dbxcr_stop_wait(s, 3000, &err) == 0, "stop_wait: %s", err.msg);
	tpl = dbxcr_template_finish(s, &err);
	CHECK(!tpl && err.code == EINVAL, "finish without start: %s", err.msg);
	CHECK(dbxcr_template_start(s, &err) == 0, "start: %s", err.msg);
	CHECK(dbxcr_template_start(s, &err) < 0 && err.code == EINVAL,
	      "second start not refused: %s", err.msg);
	CHECK(dbxcr_stop_resume(s, &err) == 0, "resume with a fork in flight: %s", err.msg);
	dbxcr_stop_abort(s);
	s = NULL;
	CHECK(count_children() == children, "children %d after resume, %d before (template "
	      "left behind?)", count_children(), children);
	CHECK(wait_in_syscall(p, SYS_pause) == 0, "process state %c, not back in pause",
	      proc_state(p));
	{
		struct dbxcr_info info;

		CHECK(dbxcr_describe(p, &info, &err) == 0 && info.tracer_pid == 0,
		      "process still traced by %d", info.tracer_pid);
	}
out:
	dbxcr_stop_abort(s);
	if (tpl)
		dbxcr_release_template(tpl, &err);
	kill_reap(p);
	CHECK(count_zombie_children() == 0, "zombies left: %d", count_zombie_children());
}

/* A server blocked in accept(): its template, its descriptors dropped, holds no socket,
 * so the port is free once the original dies, and a child spawned with the socket recreated at the same fd
 * resumes its accept() on the new socket and serves. */
static void test_listen_socket(void)
{
	struct dbxcr_error err;
	struct dbxcr_template *tpl;
	struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t len = sizeof(sa);
	struct dbxcr_listen l;
	struct dbxcr_spawn_opts o;
	int ls, ready[2], c;
	pid_t srv, child = -1;
	char buf[4] = { 0 }, x;

	current_test = "listen-socket";
	ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	CHECK(ls >= 0 && bind(ls, (struct sockaddr *)&sa, sizeof(sa)) == 0 && listen(ls, 7) == 0 &&
	      getsockname(ls, (struct sockaddr *)&sa, &len) == 0, "listen: %s", strerror(errno));
	if (pipe(ready) < 0)
		abort();
	srv = fork();
	if (srv == 0) {
		if (write(ready[1], "x", 1) < 0)
			_exit(1);
		int a = accept(ls, NULL, NULL);

		if (a < 0 || write(a, "hi", 2) != 2)
			_exit(2);
		_exit(0);
	}
	close(ready[1]);
	CHECK(read_timeout(ready[0], &x, 1, 5000) == 0, "server not ready");
	close(ready[0]);
	close(ls);
	CHECK(wait_in_syscall(srv, SYS_accept) == 0, "server never blocked in accept");
	tpl = dbxcr_make_template(srv, &err);
	CHECK(tpl != NULL, "make_template: %s", err.msg);
	if (tpl) {
		CHECK(count_fds(dbxcr_template_pid(tpl)) > 0, "the template holds no descriptor yet");
		CHECK(dbxcr_template_drop_fds(tpl, &err) == 0, "template_drop_fds: %s", err.msg);
		CHECK(count_fds(dbxcr_template_pid(tpl)) == 0, "the template still holds %d fds",
		      count_fds(dbxcr_template_pid(tpl)));
		kill_reap(srv);
		srv = -1;
		c = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
		CHECK(connect(c, (struct sockaddr *)&sa, sizeof(sa)) < 0 && errno == ECONNREFUSED,
		      "the template still holds the port");
		close(c);
		memset(&l, 0, sizeof(l));
		l.fd = ls;
		l.family = AF_INET;
		l.type = SOCK_STREAM | SOCK_CLOEXEC;
		l.backlog = 7;
		l.addrlen = sizeof(sa);
		memcpy(l.addr, &sa, sizeof(sa));
		memset(&o, 0, sizeof(o));
		o.mntns_fd = -1;
		o.listens = &l;
		o.nlistens = 1;
		child = dbxcr_spawn(tpl, &o, &err);
		CHECK(child > 0, "spawn: %s", err.msg);
		c = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
		CHECK(connect(c, (struct sockaddr *)&sa, sizeof(sa)) == 0, "connect: %s",
		      strerror(errno));
		CHECK(read_timeout(c, buf, 2, 5000) == 0 && memcmp(buf, "hi", 2) == 0,
		      "restored server did not answer ('%s')", buf);
		close(c);
		CHECK(dbxcr_release_template(tpl, &err) == 0, "release: %s", err.msg);
	}
	if (child > 0)
		CHECK(reap(child) == 0, "restored server exit status");
	if (srv > 0)
		kill_reap(srv);
}

/* A UDP socket blocked in recv(), bound and connected to our socket `peer`, with
 * SO_BROADCAST on, a receive timeout (a struct option) and a multicast group joined: its
 * template holds no socket (the port is free once the original dies), and a child spawned
 * with the socket made again (bound, connected, the options set, the group joined) gets
 * our datagram and answers through send(), which only a connected socket can; it answers
 * with the options' values and whether its socket is in the group (MCAST_MSFILTER finds
 * the membership). */
#define MCAST_GROUP 0xef010203u	/* 239.1.2.3 */

/* Whether UDP socket u is a member of the IPv4 group (host order) on lo. */
static bool in_group(int u, uint32_t group)
{
	struct group_filter gf;
	struct sockaddr_in *a = (struct sockaddr_in *)&gf.gf_group;
	socklen_t len = sizeof(gf);

	memset(&gf, 0, sizeof(gf));
	gf.gf_interface = 1;
	a->sin_family = AF_INET;
	a->sin_addr.s_addr = htonl(group);
	return getsockopt(u, IPPROTO_IP, MCAST_MSFILTER, &gf, &len) == 0;
}

static void test_udp_socket(void)
{
	struct dbxcr_error err;
	struct dbxcr_template *tpl;
	struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	struct sockaddr_in pa = sa;
	socklen_t len = sizeof(sa);
	struct dbxcr_listen l;
	struct dbxcr_spawn_opts o;
	int u, peer, one = 1, probe;
	uint32_t mc;
	pid_t srv, child = -1;
	char buf[4] = { 0 };
	struct ip_mreqn mr = { .imr_multiaddr.s_addr = htonl(MCAST_GROUP), .imr_ifindex = 1 };
	struct timeval tv = { .tv_sec = 30 };	/* whole seconds: kept in jiffies */

	current_test = "udp-socket";
	peer = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	u = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	CHECK(peer >= 0 && u >= 0 && bind(peer, (struct sockaddr *)&pa, sizeof(pa)) == 0 &&
	      getsockname(peer, (struct sockaddr *)&pa, &len) == 0 &&
	      setsockopt(u, SOL_SOCKET, SO_BROADCAST, &one, sizeof(one)) == 0 &&
	      setsockopt(u, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) == 0 &&
	      setsockopt(u, IPPROTO_IP, IP_ADD_MEMBERSHIP, &mr, sizeof(mr)) == 0 &&
	      bind(u, (struct sockaddr *)&sa, sizeof(sa)) == 0 &&
	      connect(u, (struct sockaddr *)&pa, sizeof(pa)) == 0 &&
	      getsockname(u, (struct sockaddr *)&sa, &len) == 0, "udp: %s", strerror(errno));
	srv = fork();
	if (srv == 0) {
		int bc = 0;
		socklen_t bl = sizeof(bc), tl = sizeof(tv);
		struct timeval got = { 0 };
		char x, out[3];
		ssize_t n;

		/* A receive with a timeout fails with EINTR when ptrace stops it (as after
		 * SIGSTOP and SIGCONT, signal(7)): the template's copy returns it too. */
		while ((n = recv(u, &x, 1, 0)) < 0 && errno == EINTR)
			;
		if (n != 1 || getsockopt(u, SOL_SOCKET, SO_BROADCAST, &bc, &bl) < 0 ||
		    getsockopt(u, SOL_SOCKET, SO_RCVTIMEO, &got, &tl) < 0)
			_exit(2);
		out[0] = bc ? 'b' : '-';
		out[1] = in_group(u, MCAST_GROUP) ? 'm' : '-';
		out[2] = got.tv_sec == tv.tv_sec && got.tv_usec == tv.tv_usec ? 't' : '-';
		_exit(send(u, out, 3, 0) == 3 ? 0 : 3);
	}
	close(u);
	CHECK(wait_in_syscall(srv, SYS_recvfrom) == 0, "server never blocked in recv");
	tpl = dbxcr_make_template(srv, &err);
	CHECK(tpl != NULL, "make_template: %s", err.msg);
	if (tpl) {
		CHECK(dbxcr_template_drop_fds(tpl, &err) == 0, "template_drop_fds: %s", err.msg);
		kill_reap(srv);
		srv = -1;
		probe = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
		CHECK(probe >= 0 && bind(probe, (struct sockaddr *)&sa, sizeof(sa)) == 0,
		      "the template still holds the port: %s", strerror(errno));
		close(probe);
		memset(&l, 0, sizeof(l));
		l.fd = u;
		l.family = AF_INET;
		l.type = SOCK_DGRAM | SOCK_CLOEXEC;
		l.addrlen = sizeof(sa);
		memcpy(l.addr, &sa, sizeof(sa));
		l.peerlen = sizeof(pa);
		memcpy(l.peer, &pa, sizeof(pa));
		l.nopts = 2;
		l.opts[0] = (struct dbxcr_sockopt){ .level = SOL_SOCKET, .name = SO_BROADCAST,
						    .value = 1 };
		l.opts[1] = (struct dbxcr_sockopt){ .level = SOL_SOCKET, .name = SO_RCVTIMEO,
						    .len = sizeof(tv) };
		memcpy(l.opts[1].bytes, &tv, sizeof(tv));
		l.ngroups = 1;
		l.groups[0].ifindex = 1;	/* lo */
		l.groups[0].family = AF_INET;
		mc = htonl(MCAST_GROUP);
		memcpy(l.groups[0].addr, &mc, sizeof(mc));
		memset(&o, 0, sizeof(o));
		o.mntns_fd = -1;
		o.listens = &l;
		o.nlistens = 1;
		child = dbxcr_spawn(tpl, &o, &err);
		CHECK(child > 0, "spawn: %s", err.msg);
		CHECK(sendto(peer, "x", 1, 0, (struct sockaddr *)&sa, sizeof(sa)) == 1,
		      "sendto: %s", strerror(errno));
		CHECK(read_timeout(peer, buf, 3, 5000) == 0 && memcmp(buf, "bmt", 3) == 0,
		      "restored socket did not answer through its peer with the options and "
		      "the group ('%s')", buf);
		CHECK(dbxcr_release_template(tpl, &err) == 0, "release: %s", err.msg);
	}
	if (child > 0)
		CHECK(reap(child) == 0, "restored server exit status");
	if (srv > 0)
		kill_reap(srv);
	close(peer);
}

/* A netlink socket blocked in recv(), bound to a port id of our choosing, in groups 1 (by
 * its bind) and 33 (NETLINK_ADD_MEMBERSHIP), with SO_PASSCRED on and a classic filter that
 * lets through only messages of 20 bytes: a child spawned with it made again has the same
 * port id, groups, option and filter (SO_GET_FILTER), and its filter works: of our two
 * messages to its port id, it gets the 20-byte one, sent second. */
#define NL_TEST_GROUP 33

/* Whether netlink socket n is in groups 1 and NL_TEST_GROUP (NETLINK_LIST_MEMBERSHIPS). */
static bool nl_groups_ok(int n)
{
	uint32_t g[8] = { 0 };
	socklen_t len = sizeof(g);

	if (getsockopt(n, SOL_NETLINK, NETLINK_LIST_MEMBERSHIPS, g, &len) < 0)
		return false;
	return (g[0] & 1) && (g[(NL_TEST_GROUP - 1) / 32] >> ((NL_TEST_GROUP - 1) % 32) & 1);
}

static void test_netlink_socket(void)
{
	struct sock_filter only20[] = {
		BPF_STMT(BPF_LD | BPF_W | BPF_LEN, 0),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 20, 0, 1),
		BPF_STMT(BPF_RET | BPF_K, 0xffff),
		BPF_STMT(BPF_RET | BPF_K, 0),
	};
	struct sock_fprog prog = { .len = 4, .filter = only20 };
	struct sockaddr_nl sa = { .nl_family = AF_NETLINK, .nl_groups = 1 };
	struct sockaddr_nl to = { .nl_family = AF_NETLINK };
	struct dbxcr_error err;
	struct dbxcr_template *tpl;
	struct dbxcr_listen l;
	struct dbxcr_spawn_opts o;
	struct { struct nlmsghdr h; char pad[8]; } msg;
	int n, me, one = 1, group = NL_TEST_GROUP, st;
	pid_t srv, child = -1;

	current_test = "netlink-socket";
	sa.nl_pid = 0x7d000000u | (uint32_t)getpid();
	n = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE);
	me = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE);
	CHECK(n >= 0 && me >= 0 &&
	      setsockopt(n, SOL_SOCKET, SO_ATTACH_FILTER, &prog, sizeof(prog)) == 0 &&
	      setsockopt(n, SOL_SOCKET, SO_PASSCRED, &one, sizeof(one)) == 0 &&
	      bind(n, (struct sockaddr *)&sa, sizeof(sa)) == 0 &&
	      setsockopt(n, SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, &group, sizeof(group)) == 0 &&
	      nl_groups_ok(n), "netlink: %s", strerror(errno));
	srv = fork();
	if (srv == 0) {
		struct sockaddr_nl got;
		socklen_t gl = sizeof(got), ol = sizeof(int);
		char buf[64];
		int pc = 0;

		if (recv(n, buf, sizeof(buf), 0) != 20)
			_exit(2);
		if (getsockname(n, (struct sockaddr *)&got, &gl) < 0 || got.nl_pid != sa.nl_pid)
			_exit(3);
		if (!nl_groups_ok(n))
			_exit(4);
		if (getsockopt(n, SOL_SOCKET, SO_PASSCRED, &pc, &ol) < 0 || !pc)
			_exit(5);
		ol = 0;	/* a length of 0 asks for the filter's number of instructions */
		if (getsockopt(n, SOL_SOCKET, SO_GET_FILTER, NULL, &ol) < 0 || ol != 4)
			_exit(6);
		_exit(0);
	}
	close(n);
	CHECK(wait_in_syscall(srv, SYS_recvfrom) == 0, "server never blocked in recv");
	tpl = dbxcr_make_template(srv, &err);
	CHECK(tpl != NULL, "make_template: %s", err.msg);
	if (tpl) {
		CHECK(dbxcr_template_drop_fds(tpl, &err) == 0, "template_drop_fds: %s", err.msg);
		kill_reap(srv);
		srv = -1;
		memset(&l, 0, sizeof(l));
		l.fd = n;
		l.family = AF_NETLINK;
		l.type = SOCK_RAW | SOCK_CLOEXEC;
		l.protocol = NETLINK_ROUTE;
		l.addrlen = sizeof(sa);
		memcpy(l.addr, &sa, sizeof(sa));
		l.nopts = 2;
		l.opts[0] = (struct dbxcr_sockopt){ .level = SOL_SOCKET, .name = SO_PASSCRED,
						    .value = 1 };
		l.opts[1] = (struct dbxcr_sockopt){ .level = SOL_NETLINK, .name = NETLINK_ADD_MEMBERSHIP,
						    .value = group };
		l.nfilter = 4;
		l.filter = only20;
		memset(&o, 0, sizeof(o));
		o.mntns_fd = -1;
		o.listens = &l;
		o.nlistens = 1;
		child = dbxcr_spawn(tpl, &o, &err);
		CHECK(child > 0, "spawn: %s", err.msg);
		to.nl_pid = sa.nl_pid;
		memset(&msg, 0, sizeof(msg));
		msg.h.nlmsg_type = NLMSG_NOOP;
		msg.h.nlmsg_len = 24;	/* dropped by the filter */
		CHECK(sendto(me, &msg, 24, 0, (struct sockaddr *)&to, sizeof(to)) == 24,
		      "sendto: %s", strerror(errno));
		msg.h.nlmsg_len = 20;
		CHECK(sendto(me, &msg, 20, 0, (struct sockaddr *)&to, sizeof(to)) == 20,
		      "sendto: %s", strerror(errno));
		CHECK(dbxcr_release_template(tpl, &err) == 0, "release: %s", err.msg);
	}
	if (child > 0) {
		st = reap(child);
		CHECK(st == 0, "restored netlink socket: exit status %d (2: the filter let the "
		      "24-byte message through, 3: another port id, 4: groups, 5: SO_PASSCRED, "
		      "6: no filter)", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
	}
	if (srv > 0)
		kill_reap(srv);
	close(me);
}

/* Count the watches an epoll instance of pid lists in /proc fdinfo. */
static int epoll_watch_count(pid_t pid, int efd)
{
	char path[64], buf[4096];
	int fd, n = 0;
	ssize_t len;

	snprintf(path, sizeof(path), "/proc/%d/fdinfo/%d", (int)pid, efd);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	len = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (len < 0)
		return -1;
	buf[len] = 0;
	for (char *p = buf; (p = strstr(p, "tfd:")) != NULL; p += 4)
		n++;
	return n;
}

/* A process blocked in epoll_wait on one pipe: its child, spawned with a fresh pipe at that
 * fd and the epoll instance recreated from a spec (watch, events, user data), wakes on the
 * fresh pipe and reports the spec's data; the original's instance (the template shares it)
 * is not touched. */
static void test_epoll_recreated(void)
{
	struct dbxcr_error err;
	struct dbxcr_template *tpl;
	struct dbxcr_epoll_watch w;
	struct dbxcr_epoll e;
	struct dbxcr_fdmap m;
	struct dbxcr_spawn_opts o;
	int ep, watched[2], report[2], fresh[2];
	unsigned long long got = 0;
	pid_t p, child = -1;

	current_test = "epoll-recreated";
	ep = epoll_create1(EPOLL_CLOEXEC);
	if (ep < 0 || pipe2(watched, O_CLOEXEC) < 0 || pipe2(report, O_CLOEXEC) < 0 ||
	    pipe2(fresh, O_CLOEXEC) < 0)
		abort();
	{
		struct epoll_event ev = { .events = EPOLLIN, .data.u64 = 0x111 };

		if (epoll_ctl(ep, EPOLL_CTL_ADD, watched[0], &ev) < 0)
			abort();
	}
	p = fork();
	if (p == 0) {
		struct epoll_event ev;

		for (;;) {
			long n = syscall(SYS_epoll_wait, ep, &ev, 1, -1);

			if (n == 1 && write(report[1], &ev.data.u64, sizeof(ev.data.u64)) < 0)
				_exit(1);
			if (n == 1)
				_exit(0);
		}
	}
	CHECK(wait_in_syscall(p, SYS_epoll_wait) == 0, "never blocked in epoll_wait");
	tpl = dbxcr_make_template(p, &err);
	CHECK(tpl != NULL, "make_template: %s", err.msg);
	if (tpl) {
		w = (struct dbxcr_epoll_watch){ .fd = watched[0], .events = EPOLLIN, .data = 0xabc };
		e = (struct dbxcr_epoll){ .fd = ep, .cloexec = 1, .watches = &w, .nwatches = 1 };
		m = (struct dbxcr_fdmap){ .src = fresh[0], .target = watched[0], .cloexec = 1 };
		memset(&o, 0, sizeof(o));
		o.mntns_fd = -1;
		o.fds = &m;
		o.nfds = 1;
		o.epolls = &e;
		o.nepolls = 1;
		child = dbxcr_spawn(tpl, &o, &err);
		CHECK(child > 0, "spawn: %s", err.msg);
		CHECK(wait_in_syscall(child, SYS_epoll_wait) == 0, "child not back in epoll_wait");
		CHECK(epoll_watch_count(child, ep) == 1, "child's instance has %d watches",
		      epoll_watch_count(child, ep));
		CHECK(write(fresh[1], "x", 1) == 1, "write: %s", strerror(errno));
		CHECK(read_timeout(report[0], &got, sizeof(got), 5000) == 0 && got == 0xabc,
		      "child reported data %#llx, not 0xabc", got);
		CHECK(epoll_watch_count(p, ep) == 1 && wait_in_syscall(p, SYS_epoll_wait) == 0,
		      "the original's instance changed or it woke");
		CHECK(dbxcr_release_template(tpl, &err) == 0, "release: %s", err.msg);
	}
	/* A bad spec names the fd and the step; the half-made child is gone. */
	tpl = dbxcr_make_template(p, &err);
	CHECK(tpl != NULL, "make_template: %s", err.msg);
	if (tpl) {
		w.fd = 999;
		CHECK(dbxcr_spawn(tpl, &o, &err) < 0 && err.code == EBADF &&
		      strstr(err.msg, "watch fd 999") != NULL, "bad watch: %d %s", err.code, err.msg);
		CHECK(dbxcr_release_template(tpl, &err) == 0, "release: %s", err.msg);
	}
	if (child > 0)
		kill_reap(child);
	kill_reap(p);
	for (int i = 0; i < 2; i++) {
		close(watched[i]);
		close(report[i]);
		close(fresh[i]);
	}
	close(ep);
	CHECK(count_zombie_children() == 0, "zombies left: %d", count_zombie_children());
}

/* dbxcr_netns_socket makes its socket in the namespace named, leaving ours as it was. */
static void test_netns_socket(void)
{
	struct dbxcr_error err;
	char before[64] = { 0 }, after[64] = { 0 };
	int ns, fd;

	current_test = "netns-socket";
	ns = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
	CHECK(ns >= 0 && readlink("/proc/thread-self/ns/net", before, sizeof(before) - 1) > 0,
	      "own netns: %s", strerror(errno));
	fd = dbxcr_netns_socket(ns, AF_UNIX, SOCK_STREAM, 0, &err);
	CHECK(fd >= 0, "netns socket: %s", err.msg);
	CHECK((fcntl(fd, F_GETFD) & FD_CLOEXEC) != 0, "socket not close-on-exec");
	CHECK(readlink("/proc/thread-self/ns/net", after, sizeof(after) - 1) > 0 &&
	      strcmp(before, after) == 0, "our namespace changed: %s -> %s", before, after);
	close(fd);
	CHECK(dbxcr_netns_socket(fd, AF_UNIX, SOCK_STREAM, 0, &err) < 0 && err.code == EBADF &&
	      strstr(err.msg, "setns") != NULL, "closed fd: %d %s", err.code, err.msg);
	close(ns);
}

/* dbxcr_mntns_open opens a path as another mount namespace sees it (a tmpfs mounted there
 * only), creating it with the mode asked for, follows no symlink and leaves our own
 * namespace as it was. */
static void test_mntns_open(void)
{
	struct dbxcr_error err;
	char dir[] = "/tmp/dbxcr-mntns-XXXXXX", path[96], link[96], ns[64];
	char before[64] = { 0 }, after[64] = { 0 }, x;
	int ready[2], nsfd, fd;
	struct stat st;
	pid_t holder;

	current_test = "mntns-open";
	CHECK(mkdtemp(dir) != NULL, "mkdtemp: %s", strerror(errno));
	snprintf(path, sizeof(path), "%s/seg", dir);
	snprintf(link, sizeof(link), "%s/link", dir);
	if (pipe(ready) < 0)
		abort();
	holder = fork();
	if (holder == 0) {	/* a namespace of its own with a tmpfs over dir */
		if (unshare(CLONE_NEWNS) < 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0 ||
		    mount("dbxcr-test", dir, "tmpfs", 0, "size=64k") < 0 || symlink("seg", link) < 0 ||
		    write(ready[1], "x", 1) < 0)
			_exit(1);
		pause();
		_exit(0);
	}
	close(ready[1]);
	CHECK(read_timeout(ready[0], &x, 1, 5000) == 0, "holder not ready");
	close(ready[0]);
	snprintf(ns, sizeof(ns), "/proc/%d/ns/mnt", (int)holder);
	nsfd = open(ns, O_RDONLY | O_CLOEXEC);
	CHECK(nsfd >= 0 && readlink("/proc/thread-self/ns/mnt", before, sizeof(before) - 1) > 0,
	      "open %s: %s", ns, strerror(errno));
	fd = dbxcr_mntns_open(nsfd, path, O_RDWR | O_CREAT, 0640, &err);
	CHECK(fd >= 0, "mntns open: %s", err.msg);
	CHECK((fcntl(fd, F_GETFD) & FD_CLOEXEC) != 0, "fd not close-on-exec");
	CHECK(fstat(fd, &st) == 0 && (st.st_mode & 07777) == 0640, "mode %o", st.st_mode);
	CHECK(stat(path, &st) < 0 && errno == ENOENT, "the file is in our namespace too");
	CHECK(readlink("/proc/thread-self/ns/mnt", after, sizeof(after) - 1) > 0 &&
	      strcmp(before, after) == 0, "our namespace changed: %s -> %s", before, after);
	close(fd);
	CHECK(dbxcr_mntns_open(nsfd, link, O_RDWR, 0, &err) < 0 && err.code == ELOOP &&
	      strstr(err.msg, "openat2") != NULL, "symlink followed: %d %s", err.code, err.msg);
	close(nsfd);
	kill(holder, SIGKILL);
	waitpid(holder, NULL, 0);
	CHECK(rmdir(dir) == 0, "rmdir %s: %s", dir, strerror(errno));
}

/* A process in an IPC namespace of its own (pause()s until killed): its pid, and a pidfd of
 * it in *pidfd. */
static pid_t ipcns_holder(int *pidfd)
{
	char ready_byte;
	int ready[2];
	pid_t holder;

	if (pipe(ready) < 0)
		abort();
	holder = fork();
	if (holder == 0) {
		if (unshare(CLONE_NEWIPC) < 0 || write(ready[1], "x", 1) < 0)
			_exit(1);
		pause();
		_exit(0);
	}
	close(ready[1]);
	CHECK(read_timeout(ready[0], &ready_byte, 1, 5000) == 0, "holder not ready");
	close(ready[0]);
	*pidfd = (int)syscall(SYS_pidfd_open, holder, 0);
	return holder;
}

/* System V segments in another IPC namespace: dbxcr_ipcns_shm_make makes them with their
 * ids (one under a later sequence number), owner, lock and sparse content, open to all
 * until dbxcr_ipcns_shm_modes; dbxcr_ipcns_shm_list reads them back; a second make removes
 * the one it is not given. */
static void test_ipcns_shm(void)
{
	struct dbxcr_error err;
	struct dbxcr_shm_segment segs[2], got[4];
	char buf[8] = { 0 };
	int pidfd, content;
	size_t n = 0;
	pid_t holder;

	current_test = "ipcns-shm";
	holder = ipcns_holder(&pidfd);
	content = memfd_create("seg", MFD_CLOEXEC);
	CHECK(pidfd >= 0 && content >= 0 && ftruncate(content, 5 * 4096) == 0 &&
	      pwrite(content, "seg-7", 5, 3 * 4096) == 5, "setup: %s", strerror(errno));
	segs[0] = (struct dbxcr_shm_segment){ .id = 7, .key = 0x7777, .mode = 0640 | SHM_LOCKED,
		.uid = 1000, .gid = 1000, .size = 5 * 4096, .fd = content };
	segs[1] = (struct dbxcr_shm_segment){ .id = 32768 + 1, .key = 0, .mode = 0600,
		.size = 100, .fd = -1 };
	CHECK(dbxcr_ipcns_shm_make(pidfd, segs, 2, &err) == 0, "make: %s", err.msg);
	CHECK(!segs[0].removed && !segs[1].removed, "found removed");
	/* Listed by index: 32769 (sequence 1, index 1) first. */
	CHECK(dbxcr_ipcns_shm_list(pidfd, got, 4, &n, &err) == 0 && n == 2, "list: %zu %s", n,
	      err.msg);
	if (n == 2) {
		CHECK(got[1].id == 7 && got[1].key == 0x7777 && got[1].uid == 1000 &&
		      (got[1].mode & 0777) == 0666 && (got[1].mode & SHM_LOCKED) &&
		      got[1].size == 5 * 4096, "segment 7: %d %#x %o", got[1].id, got[1].key,
		      got[1].mode);
		CHECK(got[0].id == 32769 && got[0].size == 100, "first: id %d", got[0].id);
		CHECK(lseek(got[1].fd, 0, SEEK_DATA) == 3 * 4096 &&
		      pread(got[1].fd, buf, 5, 3 * 4096) == 5 && !strcmp(buf, "seg-7"),
		      "content: %s (holes kept?)", buf);
	}
	for (size_t i = 0; i < n; i++)
		close(got[i].fd);
	CHECK(dbxcr_ipcns_shm_modes(pidfd, segs, 2, &err) == 0, "modes: %s", err.msg);
	CHECK(dbxcr_ipcns_shm_list(pidfd, got, 4, &n, &err) == 0 && n == 2 &&
	      (got[1].mode & 0777) == 0640 && (got[0].mode & 0777) == 0600, "modes not set");
	for (size_t i = 0; i < n; i++)
		close(got[i].fd);
	CHECK(dbxcr_ipcns_shm_make(pidfd, segs, 1, &err) == 0 &&
	      dbxcr_ipcns_shm_list(pidfd, got, 4, &n, &err) == 0 && n == 1 && got[0].id == 7,
	      "the segment not given stays: %zu", n);
	for (size_t i = 0; i < n; i++)
		close(got[i].fd);
	CHECK(dbxcr_ipcns_shm_list(pidfd, got, 0, &n, &err) < 0 && err.code == ENOSPC && n == 0,
	      "over max: %d", err.code);
	close(content);
	close(pidfd);
	kill(holder, SIGKILL);
	waitpid(holder, NULL, 0);
}

/* One message record as dbxcr_ipcns_msg_list writes it: type, length, text. */
static void put_message(int fd, uint64_t type, const char *text)
{
	uint64_t head[2] = { type, strlen(text) };

	if (write(fd, head, sizeof(head)) != sizeof(head) ||
	    write(fd, text, strlen(text)) != (ssize_t)strlen(text))
		abort();
}

/* System V message queues in another IPC namespace: dbxcr_ipcns_msg_make makes them with
 * their ids (one under a later sequence number), owner, mode, limit and messages in order;
 * dbxcr_ipcns_msg_list reads them back (the messages left queued); a second make leaves
 * only the queue it is given; a copy cut short is refused; more queues than asked for are
 * refused. */
static void test_ipcns_msg(void)
{
	struct dbxcr_error err;
	struct dbxcr_msg_queue qs[2], got[4];
	char copy[64], given[64];
	int pidfd, msgs, cut;
	size_t n = 0;
	pid_t holder;

	current_test = "ipcns-msg";
	holder = ipcns_holder(&pidfd);
	msgs = memfd_create("msgs", MFD_CLOEXEC);
	cut = memfd_create("cut", MFD_CLOEXEC);
	CHECK(pidfd >= 0 && msgs >= 0 && cut >= 0, "setup: %s", strerror(errno));
	put_message(msgs, 3, "three");
	put_message(msgs, 1, "");
	put_message(msgs, 3, "again");
	CHECK(write(cut, "\1\0\0\0\0\0\0\0\x40\0\0\0\0\0\0\0abc", 19) == 19, "cut");
	qs[0] = (struct dbxcr_msg_queue){ .id = 5, .key = 0x5555, .mode = 0640, .uid = 1000,
		.gid = 1000, .qbytes = 8, .count = 3, .bytes = 10, .fd = msgs };
	qs[1] = (struct dbxcr_msg_queue){ .id = 32768 + 1, .key = 0, .mode = 0600,
		.qbytes = 16384, .fd = -1 };
	CHECK(dbxcr_ipcns_msg_make(pidfd, qs, 2, &err) == 0, "make: %s", err.msg);
	/* Listed by index: 32769 (sequence 1, index 1) first. */
	CHECK(dbxcr_ipcns_msg_list(pidfd, got, 4, &n, &err) == 0 && n == 2, "list: %zu %s", n,
	      err.msg);
	if (n == 2) {
		CHECK(got[1].id == 5 && got[1].key == 0x5555 && got[1].uid == 1000 &&
		      (got[1].mode & 0777) == 0640 && got[1].qbytes == 8 && got[1].count == 3 &&
		      got[1].bytes == 10, "queue 5: %d %#x %o %llu %llu", got[1].id, got[1].key,
		      got[1].mode, got[1].qbytes, got[1].count);
		CHECK(got[0].id == 32769 && got[0].count == 0, "first: id %d", got[0].id);
		/* Its copy is the copy it was made from, byte for byte (3 heads, 10 bytes). */
		CHECK(pread(got[1].fd, copy, sizeof(copy), 0) == 58 &&
		      pread(msgs, given, sizeof(given), 0) == 58 && !memcmp(copy, given, 58),
		      "the messages' copy differs");
	}
	for (size_t i = 0; i < n; i++)
		close(got[i].fd);
	CHECK(dbxcr_ipcns_msg_make(pidfd, qs, 1, &err) == 0 &&
	      dbxcr_ipcns_msg_list(pidfd, got, 4, &n, &err) == 0 && n == 1 && got[0].id == 5 &&
	      got[0].count == 3, "the queue not given stays: %zu", n);
	for (size_t i = 0; i < n; i++)
		close(got[i].fd);
	qs[1].fd = cut;
	qs[1].count = 1;
	CHECK(dbxcr_ipcns_msg_make(pidfd, &qs[1], 1, &err) < 0 && err.code == EIO &&
	      strstr(err.msg, "System V message queue 32769") != NULL &&
	      strstr(err.msg, "cut short") != NULL, "a cut copy: %d %s", err.code, err.msg);
	/* Left as the failure found it (the caller restarts the processes and clears it). */
	CHECK(dbxcr_ipcns_msg_list(pidfd, got, 4, &n, &err) == 0 && n == 1 &&
	      got[0].id == 32769 && got[0].count == 0, "after the cut copy: %zu", n);
	for (size_t i = 0; i < n; i++)
		close(got[i].fd);
	CHECK(dbxcr_ipcns_msg_list(pidfd, got, 0, &n, &err) < 0 && err.code == ENOSPC && n == 0,
	      "over max: %d", err.code);
	close(msgs);
	close(cut);
	close(pidfd);
	kill(holder, SIGKILL);
	waitpid(holder, NULL, 0);
}

/* One descriptor of the queue /name of the namespace (dbxcr_ipcns_mq_open), or -1. */
static int mq_open_in(int pidfd, const char *name, int flags, struct dbxcr_error *err)
{
	int fd = -1;

	return dbxcr_ipcns_mq_open(pidfd, &name, &flags, &fd, 1, err) < 0 ? -1 : fd;
}

/* The messages a queue of the holder's namespace gives a receiver, in order, as
 * "prio:text," (taken: the queue is empty after). */
static void take_all(int pidfd, const char *name, char *out, size_t size)
{
	struct dbxcr_error err;
	char text[64];
	unsigned int prio;
	ssize_t len;
	int q = mq_open_in(pidfd, name, O_RDONLY | O_NONBLOCK, &err);

	out[0] = '\0';
	CHECK(q >= 0, "mq_open %s: %s", name, err.msg);
	if (q < 0)
		return;
	while ((len = mq_receive(q, text, sizeof(text), &prio)) >= 0)
		snprintf(out + strlen(out), size - strlen(out), "%u:%.*s,", prio, (int)len, text);
	CHECK(errno == EAGAIN, "mq_receive: %s", strerror(errno));
	close(q);
}

/* POSIX message queues in another IPC namespace: dbxcr_ipcns_mq_make makes them with their
 * names, sizes, owner, mode and messages; dbxcr_ipcns_mq_list reads them back, its copy in
 * the order a receiver gets them, and leaves them as they were (same order after); a
 * descriptor opened by dbxcr_ipcns_mq_open has the flags asked for; a second make leaves
 * only the queue it is given; a copy cut short is refused; a queue someone is registered
 * for the notification of is listed with that pid and not read. */
static void test_ipcns_posix(void)
{
	struct dbxcr_error err;
	struct dbxcr_posix_queue qs[2], got[4], *jobs = NULL;
	char taken[128], copy[128];
	int pidfd, msgs, cut, q;
	size_t n = 0;
	pid_t holder;

	current_test = "ipcns-posix";
	holder = ipcns_holder(&pidfd);
	msgs = memfd_create("msgs", MFD_CLOEXEC);
	cut = memfd_create("cut", MFD_CLOEXEC);
	CHECK(pidfd >= 0 && msgs >= 0 && cut >= 0, "setup: %s", strerror(errno));
	/* In a receiver's order: priority 5 first, then 1, oldest first within one. */
	put_message(msgs, 5, "b");
	put_message(msgs, 5, "d");
	put_message(msgs, 1, "a");
	put_message(msgs, 1, "");
	CHECK(write(cut, "\1\0\0\0\0\0\0\0\x40\0\0\0\0\0\0\0abc", 19) == 19, "cut");
	qs[0] = (struct dbxcr_posix_queue){ .name = "jobs", .mode = 0640, .uid = 1000,
		.gid = 1000, .maxmsg = 8, .msgsize = 64, .fd = msgs };
	qs[1] = (struct dbxcr_posix_queue){ .name = "empty", .mode = 0600, .maxmsg = 2,
		.msgsize = 16, .fd = -1 };
	CHECK(dbxcr_ipcns_mq_make(pidfd, qs, 2, &err) == 0, "make: %s", err.msg);
	CHECK(dbxcr_ipcns_mq_list(pidfd, got, 4, &n, &err) == 0 && n == 2, "list: %zu %s", n,
	      err.msg);
	for (size_t i = 0; i < n; i++)
		if (!strcmp(got[i].name, "jobs"))
			jobs = &got[i];
	CHECK(jobs != NULL, "jobs not listed");
	if (jobs) {
		CHECK(jobs->uid == 1000 && jobs->gid == 1000 && jobs->mode == 0640 &&
		      jobs->maxmsg == 8 && jobs->msgsize == 64 && jobs->count == 4 &&
		      jobs->bytes == 3 && jobs->notify_pid == 0, "jobs: %o %lld %lld %llu",
		      jobs->mode, jobs->maxmsg, jobs->msgsize, jobs->count);
		/* Its copy is the copy it was made from, byte for byte (4 heads, 3 bytes). */
		CHECK(pread(jobs->fd, copy, sizeof(copy), 0) == 67 &&
		      pread(msgs, taken, sizeof(taken), 0) == 67 && !memcmp(copy, taken, 67),
		      "the messages' copy differs");
	}
	for (size_t i = 0; i < n; i++)
		close(got[i].fd);
	/* Listing took the messages and sent them back: the same order. */
	take_all(pidfd, "jobs", taken, sizeof(taken));
	CHECK(!strcmp(taken, "5:b,5:d,1:a,1:,"), "after the list: %s", taken);
	q = mq_open_in(pidfd, "empty", O_WRONLY | O_NONBLOCK, &err);
	CHECK(q >= 0 && (fcntl(q, F_GETFL) & (O_ACCMODE | O_NONBLOCK)) == (O_WRONLY | O_NONBLOCK)
	      && (fcntl(q, F_GETFD) & FD_CLOEXEC), "mq_open's flags: %s", err.msg);
	if (q >= 0)
		close(q);
	/* Several at once: one missing fails them all, none left open. */
	const char *names[2] = { "empty", "none" };
	int flags[2] = { O_RDONLY, O_RDONLY }, fds[2] = { -1, -1 };
	CHECK(dbxcr_ipcns_mq_open(pidfd, names, flags, fds, 2, &err) < 0 && err.code == ENOENT &&
	      fds[0] >= 0 && fcntl(fds[0], F_GETFD) < 0 && errno == EBADF,
	      "two, one missing: %s", err.msg);
	CHECK(mq_open_in(pidfd, "none", O_RDONLY, &err) < 0 && err.code == ENOENT &&
	      strstr(err.msg, "POSIX message queue /none") != NULL, "none: %s", err.msg);
	CHECK(dbxcr_ipcns_mq_make(pidfd, &qs[1], 1, &err) == 0 &&
	      dbxcr_ipcns_mq_list(pidfd, got, 4, &n, &err) == 0 && n == 1 &&
	      !strcmp(got[0].name, "empty") && got[0].count == 0,
	      "the queue not given stays: %zu", n);
	for (size_t i = 0; i < n; i++)
		close(got[i].fd);
	qs[0].fd = cut;
	CHECK(dbxcr_ipcns_mq_make(pidfd, qs, 1, &err) < 0 && err.code == EIO &&
	      strstr(err.msg, "POSIX message queue /jobs") != NULL &&
	      strstr(err.msg, "cut short") != NULL, "a cut copy: %d %s", err.code, err.msg);
	/* A queue through a descriptor of ours (one unlinked while held): the same copy,
	 * the queue left as it was; then unlinked by name. */
	qs[0].fd = msgs;
	CHECK(dbxcr_ipcns_mq_make(pidfd, qs, 1, &err) == 0, "make again: %s", err.msg);
	q = mq_open_in(pidfd, "jobs", O_RDWR | O_NONBLOCK, &err);
	{
		struct dbxcr_posix_queue one = { .name = "dbx-unlinked-1" };

		CHECK(q >= 0 && dbxcr_mq_capture_fd(q, &one, &err) == 0 &&
		      !strcmp(one.name, "dbx-unlinked-1") && one.count == 4 && one.bytes == 3 &&
		      one.maxmsg == 8 && one.mode == 0640 && one.uid == 1000 && one.fd >= 0 &&
		      pread(one.fd, copy, sizeof(copy), 0) == 67 &&
		      pread(msgs, taken, sizeof(taken), 0) == 67 && !memcmp(copy, taken, 67),
		      "capture_fd: %s", err.msg);
		if (one.fd >= 0)
			close(one.fd);
	}
	if (q >= 0)
		close(q);
	take_all(pidfd, "jobs", taken, sizeof(taken));
	CHECK(!strcmp(taken, "5:b,5:d,1:a,1:,"), "after capture_fd: %s", taken);
	{
		const char *gone[2] = { "jobs", "never-made" };

		CHECK(dbxcr_ipcns_mq_unlink(pidfd, gone, 2, &err) == 0 &&
		      mq_open_in(pidfd, "jobs", O_RDONLY, &err) < 0 && err.code == ENOENT,
		      "mq_unlink: %s", err.msg);
	}
	CHECK(dbxcr_ipcns_mq_make(pidfd, qs, 1, &err) == 0, "make a third time: %s", err.msg);
	/* Someone registered for a notification: listed with its pid, not read. */
	q = mq_open_in(pidfd, "jobs", O_RDONLY, &err);
	struct sigevent ev = { .sigev_notify = SIGEV_SIGNAL, .sigev_signo = SIGUSR1 };
	CHECK(q >= 0 && mq_notify(q, &ev) == 0, "mq_notify: %s", strerror(errno));
	CHECK(dbxcr_ipcns_mq_list(pidfd, got, 4, &n, &err) == 0 && n == 1 &&
	      got[0].notify_pid == getpid() && got[0].fd == -1, "notify: %zu %d", n,
	      n ? got[0].notify_pid : 0);
	if (q >= 0)
		close(q);
	CHECK(dbxcr_ipcns_mq_list(pidfd, got, 0, &n, &err) < 0 && err.code == ENOSPC && n == 0,
	      "over max: %d", err.code);
	close(msgs);
	close(cut);
	close(pidfd);
	kill(holder, SIGKILL);
	waitpid(holder, NULL, 0);
}

/* System V semaphore sets in another IPC namespace: dbxcr_ipcns_sem_make makes them with
 * their ids, owner, mode and values (zeros without a copy); dbxcr_ipcns_sem_list reads them
 * back; a second make leaves only the set it is given. */
static void test_ipcns_sem(void)
{
	struct dbxcr_error err;
	struct dbxcr_sem_set sets[2], got[4];
	unsigned short values[3] = { 2, 0, 5 }, back[3] = { 0 };
	int pidfd, copy;
	size_t n = 0;
	pid_t holder;

	current_test = "ipcns-sem";
	holder = ipcns_holder(&pidfd);
	copy = memfd_create("values", MFD_CLOEXEC);
	CHECK(pidfd >= 0 && copy >= 0 && write(copy, values, sizeof(values)) == sizeof(values),
	      "setup: %s", strerror(errno));
	sets[0] = (struct dbxcr_sem_set){ .id = 3, .key = 0x3333, .mode = 0640, .uid = 1000,
		.gid = 1000, .nsems = 3, .fd = copy };
	sets[1] = (struct dbxcr_sem_set){ .id = 32768 + 1, .key = 0, .mode = 0600, .nsems = 2,
		.fd = -1 };
	CHECK(dbxcr_ipcns_sem_make(pidfd, sets, 2, &err) == 0, "make: %s", err.msg);
	CHECK(dbxcr_ipcns_sem_list(pidfd, got, 4, &n, &err) == 0 && n == 2, "list: %zu %s", n,
	      err.msg);
	if (n == 2) {
		CHECK(got[1].id == 3 && got[1].key == 0x3333 && got[1].uid == 1000 &&
		      (got[1].mode & 0777) == 0640 && got[1].nsems == 3, "set 3: %d %#x %o %d",
		      got[1].id, got[1].key, got[1].mode, got[1].nsems);
		CHECK(pread(got[1].fd, back, sizeof(back), 0) == sizeof(back) &&
		      !memcmp(back, values, sizeof(values)), "values %u %u %u", back[0], back[1],
		      back[2]);
		CHECK(got[0].id == 32769 && got[0].nsems == 2 &&
		      pread(got[0].fd, back, 4, 0) == 4 && back[0] == 0 && back[1] == 0,
		      "first: id %d", got[0].id);
	}
	for (size_t i = 0; i < n; i++)
		close(got[i].fd);
	CHECK(dbxcr_ipcns_sem_make(pidfd, sets, 1, &err) == 0 &&
	      dbxcr_ipcns_sem_list(pidfd, got, 4, &n, &err) == 0 && n == 1 && got[0].id == 3,
	      "the set not given stays: %zu", n);
	for (size_t i = 0; i < n; i++)
		close(got[i].fd);
	close(copy);
	close(pidfd);
	kill(holder, SIGKILL);
	waitpid(holder, NULL, 0);
}

/* test_fork_template [NAME...]: the named tests only (all without a name). */
static bool selected(const char *name, int argc, char **argv)
{
	for (int i = 1; i < argc; i++)
		if (!strcmp(argv[i], name))
			return true;
	return argc < 2;
}

int main(int argc, char **argv)
{
	int fd;

	setvbuf(stderr, NULL, _IONBF, 0);
	if (geteuid() != 0) {
		fprintf(stderr, "test_fork_template: needs root (ptrace, setns, set_tid)\n");
		return 1;
	}
	signal(SIGPIPE, SIG_IGN);
	shared_buf = mmap(NULL, BUF_SIZE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
			  -1, 0);
	shm_page = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (shared_buf == MAP_FAILED || shm_page == MAP_FAILED)
		abort();
	snprintf(priv_path, sizeof(priv_path), "/tmp/dbxcr-priv-XXXXXX");
	fd = mkstemp(priv_path);
	if (fd < 0 || ftruncate(fd, 8192) < 0)
		abort();
	priv_pages = mmap(NULL, 8192, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
	close(fd);
	if (priv_pages == MAP_FAILED)
		abort();
	snprintf(file_path, sizeof(file_path), "/tmp/dbxcr-test-XXXXXX");
	fd = mkstemp(file_path);
	if (fd < 0 || write(fd, file_text, sizeof(file_text) - 1) < 0)
		abort();
	close(fd);

	struct {
		const char *name;
		void (*fn)(void);
	} tests[] = {
		{ "inject-nanosleep", test_inject_nanosleep },
		{ "inject-read", test_inject_read },
		{ "inject-batch", test_inject_batch },
		{ "inject-pause", test_inject_pause },
		{ "inject-pending-signal", test_inject_pending_signal },
		{ "inject-wait4", test_inject_wait4 },
		{ "inject-group-stopped", test_inject_group_stopped },
		{ "release-unseen", test_release_unseen },
		{ "template-orphan", test_template_orphan },
		{ "release-unseen-pending", test_release_unseen_pending },
		{ "templates", test_templates },
		{ "shared-remap", test_shared_remap },
		{ "private-remap", test_private_remap },
		{ "template-copy", test_template_copy },
		{ "carriers", test_carriers },
		{ "jobs", test_jobs },
		{ "spawn-mntns", test_spawn_mntns },
		{ "listen-socket", test_listen_socket },
		{ "udp-socket", test_udp_socket },
		{ "spawn-many-fds", test_spawn_many_fds },
		{ "netlink-socket", test_netlink_socket },
		{ "epoll-recreated", test_epoll_recreated },
		{ "netns-socket", test_netns_socket },
		{ "mntns-open", test_mntns_open },
		{ "ipcns-shm", test_ipcns_shm },
		{ "ipcns-msg", test_ipcns_msg },
		{ "ipcns-posix", test_ipcns_posix },
		{ "ipcns-sem", test_ipcns_sem },
		{ "template-nanosleep", test_template_nanosleep },
		{ "template-ptimers", test_template_ptimers },
		{ "template-prctls", test_template_prctls },
		{ "template-parent-death", test_template_parent_death },
		{ "template-creds", test_template_creds },
		{ "spawn-deleted-cwd", test_spawn_deleted_cwd },
		{ "template-shared-stack", test_template_shared_stack },
		{ "threads-recreated", test_threads },
		{ "stop-frozen-tree", test_stop_frozen_tree },
		{ "stop-frozen-edge-cases", test_stop_frozen_edge_cases },
		{ "template-start-abandoned", test_template_start_abandoned },
	};
	for (size_t i = 0; i < sizeof(tests) / sizeof(tests[0]); i++) {
		int before = failures;
		long long t0 = now_ms();

		if (!selected(tests[i].name, argc, argv))
			continue;
		tests[i].fn();
		fprintf(stderr, "%s %s (%lld ms)\n", failures == before ? "ok  " : "FAIL",
			tests[i].name, now_ms() - t0);
	}
	unlink(file_path);
	unlink(priv_path);
	munmap(shared_buf, BUF_SIZE);
	fprintf(stderr, "%d failure(s)\n", failures);
	return failures ? 1 : 0;
}
