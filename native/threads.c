/* Threads of multi-threaded processes: what a checkpoint captures of each thread beyond the
 * memory fork() copies, and how a child spawned from the template gets its threads back.
 * x86_64 only.
 *
 * A template is a fork of the process's main thread: it holds the whole address space
 * (every thread's stack and TLS are in it) but only one thread.  Every other thread was
 * stopped with the main one (fork_template.c, dbxcr_stop_*), and its registers, FPU state
 * and mask saved; here we add what its kernel task holds and the memory does not:
 *  - clear_child_tid (set_tid_address): the word the kernel zeroes and futex-wakes when
 *    the thread exits, which pthread_join sleeps on.  Only the thread itself can read it
 *    (prctl(PR_GET_TID_ADDRESS)), so that call is injected into it, its result written to
 *    a few bytes of its own stack below the ABI's 128-byte red zone (saved first, put
 *    back after; a signal handler could have used them anyway);
 *  - its sigaltstack (only the thread can ask, injected the same way; the main thread's
 *    is copied by fork);
 *  - its robust futex list (get_robust_list(2) from outside; fork also drops the main
 *    thread's, so the main thread's is kept too), its rseq registration
 *    (PTRACE_GET_RSEQ_CONFIGURATION), its name, its tid in the sandbox's pid namespace;
 *  - its own signal queue (fork_template.c peeks it with the thread's stop);
 *  - its CPU affinity (sched_getaffinity(tid) from outside; set again from outside once
 *    the thread is made: the child is pinned next to us while we set it up, and a thread
 *    cloned then would stay pinned).
 *
 * In each child, once it is re-rooted, every thread is cloned again by an injected clone3
 * (CLONE_THREAD and the rest of pthread_create's flags, CLONE_CHILD_CLEARTID at its old
 * clear_child_tid, set_tid = its old tid: glibc caches each thread's tid in its TLS, so a
 * thread must come back with the same one).  The new thread is auto-attached (PTRACE_O_
 * TRACECLONE, inherited from the template) and stops before user mode; into it we inject
 * rseq, set_robust_list, sigaltstack, its name and its private signals, then write its
 * registers (fs_base: its TLS), FPU state and mask, and let it go with the main thread.
 *
 * Syscalls a thread was inside at the checkpoint restart by the rules in fork_template.c's
 * file comment, except one: -ERESTART_RESTARTBLOCK continues from the task's restart_block
 * (a futex wait, a poll or a relative sleep with a timeout), which a new thread does not
 * have (clone copies the creating thread's): such a call is executed again from the start
 * (restart_without_block), or, if it was restart_syscall itself (interrupted twice), it
 * returns EINTR.
 *
 * rseq: a thread stopped inside a restartable sequence is sent to its abort handler, as
 * the kernel does to a preempted one on its way back to user mode (a restored thread may
 * resume on another CPU, and the kernel knows nothing of the sequence it was in). */
#include <errno.h>
#include <linux/prctl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "dbxcr_internal.h"

/* <linux/ptrace.h> (which clashes with <sys/ptrace.h>): since Linux 5.13. */
#define DBX_PTRACE_GET_RSEQ_CONFIGURATION 0x420f
struct dbx_rseq_config {
	uint64_t rseq_abi_pointer;
	uint32_t rseq_abi_size;
	uint32_t signature;
	uint32_t flags;
	uint32_t pad;
};

/* struct rseq_cs of the rseq ABI: the critical section a thread is in, if any. */
struct dbx_rseq_cs {
	uint32_t version, flags;
	uint64_t start_ip, post_commit_offset, abort_ip;
};
#define RSEQ_CS_OFFSET 8	/* struct rseq: cpu_id_start, cpu_id, then rseq_cs */

#define STACK_OUT 64	/* bytes of a thread's stack an injected query writes to */

static int read_rseq(pid_t tid, struct thread_state *ts, struct dbxcr_error *err)
{
	struct dbx_rseq_config c = { 0 };

	if (ptrace(DBX_PTRACE_GET_RSEQ_CONFIGURATION, tid, (void *)sizeof(c), &c) < 0) {
		if (errno == EIO || errno == EINVAL)	/* a kernel without it: no rseq either */
			return 0;
		return fail(err, errno, tid, "PTRACE_GET_RSEQ_CONFIGURATION");
	}
	ts->rseq_ptr = c.rseq_abi_pointer;
	ts->rseq_len = c.rseq_abi_size;
	ts->rseq_sig = c.signature;
	return 0;
}

static int read_robust(pid_t tid, unsigned long *head, size_t *len, struct dbxcr_error *err)
{
	if (syscall(SYS_get_robust_list, tid, head, len) < 0)
		return fail(err, errno, tid, "get_robust_list");
	return 0;
}

/* The thread's name and its tid in its innermost pid namespace (NSpid's last field). */
static int read_task(pid_t tgid, struct thread_state *ts, struct dbxcr_error *err)
{
	char path[96], buf[4096], *p;

	snprintf(path, sizeof(path), "/proc/%d/task/%d/comm", (int)tgid, (int)ts->tid);
	if (read_small_file(path, buf, sizeof(buf)) < 0)
		return fail(err, errno, ts->tid, "read %s", path);
	buf[strcspn(buf, "\n")] = '\0';
	memcpy(ts->comm, buf, strnlen(buf, sizeof(ts->comm) - 1));	/* zeroed by the caller */
	snprintf(path, sizeof(path), "/proc/%d/task/%d/status", (int)tgid, (int)ts->tid);
	if (read_small_file(path, buf, sizeof(buf)) < 0)
		return fail(err, errno, ts->tid, "read %s", path);
	p = strstr(buf, "\nNSpid:");
	if (!p)
		return fail(err, ENOENT, ts->tid, "no NSpid in %s", path);
	p += strlen("\nNSpid:");
	for (char *next;; p = next) {
		long v = strtol(p, &next, 10);

		if (next == p)
			break;
		ts->nstid = (pid_t)v;
	}
	if (ts->nstid <= 0)
		return fail(err, EPROTO, ts->tid, "unreadable NSpid in %s", path);
	return 0;
}

/* query_on_stack where there is no stack below the red zone to borrow (a program running
 * on a small stack of its own): the answer goes to a page mapped for the call. */
static int query_on_page(struct tracee *t, long nr, long a[6], int outarg, void *out,
			 size_t len, const char *what, struct dbxcr_error *err)
{
	long m[6] = { 0, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0 };
	long u[6] = { 0, 4096, 0, 0, 0, 0 };
	struct dbxcr_error ignored;
	int rc = 0;

	u[0] = rsys(t, SYS_mmap, m, err, "%s: mmap a page for its answer", what);
	if (u[0] < 0)
		return -1;
	a[outarg] = u[0];
	if (rsys(t, nr, a, err, "%s", what) < 0 || mem_read(t->pid, (unsigned long)u[0], out,
							     len, err) < 0)
		rc = -1;
	if (rsys(t, SYS_munmap, u, rc ? &ignored : err, "%s: munmap its page", what) < 0)
		rc = -1;
	return rc;
}

int query_on_stack(struct tracee *t, long nr, const long args[6], int outarg,
		   void *out, size_t len, const char *what, struct dbxcr_error *err)
{
	unsigned long at = (unsigned long)((t->regs.rsp - 128 - STACK_OUT) & ~63ULL);
	unsigned char saved[STACK_OUT];
	struct dbxcr_error ignored;
	long a[6];
	int rc = 0;

	if (len > STACK_OUT)
		return fail(err, EINVAL, t->pid, "%s: an answer of %zu bytes", what, len);
	memcpy(a, args, sizeof(a));
	if (mem_read(t->pid, at, saved, sizeof(saved), &ignored) < 0)
		return query_on_page(t, nr, a, outarg, out, len, what, err);
	a[outarg] = (long)at;
	if (rsys(t, nr, a, err, "%s", what) < 0 || mem_read(t->pid, at, out, len, err) < 0)
		rc = -1;
	if (mem_write(t->pid, at, saved, sizeof(saved), rc ? &ignored : err) < 0)
		rc = -1;
	return rc;
}

int thread_capture(struct tracee *t, pid_t tgid, bool main, struct thread_state *out,
		   struct dbxcr_error *err)
{
	long a[6] = { PR_GET_TID_ADDRESS, 0, 0, 0, 0, 0 };

	out->tid = t->pid;
	out->affinity_known = sched_getaffinity(t->pid, sizeof(out->affinity), &out->affinity) == 0;
	if (read_task(tgid, out, err) < 0 || read_rseq(t->pid, out, err) < 0 ||
	    read_robust(t->pid, &out->robust_head, &out->robust_len, err) < 0)
		return -1;
	if (query_on_stack(t, SYS_prctl, a, 1, &out->clear_tid, sizeof(out->clear_tid),
			   "prctl(PR_GET_TID_ADDRESS)", err) < 0)
		return -1;
	out->altstack.ss_flags = SS_DISABLE;
	if (!main) {
		long s[6] = { 0 };

		if (query_on_stack(t, SYS_sigaltstack, s, 1, &out->altstack,
				   sizeof(out->altstack), "sigaltstack(NULL, &old)", err) < 0)
			return -1;
	}
	return 0;
}

int main_capture(pid_t pid, struct main_regs *m, struct dbxcr_error *err)
{
	struct thread_state ts = { 0 };

	if (read_rseq(pid, &ts, err) < 0 ||
	    read_robust(pid, &ts.robust_head, &ts.robust_len, err) < 0)
		return -1;
	main_from_thread(m, &ts);
	return 0;
}

void main_from_thread(struct main_regs *m, const struct thread_state *ts)
{
	m->clear_tid = ts->clear_tid;
	m->robust_head = ts->robust_head;
	m->robust_len = ts->robust_len;
	m->rseq_ptr = ts->rseq_ptr;
	m->rseq_len = ts->rseq_len;
	m->rseq_sig = ts->rseq_sig;
}

/* Without the task's restart_block, restart_syscall() would answer -EINTR (a new task's
 * block) and the program would see its sleep or wait cut short: a perl `sleep`, a C loop
 * that takes EINTR as "done".  -ERESTARTNOINTR makes the kernel put rax back to the call's
 * number and rip on its syscall instruction, so the call runs again with its arguments,
 * which are still in the registers.  A relative nanosleep or clock_nanosleep given a `rem`
 * pointer sleeps what the kernel wrote there when the sleep was interrupted (the time
 * left, counted from the restore); others wait their whole timeout again.  Absolute
 * sleeps never get here: the kernel restarts them with -ERESTARTNOHAND. */
void restart_without_block(struct user_regs_struct *regs)
{
	if ((long)regs->orig_rax < 0 || (long)regs->rax != -KERN_ERESTART_RESTARTBLOCK)
		return;
	if (regs->orig_rax == SYS_restart_syscall) {
		/* Interrupted a second time (an earlier checkpoint's stop sent it through
		 * restart_syscall): only the task's restart_block knows which call it restarts
		 * (a futex wait, a poll, a sleep), and the new task's restart_syscall() would run
		 * its creator's block instead (a poll of the main thread's descriptors, whose
		 * count glibc's futex wait took for an error and aborted: MariaDB).  The call
		 * returns EINTR, as the kernel answers a task whose block is gone and as each of
		 * those calls may return; callers wait again. */
		regs->rax = (unsigned long)-EINTR;
		regs->orig_rax = (unsigned long)-1;
		return;
	}
	if (regs->orig_rax == SYS_nanosleep && regs->rsi)
		regs->rdi = regs->rsi;
	else if (regs->orig_rax == SYS_clock_nanosleep && regs->r10)
		regs->rdx = regs->r10;
	regs->rax = (unsigned long)-KERN_ERESTARTNOINTR;
}

int rseq_fixup(pid_t tid, uint64_t rseq_ptr, struct user_regs_struct *regs,
	       struct dbxcr_error *err)
{
	struct dbx_rseq_cs cs;
	uint64_t at = 0;

	if (!rseq_ptr)
		return 0;
	if (mem_read(tid, (unsigned long)rseq_ptr + RSEQ_CS_OFFSET, &at, sizeof(at), err) < 0)
		return -1;
	if (!at)
		return 0;
	if (mem_read(tid, (unsigned long)at, &cs, sizeof(cs), err) < 0)
		return -1;
	if (regs->rip - cs.start_ip < cs.post_commit_offset)
		regs->rip = cs.abort_ip;
	return 0;
}

/* The sigaltstack `ss` set in the stopped thread c (scratch: a page of its address space
 * for the argument).  Injected calls run on no stack of the program's: sigaltstack refuses
 * to change a stack the caller's sp is on (a thread stopped in a handler on it). */
static int altstack_set(struct tracee *c, unsigned long scratch, const stack_t *ss,
			const char *who, struct dbxcr_error *err)
{
	stack_t v = *ss;
	unsigned long sp = c->regs.rsp;
	long a[6] = { (long)scratch, 0, 0, 0, 0, 0 };
	long rc;

	v.ss_flags &= ~SS_ONSTACK;	/* reported, not settable */
	if (mem_write(c->pid, scratch, &v, sizeof(v), err) < 0)
		return -1;
	c->regs.rsp = 0;
	rc = rsys(c, SYS_sigaltstack, a, err, "%s: sigaltstack", who);
	c->regs.rsp = sp;
	return rc < 0 ? -1 : 0;
}

int main_altstack(struct tracee *t, stack_t *out, struct dbxcr_error *err)
{
	long s[6] = { 0 };

	if (query_on_stack(t, SYS_sigaltstack, s, 1, out, sizeof(*out),
			   "sigaltstack(NULL, &old)", err) < 0)
		return -1;
	if (out->ss_flags & SS_DISABLE)
		out->ss_size = 0;
	return 0;
}

/* Into the new thread (stopped at its birth): its kernel registrations, name and private
 * signals, then its checkpointed registers, FPU state and mask (set when released). */
static int set_thread_up(struct tracee *nt, const struct dbxcr_template *tpl,
			 const struct thread_state *ts, struct dbxcr_error *err)
{
	unsigned long scratch = tpl->scratch;
	long a[6] = { 0 };

	/* Injected calls run on no stack of the program's: sigaltstack refuses to change a
	 * stack the caller's sp is on. */
	nt->regs.rsp = 0;
	if (ts->rseq_ptr) {
		long r[6] = { (long)ts->rseq_ptr, ts->rseq_len, 0, ts->rseq_sig, 0, 0 };

		if (rsys(nt, SYS_rseq, r, err, "thread %d: rseq", (int)ts->nstid) < 0)
			return -1;
	}
	if (ts->robust_head) {
		long r[6] = { (long)ts->robust_head, (long)ts->robust_len, 0, 0, 0, 0 };

		if (rsys(nt, SYS_set_robust_list, r, err, "thread %d: set_robust_list",
			 (int)ts->nstid) < 0)
			return -1;
	}
	if (!(ts->altstack.ss_flags & SS_DISABLE)) {
		char who[32];

		snprintf(who, sizeof(who), "thread %d", (int)ts->nstid);
		if (altstack_set(nt, scratch, &ts->altstack, who, err) < 0)
			return -1;
	}
	if (set_comm(nt, scratch, ts->comm, err) < 0)
		return -1;
	if (ts->pend.n) {
		long tgid, tid;

		a[0] = 0;
		tgid = rsys(nt, SYS_getpid, a, err, "getpid to queue pending signals");
		tid = tgid < 0 ? -1 : rsys(nt, SYS_gettid, a, err, "gettid to queue pending signals");
		if (tid < 0)
			return -1;
		/* Sent by the thread to itself, any si_code may be queued. */
		for (int i = 0; i < ts->pend.n; i++) {
			const siginfo_t *si = &ts->pend.info[i];
			long q[6] = { tgid, tid, si->si_signo, (long)scratch, 0, 0 };

			if (mem_write(nt->pid, scratch, si, sizeof(*si), err) < 0 ||
			    rsys(nt, SYS_rt_tgsigqueueinfo, q, err, "thread %d: queue pending "
				 "signal %d", (int)ts->nstid, si->si_signo) < 0)
				return -1;
		}
	}
	nt->regs = ts->regs;
	restart_without_block(&nt->regs);	/* see the file comment */
	nt->sigmask = ts->sigmask;
	nt->xstate = ts->xstate;	/* borrowed from the template: never freed here */
	nt->xstate_len = ts->xstate_len;
	nt->deferred_sig = 0;
	return 0;
}

/* clone3 one thread in the child c; *nt gets it, stopped at birth (nt->pid 0 if none). */
static int clone_thread(struct tracee *c, const struct dbxcr_template *tpl,
			const struct thread_state *ts, bool keep_tid, struct tracee *nt,
			struct dbxcr_error *err)
{
	struct dbx_clone_args ca = { 0 };
	long ret;
	pid_t want = ts->nstid;

	nt->pid = 0;
	ca.flags = CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD |
		   CLONE_SYSVSEM;
	if (ts->clear_tid) {
		ca.flags |= CLONE_CHILD_CLEARTID;
		ca.child_tid = ts->clear_tid;
	}
	if (remote_clone3(c, tpl->scratch, &ca, &want, keep_tid ? 1 : 0, &ret, err) < 0)
		return -1;
	if (ret == -EEXIST)
		return fail(err, EEXIST, c->pid, "thread %d: its tid is taken in the pid namespace",
			    (int)want);
	if (ret < 0)
		return fail(err, (int)-ret, c->pid, "clone3 of thread %d", (int)want);
	if (c->new_child <= 0)
		return fail(err, EPROTO, c->pid, "clone3 returned %ld but no clone event", ret);
	nt->pid = c->new_child;
	if (wait_birth(nt->pid, err) < 0)
		return -1;
	if (adopt(nt, nt->pid, c->site, err) < 0)
		return -1;
	return set_thread_up(nt, tpl, ts, err);
}

/* fork() gives the main thread no clear_child_tid and no robust list (the kernel's
 * copy_process clears both; glibc's fork() registers the robust list again in the child,
 * our injected clone does not), and a birth from a carrier (clone(CLONE_VM)) no rseq
 * registration either: glibc's sched_getcpu() would read a CPU number nobody updates. */
static int main_restore(struct tracee *c, const struct main_regs *m, unsigned long scratch,
			bool born, struct dbxcr_error *err)
{
	long a[6] = { 0 };

	if (born && m->rseq_ptr) {
		long r[6] = { (long)m->rseq_ptr, m->rseq_len, 0, m->rseq_sig, 0, 0 };

		if (rsys(c, SYS_rseq, r, err, "rseq") < 0)
			return -1;
	}
	if (born && m->altstack.ss_size && altstack_set(c, scratch, &m->altstack, "main thread",
							err) < 0)
		return -1;
	if (m->clear_tid) {
		a[0] = (long)m->clear_tid;
		if (rsys(c, SYS_set_tid_address, a, err, "set_tid_address") < 0)
			return -1;
	}
	if (m->robust_head) {
		a[0] = (long)m->robust_head;
		a[1] = (long)m->robust_len;
		if (rsys(c, SYS_set_robust_list, a, err, "set_robust_list") < 0)
			return -1;
	}
	return 0;
}

/* The main thread's rseq registration and sigaltstack, for a process born of one that
 * had neither: a CLONE_VM clone inherits neither (rseq_fork, sas_ss_reset), nor do its
 * later forks (dbxcr_held_chain). */
int main_reborn(struct tracee *c, const struct dbxcr_template *tpl, const stack_t *altstack,
		struct dbxcr_error *err)
{
	struct main_regs m = { .rseq_ptr = tpl->main.rseq_ptr, .rseq_len = tpl->main.rseq_len,
			       .rseq_sig = tpl->main.rseq_sig, .altstack = *altstack };

	return main_restore(c, &m, tpl->scratch, true, err);
}

int threads_recreate(struct tracee *c, const struct dbxcr_template *tpl, bool keep_tids,
		     bool born, struct tracee **out, struct dbxcr_error *err)
{
	const struct thread_set *set = tpl->threads;
	struct tracee *thr;
	int i;

	*out = NULL;
	if (main_restore(c, &tpl->main, tpl->scratch, born, err) < 0)
		return -1;
	if (!set)
		return 0;
	thr = calloc((size_t)set->n, sizeof(*thr));
	if (!thr)
		return fail(err, ENOMEM, c->pid, "allocate %d thread tracees", set->n);
	for (i = 0; i < set->n; i++)
		if (clone_thread(c, tpl, &set->t[i], keep_tids, &thr[i], err) < 0)
			break;
	if (i < set->n) {
		threads_kill(c->pid, thr, i + 1);
		free(thr);
		return -1;
	}
	*out = thr;
	return 0;
}

int threads_release(pid_t child, const struct dbxcr_template *tpl, struct tracee *thr,
		    struct dbxcr_error *err)
{
	int i, n = tpl->threads->n;

	for (i = 0; i < n; i++) {
		const struct thread_state *ts = &tpl->threads->t[i];

		if (ts->affinity_known &&
		    sched_setaffinity(thr[i].pid, sizeof(ts->affinity), &ts->affinity) < 0) {
			fail(err, errno, thr[i].pid, "thread %d: restoring its CPU affinity",
			     (int)ts->nstid);
			break;
		}
		if (restore_and_detach(&thr[i], err) < 0)
			break;
	}
	if (i < n)	/* the threads let go die with the group */
		threads_kill(child, thr + i, n - i);
	free(thr);	/* their xstate is the template's */
	return i < n ? -1 : 0;
}

void threads_kill(pid_t child, const struct tracee *thr, int n)
{
	kill(child, SIGKILL);
	/* Traced threads stay zombies until their tracer reaps them, and the group leader
	 * cannot be reaped before them. */
	for (int i = 0; i < n; i++) {
		int status;

		if (thr[i].pid <= 0)
			continue;
		for (;;) {
			pid_t r = waitpid(thr[i].pid, &status, __WALL);

			if (r < 0 && errno == EINTR)
				continue;
			if (r < 0 || WIFEXITED(status) || WIFSIGNALED(status))
				break;
		}
	}
	kill_traced(child);
}

struct thread_set *threads_dup(const struct thread_set *src)
{
	size_t size;
	struct thread_set *dst;

	if (!src)
		return NULL;
	size = sizeof(*src) + (size_t)src->n * sizeof(src->t[0]);
	dst = malloc(size);
	if (!dst)
		return NULL;
	memcpy(dst, src, size);
	for (int i = 0; i < src->n; i++) {
		dst->t[i].xstate = malloc(src->t[i].xstate_len);
		if (!dst->t[i].xstate) {
			dst->n = i;
			threads_free(dst);
			return NULL;
		}
		memcpy(dst->t[i].xstate, src->t[i].xstate, src->t[i].xstate_len);
	}
	return dst;
}

void threads_free(struct thread_set *set)
{
	if (!set)
		return;
	for (int i = 0; i < set->n; i++)
		free(set->t[i].xstate);
	free(set);
}
