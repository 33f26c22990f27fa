/* Tests for native/criu_incr.c on real processes (root, ptrace).  Built with ASan/UBSan by
 * native/tests/run.sh; the dumped process is native/tests/criu_target.c (no sanitizers),
 * exec'ed from here.  Exits non-zero if any check fails. */
#include "../criu_incr.h"
#include "test_util.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int failures;
static const char *current_test = "";
static char target_bin[4096];

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

static double ms_now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

struct proc {
	pid_t pid;
	int in, out;	/* our ends: its stdin, its stdout */
};

static pid_t start_target(const char *arg, struct proc *p)
{
	int a[2], b[2];
	pid_t pid;

	if (pipe2(a, O_CLOEXEC) < 0 || pipe2(b, O_CLOEXEC) < 0)
		return -1;
	pid = fork();
	if (pid == 0) {
		dup2(a[0], 0);
		dup2(b[1], 1);
		execl(target_bin, target_bin, arg, (char *)NULL);
		_exit(127);
	}
	close(a[0]);
	close(b[1]);
	p->pid = pid;
	p->in = a[1];
	p->out = b[0];
	return pid;
}

static int ask(struct proc *p, const char *cmd, char *reply, size_t len)
{
	size_t n = 0;

	if (write(p->in, cmd, strlen(cmd)) != (ssize_t)strlen(cmd))
		return -1;
	while (n + 1 < len) {
		struct pollfd pf = { p->out, POLLIN, 0 };
		char c;

		if (poll(&pf, 1, 10000) <= 0 || read(p->out, &c, 1) != 1)
			return -1;
		if (c == '\n')
			break;
		reply[n++] = c;
	}
	reply[n] = '\0';
	return 0;
}

/* Wait until pid blocks in read(2) (first field of /proc/pid/syscall is 0), twice. */
static void wait_in_read(pid_t pid)
{
	char buf[64];
	int seen = 0;

	for (int i = 0; i < 500 && seen < 2; i++) {
		ssize_t n = proc_read(pid, "syscall", buf, sizeof(buf));

		seen = (n > 1 && buf[0] == '0' && buf[1] == ' ') ? seen + 1 : 0;
		usleep(10000);
	}
}

static void rm_rf(const char *dir)
{
	DIR *d = opendir(dir);
	struct dirent *de;
	char p[4096];

	if (!d)
		return;
	while ((de = readdir(d)) != NULL) {
		if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
			continue;
		snprintf(p, sizeof(p), "%s/%s", dir, de->d_name);
		if (de->d_type == DT_DIR)
			rm_rf(p);
		else
			unlink(p);
	}
	closedir(d);
	rmdir(dir);
}

static void flip_byte(const char *path, off_t off)
{
	int fd = open(path, O_RDWR);
	unsigned char c;

	if (fd < 0 || pread(fd, &c, 1, off) != 1) {
		CHECK(0, "cannot open %s", path);
		if (fd >= 0)
			close(fd);
		return;
	}
	c ^= 0x40;
	if (pwrite(fd, &c, 1, off) != 1)
		CHECK(0, "cannot write %s", path);
	close(fd);
}

static void kill_wait(pid_t pid)
{
	if (pid > 0) {
		kill(pid, SIGKILL);
		waitpid(pid, NULL, 0);
	}
}

/* Spawn a child of tpl with fresh stdio pipes. */
static pid_t spawn_child(struct dbxcr_template *tpl, struct proc *p, struct dbxcr_error *err)
{
	int a[2], b[2];
	struct dbxcr_fdmap m[2];
	struct dbxcr_spawn_opts o = { .mntns_fd = -1, .pidns_fd = -1, .ns_pidfd = -1 };
	pid_t pid;

	if (pipe2(a, O_CLOEXEC) < 0 || pipe2(b, O_CLOEXEC) < 0)
		return -1;
	m[0] = (struct dbxcr_fdmap){ a[0], 0, 0 };
	m[1] = (struct dbxcr_fdmap){ b[1], 1, 0 };
	o.fds = m;
	o.nfds = 2;
	pid = dbxcr_spawn(tpl, &o, err);
	close(a[0]);
	close(b[1]);
	if (pid < 0) {
		close(a[1]);
		close(b[0]);
		return -1;
	}
	p->pid = pid;
	p->in = a[1];
	p->out = b[0];
	return pid;
}

static void close_proc(struct proc *p)
{
	if (p->in >= 0)
		close(p->in);
	if (p->out >= 0)
		close(p->out);
	p->in = p->out = -1;
}

static void test_dump_restore(const char *base)
{
	struct dbxcr_error err;
	struct dbxcr_dump_stats st1, st2;
	struct dbxcr_template *t1 = NULL, *t2 = NULL, *r = NULL;
	struct proc orig = { -1, -1, -1 }, host = { -1, -1, -1 }, ch = { -1, -1, -1 };
	char s0[128] = "", s1[128] = "", rep[128], da[1024], db[1024], path[4096];
	const long npages = 4096;	/* 16 MiB */
	int fa = -1, fb = -1, root = -1;

	current_test = "dump_restore";
	snprintf(da, sizeof(da), "%s/a", base);
	snprintf(db, sizeof(db), "%s/b", base);
	{
		char arg[32];

		snprintf(arg, sizeof(arg), "%ld", npages);
		if (start_target(arg, &orig) < 0) {
			CHECK(0, "start target");
			return;
		}
	}
	CHECK(ask(&orig, "s\n", s0, sizeof(s0)) == 0, "no answer from target");
	wait_in_read(orig.pid);
	t1 = dbxcr_make_template(orig.pid, &err);
	CHECK(t1 != NULL, "make_template: %s", err.msg);
	if (!t1)
		goto out;
	{
		double t0 = ms_now();

		CHECK(dbxcr_dump(t1, da, NULL, &st1, &err) == 0, "dump a: %s", err.msg);
		fprintf(stderr, "  full dump: %llu pages total, %llu written, %llu zero, %llu bytes, "
			"%.1f ms (%.1f)\n", (unsigned long long)st1.pages_total,
			(unsigned long long)st1.pages_written, (unsigned long long)st1.pages_zero,
			(unsigned long long)st1.bytes_written, st1.ms, ms_now() - t0);
	}
	CHECK(st1.pages_written >= (uint64_t)npages, "full dump wrote %llu pages",
	      (unsigned long long)st1.pages_written);
	CHECK(st1.depth == 0, "depth %d", st1.depth);
	/* the target dumps again fine after a change; only the changed pages are written */
	CHECK(ask(&orig, "m 100\n", rep, sizeof(rep)) == 0 && !strcmp(rep, "ok"), "mutate: %s", rep);
	CHECK(ask(&orig, "s\n", s1, sizeof(s1)) == 0, "no answer");
	CHECK(strcmp(s0, s1) != 0, "mutation did not change the sum");
	wait_in_read(orig.pid);
	t2 = dbxcr_make_template(orig.pid, &err);
	CHECK(t2 != NULL, "make_template 2: %s", err.msg);
	if (!t2)
		goto out;
	{
		struct dbxcr_dump_opts o = { .parent_path = da, .parent_ref = "../a" };

		CHECK(dbxcr_dump(t2, db, &o, &st2, &err) == 0, "dump b: %s", err.msg);
		fprintf(stderr, "  incremental dump: %llu pages total, %llu written, %llu from parent, "
			"%llu bytes, %.1f ms\n", (unsigned long long)st2.pages_total,
			(unsigned long long)st2.pages_written, (unsigned long long)st2.pages_parent,
			(unsigned long long)st2.bytes_written, st2.ms);
		CHECK(st2.depth == 1, "depth %d", st2.depth);
		CHECK(st2.pages_written >= 100 && st2.pages_written <= 100 + 24,
		      "incremental dump wrote %llu pages for 100 changed",
		      (unsigned long long)st2.pages_written);
		CHECK(dbxcr_dump(t2, db, &o, &st2, &err) < 0 && err.code == EEXIST,
		      "dump over an existing image: %s", err.msg);
	}
	dbxcr_release_template(t1, &err);
	dbxcr_release_template(t2, &err);
	t1 = t2 = NULL;
	kill_wait(orig.pid);
	close_proc(&orig);
	orig.pid = -1;

	/* Restore b into a template in a host process, spawn twice. */
	if (start_target("host", &host) < 0) {
		CHECK(0, "start host");
		goto out;
	}
	usleep(50000);
	fa = open(da, O_RDONLY | O_DIRECTORY);
	fb = open(db, O_RDONLY | O_DIRECTORY);
	root = open("/", O_RDONLY | O_DIRECTORY);
	CHECK(dbxcr_verify_image(fb, &err) == 0, "verify b: %s", err.msg);
	{
		double t0 = ms_now();

		r = dbxcr_restore_template(host.pid, fb, root, &err);
		fprintf(stderr, "  restore b: %.1f ms\n", ms_now() - t0);
	}
	CHECK(r != NULL, "restore b: %s", err.msg);
	if (!r)
		goto out;
	for (int i = 0; i < 2; i++) {
		if (spawn_child(r, &ch, &err) < 0) {
			CHECK(0, "spawn from restored template: %s", err.msg);
			break;
		}
		CHECK(ask(&ch, "s\n", rep, sizeof(rep)) == 0, "restored child %d did not answer",
		      ch.pid);
		{
			char cn[32], tn[32];

			/* the image keeps the program's name; the restored template is named apart */
			comm_of(ch.pid, cn);
			comm_of(dbxcr_template_pid(r), tn);
			CHECK(!strcmp(cn, "criu_target") && !strcmp(tn, "dbx-template"),
			      "names: child '%s', template '%s'", cn, tn);
		}
		{
			char args[4096];
			ssize_t n = cmdline_of(ch.pid, args, sizeof(args) - 1);

			/* and its command line; the restored template's is empty (disguise) */
			args[n > 0 ? n : 0] = '\0';
			CHECK(n > 0 && !strcmp(args, target_bin) &&
			      cmdline_of(dbxcr_template_pid(r), args, sizeof(args)) == 0,
			      "command lines: child '%s' (want '%s'), template not empty", args,
			      target_bin);
		}
		/* same memory; the command counter is one higher than at the checkpoint */
		CHECK(strncmp(rep, s1, 21) == 0, "restored sum '%s', expected '%s'", rep, s1);
		CHECK(strstr(rep, " 4 2.500") != NULL, "registers/stack state: '%s'", rep);
		CHECK(ask(&ch, "m 3\n", rep, sizeof(rep)) == 0 && !strcmp(rep, "ok"),
		      "restored child mutates: '%s'", rep);
		CHECK(ask(&ch, "q\n", rep, sizeof(rep)) < 0, "quit");
		close_proc(&ch);
		kill(ch.pid, SIGKILL);
	}
	dbxcr_release_template(r, &err);
	r = NULL;
	/* Restore the full image a too. */
	r = dbxcr_restore_template(host.pid, fa, root, &err);
	CHECK(r != NULL, "restore a: %s", err.msg);
	if (r && spawn_child(r, &ch, &err) > 0) {
		CHECK(ask(&ch, "s\n", rep, sizeof(rep)) == 0, "no answer");
		CHECK(strncmp(rep, s0, 21) == 0, "restored sum '%s', expected '%s'", rep, s0);
		close_proc(&ch);
		kill(ch.pid, SIGKILL);
	}
	dbxcr_release_template(r, &err);
	r = NULL;

	/* Corruption: a flipped byte in the parent's pages, in core.img; truncation. */
	current_test = "corruption";
	snprintf(path, sizeof(path), "%s/pages.img", da);
	flip_byte(path, 4096 * 3000 + 17);
	CHECK(dbxcr_verify_image(fb, &err) < 0 && err.code == EBADMSG, "verify b: %d %s", err.code,
	      err.msg);
	fprintf(stderr, "  detected: %s\n", err.msg);
	r = dbxcr_restore_template(host.pid, fb, root, &err);
	CHECK(r == NULL && err.code == EBADMSG, "restore corrupted b: %d %s", err.code, err.msg);
	dbxcr_release_template(r, &err);
	r = NULL;
	flip_byte(path, 4096 * 3000 + 17);
	CHECK(dbxcr_verify_image(fb, &err) == 0, "verify b after repair: %s", err.msg);
	snprintf(path, sizeof(path), "%s/core.img", db);
	flip_byte(path, 200);
	CHECK(dbxcr_verify_image(fb, &err) < 0 && err.code == EBADMSG, "core: %s", err.msg);
	fprintf(stderr, "  detected: %s\n", err.msg);
	flip_byte(path, 200);
	snprintf(path, sizeof(path), "%s/pagemap.img", db);
	{
		struct stat sb;

		if (stat(path, &sb) == 0 && truncate(path, sb.st_size - 8) == 0) {
			CHECK(dbxcr_verify_image(fb, &err) < 0 && err.code == EBADMSG, "pagemap: %s",
			      err.msg);
			fprintf(stderr, "  detected: %s\n", err.msg);
		}
	}
	snprintf(path, sizeof(path), "%s/pages.img", db);
	if (truncate(path, 4096) == 0) {
		r = dbxcr_restore_template(host.pid, fb, root, &err);
		CHECK(r == NULL && err.code == EBADMSG, "truncated pages: %s", err.msg);
		dbxcr_release_template(r, &err);
		r = NULL;
	}
out:
	if (t1)
		dbxcr_release_template(t1, &err);
	if (t2)
		dbxcr_release_template(t2, &err);
	if (r)
		dbxcr_release_template(r, &err);
	kill_wait(orig.pid);
	kill_wait(host.pid);
	close_proc(&orig);
	close_proc(&host);
	close_proc(&ch);
	if (fa >= 0)
		close(fa);
	if (fb >= 0)
		close(fb);
	if (root >= 0)
		close(root);
}

struct finish_arg {
	struct dbxcr_dump_job *job;
	struct dbxcr_dump_stats st;
	struct dbxcr_error err;
	int rc;
};

static void *finish_thread(void *arg)
{
	struct finish_arg *f = arg;

	f->rc = dbxcr_dump_finish(f->job, &f->st, &f->err);
	return NULL;
}

/* dbxcr_dump_begin on the owner thread, dbxcr_dump_finish on another thread while the
 * owner spawns from the template; abort leaves nothing; a template released before the
 * finish makes it fail without an image. */
static void test_dump_two_steps(const char *base)
{
	struct dbxcr_error err;
	struct dbxcr_template *t = NULL;
	struct dbxcr_dump_job *job = NULL;
	struct proc orig = { -1, -1, -1 }, ch = { -1, -1, -1 };
	struct finish_arg f = { 0 };
	char sum[128], rep[128], dc[1024], dd[1024], de[1024];
	pthread_t th;
	int fd;

	current_test = "dump_two_steps";
	snprintf(dc, sizeof(dc), "%s/c", base);
	snprintf(dd, sizeof(dd), "%s/d", base);
	snprintf(de, sizeof(de), "%s/e", base);
	if (start_target("2048", &orig) < 0) {
		CHECK(0, "start target");
		return;
	}
	CHECK(ask(&orig, "s\n", sum, sizeof(sum)) == 0, "no answer from target");
	wait_in_read(orig.pid);
	t = dbxcr_make_template(orig.pid, &err);
	CHECK(t != NULL, "make_template: %s", err.msg);
	if (!t)
		goto out;

	CHECK(dbxcr_dump_begin(t, dc, NULL, &f.job, &err) == 0, "begin c: %s", err.msg);
	if (f.job && pthread_create(&th, NULL, finish_thread, &f) == 0) {
		if (spawn_child(t, &ch, &err) > 0) {	/* meanwhile, on the owner thread */
			CHECK(ask(&ch, "s\n", rep, sizeof(rep)) == 0 && !strncmp(rep, sum, 21),
			      "child spawned during the finish: '%s'", rep);
			close_proc(&ch);
			kill_wait(ch.pid);
		} else {
			CHECK(0, "spawn during the finish: %s", err.msg);
		}
		pthread_join(th, NULL);
		CHECK(f.rc == 0, "finish c on another thread: %s", f.err.msg);
		CHECK(f.st.pages_written >= 2048, "finish c wrote %llu pages",
		      (unsigned long long)f.st.pages_written);
		fd = open(dc, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
		CHECK(fd >= 0 && dbxcr_verify_image(fd, &err) == 0, "verify c: %s", err.msg);
		if (fd >= 0)
			close(fd);
	}

	CHECK(dbxcr_dump_begin(t, dd, NULL, &job, &err) == 0, "begin d: %s", err.msg);
	dbxcr_dump_abort(job);
	job = NULL;
	CHECK(access(dd, F_OK) < 0 && errno == ENOENT, "aborted dump left %s", dd);
	CHECK(dbxcr_dump(t, dd, NULL, NULL, &err) == 0, "dump after an abort: %s", err.msg);

	CHECK(dbxcr_dump_begin(t, de, NULL, &job, &err) == 0, "begin e: %s", err.msg);
	dbxcr_release_template(t, &err);
	t = NULL;
	if (job) {
		CHECK(dbxcr_dump_finish(job, NULL, &err) < 0, "finish after release succeeded");
		fprintf(stderr, "  released before the finish: %s\n", err.msg);
		CHECK(access(de, F_OK) < 0 && errno == ENOENT, "failed dump left %s", de);
	}
out:
	dbxcr_release_template(t, &err);
	close_proc(&orig);
	kill_wait(orig.pid);
}

/* pid's state letter and parent (/proc/pid/stat); false if it is gone. */
static bool stat_of(pid_t pid, char *state, pid_t *ppid)
{
	char buf[512], *p;
	int pp;

	if (proc_read(pid, "stat", buf, sizeof(buf)) < 0)
		return false;
	p = strrchr(buf, ')');	/* comm may hold spaces */
	if (!p || sscanf(p + 2, "%c %d", state, &pp) != 2)
		return false;
	*ppid = pp;
	return true;
}

static pid_t ppid_of(pid_t pid)
{
	char state;
	pid_t ppid;

	return stat_of(pid, &state, &ppid) ? ppid : -1;
}

/* Whether pid exits within 5 s and stays a zombie of `parent` (which does not reap). */
static bool zombie_of(pid_t pid, pid_t parent)
{
	char state;
	pid_t ppid;

	for (int i = 0; i < 500 && stat_of(pid, &state, &ppid); i++) {
		if (state == 'Z')
			return ppid == parent;
		usleep(10000);
	}
	return false;
}

/* A free pid well above the ones in use (the kernel hands them out upwards), for set_tid. */
static int read_int(const char *path)
{
	char buf[32] = "";
	int fd = open(path, O_RDONLY | O_CLOEXEC);

	if (fd < 0)
		return -1;
	if (read(fd, buf, sizeof(buf) - 1) <= 0)
		buf[0] = '\0';
	close(fd);
	return atoi(buf);
}

static bool pid_free(pid_t p)
{
	char path[32];

	snprintf(path, sizeof(path), "/proc/%d", (int)p);
	return access(path, F_OK) < 0;
}

/* The first of three free pids well ahead of the last one given, below pid_max (clone3
 * fails with EINVAL above it: 32768 here, which the counter reaches in a long run) and
 * above the 300 the kernel skips when it wraps. */
static pid_t free_pid(void)
{
	int last = read_int("/proc/sys/kernel/ns_last_pid");
	int max = read_int("/proc/sys/kernel/pid_max");

	if (last <= 0 || max <= 1000)
		return -1;
	for (int i = 0; i < 1000; i++) {
		pid_t p = (pid_t)((last + 5000 + i) % (max - 3));

		if (p < 300)
			continue;
		if (pid_free(p) && pid_free(p + 1) && pid_free(p + 2))
			return p;
	}
	return -1;
}

/* Whether pid's /proc/pid/stat shows comm `comm` and wait status `status`. */
static bool exited_as(pid_t pid, const char *comm, int status)
{
	char buf[512], want[64], *p;

	if (proc_read(pid, "stat", buf, sizeof(buf)) < 0)
		return false;
	snprintf(want, sizeof(want), "(%s) Z ", comm);
	p = strrchr(buf, ' ');
	return strstr(buf, want) && p && atoi(p + 1) == status;
}

/* held_zombie: a held process gets back children that had exited and not been waited for
 * (zombies) with their pids, names and wait statuses, an exit code and a death by a
 * signal (SIGTERM, and SIGKILL, whose action cannot be set; no core dump); a status
 * with a core dump is refused, nothing made. */
static void test_held_zombie(void)
{
	struct dbxcr_error err;
	struct dbxcr_template *th = NULL;
	struct dbxcr_held *hp = NULL;
	struct proc host = { -1, -1, -1 };
	struct dbxcr_spawn_opts o = { .mntns_fd = -1, .pidns_fd = -1, .ns_pidfd = -1 };
	pid_t parent = -1, z1 = free_pid(), z2 = -1, z3 = -1, z4 = -1;

	current_test = "held_zombie";
	if (z1 <= 0 || start_target("host", &host) < 0) {
		CHECK(0, "a free pid (%d), the target", (int)z1);
		goto out;
	}
	z2 = z1 + 1;
	z3 = z1 + 2;
	z4 = z1 + 3;
	th = dbxcr_make_template(host.pid, &err);
	CHECK(th != NULL, "make_template: %s", err.msg);
	if (!th)
		goto out;
	parent = dbxcr_spawn_held(th, &o, &hp, &err);
	CHECK(parent > 0, "spawn_held: %s", err.msg);
	if (parent <= 0)
		goto out;
	CHECK(dbxcr_held_zombie(hp, z1, 7 << 8, "exited", &err) == 0, "exit 7: %s", err.msg);
	CHECK(dbxcr_held_zombie(hp, z2, SIGTERM, "killed", &err) == 0, "SIGTERM: %s", err.msg);
	CHECK(dbxcr_held_zombie(hp, z3, SIGSEGV | 0x80, "cored", &err) < 0 && err.code == EINVAL,
	      "a core dump's status: %d (%s)", err.code, err.msg);
	CHECK(dbxcr_held_zombie(hp, z4, SIGKILL, "timedout", &err) == 0, "SIGKILL: %s", err.msg);
	CHECK(zombie_of(z1, parent) && exited_as(z1, "exited", 7 << 8),
	      "pid %d: a zombie of %d, exited with 7", (int)z1, (int)parent);
	CHECK(zombie_of(z2, parent) && exited_as(z2, "killed", SIGTERM),
	      "pid %d: a zombie of %d, killed by SIGTERM", (int)z2, (int)parent);
	CHECK(zombie_of(z4, parent) && exited_as(z4, "timedout", SIGKILL),
	      "pid %d: a zombie of %d, killed by SIGKILL", (int)z4, (int)parent);
	CHECK(ppid_of(z3) < 0, "pid %d was made for a status it refused", (int)z3);
	CHECK(dbxcr_held_release(hp, &err) == 0, "release the parent: %s", err.msg);
	hp = NULL;
out:
	if (hp)
		dbxcr_held_kill(hp);
	kill_wait(parent);	/* its zombies go with it (reaped by init) */
	dbxcr_release_template(th, &err);
	kill_wait(host.pid);
	close_proc(&host);
}

/* Whether /proc/pid/fdinfo/fd has a line starting with `want`. */
static bool fdinfo_has(pid_t pid, int fd, const char *want)
{
	char path[64], line[256];
	bool found = false;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/fdinfo/%d", (int)pid, fd);
	f = fopen(path, "re");
	if (!f)
		return false;
	while (!found && fgets(line, sizeof(line), f))
		found = strncmp(line, want, strlen(want)) == 0;
	fclose(f);
	return found;
}

/* dbxcr_held_install_fd: an epoll instance of ours at fd 78 of the held parent, then a
 * pidfd of its adopted child at fd 77, close-on-exec, watched by it (cr/pidfds.py). */
static void check_install_fd(struct dbxcr_held *hp, pid_t parent, pid_t child)
{
	struct dbxcr_epoll_watch add = { 78, EPOLLIN, 42 };
	struct dbxcr_error err;
	char want[64];
	int ep = epoll_create1(EPOLL_CLOEXEC), pfd = (int)syscall(SYS_pidfd_open, child, 0);

	if (ep < 0 || pfd < 0) {
		CHECK(0, "epoll_create1 / pidfd_open: %s", strerror(errno));
	} else {
		CHECK(dbxcr_held_install_fd(hp, ep, 78, 0, NULL, 0, &err) == 0,
		      "install an epoll instance: %s", err.msg);
		CHECK(dbxcr_held_install_fd(hp, pfd, 77, 1, &add, 1, &err) == 0,
		      "install the pidfd: %s", err.msg);
		snprintf(want, sizeof(want), "Pid:\t%d", (int)child);
		CHECK(fdinfo_has(parent, 77, want), "fd 77 of the parent is no pidfd of %d",
		      (int)child);
		CHECK(fdinfo_has(parent, 77, "flags:\t02000002"), "fd 77: not O_RDWR|O_CLOEXEC");
		/* the kernel's format (fs/eventpoll.c: ep_show_fdinfo), which always adds
		 * EPOLLERR and EPOLLHUP */
		snprintf(want, sizeof(want), "tfd: %8d events: %8x data: %16llx", 77,
			 (unsigned)(EPOLLIN | EPOLLERR | EPOLLHUP), 42ULL);
		CHECK(fdinfo_has(parent, 78, want), "the epoll instance at fd 78 does not watch "
		      "fd 77");
		/* a watch of an fd it does not hold: refused, naming the step */
		add.fd = 79;
		CHECK(dbxcr_held_install_fd(hp, pfd, 76, 1, &add, 1, &err) < 0 &&
		      err.code == EBADF && strstr(err.msg, "epoll fd 79: watch fd 76"),
		      "a watch by a missing epoll fd: %s", err.msg);
	}
	if (ep >= 0)
		close(ep);
	if (pfd >= 0)
		close(pfd);
}

/* A memfd holding a copy of pid's memory [at, at + len), or -1. */
static int memfd_copy_of(pid_t pid, unsigned long at, size_t len)
{
	char path[64];
	char *buf = malloc(len);
	int mem, fd = -1;

	snprintf(path, sizeof(path), "/proc/%d/mem", (int)pid);
	mem = open(path, O_RDONLY | O_CLOEXEC);
	if (buf && mem >= 0 && pread(mem, buf, len, (off_t)at) == (ssize_t)len) {
		fd = memfd_create("remapped", MFD_CLOEXEC);
		if (fd >= 0 && write(fd, buf, len) != (ssize_t)len) {
			close(fd);
			fd = -1;
		}
	}
	if (mem >= 0)
		close(mem);
	free(buf);
	return fd;
}

/* A held process (spawned from a template, stopped) adopts a child restored from an image:
 * the child is the held process's own (its parent pid, and once it exits a zombie waiting
 * for that parent: the restored host sits in pause() and does not reap), with the
 * image's state.  live: the image only indexes the pages, which are copied from the
 * template given as the source; without that source it is refused, changing nothing.
 * Pages [64, 128) of its 256 are mapped afresh, shared, from a memfd holding their copy
 * (a remap, as the daemon maps a shared object it made again): the image's runs are cut
 * around them (skip_remapped), the pages on both sides still the image's (the hash and
 * the checksum agree), and the child writes through to the memfd. */
static void test_held_adopt(const char *base, bool live)
{
	struct dbxcr_error err;
	struct dbxcr_dump_stats st;
	struct dbxcr_template *tc = NULL, *th = NULL;
	struct dbxcr_held *hp = NULL, *hc = NULL;
	struct proc orig = { -1, -1, -1 }, host = { -1, -1, -1 }, ch = { -1, -1, -1 };
	char s0[128] = "", rep[128] = "", img[1024];
	int fi = -1, root = -1, a[2] = { -1, -1 }, b[2] = { -1, -1 }, shm = -1;
	unsigned long mem = 0;
	pid_t parent = -1, child = -1;

	current_test = live ? "held_adopt_live" : "held_adopt";
	snprintf(img, sizeof(img), "%s/%s", base, live ? "adopt-live" : "adopt");
	if (start_target("256", &orig) < 0 || start_target("host", &host) < 0) {
		CHECK(0, "start targets");
		goto out;
	}
	CHECK(ask(&orig, "a\n", rep, sizeof(rep)) == 0 && sscanf(rep, "at %lx", &mem) == 1,
	      "the target's memory: '%s'", rep);
	CHECK(ask(&orig, "s\n", s0, sizeof(s0)) == 0, "no answer from target");
	wait_in_read(orig.pid);
	shm = mem ? memfd_copy_of(orig.pid, mem + 64 * 4096, 64 * 4096) : -1;
	CHECK(shm >= 0, "the target's 256 pages (at %#lx) copied to a memfd", mem);
	if (shm < 0)
		goto out;
	tc = dbxcr_make_template(orig.pid, &err);
	CHECK(tc != NULL, "make_template: %s", err.msg);
	if (!tc)
		goto out;
	{
		struct dbxcr_dump_opts d = { .live = live };

		CHECK(dbxcr_dump(tc, img, &d, &st, &err) == 0, "dump: %s", err.msg);
		CHECK(!live || (st.pages_written == 0 && st.pages_total > 0),
		      "a live image copied %llu of %llu pages", (unsigned long long)st.pages_written,
		      (unsigned long long)st.pages_total);
	}
	th = dbxcr_make_template(host.pid, &err);
	CHECK(th != NULL, "make_template of the host: %s", err.msg);
	if (!th)
		goto out;
	{
		struct dbxcr_spawn_opts o = { .mntns_fd = -1, .pidns_fd = -1, .ns_pidfd = -1 };

		parent = dbxcr_spawn_held(th, &o, &hp, &err);
	}
	CHECK(parent > 0, "spawn_held: %s", err.msg);
	if (parent <= 0)
		goto out;
	fi = open(img, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	root = open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (fi < 0 || root < 0 || pipe2(a, O_CLOEXEC) < 0 || pipe2(b, O_CLOEXEC) < 0) {
		CHECK(0, "open the image, the root, pipes");
		goto out;
	}
	{
		struct dbxcr_fdmap m[2] = { { a[0], 0, 0 }, { b[1], 1, 0 } };
		struct dbxcr_remap r = { .start = mem + 64 * 4096, .end = mem + 128 * 4096,
					 .prot = PROT_READ | PROT_WRITE, .src = shm };
		struct dbxcr_spawn_opts o = { .mntns_fd = -1, .pidns_fd = -1, .ns_pidfd = -1,
					      .fds = m, .nfds = 2, .remaps = &r, .nremaps = 1 };

		if (live) {
			pid_t none = dbxcr_held_adopt(hp, fi, root, NULL, &o, &hc, &err);

			CHECK(none < 0 && err.code == EBADMSG && hc == NULL,
			      "a live image without its template: %d (%s)", (int)none, err.msg);
		}
		child = dbxcr_held_adopt(hp, fi, root, live ? tc : NULL, &o, &hc, &err);
	}
	CHECK(child > 0, "held_adopt: %s", err.msg);
	if (child <= 0)
		goto out;
	CHECK(ppid_of(child) == parent, "the adopted child's parent is %d, not %d",
	      (int)ppid_of(child), (int)parent);
	if (!live)
		check_install_fd(hp, parent, child);
	CHECK(dbxcr_held_release(hc, &err) == 0, "release the child: %s", err.msg);
	hc = NULL;
	CHECK(dbxcr_held_release(hp, &err) == 0, "release the parent: %s", err.msg);
	hp = NULL;
	ch = (struct proc){ child, a[1], b[0] };
	a[1] = b[0] = -1;
	{
		char sum0[64] = "", sum[64] = "";
		unsigned n0 = 0, n = 0;

		/* the same state, one command later: "sum <hex> <commands> <xmm>" */
		CHECK(ask(&ch, "s\n", rep, sizeof(rep)) == 0 &&
		      sscanf(s0, "sum %63s %u", sum0, &n0) == 2 &&
		      sscanf(rep, "sum %63s %u", sum, &n) == 2 && !strcmp(sum, sum0) &&
		      n == n0 + 1, "the adopted child answers '%s', the original '%s'", rep, s0);
	}
	{
		/* "m 100", its 4th command (a, s; s, m), adds 4 to word p of each page p < 100 */
		uint64_t before = 0, after = 0;
		off_t at = (70 - 64) * 4096 + 70 * 8;

		CHECK(pread(shm, &before, 8, at) == 8 && ask(&ch, "m 100\n", rep, sizeof(rep)) == 0 &&
		      pread(shm, &after, 8, at) == 8 && after == before + 4,
		      "the remapped page 70 reads %#llx then %#llx through the memfd",
		      (unsigned long long)before, (unsigned long long)after);
	}
	CHECK(write(ch.in, "q\n", 2) == 2, "ask the child to exit");
	CHECK(zombie_of(child, parent), "the adopted child %d did not wait for its parent %d "
	      "to reap it", (int)child, (int)parent);
out:
	if (hc)
		dbxcr_held_kill(hc);
	if (hp)
		dbxcr_held_kill(hp);
	kill_wait(parent);	/* our child: a spawn is its template's sibling */
	dbxcr_release_template(tc, &err);
	dbxcr_release_template(th, &err);
	kill_wait(orig.pid);
	kill_wait(host.pid);
	close_proc(&orig);
	close_proc(&host);
	close_proc(&ch);
	for (int i = 0; i < 2; i++) {
		if (a[i] >= 0)
			close(a[i]);
		if (b[i] >= 0)
			close(b[i]);
	}
	if (fi >= 0)
		close(fi);
	if (root >= 0)
		close(root);
	if (shm >= 0)
		close(shm);
}

/* A held chain: the small parent's image copied in place, the big child its template's
 * copy-on-write copy, a child of the parent; both answer as their originals did. */
static void test_held_chain(const char *base)
{
	struct dbxcr_error err;
	struct dbxcr_dump_stats st;
	struct dbxcr_template *tp = NULL, *tc = NULL;
	struct dbxcr_held *out[2] = { NULL, NULL };
	struct proc op = { -1, -1, -1 }, oc = { -1, -1, -1 };
	struct proc np = { -1, -1, -1 }, nc = { -1, -1, -1 };
	char sp0[128] = "", sc0[128] = "", rep[128], img[1024];
	int fi = -1, root = -1, pa[2] = { -1, -1 }, pb[2] = { -1, -1 };
	int ca[2] = { -1, -1 }, cb[2] = { -1, -1 };
	pid_t parent = -1, child = -1;

	current_test = "held_chain";
	snprintf(img, sizeof(img), "%s/chain", base);
	if (start_target("16", &op) < 0 || start_target("2048", &oc) < 0) {
		CHECK(0, "start targets");
		goto out;
	}
	CHECK(ask(&op, "s\n", sp0, sizeof(sp0)) == 0, "no answer from the parent target");
	CHECK(ask(&oc, "s\n", sc0, sizeof(sc0)) == 0, "no answer from the child target");
	wait_in_read(op.pid);
	wait_in_read(oc.pid);
	tp = dbxcr_make_template(op.pid, &err);
	CHECK(tp != NULL, "make_template of the parent: %s", err.msg);
	tc = dbxcr_make_template(oc.pid, &err);
	CHECK(tc != NULL, "make_template of the child: %s", err.msg);
	if (!tp || !tc)
		goto out;
	{
		struct dbxcr_dump_opts d = { .live = 1 };

		CHECK(dbxcr_dump(tp, img, &d, &st, &err) == 0, "live image: %s", err.msg);
	}
	fi = open(img, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	root = open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (fi < 0 || root < 0 || pipe2(pa, O_CLOEXEC) < 0 || pipe2(pb, O_CLOEXEC) < 0 ||
	    pipe2(ca, O_CLOEXEC) < 0 || pipe2(cb, O_CLOEXEC) < 0) {
		CHECK(0, "open the image, the root, pipes");
		goto out;
	}
	{
		struct dbxcr_fdmap pm[2] = { { pa[0], 0, 0 }, { pb[1], 1, 0 } };
		struct dbxcr_fdmap cm[2] = { { ca[0], 0, 0 }, { cb[1], 1, 0 } };
		struct dbxcr_spawn_opts po = { .mntns_fd = -1, .pidns_fd = -1, .ns_pidfd = -1,
					       .fds = pm, .nfds = 2 };
		struct dbxcr_spawn_opts co = { .mntns_fd = -1, .pidns_fd = -1, .ns_pidfd = -1,
					       .fds = cm, .nfds = 2 };
		const struct dbxcr_template *srcs[1] = { tp };

		char stub[4096];
		const char *slash = strrchr(target_bin, '/');
		int dir = slash ? (int)(slash - target_bin) + 1 : 0;
		int exe;

		/* exec_stub is built beside the target (run.sh) */
		snprintf(stub, sizeof(stub), "%.*sexec_stub", dir, target_bin);
		exe = open(stub, O_RDONLY | O_CLOEXEC);
		CHECK(exe >= 0, "open %s", stub);
		parent = dbxcr_held_chain(tc, 1, &po, &fi, srcs, root, exe, &co, out, &err);
		if (exe >= 0)
			close(exe);
	}
	CHECK(parent > 0 && out[0] && out[1], "held_chain: %s", err.msg);
	if (parent <= 0)
		goto out;
	child = dbxcr_held_pid(out[1]);
	CHECK(ppid_of(child) == parent, "the child's parent is %d, not %d",
	      (int)ppid_of(child), (int)parent);
	CHECK(dbxcr_held_release(out[1], &err) == 0, "release the child: %s", err.msg);
	out[1] = NULL;
	CHECK(dbxcr_held_release(out[0], &err) == 0, "release the parent: %s", err.msg);
	out[0] = NULL;
	np = (struct proc){ parent, pa[1], pb[0] };
	nc = (struct proc){ child, ca[1], cb[0] };
	pa[1] = pb[0] = ca[1] = cb[0] = -1;
	{
		char sum0[64] = "", sum[64] = "";
		unsigned n0 = 0, n = 0;

		CHECK(ask(&nc, "s\n", rep, sizeof(rep)) == 0 &&
		      sscanf(sc0, "sum %63s %u", sum0, &n0) == 2 &&
		      sscanf(rep, "sum %63s %u", sum, &n) == 2 && !strcmp(sum, sum0) &&
		      n == n0 + 1, "the child answers '%s', its original '%s'", rep, sc0);
		CHECK(ask(&np, "s\n", rep, sizeof(rep)) == 0 &&
		      sscanf(sp0, "sum %63s %u", sum0, &n0) == 2 &&
		      sscanf(rep, "sum %63s %u", sum, &n) == 2 && !strcmp(sum, sum0) &&
		      n == n0 + 1, "the parent answers '%s', its original '%s'", rep, sp0);
	}
	CHECK(write(nc.in, "q\n", 2) == 2, "ask the child to exit");
	CHECK(zombie_of(child, parent), "the child %d did not wait for its parent %d to reap it",
	      (int)child, (int)parent);
out:
	if (out[1])
		dbxcr_held_kill(out[1]);
	if (out[0])
		dbxcr_held_kill(out[0]);
	kill_wait(parent);	/* our child: born from the child's template, our child's sibling */
	dbxcr_release_template(tp, &err);
	dbxcr_release_template(tc, &err);
	kill_wait(op.pid);
	kill_wait(oc.pid);
	close_proc(&op);
	close_proc(&oc);
	close_proc(&np);
	close_proc(&nc);
	for (int i = 0; i < 2; i++) {
		int *fds[4] = { pa, pb, ca, cb };

		for (int j = 0; j < 4; j++)
			if (fds[j][i] >= 0)
				close(fds[j][i]);
	}
	if (fi >= 0)
		close(fi);
	if (root >= 0)
		close(root);
}

static void test_hash(void)
{
	unsigned char buf[4096];
	uint64_t h1[2], h2[2];

	current_test = "hash";
	memset(buf, 0, sizeof(buf));
	dbxcr_hash128(buf, sizeof(buf), h1);
	buf[4095] = 1;
	dbxcr_hash128(buf, sizeof(buf), h2);
	CHECK(h1[0] != h2[0] && h1[1] != h2[1], "hash ignores a byte");
	dbxcr_hash128(buf, 4095, h2);
	CHECK(h1[0] != h2[0], "hash ignores the length");
}

int main(int argc, char **argv)
{
	char base[] = "/tmp/dbxcr-img-XXXXXX";

	if (argc > 1)
		snprintf(target_bin, sizeof(target_bin), "%s", argv[1]);
	else
		snprintf(target_bin, sizeof(target_bin), "build/native-tests/criu_target");
	if (!mkdtemp(base)) {
		perror("mkdtemp");
		return 1;
	}
	test_hash();
	test_dump_restore(base);
	test_dump_two_steps(base);
	test_held_adopt(base, false);
	test_held_adopt(base, true);
	test_held_zombie();
	test_held_chain(base);
	rm_rf(base);
	if (failures) {
		fprintf(stderr, "test_criu_incr: %d failure(s)\n", failures);
		return 1;
	}
	fprintf(stderr, "test_criu_incr: all passed\n");
	return 0;
}
