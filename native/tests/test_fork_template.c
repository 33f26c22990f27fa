/* Tests for native/fork_template.c on real processes (needs root and ptrace).
 * Built with ASan/UBSan by native/tests/run.sh; exits non-zero if any check fails. */
#include "../fork_template.h"

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
#include <sys/mman.h>
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
	char path[64], buf[256];
	int fd;
	ssize_t n;

	snprintf(path, sizeof(path), "/proc/%d/syscall", (int)pid);
	fd = open(path, O_RDONLY);
	n = fd >= 0 ? read(fd, buf, sizeof(buf) - 1) : -1;
	if (fd >= 0)
		close(fd);
	if (n <= 0 || buf[0] < '0' || buf[0] > '9')
		return -1;	/* "running" or gone */
	buf[n] = '\0';
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
	char path[64], buf[256];
	int f;
	ssize_t n;

	snprintf(path, sizeof(path), "/proc/%d/fdinfo/%d", (int)pid, fd);
	f = open(path, O_RDONLY);
	if (f < 0)
		return -1;
	n = read(f, buf, sizeof(buf) - 1);
	close(f);
	if (n <= 0)
		return -1;
	buf[n] = '\0';
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

static void test_inject_read(void)
{
	int cmd[2], rep[2];
	pid_t pid;
	struct dbxcr_error err;
	struct read_report r;
	struct dbxcr_info info;

	current_test = "inject-read";
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
};

static unsigned char *shared_buf;	/* mapped before fork: same address in every copy */
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
static struct proc spawn_program(struct dbxcr_template *tpl, const pid_t *set_tid,
				 size_t n_tid, int mntns_fd, const char *cwd,
				 struct dbxcr_error *err)
{
	int cmd[2], rep[2];
	struct proc p;
	struct dbxcr_fdmap fds[2];
	struct dbxcr_file file = { FILE_FD, O_RDONLY, 10, file_path };
	struct dbxcr_spawn_opts o = { 0 };

	if (pipe2(cmd, O_CLOEXEC) < 0 || pipe2(rep, O_CLOEXEC) < 0)
		abort();
	fds[0] = (struct dbxcr_fdmap){ cmd[0], CMD_FD, 0 };
	fds[1] = (struct dbxcr_fdmap){ rep[1], REP_FD, 0 };
	o.mntns_fd = mntns_fd;
	o.cwd = cwd;
	o.files = &file;
	o.nfiles = 1;
	o.fds = fds;
	o.nfds = 2;
	o.set_tid = set_tid;
	o.set_tid_size = n_tid;
	p.pid = dbxcr_spawn(tpl, &o, err);
	close(cmd[0]);
	close(rep[1]);
	p.cmd = cmd[1];
	p.rep = rep[0];
	return p;
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

static void *idle_thread(void *arg)
{
	(void)arg;
	for (;;)
		pause();
	return NULL;
}

static void test_refuse_threads(void)
{
	struct dbxcr_error err;
	struct dbxcr_template *tpl;
	int ready[2];
	pid_t pid;
	char c;

	current_test = "refuse-threads";
	if (pipe(ready) < 0)
		abort();
	pid = fork();
	if (pid == 0) {
		pthread_t t;

		if (pthread_create(&t, NULL, idle_thread, NULL) != 0)
			_exit(1);
		if (write(ready[1], "x", 1) < 0)
			_exit(1);
		for (;;)
			pause();
	}
	close(ready[1]);
	CHECK(read_timeout(ready[0], &c, 1, 5000) == 0, "thread child not ready");
	tpl = dbxcr_make_template(pid, &err);
	CHECK(tpl == NULL && err.code == ENOTSUP && strstr(err.msg, "2 threads"),
	      "multi-threaded process: %s", tpl ? "templated!" : err.msg);
	if (tpl)
		dbxcr_release_template(tpl, &err);
	kill_reap(pid);
	close(ready[0]);
}

int main(void)
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
	if (shared_buf == MAP_FAILED)
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
		{ "inject-pause", test_inject_pause },
		{ "inject-pending-signal", test_inject_pending_signal },
		{ "inject-wait4", test_inject_wait4 },
		{ "inject-group-stopped", test_inject_group_stopped },
		{ "templates", test_templates },
		{ "spawn-mntns", test_spawn_mntns },
		{ "template-nanosleep", test_template_nanosleep },
		{ "refuse-threads", test_refuse_threads },
	};
	for (size_t i = 0; i < sizeof(tests) / sizeof(tests[0]); i++) {
		int before = failures;
		long long t0 = now_ms();

		tests[i].fn();
		fprintf(stderr, "%s %s (%lld ms)\n", failures == before ? "ok  " : "FAIL",
			tests[i].name, now_ms() - t0);
	}
	unlink(file_path);
	munmap(shared_buf, BUF_SIZE);
	fprintf(stderr, "%d failure(s)\n", failures);
	return failures ? 1 : 0;
}
