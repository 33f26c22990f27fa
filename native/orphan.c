/* A template that is init's child, not a child of its original's parent.
 *
 * A template forked with clone(CLONE_PARENT) (fork_template.c) is its original's sibling:
 * while a checkpoint holds it, the original's parent has one more child.  A parent that
 * waits for any child until none is left (python's `while True: os.wait()` until
 * ChildProcessError, perl's `1 while wait() != -1`) then waits for as long as the
 * checkpoint lives, and the template's end had to be hidden from that parent
 * (reap_unseen.c).  So when the parent is a live process other than an init, the template
 * is forked through an intermediate instead:
 *
 *  1. clone(CLONE_VM), exit signal 0, injected into the stopped original: the
 *     intermediate shares the original's memory (no page tables are copied), is
 *     auto-attached at its birth (PTRACE_O_TRACECLONE) and stops there before it runs an
 *     instruction;
 *  2. clone, exit signal 0, injected into the intermediate: the template, its child, a
 *     copy-on-write copy of that memory (the page-table copy any template costs; started
 *     here and collected by via_finish, so that it runs while the caller drives others);
 *  3. the intermediate is killed: the kernel hands its orphan to the pid namespace's init
 *     (or to the nearest child-subreaper ancestor) and sets the orphan's exit signal to
 *     SIGCHLD (reparent_leader), which what is spawned from the template with
 *     CLONE_PARENT takes;
 *  4. the intermediate's zombie, a "clone child" of the original (exit signal 0: no
 *     SIGCHLD was sent, and a wait without __WCLONE or __WALL does not see it), is reaped
 *     inside the original by an injected wait4(pid, __WCLONE | WNOHANG) before the
 *     original runs again.  The original, the intermediate and the template share a
 *     process group, so neither the exit nor the reparenting can orphan a group
 *     (kill_orphaned_pgrp compares the groups of parent and child).
 *
 * A task made by clone(CLONE_VM) gets no rseq registration and no sigaltstack (rseq_fork,
 * sas_ss_reset), so neither does the template forked from it: fork_template.c gives both
 * back to the template, the original's, when it maps the template's scratch page (before
 * any child or copy is forked from it, and off the checkpoint's freeze window).
 *
 * The template stays the original's sibling where the orphan's way would change nothing or
 * change too much: a parent that is an init (dbx-init, or the init of a pid namespace made
 * in the sandbox; the template is init's child either way), that is the caller (a program
 * templating its own children waits for them by pid: the C tests), or gone, and an exit
 * signal other than SIGCHLD (the orphan's would become SIGCHLD).
 */
#include "dbxcr_internal.h"

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

/* The intermediate runs no code of its own: no stack is needed, and none is given. */
static const long via_clone_args[6] = { CLONE_VM, 0, 0, 0, 0, 0 };
/* The template: a plain fork of the intermediate (exit signal 0 until reparented). */
static const long orphan_clone_args[6] = { 0, 0, 0, 0, 0, 0 };

/* Fields 4 (ppid) and 38 (exit_signal) of /proc/pid/stat; -1 if it cannot be read. */
static int parent_and_exit_signal(pid_t pid, pid_t *ppid, int *exit_signal)
{
	char path[64], buf[2048], *p, *save = NULL;
	int field = 3;

	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	if (read_small_file(path, buf, sizeof(buf)) < 0 || !(p = strrchr(buf, ')')))
		return -1;
	*ppid = 0;
	*exit_signal = -1;
	for (char *tok = strtok_r(p + 1, " ", &save); tok; tok = strtok_r(NULL, " ", &save)) {
		if (field == 4)
			*ppid = (pid_t)atoi(tok);
		if (field == 38) {
			*exit_signal = atoi(tok);
			return 0;
		}
		field++;
	}
	return -1;
}

bool orphan_wanted(pid_t pid)
{
	char path[64], status[8192];
	pid_t ppid;
	int exit_signal, depth;

	if (parent_and_exit_signal(pid, &ppid, &exit_signal) < 0 || exit_signal != SIGCHLD ||
	    ppid <= 1 || ppid == getpid())
		return false;
	snprintf(path, sizeof(path), "/proc/%d/status", (int)ppid);
	if (read_small_file(path, status, sizeof(status)) < 0)
		return false;
	depth = nspid_at(status, 0);
	return depth > 0 && nspid_at(status, depth) != 1;
}

/* Kill the intermediate and reap its zombie inside the original, so that nothing of it is
 * left; with err NULL (a failure path), quietly. */
static int via_end(struct tracee *orig, struct via *v, struct dbxcr_error *err)
{
	struct dbxcr_error ignored;
	long a[6] = { v->seen, 0, __WCLONE | WNOHANG, 0, 0, 0 }, got;

	if (!err)
		err = &ignored;
	if (v->t.pid <= 0)
		return 0;
	/* Reaped as its tracer first: wait_task_zombie then hands the zombie to its real
	 * parent, the original (do_notify_parent: exit signal 0, so no signal). */
	kill_traced(v->t.pid);
	v->t.pid = 0;
	if (remote_syscall(orig, SYS_wait4, a, &got, err) < 0)
		return -1;
	if (got != v->seen)
		return fail(err, got < 0 ? (int)-got : EPROTO, orig->pid,
			    "reaping the template's intermediate (%d there) in the process: wait4 "
			    "gave %ld", (int)v->seen, got);
	return 0;
}

int via_start(struct tracee *orig, struct via *v, struct dbxcr_error *err)
{
	long ret;

	memset(v, 0, sizeof(*v));
	orig->new_child = 0;
	if (remote_syscall(orig, SYS_clone, via_clone_args, &ret, err) < 0) {
		kill_traced(orig->new_child);
		return -1;
	}
	if (ret < 0)
		return fail(err, (int)-ret, orig->pid, "injected clone(CLONE_VM) (the template's "
			    "intermediate)");
	if (orig->new_child <= 0)
		return fail(err, EPROTO, orig->pid, "clone(CLONE_VM) returned %ld but no clone "
			    "event", ret);
	v->t.pid = orig->new_child;
	v->seen = (pid_t)ret;
	if (wait_birth(v->t.pid, err) < 0 || adopt(&v->t, v->t.pid, orig->site, err) < 0 ||
	    syscall_start(&v->t, SYS_clone, orphan_clone_args, err) < 0) {
		via_end(orig, v, NULL);
		return -1;
	}
	return 0;
}

pid_t via_finish(struct tracee *orig, struct via *v, struct dbxcr_error *err)
{
	long ret;
	pid_t child;

	if (syscall_finish(&v->t, SYS_clone, &ret, err) < 0 ||
	    (ret == -KERN_ERESTARTNOINTR &&	/* a SIGSTOP came: the kernel would re-run it */
	     remote_syscall(&v->t, SYS_clone, orphan_clone_args, &ret, err) < 0)) {
		kill_traced(v->t.new_child);
		via_end(orig, v, NULL);
		return -1;
	}
	child = v->t.new_child;
	if (ret < 0 || child <= 0) {
		kill_traced(child);
		via_end(orig, v, NULL);
		if (ret < 0)
			return fail(err, (int)-ret, orig->pid, "injected clone in the template's "
				    "intermediate %d", (int)v->seen);
		return fail(err, EPROTO, orig->pid, "clone returned %ld in the intermediate but "
			    "no clone event", ret);
	}
	if (via_end(orig, v, err) < 0) {
		kill_traced(child);
		return -1;
	}
	return child;
}
