/* Ending a task we trace (a template, a carrier or a keeper) without its parent seeing it.
 *
 * A template is its original's sibling (clone(CLONE_PARENT), fork_template.c), and so are
 * the carriers spawned from it: their real parent is the original's parent, a live process
 * of the sandbox until a rollback ends it (they are then orphans under the sandbox's init).
 * Since orphan.c a template whose original's parent is a live process other than an init
 * is init's child from the start; a live parent remains for one whose exit signal is not
 * SIGCHLD, and for an orphan taken by a child-subreaper ancestor (`tini -s`).
 * When we kill such a task and reap it as its tracer, wait_task_zombie() hands it to its
 * real parent (do_notify_parent with its exit signal): a zombie plus SIGCHLD.  A parent
 * that waits for any child then reaps a stranger killed by SIGKILL: PostgreSQL's
 * postmaster takes it for a crashed backend and restarts every server process, nginx
 * logs an alert, a parent that never waits for it keeps the zombie.
 *
 * So while that parent is a live process we hold it for the moment: stop it, every thread
 * (a stop handle, as a checkpoint's: dbxcr_stop_begin/wait; the SIGCHLD, sent to the
 * process, then waits in its queue for us), block its main thread's signals for our calls
 * (fork_template.c's file comment), note whether SIGCHLD is already pending for it, kill
 * and reap the task, reap the zombie the parent was handed with an injected wait4(pid,
 * WNOHANG | __WALL), take back the SIGCHLD the kernel queued (rt_sigtimedwait with a zero
 * timeout, its arguments on the parent's stack below the red zone, put back after) unless
 * one was pending before, and let the parent go with its registers, mask and any signal its
 * stop dequeued.  It ran nothing meanwhile; its wait, poll or sleep restarts as after any
 * ptrace stop.
 *
 * Otherwise the task ends as it always did and the parent sees it: an init (dbx-init, which
 * reaps anything), a parent traced (by us too: a process a checkpoint holds stopped),
 * stopped, in uninterruptible sleep (a vfork), or gone, or one that does not stop within
 * HOLD_MS (frozen: its stop would come only at the thaw, and the handle is left to
 * dbxcr_stop_sweep; the ptrace thread never waits on it).
 */
#include "dbxcr_internal.h"

#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define SIGCHLD_BIT (1ULL << (SIGCHLD - 1))
#define HOLD_MS 200	/* a live process stops in microseconds */

/* /proc/pid/status into buf; -1 if the process is gone. */
static int read_status(pid_t pid, char *buf, size_t len)
{
	char path[64];

	snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
	return read_small_file(path, buf, len) < 0 ? -1 : 0;
}

/* The NSpid entry at `level` (1: the host's pid namespace), 0 if none; level 0: how many
 * entries there are. */
pid_t nspid_at(const char *status, int level)
{
	const char *v = status_field(status, "NSpid");
	int i = 0;

	while (v) {
		char *next;
		long x = strtol(v, &next, 10);

		if (next == v || *v == '\n')
			break;
		if (++i == level)
			return (pid_t)x;
		v = next;
	}
	return level == 0 ? i : 0;
}

/* The parent worth holding while pid ends, or 0 (see the file comment); *seen: pid as that
 * parent names it (its pid namespace's number: a sandbox's process).  Reads two status
 * files: this runs for every release. */
static pid_t parent_to_hold(pid_t pid, pid_t *seen)
{
	char st[8192], pst[8192];
	const char *v;
	pid_t ppid;
	int depth;

	if (read_status(pid, st, sizeof(st)) < 0 || !(v = status_field(st, "PPid")))
		return 0;
	ppid = atoi(v);
	if (ppid <= 1 || ppid == getpid() || read_status(ppid, pst, sizeof(pst)) < 0)
		return 0;
	depth = nspid_at(pst, 0);
	if (depth == 0 || nspid_at(pst, depth) == 1)		/* an init */
		return 0;
	if (!(v = status_field(pst, "TracerPid")) || atoi(v) != 0)
		return 0;
	if (!(v = status_field(pst, "State")) || (v[strspn(v, " \t")] != 'S' &&
						  v[strspn(v, " \t")] != 'R'))
		return 0;
	*seen = nspid_at(st, depth);
	return *seen > 0 ? ppid : 0;
}

/* SIGCHLD pending for the stopped pid, in its main thread's queue or the process's. */
static bool sigchld_pending(pid_t pid)
{
	char status[8192];
	const char *v;
	uint64_t mask = 0;

	if (read_status(pid, status, sizeof(status)) < 0)
		return true;	/* unknown: then take nothing back */
	if ((v = status_field(status, "SigPnd")))
		mask |= strtoull(v, NULL, 16);
	if ((v = status_field(status, "ShdPnd")))
		mask |= strtoull(v, NULL, 16);
	return (mask & SIGCHLD_BIT) != 0;
}

/* SIGKILL pid and reap it as its tracer (its parent, if someone else, gets it next). */
static int kill_and_reap(pid_t pid, struct dbxcr_error *err)
{
	int status;

	if (kill(pid, SIGKILL) < 0 && errno != ESRCH)
		return fail(err, errno, pid, "kill (release)");
	for (;;) {
		pid_t r = waitpid(pid, &status, __WALL);

		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return errno == ECHILD ? 0 : fail(err, errno, pid, "reap (release)");
		if (WIFEXITED(status) || WIFSIGNALED(status))
			return 0;
	}
}

/* In the held parent p: take back the SIGCHLD just queued for it, its arguments on its
 * stack below the red zone (the bytes there put back after). */
static int take_back_on_stack(struct tracee *p, pid_t child, struct dbxcr_error *err)
{
	unsigned long at = (unsigned long)((p->regs.rsp - 128 - 64) & ~63ULL);
	unsigned char saved[64];
	struct dbxcr_error ignored;
	int rc;

	if (mem_read(p->pid, at, saved, sizeof(saved), err) < 0)
		return -1;
	rc = take_back_sigchld(p, at, child, err);
	if (mem_write(p->pid, at, saved, sizeof(saved), rc ? &ignored : err) < 0)
		rc = -1;
	return rc;
}

/* In the held parent p, once pid (`seen` there) is its zombie: reap it, and take back its
 * SIGCHLD. */
static int unseen_in_parent(struct tracee *p, pid_t pid, pid_t seen, bool was_pending,
			    struct dbxcr_error *err)
{
	long a[6] = { seen, 0, WNOHANG | __WALL, 0, 0, 0 };
	long got;

	/* -ECHILD: the parent ignores SIGCHLD, so the kernel reaped it (and sent nothing). */
	if (remote_syscall(p, SYS_wait4, a, &got, err) < 0)
		return -1;
	if (got != seen && got != -ECHILD)
		return fail(err, got < 0 ? (int)-got : EPROTO, p->pid,
			    "reaping %d in its parent: wait4 gave %ld", (int)pid, got);
	return was_pending ? 0 : take_back_on_stack(p, seen, err);
}

/* The parent stopped, every thread, or NULL. */
static struct dbxcr_stop *hold(pid_t parent)
{
	struct dbxcr_error ignored;
	struct dbxcr_stop *s;

	if (dbxcr_stop_begin(parent, &s, &ignored) < 0)
		return NULL;
	if (dbxcr_stop_wait(s, HOLD_MS, &ignored) < 0) {
		dbxcr_stop_abort(s);
		return NULL;
	}
	return s;
}

int reap_unseen(pid_t pid, struct dbxcr_error *err)
{
	struct dbxcr_error perr;
	pid_t seen = 0, parent = parent_to_hold(pid, &seen);
	struct dbxcr_stop *s = parent > 0 ? hold(parent) : NULL;
	struct tracee *p = s ? stop_for_calls(s, &perr) : NULL;
	bool was_pending = p && sigchld_pending(parent);
	int rc = kill_and_reap(pid, err);

	/* A failure here costs only the quiet: the parent sees the task end, as before. */
	if (p && rc == 0)
		unseen_in_parent(p, pid, seen, was_pending, &perr);
	if (s) {
		dbxcr_stop_resume(s, &perr);
		dbxcr_stop_abort(s);	/* frees it; resumes it if the above could not */
	}
	return rc;
}
