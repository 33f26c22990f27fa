/* DeltaCR core: remote system calls by ptrace, process templates and children forked from
 * them.  x86_64 only.  See fork_template.h for the API and DESIGN.md sections 3 and 4b.
 *
 * How a system call is run inside a tracee
 * ----------------------------------------
 *  - PTRACE_SEIZE + PTRACE_INTERRUPT: the tracee stops in a PTRACE_EVENT_STOP trap taken
 *    inside get_signal(); unlike PTRACE_ATTACH no SIGSTOP is queued, so no group stop
 *    happens and the tracee's parent sees nothing (no CLD_STOPPED, nothing for WUNTRACED).
 *  - Registers (PTRACE_GETREGS), the FPU/xstate area (PTRACE_GETREGSET NT_X86_XSTATE) and
 *    the signal mask (PTRACE_GETSIGMASK, which returns saved_sigmask while a ppoll/pselect/
 *    sigsuspend temporary mask is installed) are saved.  While we work, every blockable
 *    signal is blocked with PTRACE_SETSIGMASK so signals arriving meanwhile stay pending
 *    for the program instead of interrupting our calls.
 *  - Syscall site: we execute the bytes 0f 05 found in the tracee's [vdso].  The vdso is
 *    mapped executable in every process of this kernel, is never written by the program,
 *    and any 0f 05 pair decodes as `syscall` when jumped to, so nothing in the tracee's
 *    memory is modified and nothing has to be cleaned up in the template's children
 *    (alternatives: poking `syscall; int3` over program text would have to be undone in
 *    every fork; mapping a stub page needs a syscall site first and leaves a mapping in
 *    every child).  If there is no vdso we fall back to the `syscall` the tracee is stopped
 *    after (rip - 2), which exists whenever it was interrupted inside a system call.
 *  - We set rip = site, rax = nr, args in rdi/rsi/rdx/r10/r8/r9, orig_rax = -1, and resume
 *    with PTRACE_SINGLESTEP.  With TF set the kernel reports the step at syscall exit
 *    (syscall_exit_work -> user_single_step_report -> SIGTRAP), so the tracee stops right
 *    after the syscall instruction in a SIGTRAP signal-delivery-stop, which we suppress.
 *    orig_rax = -1 tells the signal code that the stop it resumes from is not inside a
 *    system call, so our register image is never "restarted".
 *  - Restoring: every stop we ever leave a tracee in (the interrupt trap, the single-step
 *    SIGTRAP, a new child's first trap) is taken inside get_signal().  When such a tracee
 *    is resumed, get_signal() finds no signal and arch_do_signal_or_restart() applies the
 *    syscall restart rules to the *current* registers: if orig_rax >= 0 and rax is
 *    -ERESTARTSYS / -ERESTARTNOINTR / -ERESTARTNOHAND it sets rax = orig_rax and rip -= 2
 *    (the call is re-executed), and for -ERESTART_RESTARTBLOCK it sets rax =
 *    __NR_restart_syscall, rip -= 2 (continues from current->restart_block, e.g. nanosleep
 *    to its original deadline).  If a signal with a handler is delivered instead,
 *    handle_signal() turns them into -EINTR or a restart depending on SA_RESTART.  So
 *    writing back the *exact* saved registers (rax = -ERESTART*, orig_rax = nr, rip after
 *    the syscall) gives the program precisely the semantics it would have had without us;
 *    rewinding rip ourselves would be wrong (a handler run at that point would then
 *    restart a call that must return EINTR).  The same holds in forked children: fork
 *    copies restart_block with the task, and their last stop is also inside get_signal().
 *  - A signal the interrupt stop reported as a signal-delivery-stop has been dequeued; we
 *    keep its siginfo and hand it back at the final stop (PTRACE_SETSIGINFO + resume with
 *    that signal), after the mask is restored, so it is delivered exactly once.  An
 *    unblockable SIGSTOP arriving while we work is re-raised with tgkill.
 *
 * Templates and children
 * ----------------------
 *  - make_template injects clone(CLONE_PARENT) into the process: the template becomes a
 *    sibling (child of the process's parent, with the process's own exit signal), so the
 *    process itself can never wait for it or get SIGCHLD for it.  Where that parent is a
 *    live process other than an init, the template is made an orphan instead (init's
 *    child, forked through a short-lived intermediate: orphan.c), so that the parent
 *    never has it as a child either.  PTRACE_O_TRACECLONE
 *    auto-attaches the template at birth; a seized tracer's auto-attached child starts with
 *    a PTRACE_EVENT_STOP trap before ever returning to user mode, so it runs no program
 *    code.  It is then parked: all signals blocked, registers set to run exit_group(0) if it
 *    were ever resumed, and PTRACE_O_EXITKILL (inherited from the options set on the
 *    original) kills it if the tracer thread dies.  Its release keeps its end from that
 *    parent while the parent lives (reap_unseen.c).
 *  - spawn injects clone3(CLONE_PARENT, set_tid) into the template: the child is again a
 *    sibling, i.e. it takes the original's place under the same parent with the same exit
 *    signal (and with set_tid the same pid).  In the child, before it runs anything, we
 *    inject the re-rooting calls, then write back the checkpointed registers, xstate and
 *    signal mask and detach.
 *  - Pending signals: fork() does not copy them, so the signals queued for the original at
 *    its stop (PTRACE_PEEKSIGINFO, both queues, with their siginfo; plus a signal the stop
 *    had dequeued) are queued again in every child with rt_[tg]sigqueueinfo to itself
 *    while its mask is still all-blocked.  SIGKILL and SIGSTOP are not copied.
 *
 * Stopping a frozen tree at one instant (dbxcr_stop_*)
 * ---------------------------------------------------
 *  - A task frozen by the v1 freezer sleeps in TASK_FROZEN (in the refrigerator, or frozen
 *    in place in a freezable sleep such as nanosleep).  PTRACE_SEIZE works on it, and
 *    PTRACE_INTERRUPT sets JOBCTL_TRAP_STOP + TIF_SIGPENDING; its wake-up cannot wake a
 *    frozen task but marks the saved sleep state runnable, so at the thaw the task runs
 *    into get_signal(), which serves the pending trap before anything else: it reports
 *    PTRACE_EVENT_STOP without having run user code.  Hence begin never waits, and wait
 *    comes after the thaw.
 *  - Exception: a task frozen in place in a group stop (it reads as state D with wchan
 *    do_signal_stop).  The kernel re-traps a stopped task into a ptrace stop only when it
 *    is seized while in TASK_STOPPED; seized while frozen, it would go back to plain
 *    TASK_STOPPED at the thaw and never report.  We seize it in dbxcr_stop_wait instead
 *    (after the thaw; a stopped task runs nothing unless someone sends SIGCONT).
 *  - The seize sets no EXITKILL and no fork events: while it is only stopped, nothing of
 *    the tracee is changed and a dying tracer simply lets it go.  dbxcr_template_stopped
 *    sets them for the injected clone and puts registers, xstate, mask and options back
 *    right after, so the process sits at its stop exactly as it was until resumed.
 *  - A tracer can detach only a stopped tracee.  A handle aborted before its stop (still
 *    frozen) is kept in a list and detached by dbxcr_stop_sweep once it has stopped.
 *  - Descriptors from the caller (fresh stdio pipes, a mount namespace fd) reach the child
 *    through a socketpair created *in the child*: we take one end with pidfd_getfd(2) (the
 *    direction it supports), sendmsg SCM_RIGHTS on it, and the child recvmsg's them.  This
 *    works across pid and mount namespaces, unlike opening /proc/<our pid>/fd/N in the
 *    child (our pid and /proc are not visible inside a sandbox).
 */
#include "fork_template.h"

#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <pthread.h>
#include <time.h>
#include <netinet/in.h>
#include <linux/openat2.h>
#include <linux/prctl.h>
#include <sys/epoll.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/resource.h>
#include <sys/shm.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/user.h>
#include <sys/wait.h>
#include <unistd.h>

#if !defined(__x86_64__)
#error "fork_template.c supports x86_64 only"
#endif

#include "dbxcr_internal.h"

/* ---------- errors ---------- */

__attribute__((format(printf, 4, 5)))
int fail(struct dbxcr_error *err, int code, pid_t pid, const char *fmt, ...)
{
	char step[384];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(step, sizeof(step), fmt, ap);
	va_end(ap);
	if (err) {
		err->code = code;
		if (code)
			snprintf(err->msg, sizeof(err->msg), "pid %d: %s: %s", (int)pid, step,
				 strerror(code));
		else
			snprintf(err->msg, sizeof(err->msg), "pid %d: %s", (int)pid, step);
	}
	errno = code;
	return -1;
}

void clear_error(struct dbxcr_error *err)
{
	if (err) {
		err->code = 0;
		err->msg[0] = '\0';
	}
}

pid_t current_tid(void)
{
	return (pid_t)syscall(SYS_gettid);
}

/* ---------- /proc ---------- */

int read_small_file(const char *path, char *buf, size_t len)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	ssize_t n;
	size_t got = 0;

	if (fd < 0)
		return -1;
	while (got + 1 < len) {
		n = read(fd, buf + got, len - 1 - got);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		got += (size_t)n;
	}
	buf[got] = '\0';
	close(fd);
	return 0;
}

static int count_threads(pid_t pid)
{
	char path[64];
	DIR *d;
	struct dirent *de;
	int n = 0;

	snprintf(path, sizeof(path), "/proc/%d/task", (int)pid);
	d = opendir(path);
	if (!d)
		return -1;
	while ((de = readdir(d)) != NULL)
		if (de->d_name[0] != '.')
			n++;
	closedir(d);
	return n;
}

const char *status_field(const char *status, const char *name)
{
	size_t len = strlen(name);
	const char *p = status;

	while (p && *p) {
		if (strncmp(p, name, len) == 0 && p[len] == ':')
			return p + len + 1;
		p = strchr(p, '\n');
		if (p)
			p++;
	}
	return NULL;
}

int dbxcr_describe(pid_t pid, struct dbxcr_info *out, struct dbxcr_error *err)
{
	char path[64], status[8192];
	const char *v;

	clear_error(err);
	memset(out, 0, sizeof(*out));
	snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
	if (read_small_file(path, status, sizeof(status)) < 0)
		return fail(err, errno, pid, "read %s", path);
	out->threads = count_threads(pid);
	if (out->threads < 0)
		return fail(err, errno, pid, "list /proc/%d/task", (int)pid);
	if ((v = status_field(status, "State")))
		sscanf(v, " %c", &out->state);
	if ((v = status_field(status, "TracerPid")))
		out->tracer_pid = atoi(v);
	if ((v = status_field(status, "PPid")))
		out->ppid = atoi(v);
	if ((v = status_field(status, "Seccomp")))
		out->seccomp = atoi(v);
	if ((v = status_field(status, "NSpid"))) {
		const char *end = strchr(v, '\n');
		char *next;

		for (;;) {
			long x = strtol(v, &next, 10);

			if (next == v || (end && next > end))
				break;
			out->nspid = (int)x;
			out->nspid_depth++;
			v = next;
		}
	}
	return 0;
}

/* ---------- ptrace stops ---------- */

/* Wait for the next stop of a tracee; a tracee that exits or is killed is an error. */
int wait_stop(pid_t pid, int *status, struct dbxcr_error *err)
{
	for (;;) {
		pid_t r = waitpid(pid, status, __WALL);

		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return fail(err, errno, pid, "waitpid");
		if (WIFSTOPPED(*status))
			return 0;
		if (WIFEXITED(*status))
			return fail(err, ESRCH, pid, "exited with status %d while traced",
				    WEXITSTATUS(*status));
		if (WIFSIGNALED(*status))
			return fail(err, ESRCH, pid, "killed by signal %d while traced",
				    WTERMSIG(*status));
	}
}

static int stop_event(int status)
{
	return (unsigned)status >> 16;
}

/* A signal-delivery-stop for a signal other than our single-step trap: remember it so the
 * program still gets it.  Everything but SIGKILL/SIGSTOP is blocked while we work, so
 * apart from the attach stop this is only ever SIGSTOP. */
static int defer_signal(struct tracee *t, int sig, struct dbxcr_error *err)
{
	if (t->deferred_sig == 0) {
		if (ptrace(PTRACE_GETSIGINFO, t->pid, 0, &t->deferred_info) < 0)
			return fail(err, errno, t->pid, "PTRACE_GETSIGINFO for signal %d", sig);
		t->deferred_sig = sig;
		return 0;
	}
	if (t->nextra >= MAX_EXTRA_SIGS)
		return fail(err, EOVERFLOW, t->pid, "too many signals arrived while stopped");
	t->extra_sigs[t->nextra++] = sig;
	return 0;
}

/* ---------- memory ---------- */

int mem_write(pid_t pid, unsigned long addr, const void *buf, size_t len,
		     struct dbxcr_error *err)
{
	struct iovec local = { (void *)buf, len }, remote = { (void *)addr, len };
	ssize_t n = process_vm_writev(pid, &local, 1, &remote, 1, 0);

	if (n < 0)
		return fail(err, errno, pid, "write %zu bytes at %#lx", len, addr);
	if ((size_t)n != len)
		return fail(err, EIO, pid, "short write at %#lx (%zd of %zu)", addr, n, len);
	return 0;
}

int mem_read(pid_t pid, unsigned long addr, void *buf, size_t len,
		    struct dbxcr_error *err)
{
	struct iovec local = { buf, len }, remote = { (void *)addr, len };
	ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);

	if (n < 0)
		return fail(err, errno, pid, "read %zu bytes at %#lx", len, addr);
	if ((size_t)n != len)
		return fail(err, EIO, pid, "short read at %#lx (%zd of %zu)", addr, n, len);
	return 0;
}

/* Find the [vdso] mapping in /proc/pid/maps. */
int find_vdso(pid_t pid, unsigned long *start, unsigned long *end)
{
	char path[64], line[512];
	FILE *f;
	int found = -1;

	snprintf(path, sizeof(path), "/proc/%d/maps", (int)pid);
	f = fopen(path, "re");
	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f)) {
		if (strstr(line, "[vdso]") && sscanf(line, "%lx-%lx", start, end) == 2) {
			found = 0;
			break;
		}
	}
	fclose(f);
	if (found < 0)
		errno = ENOENT;
	return found;
}

/* Address of an executable `syscall` instruction in the tracee (see the file comment). */
int find_syscall_site(struct tracee *t, struct dbxcr_error *err)
{
	unsigned long start, end;

	if (find_vdso(t->pid, &start, &end) == 0 && end > start && end - start <= (1 << 20)) {
		size_t len = end - start;
		unsigned char *buf = malloc(len);
		char path[64];
		int fd;
		ssize_t n = -1;

		if (!buf)
			return fail(err, ENOMEM, t->pid, "allocate vdso copy");
		/* /proc/pid/mem reads with FOLL_FORCE, so it works on the r-x vdso. */
		snprintf(path, sizeof(path), "/proc/%d/mem", (int)t->pid);
		fd = open(path, O_RDONLY | O_CLOEXEC);
		if (fd >= 0) {
			n = pread(fd, buf, len, (off_t)start);
			close(fd);
		}
		for (ssize_t i = 0; n > 1 && i + 1 < n; i++) {
			if (buf[i] == 0x0f && buf[i + 1] == 0x05) {
				t->site = start + (unsigned long)i;
				free(buf);
				return 0;
			}
		}
		free(buf);
	}
	/* Interrupted inside a syscall: the instruction before rip is that syscall. */
	if ((long)t->regs.orig_rax >= 0) {
		errno = 0;
		long word = ptrace(PTRACE_PEEKTEXT, t->pid, t->regs.rip - 2, 0);

		if (errno == 0 && (word & 0xffff) == 0x050f) {
			t->site = t->regs.rip - 2;
			return 0;
		}
	}
	return fail(err, ENOEXEC, t->pid,
		    "no syscall instruction found (no [vdso] and not stopped in a syscall)");
}

/* ---------- attach / save / restore ---------- */

int save_xstate(pid_t pid, void **out, size_t *out_len, struct dbxcr_error *err)
{
	/* The kernel truncates to iov_len and reports the real size; SETREGSET later needs
	 * exactly that size (fpu_user_cfg.max_size). */
	size_t cap = 64 * 1024;
	void *buf = calloc(1, cap);
	struct iovec iov = { buf, cap };

	if (!buf)
		return fail(err, ENOMEM, pid, "allocate xstate buffer");
	if (ptrace(PTRACE_GETREGSET, pid, (void *)NT_X86_XSTATE, &iov) < 0) {
		int e = errno;

		free(buf);
		return fail(err, e, pid, "PTRACE_GETREGSET NT_X86_XSTATE");
	}
	*out = buf;
	*out_len = iov.iov_len;
	return 0;
}

int set_xstate(pid_t pid, void *xstate, size_t len, struct dbxcr_error *err)
{
	struct iovec iov = { xstate, len };

	if (ptrace(PTRACE_SETREGSET, pid, (void *)NT_X86_XSTATE, &iov) < 0)
		return fail(err, errno, pid, "PTRACE_SETREGSET NT_X86_XSTATE");
	return 0;
}

int set_sigmask(pid_t pid, uint64_t mask, struct dbxcr_error *err)
{
	if (ptrace(PTRACE_SETSIGMASK, pid, (void *)sizeof(mask), &mask) < 0)
		return fail(err, errno, pid, "PTRACE_SETSIGMASK");
	return 0;
}

/* Options for every tracee: fork events to auto-attach children, EXITKILL so nothing we
 * hold can run half-set-up registers if the tracer dies, and seccomp suspended so a filter
 * cannot veto (or kill the process for) an injected call. */
/* BASE_OPTIONS: see dbxcr_internal.h. */

/* Seize pid with opts, adding PTRACE_O_SUSPEND_SECCOMP when we may; *got receives the
 * options in effect (to set them again later with PTRACE_SETOPTIONS). */
int seize(pid_t pid, long opts, long *got, struct dbxcr_error *err)
{
	if (ptrace(PTRACE_SEIZE, pid, 0, (void *)(opts | PTRACE_O_SUSPEND_SECCOMP)) == 0) {
		*got = opts | PTRACE_O_SUSPEND_SECCOMP;
		return 0;
	}
	/* SUSPEND_SECCOMP needs CAP_SYS_ADMIN and CONFIG_CHECKPOINT_RESTORE; without it we
	 * can still work on processes that have no seccomp filter. */
	if (errno == EINVAL || errno == EPERM) {
		if (ptrace(PTRACE_SEIZE, pid, 0, (void *)opts) == 0) {
			*got = opts;
			return 0;
		}
	}
	if (errno == EPERM)
		return fail(err, EPERM, pid, "PTRACE_SEIZE (already traced, or not permitted)");
	return fail(err, errno, pid, "PTRACE_SEIZE");
}

/* Record the state of a stopped tracee that we must give back (nothing is changed). */
static int save_state(struct tracee *t, struct dbxcr_error *err)
{
	if (ptrace(PTRACE_GETREGS, t->pid, 0, &t->regs) < 0)
		return fail(err, errno, t->pid, "PTRACE_GETREGS");
	if (t->regs.cs != USER_CS_64)
		return fail(err, ENOEXEC, t->pid, "not a 64-bit process (cs=%#llx)",
			    (unsigned long long)t->regs.cs);
	if (save_xstate(t->pid, &t->xstate, &t->xstate_len, err) < 0)
		return -1;
	if (ptrace(PTRACE_GETSIGMASK, t->pid, (void *)sizeof(t->sigmask), &t->sigmask) < 0)
		return fail(err, errno, t->pid, "PTRACE_GETSIGMASK");
	return 0;
}

/* Before injecting: block every blockable signal so signals arriving meanwhile stay
 * pending for the program instead of interrupting our calls. */
int block_all(struct tracee *t, struct dbxcr_error *err)
{
	return set_sigmask(t->pid, ~0ULL, err);
}

/* Kinds of the first stop of a seized tracee (fork_template.h: enum dbxcr_stop_kind). */
static int classify_stop(struct tracee *t, int status, int *kind, struct dbxcr_error *err)
{
	int ev = stop_event(status), sig = WSTOPSIG(status);

	/* The PTRACE_EVENT_STOP trap (interrupt or group stop) and a signal-delivery-stop
	 * both happen in get_signal(). */
	t->in_get_signal = true;
	if (ev == PTRACE_EVENT_STOP) {
		*kind = sig == SIGTRAP ? DBXCR_STOP_INTERRUPT : DBXCR_STOP_GROUP;
		return 0;
	}
	if (ev == 0) {
		/* A signal was being delivered when we interrupted: it is out of the queue
		 * now, so keep it (the interrupt trap itself will follow on resume).  With
		 * no syscall tracing or single-step yet, even SIGTRAP here is a real signal. */
		*kind = DBXCR_STOP_SIGNAL;
		t->in_signal_stop = true;
		return defer_signal(t, sig, err);
	}
	return fail(err, EPROTO, t->pid, "unexpected first stop (status %#x)", status);
}

/* After the first stop: save what we must give back and find a syscall site (unless
 * known: a thread uses its main thread's, in the same address space). */
static int take_stop(struct tracee *t, int status, int *kind, struct dbxcr_error *err)
{
	if (classify_stop(t, status, kind, err) < 0 || save_state(t, err) < 0 ||
	    (!t->site && find_syscall_site(t, err) < 0))
		return -1;
	return 0;
}

/* Leave a tracee at its first stop, nothing changed, handing back a dequeued signal. */
void detach_unchanged(struct tracee *t)
{
	if (t->deferred_sig)
		ptrace(PTRACE_DETACH, t->pid, 0, (void *)(long)t->deferred_sig);
	else
		ptrace(PTRACE_DETACH, t->pid, 0, 0);
	free(t->xstate);
	t->xstate = NULL;
}

/* Attach with PTRACE_SEIZE, stop the tracee with PTRACE_INTERRUPT and block its signals. */
int attach(struct tracee *t, pid_t pid, struct dbxcr_error *err)
{
	int status, kind;
	long opts;

	memset(t, 0, sizeof(*t));
	t->pid = pid;
	if (seize(pid, BASE_OPTIONS, &opts, err) < 0)
		return -1;
	if (ptrace(PTRACE_INTERRUPT, pid, 0, 0) < 0) {
		fail(err, errno, pid, "PTRACE_INTERRUPT");
		ptrace(PTRACE_DETACH, pid, 0, 0);
		return -1;
	}
	if (wait_stop(pid, &status, err) < 0)
		return -1;
	if (take_stop(t, status, &kind, err) < 0 || block_all(t, err) < 0) {
		detach_unchanged(t);
		return -1;
	}
	return 0;
}

/* Take a tracee that is already stopped under our ptrace into a struct: a new child at its
 * birth trap, or a parked template at its last single-step stop (both in get_signal()). */
int adopt(struct tracee *t, pid_t pid, unsigned long site, struct dbxcr_error *err)
{
	memset(t, 0, sizeof(*t));
	t->pid = pid;
	t->site = site;
	t->in_get_signal = true;
	if (ptrace(PTRACE_GETREGS, pid, 0, &t->regs) < 0)
		return fail(err, errno, pid, "PTRACE_GETREGS");
	return 0;
}

static int remote_syscall_once(struct tracee *t, long nr, const long a[6], long *ret,
			       struct dbxcr_error *err);

/* Run one system call in a stopped tracee; see the file comment for the mechanism.
 * fork/clone return -ERESTARTNOINTR when a signal (here only an unblockable SIGSTOP) is
 * pending; the kernel would re-execute them, and so do we. */
int remote_syscall(struct tracee *t, long nr, const long a[6], long *ret,
			  struct dbxcr_error *err)
{
	for (int i = 0; i < 8; i++) {
		if (remote_syscall_once(t, nr, a, ret, err) < 0)
			return -1;
		if (*ret != -KERN_ERESTARTNOINTR)
			return 0;
	}
	return fail(err, EAGAIN, t->pid, "syscall %ld kept asking to be restarted", nr);
}

/* Start a system call in a stopped tracee and return at once: the tracee runs it (a fork
 * of a large process copies page tables for milliseconds, on another CPU) while the caller
 * drives other tracees.  syscall_finish collects it. */
int syscall_start(struct tracee *t, long nr, const long a[6], struct dbxcr_error *err)
{
	struct user_regs_struct r = t->regs;

	r.rip = t->site;
	r.rax = (unsigned long)nr;
	r.orig_rax = (unsigned long)-1;
	r.rdi = (unsigned long)a[0];
	r.rsi = (unsigned long)a[1];
	r.rdx = (unsigned long)a[2];
	r.r10 = (unsigned long)a[3];
	r.r8 = (unsigned long)a[4];
	r.r9 = (unsigned long)a[5];
	r.eflags &= ~0x100ULL;	/* TF: the kernel sets it for PTRACE_SINGLESTEP */
	if (ptrace(PTRACE_SETREGS, t->pid, 0, &r) < 0)
		return fail(err, errno, t->pid, "PTRACE_SETREGS for syscall %ld", nr);
	/* Always resume with SINGLESTEP: resuming a fork-event stop with PTRACE_CONT would
	 * drop the single-step and let the tracee run off. */
	if (ptrace(PTRACE_SINGLESTEP, t->pid, 0, 0) < 0)
		return fail(err, errno, t->pid, "PTRACE_SINGLESTEP for syscall %ld", nr);
	return 0;
}

int wait_trap(struct tracee *t, int how, struct user_regs_struct *r, struct dbxcr_error *err)
{
	const char *req = how == PTRACE_CONT ? "PTRACE_CONT" : "PTRACE_SINGLESTEP";
	int status;

	for (;;) {
		int sig, ev;

		if (wait_stop(t->pid, &status, err) < 0)
			return -1;
		sig = WSTOPSIG(status);
		ev = stop_event(status);
		if (ev == PTRACE_EVENT_FORK || ev == PTRACE_EVENT_VFORK || ev == PTRACE_EVENT_CLONE) {
			unsigned long msg;

			if (ptrace(PTRACE_GETEVENTMSG, t->pid, 0, &msg) < 0)
				return fail(err, errno, t->pid, "PTRACE_GETEVENTMSG");
			t->new_child = (pid_t)msg;
		} else if (ev == 0 && sig == SIGTRAP) {
			break;
		} else if (ev == 0 && defer_signal(t, sig, err) < 0) {
			return -1;
		}
		/* else PTRACE_EVENT_STOP: pending interrupt or group stop */
		if (ptrace((enum __ptrace_request)how, t->pid, 0, 0) < 0)
			return fail(err, errno, t->pid, "%s on the way to a trap", req);
	}
	t->in_signal_stop = true;
	t->in_get_signal = true;
	if (ptrace(PTRACE_GETREGS, t->pid, 0, r) < 0)
		return fail(err, errno, t->pid, "PTRACE_GETREGS at a trap");
	return 0;
}

/* Wait for the system call syscall_start began: its return value in *ret. */
int syscall_finish(struct tracee *t, long nr, long *ret, struct dbxcr_error *err)
{
	struct user_regs_struct r;

	if (wait_trap(t, PTRACE_SINGLESTEP, &r, err) < 0)
		return -1;
	if (r.rip != t->site + 2) {
		/* A successful exec returns into the new image, at its entry: the single-step
		 * trap comes there, before its first instruction (held_exec). */
		if (nr == SYS_execveat && r.rax == 0) {
			t->regs = r;
			*ret = 0;
			return 0;
		}
		return fail(err, EFAULT, t->pid, "syscall %ld: stopped at %#llx, expected %#lx",
			    nr, (unsigned long long)r.rip, t->site + 2);
	}
	*ret = (long)r.rax;
	return 0;
}

static int remote_syscall_once(struct tracee *t, long nr, const long a[6], long *ret,
			       struct dbxcr_error *err)
{
	if (syscall_start(t, nr, a, err) < 0)
		return -1;
	return syscall_finish(t, nr, ret, err);
}

/* remote_syscall that treats a negative return as an error named after the step. */
__attribute__((format(printf, 5, 6)))
long rsys(struct tracee *t, long nr, const long a[6], struct dbxcr_error *err,
		 const char *fmt, ...)
{
	long ret;
	char step[256];
	va_list ap;

	if (remote_syscall(t, nr, a, &ret, err) < 0)
		return -1;
	if (ret < 0 && ret > -4096) {
		va_start(ap, fmt);
		vsnprintf(step, sizeof(step), fmt, ap);
		va_end(ap);
		fail(err, (int)-ret, t->pid, "%s", step);
		return -1;
	}
	return ret;
}

/* Re-raise stop signals that arrived while we worked (mask is still all-blocked; SIGSTOP
 * is unblockable and will take effect on resume). */
static int reraise_extra(struct tracee *t, struct dbxcr_error *err)
{
	for (int i = 0; i < t->nextra; i++) {
		long a[6] = { 0 }, self;

		self = rsys(t, SYS_getpid, a, err, "getpid to re-raise signal");
		if (self < 0)
			return -1;
		a[0] = self;
		a[1] = self;
		a[2] = t->extra_sigs[i];
		if (rsys(t, SYS_tgkill, a, err, "re-raise signal %d", t->extra_sigs[i]) < 0)
			return -1;
	}
	t->nextra = 0;
	return 0;
}

/* The interrupted-syscall state a register image carries, if any (see the file comment):
 * orig_rax >= 0 says "stopped in a system call", rax says how the kernel will resume it. */
static const char *pending_restart(const struct user_regs_struct *r)
{
	if ((long)r->orig_rax < 0)
		return NULL;
	switch ((long)r->rax) {
	case -KERN_ERESTARTSYS:
		return "ERESTARTSYS";
	case -KERN_ERESTARTNOINTR:
		return "ERESTARTNOINTR";
	case -KERN_ERESTARTNOHAND:
		return "ERESTARTNOHAND";
	case -KERN_ERESTART_RESTARTBLOCK:
		return "ERESTART_RESTARTBLOCK";
	}
	return NULL;
}

/* Give back registers, xstate and mask; the tracee stays stopped. */
static int restore_state(struct tracee *t, struct dbxcr_error *err)
{
	const char *restart = pending_restart(&t->regs);

	/* The kernel applies the restart rules to these exact registers only when the task
	 * resumes from a stop inside get_signal(); from any other stop (e.g. a syscall-exit
	 * stop, which we never use) it would return -ERESTART* to the program. */
	if (restart && !t->in_get_signal)
		return fail(err, EPROTO, t->pid, "cannot restore a pending %s outside get_signal()",
			    restart);
	if (reraise_extra(t, err) < 0)
		return -1;
	if (set_sigmask(t->pid, t->sigmask, err) < 0)
		return -1;
	if (set_xstate(t->pid, t->xstate, t->xstate_len, err) < 0)
		return -1;
	if (ptrace(PTRACE_SETREGS, t->pid, 0, &t->regs) < 0)
		return fail(err, errno, t->pid, "PTRACE_SETREGS (restore)");
	return 0;
}

/* A child of a template whose origin sat in a job-control stop stops the same way once let
 * go: SIGSTOP handed back at the detach (detach_tracee) is delivered before any of its
 * code runs, and it enters the group stop (SIGSTOP whatever stopped the origin: a
 * SIGTSTP sent to an orphaned process group would be discarded).  Its parent sees it
 * stop again (SIGCHLD, CLD_STOPPED). */
static void stop_again(struct tracee *c, const struct dbxcr_template *tpl)
{
	if (!tpl->group_stop)
		return;
	memset(&c->deferred_info, 0, sizeof(c->deferred_info));
	c->deferred_info.si_signo = SIGSTOP;
	c->deferred_info.si_code = SI_USER;
	c->deferred_sig = SIGSTOP;
}

int dbxcr_template_group_stop(const struct dbxcr_template *tpl)
{
	return tpl->group_stop;
}

void dbxcr_template_set_group_stop(struct dbxcr_template *tpl, int stopped)
{
	tpl->group_stop = stopped != 0;
}

/* Detach; a dequeued signal is handed back through the current signal-delivery-stop. */
static int detach_tracee(struct tracee *t, struct dbxcr_error *err)
{
	long sig = 0;

	if (t->deferred_sig) {
		/* PTRACE_DETACH's signal is delivered only from a signal-delivery-stop; every
		 * injected call ends in one and the attach stop was one if we deferred. */
		if (!t->in_signal_stop)
			return fail(err, EINVAL, t->pid, "cannot hand back signal %d",
				    t->deferred_sig);
		if (ptrace(PTRACE_SETSIGINFO, t->pid, 0, &t->deferred_info) < 0)
			return fail(err, errno, t->pid, "PTRACE_SETSIGINFO");
		sig = t->deferred_sig;
	}
	if (ptrace(PTRACE_DETACH, t->pid, 0, (void *)sig) < 0)
		return fail(err, errno, t->pid, "PTRACE_DETACH");
	return 0;
}

int restore_and_detach(struct tracee *t, struct dbxcr_error *err)
{
	if (restore_state(t, err) < 0)
		return -1;
	return detach_tracee(t, err);
}

void tracee_free(struct tracee *t)
{
	free(t->xstate);
	t->xstate = NULL;
}

/* Kill a half-made child that we trace and reap what we can of it. */
void kill_traced(pid_t pid)
{
	int status;

	if (pid <= 0)
		return;
	kill(pid, SIGKILL);
	for (;;) {
		pid_t r = waitpid(pid, &status, __WALL);

		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0 || WIFEXITED(status) || WIFSIGNALED(status))
			break;
	}
}

/* ---------- public: single injection ---------- */

/* PTRACE_INTERRUPT only takes effect when the task next passes get_signal(): a task in
 * uninterruptible sleep (state D, e.g. a vfork parent waiting for its child, or stuck I/O)
 * would keep us in waitpid indefinitely, and a seized task can only be detached once
 * stopped.  Refuse those up front (racy, but it covers the long waits). */
static int check_stoppable(pid_t pid, const struct dbxcr_info *info, struct dbxcr_error *err)
{
	if (info->state == 'Z' || info->state == 'X')
		return fail(err, ESRCH, pid, "process is exiting (state %c)", info->state);
	if (info->state == 'D')
		return fail(err, EAGAIN, pid,
			    "process is in uninterruptible sleep (state D, e.g. vfork or I/O); "
			    "it cannot be stopped now");
	return 0;
}

int dbxcr_inject_syscall(pid_t pid, long nr, const long args[6], long *ret,
			 struct dbxcr_error *err)
{
	struct tracee t;
	int rc;

	struct dbxcr_info info;

	clear_error(err);
	if (dbxcr_describe(pid, &info, err) < 0 || check_stoppable(pid, &info, err) < 0)
		return -1;
	if (info.threads != 1)
		return fail(err, ENOTSUP, pid, "process has %d threads; injection supports "
			    "single-threaded processes only", info.threads);
	if (attach(&t, pid, err) < 0)
		return -1;
	rc = remote_syscall(&t, nr, args, ret, err);
	if (rc < 0) {
		/* Still try to give the process back its state; keep the first error. */
		struct dbxcr_error ignored;

		restore_and_detach(&t, &ignored);
	} else {
		rc = restore_and_detach(&t, err);
	}
	tracee_free(&t);
	return rc;
}

/* ---------- templates ---------- */

/* A process has one tracer; threads beyond the main one are captured one by one (fork()
 * copies only the calling thread: see threads.c), up to MAX_THREADS. */
static int check_untraced(pid_t pid, const struct dbxcr_info *info, struct dbxcr_error *err)
{
	if (info->threads > MAX_THREADS)
		return fail(err, ENOTSUP, pid, "process has %d threads; at most %d are captured",
			    info->threads, MAX_THREADS);
	if (info->tracer_pid != 0)
		return fail(err, EBUSY, pid, "already traced by pid %d", info->tracer_pid);
	return 0;
}

static int check_templatable(pid_t pid, struct dbxcr_error *err)
{
	struct dbxcr_info info;

	if (dbxcr_describe(pid, &info, err) < 0)
		return -1;
	if (check_untraced(pid, &info, err) < 0)
		return -1;
	return check_stoppable(pid, &info, err);
}

/* Wait for an auto-attached child's first stop (PTRACE_EVENT_STOP before user mode). */
int wait_birth(pid_t child, struct dbxcr_error *err)
{
	int status;

	if (wait_stop(child, &status, err) < 0)
		return -1;
	if (stop_event(status) != PTRACE_EVENT_STOP)
		return fail(err, EPROTO, child, "unexpected first stop (status %#x)", status);
	return 0;
}

/* Registers a parked template holds: were it ever resumed without us it would run
 * exit_group(0) at the syscall site instead of program code. */
void park_regs(struct dbxcr_template *tpl, const struct user_regs_struct *base)
{
	tpl->park = *base;
	tpl->park.rip = tpl->site;
	tpl->park.rax = SYS_exit_group;
	tpl->park.orig_rax = (unsigned long)-1;
	tpl->park.rdi = 0;
	tpl->park.eflags &= ~0x100ULL;
}

int park(struct dbxcr_template *tpl, struct dbxcr_error *err)
{
	if (ptrace(PTRACE_SETREGS, tpl->pid, 0, &tpl->park) < 0)
		return fail(err, errno, tpl->pid, "PTRACE_SETREGS (park template)");
	return 0;
}

/* Fork the template out of the stopped original (clone with CLONE_PARENT), in two steps:
 * the clone runs in the original (page tables copied on its CPU) between them.  An
 * orphan (orphan.c) is forked by an intermediate instead, in the same two steps. */
static const long template_clone_args[6] = { CLONE_PARENT, 0, 0, 0, 0, 0 };

static int fork_template_start(struct tracee *orig, struct via *via, struct dbxcr_error *err)
{
	if (via)
		return via_start(orig, via, err);
	orig->new_child = 0;
	return syscall_start(orig, SYS_clone, template_clone_args, err);
}

static pid_t fork_template_finish(struct tracee *orig, struct via *via, struct dbxcr_error *err)
{
	long ret;

	if (via)
		return via_finish(orig, via, err);
	if (syscall_finish(orig, SYS_clone, &ret, err) < 0 ||
	    (ret == -KERN_ERESTARTNOINTR &&	/* a SIGSTOP came: the kernel would re-run it */
	     remote_syscall(orig, SYS_clone, template_clone_args, &ret, err) < 0)) {
		kill_traced(orig->new_child);
		return -1;
	}
	if (ret < 0) {
		if (ret == -EINVAL)
			return fail(err, EINVAL, orig->pid,
				    "clone(CLONE_PARENT) refused: the process is the init of its "
				    "pid namespace, which cannot be templated");
		return fail(err, (int)-ret, orig->pid, "injected clone");
	}
	if (orig->new_child <= 0)
		return fail(err, EPROTO, orig->pid, "clone returned %ld but no fork event", ret);
	return orig->new_child;
}

/* Field numbers are 1-based, as in proc(5). */
int read_mm_bounds(pid_t pid, uint64_t mm[MM_BOUNDS], struct dbxcr_error *err)
{
	char path[64], buf[4096], *p;
	unsigned long long f[64];
	int n = 0;

	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	if (read_small_file(path, buf, sizeof(buf)) < 0)
		return fail(err, errno, pid, "read %s", path);
	p = strrchr(buf, ')');
	if (!p)
		return fail(err, EPROTO, pid, "parse %s", path);
	p += 2;			/* field 3 (state) */
	p = strchr(p, ' ');	/* skip state */
	/* f[k] = field k+4 */
	while (p && n < 60) {
		char *end;

		f[n] = strtoull(p, &end, 10);
		if (end == p)
			break;
		n++;
		p = end;
	}
	if (n < 48)
		return fail(err, EPROTO, pid, "%s has %d fields", path, n + 3);
#define FLD(k) f[(k) - 4]
	mm[0] = FLD(26);	/* start_code */
	mm[1] = FLD(27);	/* end_code */
	mm[2] = FLD(45);	/* start_data */
	mm[3] = FLD(46);	/* end_data */
	mm[4] = FLD(47);	/* start_brk */
	mm[MM_BRK] = 0;		/* brk: asked with brk(0) */
	mm[6] = FLD(28);	/* start_stack */
	mm[MM_ARG_START] = FLD(48);
	mm[MM_ARG_END] = FLD(49);
	mm[9] = FLD(50);	/* env_start */
	mm[10] = FLD(51);	/* env_end */
#undef FLD
	return 0;
}

void mm_map_of(const uint64_t mm[MM_BOUNDS], bool hide_args, struct prctl_mm_map *map)
{
	memset(map, 0, sizeof(*map));
	memcpy(map, mm, sizeof(uint64_t) * MM_BOUNDS);
	if (hide_args)
		map->arg_end = map->arg_start;
	map->exe_fd = (uint32_t)-1;	/* unchanged; auxv too (auxv_size 0) */
}

int set_mm_bounds(struct tracee *t, unsigned long scratch, const uint64_t mm[MM_BOUNDS],
		  bool hide_args, struct dbxcr_error *err)
{
	struct prctl_mm_map map;
	long a[6] = { PR_SET_MM, PR_SET_MM_MAP, (long)scratch, sizeof(map), 0, 0 };

	mm_map_of(mm, hide_args, &map);
	if (mem_write(t->pid, scratch, &map, sizeof(map), err) < 0)
		return -1;
	return rsys(t, SYS_prctl, a, err, "prctl(PR_SET_MM_MAP, args %#llx-%#llx)",
		    (unsigned long long)map.arg_start, (unsigned long long)map.arg_end) < 0 ? -1 : 0;
}

/* Empty the template's command line: /proc/pid/cmdline reads the argument area between
 * the mm's arg_start and arg_end, so with arg_end = arg_start it reads nothing and
 * `pgrep -f` / `pkill -f` in the sandbox never match the template (a `pkill -9 -f` would
 * otherwise lose the checkpoint's process state); ps shows it as [dbx-template].  Only
 * the mm's bounds change, never its memory.  PR_SET_MM_MAP needs no capability when the
 * exe file stays; it sets brk too, so brk(0) asks for the current one first. */
static int hide_args(struct dbxcr_template *tpl, struct tracee *t, unsigned long at,
		     struct dbxcr_error *err)
{
	long a[6] = { 0 }, brk;

	if (read_mm_bounds(tpl->pid, tpl->mm, err) < 0)
		return -1;
	brk = rsys(t, SYS_brk, a, err, "brk(0) in the template");
	if (brk < 0)
		return -1;
	tpl->mm[MM_BRK] = (uint64_t)brk;
	if (set_mm_bounds(t, at, tpl->mm, true, err) < 0)
		return -1;
	tpl->args_hidden = true;
	return 0;
}

/* Disguise the template: name it TEMPLATE_COMM, remembering its origin's name (fork copied
 * it) for its children, and empty its command line; the arguments pass through `at`,
 * DISGUISE_LEN writable bytes of the template. */
#define DISGUISE_LEN sizeof(struct prctl_mm_map)
static int disguise(struct dbxcr_template *tpl, struct tracee *t, unsigned long at,
		    struct dbxcr_error *err)
{
	char path[64];

	if (!tpl->comm[0]) {
		snprintf(path, sizeof(path), "/proc/%d/comm", (int)tpl->pid);
		if (read_small_file(path, tpl->comm, sizeof(tpl->comm)) < 0)
			return fail(err, errno, tpl->pid, "reading %s", path);
		tpl->comm[strcspn(tpl->comm, "\n")] = '\0';
	}
	if (set_comm(t, at, TEMPLATE_COMM, err) < 0)
		return -1;
	if (hide_args(tpl, t, at, err) < 0)
		return -1;
	tpl->named = true;
	return 0;
}

/* PROCMAP_QUERY (Linux 6.11, uapi linux/fs.h): the mapping at an address, asked of
 * /proc/pid/maps by ioctl instead of generating and parsing the whole text. Kept local, as
 * clone_args is, so older installed headers do not matter. */
struct dbx_procmap_query {
	uint64_t size, query_flags, query_addr, vma_start, vma_end, vma_flags, vma_page_size,
		vma_offset, inode;
	uint32_t dev_major, dev_minor, vma_name_size, build_id_size;
	uint64_t vma_name_addr, build_id_addr;
};
#define DBX_PROCMAP_QUERY _IOWR('f', 17, struct dbx_procmap_query)
#define DBX_PROCMAP_VMA_WRITABLE 0x02
#define DBX_PROCMAP_VMA_SHARED 0x08

/* Whether [addr, addr + len) lies in one private writable mapping of pid: a write there is
 * seen by nobody else (a shared one would show it to other processes, and to a file).
 * False when the kernel cannot say (no PROCMAP_QUERY). */
static bool private_writable(pid_t pid, unsigned long addr, size_t len)
{
	struct dbx_procmap_query q = { .size = sizeof(q), .query_addr = addr };
	char path[64];
	int fd, rc;

	snprintf(path, sizeof(path), "/proc/%d/maps", (int)pid);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return false;
	rc = ioctl(fd, DBX_PROCMAP_QUERY, &q);
	close(fd);
	return rc == 0 && addr + len <= q.vma_end && (q.vma_flags & DBX_PROCMAP_VMA_WRITABLE) &&
	       !(q.vma_flags & DBX_PROCMAP_VMA_SHARED);
}

/* A template is disguised (named, command line emptied) while the checkpoint still holds
 * every process of the sandbox stopped, so nothing in the sandbox ever lists it as the
 * program.  It has no scratch area yet (mapped at its first spawn or dump, outside that
 * window): the arguments go through the DISGUISE_LEN bytes at its stack pointer, put back
 * right after -- the template never runs program code again and its children are forked
 * later, so its memory is unchanged.  If that memory cannot be used (not private and
 * writable), map_scratch disguises it. */
static int name_new_template(struct dbxcr_template *tpl, struct tracee *t,
			     struct dbxcr_error *err)
{
	unsigned long at = t->regs.rsp;
	char saved[DISGUISE_LEN];

	if (!private_writable(tpl->pid, at, sizeof(saved)))
		return 0;
	if (mem_read(tpl->pid, at, saved, sizeof(saved), err) < 0) {
		clear_error(err);
		return 0;
	}
	if (disguise(tpl, t, at, err) < 0) {
		struct dbxcr_error ignored;

		mem_write(tpl->pid, at, saved, sizeof(saved), &ignored);
		return -1;
	}
	return mem_write(tpl->pid, at, saved, sizeof(saved), err);
}

/* Park a template just forked, without a scratch area yet: the checkpoint's stop window
 * holds the fork and the naming per process, the mmap waits for the first spawn. */
static int park_new(struct dbxcr_template *tpl, struct dbxcr_error *err)
{
	struct tracee t;

	if (adopt(&t, tpl->pid, tpl->site, err) < 0 || name_new_template(tpl, &t, err) < 0)
		return -1;
	park_regs(tpl, &t.regs);
	return park(tpl, err);
}

/* Map the template's scratch area (it and all its children have it; children unmap it). */
static int map_scratch(struct dbxcr_template *tpl, struct dbxcr_error *err);

/* An orphan (orphan.c) was forked from a CLONE_VM clone, which has no rseq registration
 * and no sigaltstack: the origin's are given to the template before anything is forked
 * from it (until that succeeds, every use of the template fails with its error). */
static int rehome(struct dbxcr_template *tpl, struct dbxcr_error *err)
{
	struct dbxcr_error ignored;
	struct tracee t;
	int rc;

	if (adopt(&t, tpl->pid, tpl->site, err) < 0)
		return -1;
	t.regs = tpl->park;
	rc = main_reborn(&t, tpl, &tpl->rehome_ss, err);
	if (park(tpl, rc < 0 ? &ignored : err) < 0)
		rc = -1;
	if (rc == 0)
		tpl->rehome = false;
	return rc;
}

int template_scratch(struct dbxcr_template *tpl, struct dbxcr_error *err)
{
	if (!tpl->scratch && map_scratch(tpl, err) < 0)
		return -1;
	return tpl->rehome ? rehome(tpl, err) : 0;
}

int set_comm(struct tracee *t, unsigned long scratch, const char *name, struct dbxcr_error *err)
{
	char buf[16] = { 0 };
	long a[6] = { PR_SET_NAME, (long)scratch, 0, 0, 0, 0 };

	strncpy(buf, name, sizeof(buf) - 1);
	if (mem_write(t->pid, scratch, buf, sizeof(buf), err) < 0)
		return -1;
	return rsys(t, SYS_prctl, a, err, "prctl(PR_SET_NAME, %s)", buf) < 0 ? -1 : 0;
}

static int map_scratch(struct dbxcr_template *tpl, struct dbxcr_error *err)
{
	struct tracee t;
	long a[6] = { 0, SCRATCH_LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0 };
	long addr;

	if (adopt(&t, tpl->pid, tpl->site, err) < 0)
		return -1;
	addr = rsys(&t, SYS_mmap, a, err, "mmap template scratch");
	if (addr < 0)
		return -1;
	tpl->scratch = (unsigned long)addr;
	/* Children forked from here on carry the disguise until finish_child gives them back
	 * the origin's name and command line. */
	if (!tpl->named && disguise(tpl, &t, tpl->scratch, err) < 0)
		return -1;
	park_regs(tpl, &t.regs);
	return park(tpl, err);
}

pid_t dbxcr_template_pid(const struct dbxcr_template *tpl)
{
	return tpl->pid;
}

pid_t dbxcr_template_origin(const struct dbxcr_template *tpl)
{
	return tpl->origin;
}

/* The system call the registers of a stop were taken in, and its six arguments; -1 if
 * none.  A thread stopped inside a blocking system call keeps its number in orig_rax and
 * rax holds -ERESTART*: it re-enters the call when resumed; or -EINTR, from the calls the
 * kernel never restarts (epoll_wait, ...), which the stop interrupted: the program gets
 * EINTR and, as a rule, calls again (the inspector counts that re-entry as the call going
 * on, inspector/program.py).  orig_rax alone does not say so: the kernel leaves it set
 * after a call returns, and a thread stopped on its way back to user mode from one that
 * completed (the interrupt found it there) has orig_rax = nr with the result in rax;
 * resumed, it runs on in user mode.  Only one entered from user mode by an interrupt has
 * orig_rax = -1. */
static long syscall_of(const struct user_regs_struct *r, long args[6])
{
	args[0] = (long)r->rdi;
	args[1] = (long)r->rsi;
	args[2] = (long)r->rdx;
	args[3] = (long)r->r10;
	args[4] = (long)r->r8;
	args[5] = (long)r->r9;
	if (pending_restart(r) || ((long)r->orig_rax >= 0 && (long)r->rax == -EINTR))
		return (long)r->orig_rax;
	return -1;
}

long dbxcr_template_syscall(const struct dbxcr_template *tpl, int thread, long args[6])
{
	if (thread == 0)
		return syscall_of(&tpl->regs, args);
	if (tpl->threads && thread <= tpl->threads->n)
		return syscall_of(&tpl->threads->t[thread - 1].regs, args);
	return -2;
}

int check_owner(const struct dbxcr_template *tpl, struct dbxcr_error *err)
{
	if (current_tid() != tpl->tracer_tid)
		return fail(err, EPERM, tpl->pid,
			    "template is ptrace-held by thread %d; called from thread %d",
			    (int)tpl->tracer_tid, (int)current_tid());
	return 0;
}

/* ---------- stopping for a checkpoint (see fork_template.h) ---------- */

enum { ST_BEGUN = 1, ST_STOPPED, ST_DONE };

struct dbxcr_stop {
	struct tracee t;
	pid_t tracer_tid;
	int state;
	bool seized;		/* false while the seize waits for the thaw (group stop) */
	bool modified;		/* mask/options/registers differ from the stop */
	bool forking;		/* dbxcr_template_start's clone not collected yet */
	bool orphan;		/* its template is forked through an intermediate (orphan.c) */
	struct via via;		/* ... that one, while forking */
	long opts;		/* options at seize (no fork events; EXITKILL once held) */
	int kind;		/* enum dbxcr_stop_kind */
	int signal;
	struct pending_sigs pend;	/* queued at the stop (and the dequeued one) */
	struct dbxcr_stop *next;	/* in the limbo list */
	/* A multi-threaded process: a handle per other thread, stopped and resumed with
	 * this one (their pend holds only their own queue). */
	bool is_thread;
	pid_t tgid;			/* is_thread: the process */
	struct dbxcr_stop **threads;
	int nthreads;
};

/* Copy (without dequeuing) the signals queued for a stopped tracee: its own queue, and
 * the process's unless `own_only` (a thread other than the main one). */
static int peek_pending(struct tracee *t, struct pending_sigs *p, bool own_only,
			struct dbxcr_error *err)
{
	p->n = 0;
	if (t->deferred_sig) {	/* dequeued by the signal-delivery-stop: still pending */
		p->info[p->n] = t->deferred_info;
		p->shared[p->n++] = false;
	}
	for (int shared = 0; shared < (own_only ? 1 : 2); shared++) {
		for (uint64_t off = 0;; off++) {
			struct __ptrace_peeksiginfo_args a = {
				.off = off, .flags = shared ? PTRACE_PEEKSIGINFO_SHARED : 0, .nr = 1 };
			siginfo_t si;
			long got = ptrace(PTRACE_PEEKSIGINFO, t->pid, &a, &si);

			if (got < 0)
				return fail(err, errno, t->pid, "PTRACE_PEEKSIGINFO");
			if (got == 0)
				break;
			/* SIGKILL: a dying process, nothing to copy; SIGSTOP: a stop already
			 * taken shows as the group stop (stop_again), one still queued would
			 * stop the checkpoint's process too, not its copy alone. */
			if (si.si_signo == SIGKILL || si.si_signo == SIGSTOP)
				continue;
			if (p->n == MAX_PENDING)
				return fail(err, EOVERFLOW, t->pid, "more than %d pending signals",
					    MAX_PENDING);
			p->info[p->n] = si;
			p->shared[p->n++] = shared;
		}
	}
	return 0;
}

/* Aborted handles whose tracee had not stopped yet: the kernel lets a tracer detach only
 * a stopped tracee, so they wait here for dbxcr_stop_sweep (by their own thread). */
static struct dbxcr_stop *limbo;
static pthread_mutex_t limbo_lock = PTHREAD_MUTEX_INITIALIZER;

static int owns(const struct dbxcr_stop *s, struct dbxcr_error *err)
{
	if (current_tid() != s->tracer_tid)
		return fail(err, EPERM, s->t.pid,
			    "stopped process is ptrace-held by thread %d; called from thread %d",
			    (int)s->tracer_tid, (int)current_tid());
	return 0;
}

static void read_wchan(pid_t pid, char *buf, size_t len)
{
	char path[64];

	snprintf(path, sizeof(path), "/proc/%d/wchan", (int)pid);
	if (read_small_file(path, buf, len) < 0)
		snprintf(buf, len, "?");
}

/* Seize and interrupt every thread of the process but the main one.  The cgroup is
 * frozen, so none is created or exits meanwhile (dbxcr_stop_wait checks the count). */
static int begin_threads(struct dbxcr_stop *s, struct dbxcr_error *err)
{
	char path[64];
	struct dirent *de;
	DIR *d;
	int rc = 0;

	snprintf(path, sizeof(path), "/proc/%d/task", (int)s->t.pid);
	s->threads = calloc(MAX_THREADS, sizeof(*s->threads));
	if (!s->threads)
		return fail(err, ENOMEM, s->t.pid, "allocate thread handles");
	d = opendir(path);
	if (!d)
		return fail(err, errno, s->t.pid, "list %s", path);
	while (rc == 0 && (de = readdir(d)) != NULL) {
		pid_t tid = (pid_t)atoi(de->d_name);
		struct dbxcr_stop *th;

		if (tid <= 0 || tid == s->t.pid)
			continue;
		if (s->nthreads == MAX_THREADS - 1) {
			rc = fail(err, ENOTSUP, s->t.pid, "more than %d threads", MAX_THREADS);
			break;
		}
		th = calloc(1, sizeof(*th));
		if (!th) {
			rc = fail(err, ENOMEM, tid, "allocate a thread handle");
			break;
		}
		th->t.pid = tid;
		th->tracer_tid = s->tracer_tid;
		th->state = ST_BEGUN;
		th->is_thread = true;
		th->tgid = s->t.pid;
		s->threads[s->nthreads++] = th;
		if (seize(tid, 0, &th->opts, err) < 0) {
			rc = -1;
			break;
		}
		th->seized = true;
		if (ptrace(PTRACE_INTERRUPT, tid, 0, 0) < 0)
			rc = fail(err, errno, tid, "PTRACE_INTERRUPT (thread of %d)", (int)s->t.pid);
	}
	closedir(d);
	return rc;
}

int dbxcr_stop_begin(pid_t pid, struct dbxcr_stop **out, struct dbxcr_error *err)
{
	struct dbxcr_info info;
	struct dbxcr_stop *s;
	char wchan[64];

	clear_error(err);
	*out = NULL;
	dbxcr_stop_sweep(0);
	if (dbxcr_describe(pid, &info, err) < 0)
		return -1;
	if (check_untraced(pid, &info, err) < 0)
		return -1;
	if (info.state == 'Z' || info.state == 'X')
		return fail(err, ESRCH, pid, "process is exiting (state %c)", info.state);
	s = calloc(1, sizeof(*s));
	if (!s)
		return fail(err, ENOMEM, pid, "allocate stop handle");
	s->t.pid = pid;
	s->tracer_tid = current_tid();
	s->state = ST_BEGUN;
	/* Frozen in place in a group stop (a frozen task reads as D): seizing it now would
	 * miss the kernel's re-trap of stopped tasks, and PTRACE_INTERRUPT cannot wake a
	 * stopped task, so it would never report.  Seize it after the thaw instead. */
	read_wchan(pid, wchan, sizeof(wchan));
	if (info.state == 'D' && strcmp(wchan, "do_signal_stop") == 0) {
		if (info.threads > 1) {
			free(s);
			return fail(err, ENOTSUP, pid, "a multi-threaded process in a job-control "
				    "stop is not captured (SIGCONT it first)");
		}
		*out = s;
		return 0;
	}
	if (seize(pid, 0, &s->opts, err) < 0) {
		free(s);
		return -1;
	}
	s->seized = true;
	if (ptrace(PTRACE_INTERRUPT, pid, 0, 0) < 0) {
		/* Only fails if the task is exiting; it cannot be detached unstopped. */
		int e = errno;

		dbxcr_stop_abort(s);
		return fail(err, e, pid, "PTRACE_INTERRUPT");
	}
	if (info.threads > 1 && begin_threads(s, err) < 0) {
		dbxcr_stop_abort(s);
		return -1;
	}
	*out = s;
	return 0;
}

static long long mono_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

/* waitpid with a timeout (polling: a ptrace stop gives no pidfd event). 0 on a report,
 * 1 on timeout, -1 on error (errno). */
static int wait_report(pid_t pid, int *status, int timeout_ms)
{
	long long deadline = mono_ms() + (timeout_ms > 0 ? timeout_ms : 0);
	useconds_t nap = 100;

	for (;;) {
		pid_t r = waitpid(pid, status, __WALL | (timeout_ms >= 0 ? WNOHANG : 0));

		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return -1;
		if (r > 0)
			return 0;
		if (mono_ms() >= deadline)
			return 1;
		usleep(nap);
		if (nap < 5000)
			nap *= 2;
	}
}

/* After the main thread's stop: every other thread's, and the count checked again. */
static int wait_threads(struct dbxcr_stop *s, int timeout_ms, struct dbxcr_error *err)
{
	int now;

	for (int i = 0; i < s->nthreads; i++) {
		struct dbxcr_stop *th = s->threads[i];

		th->t.site = s->t.site;
		if (dbxcr_stop_wait(th, timeout_ms, err) < 0) {
			/* ESRCH says the process is gone (the caller leaves it out): not so. */
			if (err->code == ESRCH)
				return fail(err, EAGAIN, th->t.pid, "thread of pid %d exited during "
					    "the checkpoint; retry", (int)s->t.pid);
			return -1;
		}
		if (th->kind == DBXCR_STOP_GROUP)
			return fail(err, EAGAIN, th->t.pid, "thread of pid %d entered a job-control "
				    "stop during the checkpoint; retry", (int)s->t.pid);
	}
	if (s->nthreads && (now = count_threads(s->t.pid)) != s->nthreads + 1)
		return fail(err, EAGAIN, s->t.pid, "threads started or ended during the "
			    "checkpoint (%d, now %d); retry", s->nthreads + 1, now);
	return 0;
}

int dbxcr_stop_wait(struct dbxcr_stop *s, int timeout_ms, struct dbxcr_error *err)
{
	pid_t pid = s->t.pid;
	int status, r, kind = 0;

	clear_error(err);
	if (owns(s, err) < 0)
		return -1;
	if (s->state == ST_STOPPED)
		return wait_threads(s, timeout_ms, err);
	if (s->state != ST_BEGUN)
		return fail(err, EINVAL, pid, "stop handle is finished");
	if (!s->seized) {
		if (seize(pid, 0, &s->opts, err) < 0) {
			s->state = ST_DONE;
			return -1;
		}
		s->seized = true;
		if (ptrace(PTRACE_INTERRUPT, pid, 0, 0) < 0)
			return fail(err, errno, pid, "PTRACE_INTERRUPT");
	}
	r = wait_report(pid, &status, timeout_ms);
	if (r < 0) {
		s->state = ST_DONE;
		return fail(err, errno, pid, "waitpid");
	}
	if (r > 0) {
		char wchan[64];
		struct dbxcr_info info;
		struct dbxcr_error e2;

		read_wchan(pid, wchan, sizeof(wchan));
		if (dbxcr_describe(pid, &info, &e2) < 0)
			info.state = '?';
		return fail(err, ETIMEDOUT, pid,
			    "no stop within %d ms (state %c, wchan %s; cgroup still frozen, or "
			    "uninterruptible sleep?)", timeout_ms, info.state, wchan);
	}
	if (WIFEXITED(status) || WIFSIGNALED(status)) {
		s->state = ST_DONE;
		if (WIFEXITED(status))
			return fail(err, ESRCH, pid, "exited with status %d before it stopped",
				    WEXITSTATUS(status));
		return fail(err, ESRCH, pid, "killed by signal %d before it stopped",
			    WTERMSIG(status));
	}
	if (take_stop(&s->t, status, &kind, err) < 0 ||
	    peek_pending(&s->t, &s->pend, s->is_thread, err) < 0) {
		detach_unchanged(&s->t);
		s->state = ST_DONE;
		return -1;
	}
	s->kind = kind;
	s->signal = kind == DBXCR_STOP_INTERRUPT ? 0 : WSTOPSIG(status);
	s->state = ST_STOPPED;
	return wait_threads(s, timeout_ms, err);
}

/* The registers a template of a stopped process takes are those saved at its stop
 * (take_stop; a thread's are put back unchanged after its capture), so the stop already
 * says which system call each thread was in, before any template is made. */
long dbxcr_stop_syscall(const struct dbxcr_stop *s, int thread, long args[6])
{
	if (s->state != ST_STOPPED)
		return -3;
	if (thread == 0)
		return syscall_of(&s->t.regs, args);
	if (thread <= s->nthreads && s->threads[thread - 1]->state == ST_STOPPED)
		return syscall_of(&s->threads[thread - 1]->t.regs, args);
	return thread <= s->nthreads ? -3 : -2;
}

static int set_exitkill(struct dbxcr_stop *s, struct dbxcr_error *err)
{
	long opts = s->opts | PTRACE_O_EXITKILL;

	if (ptrace(PTRACE_SETOPTIONS, s->t.pid, 0, (void *)opts) < 0)
		return fail(err, errno, s->t.pid, "PTRACE_SETOPTIONS (EXITKILL, held)");
	s->opts = opts;	/* what unmodify puts back, until the detach drops it */
	return 0;
}

/* A process held stopped past its checkpoint's answer (its templates made after it) must
 * not outlive its tracer: detached by a dying daemon it would run on and change the files
 * whose snapshot the restarted daemon takes for that checkpoint.  With PTRACE_O_EXITKILL
 * the kernel SIGKILLs each of its threads when the tracing thread exits. */
int dbxcr_stop_hold(struct dbxcr_stop *s, struct dbxcr_error *err)
{
	clear_error(err);
	if (owns(s, err) < 0)
		return -1;
	if (s->state != ST_STOPPED)
		return fail(err, EINVAL, s->t.pid, "process is not stopped");
	for (int i = 0; i < s->nthreads; i++)
		if (set_exitkill(s->threads[i], err) < 0)
			return -1;
	return set_exitkill(s, err);
}

void dbxcr_stop_get_info(const struct dbxcr_stop *s, struct dbxcr_stop_info *out)
{
	out->pid = s->t.pid;
	out->kind = s->state == ST_STOPPED ? s->kind : DBXCR_STOP_NONE;
	out->signal = s->state == ST_STOPPED ? s->signal : 0;
	out->done = s->state == ST_DONE;
}

/* Put the tracee back exactly as at its stop (it stays stopped) and drop EXITKILL. */
static int unmodify(struct dbxcr_stop *s, struct dbxcr_error *err)
{
	if (restore_state(&s->t, err) < 0)
		return -1;
	if (ptrace(PTRACE_SETOPTIONS, s->t.pid, 0, (void *)s->opts) < 0)
		return fail(err, errno, s->t.pid, "PTRACE_SETOPTIONS (restore)");
	s->modified = false;
	return 0;
}

/* For calls injected into a stopped process by another module (reap_unseen.c): its main
 * thread, every signal blocked, the handle marked modified (dbxcr_stop_resume puts back
 * registers, mask and options) and the process killed with its tracer should that die
 * meanwhile, as for a template's clone. */
struct tracee *stop_for_calls(struct dbxcr_stop *s, struct dbxcr_error *err)
{
	struct dbxcr_error ignored;

	if (owns(s, err) < 0)
		return NULL;
	if (s->state != ST_STOPPED || s->forking) {
		fail(err, EINVAL, s->t.pid, "process is not stopped, or a template of it is begun");
		return NULL;
	}
	s->modified = true;
	if (ptrace(PTRACE_SETOPTIONS, s->t.pid, 0, (void *)(s->opts | PTRACE_O_EXITKILL)) < 0)
		fail(err, errno, s->t.pid, "PTRACE_SETOPTIONS (EXITKILL, calls)");
	else if (block_all(&s->t, err) == 0)
		return &s->t;
	unmodify(s, &ignored);
	return NULL;
}

int dbxcr_template_start(struct dbxcr_stop *s, struct dbxcr_error *err)
{
	pid_t pid = s->t.pid;

	clear_error(err);
	if (owns(s, err) < 0)
		return -1;
	if (s->state != ST_STOPPED)
		return fail(err, EINVAL, pid, "process is not stopped (call dbxcr_stop_wait first)");
	if (s->forking)
		return fail(err, EINVAL, pid, "a template of it is being made already");
	s->orphan = orphan_wanted(pid);
	/* From here on the registers are not the program's: a tracer that dies must take the
	 * process (and the template, which inherits the options) with it. */
	s->modified = true;
	if (ptrace(PTRACE_SETOPTIONS, pid, 0, (void *)(s->opts | BASE_OPTIONS)) < 0)
		fail(err, errno, pid, "PTRACE_SETOPTIONS");
	else if (block_all(&s->t, err) == 0 &&
		 fork_template_start(&s->t, s->orphan ? &s->via : NULL, err) == 0) {
		s->forking = true;
		return 0;
	}
	{
		struct dbxcr_error ignored;

		unmodify(s, &ignored);	/* the original goes back as it was */
	}
	return -1;
}

/* The clone dbxcr_template_start began, collected; NULL (and no child) on failure. */
static pid_t finish_fork(struct dbxcr_stop *s, struct dbxcr_error *err)
{
	pid_t child;

	s->forking = false;
	child = fork_template_finish(&s->t, s->orphan ? &s->via : NULL, err);
	if (child > 0 && wait_birth(child, err) < 0) {
		kill_traced(child);
		child = -1;
	}
	return child;
}

/* A fresh template lacks the process's MADV_DONTFORK mappings (dontfork.c): when it does,
 * it is made again with them (the marks lifted in the process around the fork) and their
 * runs kept for its children.  Returns the template's pid (maybe another one), or -1 with
 * no template. */
static pid_t fork_all_mappings(struct dbxcr_stop *s, pid_t child, struct vma_run **runs,
			       int *nruns, struct dbxcr_error *err)
{
	struct dbxcr_error ignored;

	if (dontfork_runs(s->t.pid, child, runs, nruns, err) < 0) {
		kill_traced(child);
		return -1;
	}
	if (*nruns == 0)
		return child;
	kill_traced(child);
	child = -1;
	if (madvise_runs(&s->t, *runs, *nruns, MADV_DOFORK, err) == 0 &&
	    fork_template_start(&s->t, s->orphan ? &s->via : NULL, err) == 0) {
		s->forking = true;
		child = finish_fork(s, err);
	}
	/* The process keeps its marks, whatever happened. */
	if (madvise_runs(&s->t, *runs, *nruns, MADV_DONTFORK, child > 0 ? err : &ignored) < 0 &&
	    child > 0) {
		kill_traced(child);
		child = -1;
	}
	if (child < 0) {
		free(*runs);
		*runs = NULL;
		*nruns = 0;
	}
	return child;
}

/* One other thread's state for the template (threads.c): its registrations are asked by
 * calls injected into it (EXITKILL meanwhile), then it is put back as it was. */
static int capture_thread(struct dbxcr_stop *th, struct thread_state *ts, struct dbxcr_error *err)
{
	struct dbxcr_error ignored;
	int rc = -1;

	th->modified = true;
	if (ptrace(PTRACE_SETOPTIONS, th->t.pid, 0, (void *)(th->opts | PTRACE_O_EXITKILL)) < 0)
		fail(err, errno, th->t.pid, "PTRACE_SETOPTIONS");
	else if (block_all(&th->t, err) == 0 && thread_capture(&th->t, th->tgid, false, ts, err) == 0)
		rc = 0;
	if (unmodify(th, rc ? &ignored : err) < 0)
		rc = -1;
	if (rc < 0)
		return -1;
	ts->regs = th->t.regs;
	ts->sigmask = th->t.sigmask;
	ts->pend = th->pend;
	ts->xstate = malloc(th->t.xstate_len);
	if (!ts->xstate)
		return fail(err, ENOMEM, th->t.pid, "copying xstate");
	memcpy(ts->xstate, th->t.xstate, th->t.xstate_len);
	ts->xstate_len = th->t.xstate_len;
	return rseq_fixup(th->t.pid, ts->rseq_ptr, &ts->regs, err);
}

/* The other threads of a stopped multi-threaded process, and what fork() does not give
 * its main thread (s must be modified: its registers are ours to inject with). */
static struct thread_set *capture_threads(struct dbxcr_stop *s, struct main_regs *main,
					  struct dbxcr_error *err)
{
	struct thread_set *set;
	struct thread_state main_ts = { 0 };

	set = calloc(1, sizeof(*set) + (size_t)s->nthreads * sizeof(set->t[0]));
	if (!set) {
		fail(err, ENOMEM, s->t.pid, "allocate the state of %d threads", s->nthreads);
		return NULL;
	}
	for (int i = 0; i < s->nthreads; i++) {
		set->n = i + 1;
		if (capture_thread(s->threads[i], &set->t[i], err) < 0)
			goto fail;
	}
	if (thread_capture(&s->t, s->t.pid, true, &main_ts, err) < 0)
		goto fail;
	main_from_thread(main, &main_ts);
	return set;
fail:
	threads_free(set);
	return NULL;
}

struct dbxcr_template *dbxcr_template_finish(struct dbxcr_stop *s, struct dbxcr_error *err)
{
	struct dbxcr_template *tpl;
	pid_t pid = s->t.pid, child;
	bool tpl_ok = true;
	struct vma_run *runs = NULL;
	int nruns = 0;
	struct pinning pin = { 0 };

	clear_error(err);
	if (owns(s, err) < 0)
		return NULL;
	if (!s->forking) {
		fail(err, EINVAL, pid, "no template of it is being made (dbxcr_template_start)");
		return NULL;
	}
	child = finish_fork(s, err);
	if (child > 0)
		child = fork_all_mappings(s, child, &runs, &nruns, err);
	tpl = child > 0 ? calloc(1, sizeof(*tpl)) : NULL;
	if (tpl)
		tpl->xstate = malloc(s->t.xstate_len);
	/* What the fork did not copy is read by calls injected one by one (timers, the
	 * parent-death signal, ...): the process beside us meanwhile ("tracer and template on
	 * one CPU"), its own mask put back after.  The template, forked already, has that
	 * mask; the page-table copy ran on the process's own CPU. */
	if (tpl && tpl->xstate)
		pin_beside(&pin, pid);
	if (child > 0 && (!tpl || !tpl->xstate))
		fail(err, ENOMEM, pid, "allocate template");
	else if (tpl && s->nthreads && !(tpl->threads = capture_threads(s, &tpl->main, err)))
		tpl_ok = false;
	else if (tpl && !s->nthreads && main_capture(pid, &tpl->main, err) < 0)
		tpl_ok = false;
	else if (tpl && tpl->xstate && (capture_itimers(&s->t, tpl->itimers, err) < 0 ||
					capture_ptimers(&s->t, tpl, err) < 0 ||
					tracee_parent_death(&s->t, &tpl->pdeathsig,
							    &tpl->subreaper, err) < 0 ||
					(s->orphan &&
					 main_altstack(&s->t, &tpl->rehome_ss, err) < 0)))
		tpl_ok = false;
	{
		struct dbxcr_error ignored;

		if (unpin_beside(&pin, tpl_ok ? err : &ignored) < 0)
			tpl_ok = false;
	}
	/* The original goes back first, whatever happened to the template. */
	if (!tpl || !tpl->xstate || !tpl_ok || unmodify(s, err) < 0) {
		struct dbxcr_error ignored;

		if (child > 0)
			kill_traced(child);
		if (s->modified)
			unmodify(s, &ignored);
		if (tpl) {
			free(tpl->xstate);
			threads_free(tpl->threads);
		}
		free(tpl);
		free(runs);
		return NULL;
	}
	tpl->dontfork = runs;
	tpl->ndontfork = nruns;
	tpl->pid = child;
	tpl->origin = pid;
	tpl->tracer_tid = s->tracer_tid;
	tpl->regs = s->t.regs;
	if (rseq_fixup(pid, tpl->main.rseq_ptr, &tpl->regs, err) < 0) {
		struct dbxcr_error ignored;

		dbxcr_release_template(tpl, &ignored);
		return NULL;
	}
	memcpy(tpl->xstate, s->t.xstate, s->t.xstate_len);
	tpl->xstate_len = s->t.xstate_len;
	tpl->sigmask = s->t.sigmask;
	tpl->site = s->t.site;
	tpl->pend = s->pend;
	tpl->group_stop = s->kind == DBXCR_STOP_GROUP;
	tpl->rehome = s->orphan;
	/* The template inherited the all-blocked mask we set on the original, so signals sent
	 * to it stay pending (and fork does not pass pending signals to children). */
	if (park_new(tpl, err) < 0) {
		struct dbxcr_error ignored;

		dbxcr_release_template(tpl, &ignored);
		return NULL;
	}
	return tpl;
}

struct dbxcr_template *dbxcr_template_stopped(struct dbxcr_stop *s, struct dbxcr_error *err)
{
	if (dbxcr_template_start(s, err) < 0)
		return NULL;
	return dbxcr_template_finish(s, err);
}

int dbxcr_stop_resume(struct dbxcr_stop *s, struct dbxcr_error *err)
{
	clear_error(err);
	if (owns(s, err) < 0)
		return -1;
	if (s->state != ST_STOPPED)
		return fail(err, EINVAL, s->t.pid, "process is not stopped%s",
			    s->state == ST_DONE ? " (already resumed or gone)" : " yet");
	if (s->forking) {	/* a template begun and never collected: it goes */
		struct dbxcr_error ignored;
		pid_t child = finish_fork(s, &ignored);

		if (child > 0)
			kill_traced(child);
	}
	for (int i = 0; i < s->nthreads; i++)
		if (s->threads[i]->state == ST_STOPPED && dbxcr_stop_resume(s->threads[i], err) < 0)
			return -1;
	if (s->modified && unmodify(s, err) < 0)
		return -1;
	if (detach_tracee(&s->t, err) < 0)
		return -1;
	s->state = ST_DONE;
	tracee_free(&s->t);
	return 0;
}

/* One poll of a seized tracee that has not reported its stop: detach it if it stopped.
 * Returns true when the tracee needs nothing more from us. */
static bool settle_unstopped(struct dbxcr_stop *s)
{
	int status;
	pid_t r;

	do
		r = waitpid(s->t.pid, &status, __WALL | WNOHANG);
	while (r < 0 && errno == EINTR);
	if (r < 0)
		return true;	/* ECHILD: not ours any more */
	if (r == 0)
		return false;
	if (WIFEXITED(status) || WIFSIGNALED(status))
		return true;
	/* Nothing was changed: a signal-delivery-stop gets its signal back, any other
	 * stop (interrupt, group stop) is simply left. */
	if (stop_event(status) == 0)
		ptrace(PTRACE_DETACH, s->t.pid, 0, (void *)(long)WSTOPSIG(status));
	else
		ptrace(PTRACE_DETACH, s->t.pid, 0, 0);
	return true;
}

void dbxcr_stop_abort(struct dbxcr_stop *s)
{
	struct dbxcr_error ignored;

	if (!s)
		return;
	/* Its threads first (each may wait in the limbo list on its own). */
	for (int i = 0; i < s->nthreads; i++)
		dbxcr_stop_abort(s->threads[i]);
	free(s->threads);
	s->threads = NULL;
	s->nthreads = 0;
	if (s->state == ST_BEGUN && s->seized) {
		if (current_tid() == s->tracer_tid && settle_unstopped(s))
			s->state = ST_DONE;
		else {
			tracee_free(&s->t);
			pthread_mutex_lock(&limbo_lock);
			s->next = limbo;
			limbo = s;
			pthread_mutex_unlock(&limbo_lock);
			return;
		}
	} else if (s->state == ST_STOPPED) {
		if (current_tid() != s->tracer_tid) {
			/* Cannot touch it from here; park it for its own thread's sweep. */
			pthread_mutex_lock(&limbo_lock);
			s->next = limbo;
			limbo = s;
			pthread_mutex_unlock(&limbo_lock);
			return;
		}
		if (dbxcr_stop_resume(s, &ignored) < 0 && s->modified) {
			/* Its registers are ours, not the program's: it must not run. */
			kill(s->t.pid, SIGKILL);
		}
		if (s->state != ST_DONE)
			ptrace(PTRACE_DETACH, s->t.pid, 0, 0);
	}
	tracee_free(&s->t);
	free(s);
}

int dbxcr_stop_sweep(int timeout_ms)
{
	long long deadline = mono_ms() + (timeout_ms > 0 ? timeout_ms : 0);
	pid_t me = current_tid();
	useconds_t nap = 100;
	int left;

	for (;;) {
		struct dbxcr_stop **pp, *s, *done = NULL;

		left = 0;
		pthread_mutex_lock(&limbo_lock);
		for (pp = &limbo; (s = *pp) != NULL;) {
			if (s->tracer_tid != me) {
				pp = &s->next;
				continue;
			}
			*pp = s->next;
			s->next = done;
			done = s;
		}
		pthread_mutex_unlock(&limbo_lock);
		/* Work on our own entries outside the lock; put back what is not settled. */
		while ((s = done) != NULL) {
			done = s->next;
			if (s->state == ST_STOPPED) {	/* aborted from another thread */
				dbxcr_stop_abort(s);
				continue;
			}
			if (settle_unstopped(s)) {
				free(s);
				continue;
			}
			left++;
			pthread_mutex_lock(&limbo_lock);
			s->next = limbo;
			limbo = s;
			pthread_mutex_unlock(&limbo_lock);
		}
		if (left == 0 || (timeout_ms >= 0 && mono_ms() >= deadline))
			return left;
		usleep(nap);
		if (nap < 5000)
			nap *= 2;
	}
}

/* One-shot: stop, template and resume pid. */
struct dbxcr_template *dbxcr_make_template(pid_t pid, struct dbxcr_error *err)
{
	struct dbxcr_template *tpl;
	struct dbxcr_stop *s;

	clear_error(err);
	if (check_templatable(pid, err) < 0)
		return NULL;
	if (dbxcr_stop_begin(pid, &s, err) < 0)
		return NULL;
	if (dbxcr_stop_wait(s, -1, err) < 0) {
		dbxcr_stop_abort(s);
		return NULL;
	}
	tpl = dbxcr_template_stopped(s, err);
	if (!tpl) {
		dbxcr_stop_abort(s);
		return NULL;
	}
	if (dbxcr_stop_resume(s, err) < 0) {
		struct dbxcr_error ignored;

		dbxcr_release_template(tpl, &ignored);
		dbxcr_stop_abort(s);
		return NULL;
	}
	dbxcr_stop_abort(s);
	return tpl;
}

/* A fork shares every open file description with its parent, so a template holding its
 * copies keeps them alive in the live sandbox after the process closes them: a pipe's
 * reader never sees EOF once its writer exits, a flock or OFD lock stays taken (its owner
 * is the description), a port stays bound, a connection is never closed.  Children whose
 * spawn installs every descriptor afresh (the daemon's) need none of them. */
int dbxcr_template_drop_fds(struct dbxcr_template *tpl, struct dbxcr_error *err)
{
	struct dbxcr_error ignored;
	struct tracee t;
	long a[6] = { 0, ~0L, 0, 0, 0, 0 };
	int rc = 0;

	clear_error(err);
	if (check_owner(tpl, err) < 0 || adopt(&t, tpl->pid, tpl->site, err) < 0)
		return -1;
	t.regs = tpl->park;
	if (rsys(&t, SYS_close_range, a, err, "close_range in the template") < 0)
		rc = -1;
	if (park(tpl, rc ? &ignored : err) < 0)
		rc = -1;
	return rc;
}

/* One call injected into the parked template, which is parked again after it. */
static int template_call(struct dbxcr_template *tpl, long nr, const long args[6],
			 const char *what, struct dbxcr_error *err)
{
	struct dbxcr_error ignored;
	struct tracee t;
	long a[6];
	int rc = 0;

	clear_error(err);
	memcpy(a, args, sizeof(a));
	if (check_owner(tpl, err) < 0 || adopt(&t, tpl->pid, tpl->site, err) < 0)
		return -1;
	t.regs = tpl->park;
	if (rsys(&t, nr, a, err, "%s in the template", what) < 0)
		rc = -1;
	if (park(tpl, rc ? &ignored : err) < 0)
		rc = -1;
	return rc;
}

int dbxcr_template_own_group(struct dbxcr_template *tpl, struct dbxcr_error *err)
{
	static const long none[6];

	return template_call(tpl, SYS_setpgid, none, "setpgid(0, 0)", err);
}

int dbxcr_template_own_session(struct dbxcr_template *tpl, struct dbxcr_error *err)
{
	static const long none[6];

	/* setsid() fails (EPERM) in a group leader: a fresh template is not one (it is a
	 * fork in its process's group), unless own_group made it one. */
	return template_call(tpl, SYS_setsid, none, "setsid()", err);
}

int dbxcr_template_shmdt(struct dbxcr_template *tpl, unsigned long addr,
			 struct dbxcr_error *err)
{
	long a[6] = { (long)addr, 0, 0, 0, 0, 0 };

	return template_call(tpl, SYS_shmdt, a, "shmdt", err);
}

/* Free the struct (what it owns), not the process it describes. */
static void template_free(struct dbxcr_template *tpl)
{
	free(tpl->xstate);
	threads_free(tpl->threads);
	free(tpl->dontfork);
	free(tpl);
}

int dbxcr_release_template(struct dbxcr_template *tpl, struct dbxcr_error *err)
{
	int rc = 0;
	pid_t pid;

	clear_error(err);
	if (!tpl)
		return 0;
	pid = tpl->pid;
	if (tpl->tracer_tid == 0) {
		/* A copy between its handover and its adoption: nobody traces it. */
		if (kill(pid, SIGKILL) < 0 && errno != ESRCH)
			rc = fail(err, errno, pid, "kill template copy");
	} else if (check_owner(tpl, err) < 0) {
		/* We cannot reap it from here; SIGKILL still ends it (its parent reaps it). */
		kill(pid, SIGKILL);
		rc = -1;
	} else {
		/* As its tracer we see its death first; reaping it here releases it fully when
		 * we are also its parent, otherwise hands the zombie to its parent with the
		 * original's exit signal, which reap_unseen keeps from a live parent. */
		rc = reap_unseen(pid, err);
	}
	template_free(tpl);
	return rc;
}

/* dst = *src with its own copy of src's xstate (carriers and template copies keep the
 * checkpointed registers after the template that holds them is released). */
static int dup_template(struct dbxcr_template *dst, const struct dbxcr_template *src,
			struct dbxcr_error *err)
{
	*dst = *src;
	dst->xstate = NULL;
	dst->threads = NULL;
	dst->dontfork = NULL;
	if (src->ndontfork) {
		size_t size = (size_t)src->ndontfork * sizeof(*src->dontfork);

		dst->dontfork = malloc(size);
		if (!dst->dontfork)
			return fail(err, ENOMEM, src->pid, "copying %d mapping runs", src->ndontfork);
		memcpy(dst->dontfork, src->dontfork, size);
	}
	if (src->threads && !(dst->threads = threads_dup(src->threads))) {
		free(dst->dontfork);
		dst->dontfork = NULL;
		return fail(err, ENOMEM, src->pid, "copying the state of %d threads",
			    src->threads->n);
	}
	if (!src->xstate_len)
		return 0;
	dst->xstate = malloc(src->xstate_len);
	if (!dst->xstate) {
		threads_free(dst->threads);
		dst->threads = NULL;
		free(dst->dontfork);
		dst->dontfork = NULL;
		return fail(err, ENOMEM, src->pid, "copying xstate (%zu bytes)", src->xstate_len);
	}
	memcpy(dst->xstate, src->xstate, src->xstate_len);
	return 0;
}

/* ---------- template copies: a second fork lane ----------
 *
 * A template forks one child at a time, and each fork copies its page tables in the
 * template's own context, on one CPU: a fan-out of many children from one template is a
 * chain of such copies.  A copy of the template (the same memory, shared copy-on-write;
 * the same checkpointed registers, mask and signals) traced by a second thread lets two
 * chains run on two CPUs.
 *
 * ptrace binds a tracee to one thread, and a new child of a tracee is auto-attached to the
 * tracer of its parent, so the copy is handed over: parked in pause(2) with every blockable
 * signal blocked, detached (it sleeps there: no program code runs, and nothing but SIGKILL
 * or SIGSTOP can wake it), then seized by the other thread (dbxcr_template_adopt). */

/* In a freshly born copy stopped at its birth trap: sleep in pause() once detached. */
static int park_in_pause(struct dbxcr_template *cp, struct dbxcr_error *err)
{
	struct user_regs_struct r = cp->park;

	if (set_sigmask(cp->pid, ~0ULL, err) < 0)
		return -1;
	r.rax = SYS_pause;
	if (ptrace(PTRACE_SETREGS, cp->pid, 0, &r) < 0)
		return fail(err, errno, cp->pid, "PTRACE_SETREGS (pause before the handover)");
	if (ptrace(PTRACE_DETACH, cp->pid, 0, 0) < 0)
		return fail(err, errno, cp->pid, "PTRACE_DETACH (handover)");
	return 0;
}

static pid_t clone_template(struct dbxcr_template *tpl, struct dbxcr_error *err)
{
	struct dbxcr_error ignored;
	struct tracee t;
	long ret;

	if (adopt(&t, tpl->pid, tpl->site, err) < 0)
		return -1;
	t.regs = tpl->park;
	if (remote_syscall(&t, SYS_clone, template_clone_args, &ret, err) < 0) {
		kill_traced(t.new_child);
		park(tpl, &ignored);
		return -1;
	}
	if (park(tpl, err) < 0) {
		kill_traced(t.new_child);
		return -1;
	}
	if (ret < 0)
		return fail(err, (int)-ret, tpl->pid, "injected clone (template copy)");
	if (t.new_child <= 0)
		return fail(err, EPROTO, tpl->pid, "clone returned %ld but no fork event", ret);
	return t.new_child;
}

struct dbxcr_template *dbxcr_template_copy(struct dbxcr_template *tpl, struct dbxcr_error *err)
{
	struct dbxcr_template *cp;
	pid_t child;

	clear_error(err);
	if (check_owner(tpl, err) < 0 || template_scratch(tpl, err) < 0)
		return NULL;
	cp = malloc(sizeof(*cp));
	if (!cp) {
		fail(err, ENOMEM, tpl->pid, "allocate template copy");
		return NULL;
	}
	if (dup_template(cp, tpl, err) < 0) {
		free(cp);
		return NULL;
	}
	child = clone_template(tpl, err);
	if (child < 0)
		goto out;
	cp->pid = child;
	if (wait_birth(child, err) < 0 || park_in_pause(cp, err) < 0) {
		kill_traced(child);
		goto out;
	}
	cp->tracer_tid = 0;	/* nobody's until dbxcr_template_adopt */
	return cp;
out:
	free(cp->xstate);
	threads_free(cp->threads);
	free(cp->dontfork);
	free(cp);
	return NULL;
}

int dbxcr_template_adopt(struct dbxcr_template *cp, struct dbxcr_error *err)
{
	int status;
	long opts;

	clear_error(err);
	if (cp->tracer_tid != 0)
		return fail(err, EBUSY, cp->pid, "template is ptrace-held by thread %d already",
			    (int)cp->tracer_tid);
	if (seize(cp->pid, BASE_OPTIONS, &opts, err) < 0)
		return -1;
	if (ptrace(PTRACE_INTERRUPT, cp->pid, 0, 0) < 0)
		return fail(err, errno, cp->pid, "PTRACE_INTERRUPT (template copy)");
	/* The interrupt takes it out of pause() into a stop inside get_signal(); its
	 * registers there are pause's, and parking replaces them. */
	if (wait_stop(cp->pid, &status, err) < 0)
		return -1;
	if (stop_event(status) != PTRACE_EVENT_STOP)
		return fail(err, EPROTO, cp->pid, "unexpected stop of a template copy (status %#x)",
			    status);
	cp->tracer_tid = current_tid();
	return park(cp, err);
}

/* ---------- tracer and template on one CPU ----------
 *
 * An injected system call is two wake-ups: we resume the tracee, its stop wakes us.  On
 * one CPU each is a plain context switch (about 12 us per call on these machines); across
 * CPUs each wake-up is an inter-processor interrupt, a VM exit under a hypervisor (about
 * 55 us per call measured here, and a busy daemon's scheduler often splits the pair).  A
 * spawn or a birth injects some thirty calls into a template (or carrier) and its new
 * child, so for its duration the calling thread and the template are pinned to the CPU
 * we run on; the child is born pinned (fork copies the mask) and gets the template's own
 * affinity -- the original's at the checkpoint -- back before it runs an instruction of
 * its own.  A template runs no program code, so its own mask is not put back: it is read
 * once, before the first pin, and kept.  Best effort: where pinning is refused (a cpuset
 * that excludes our CPU) the calls are just slower. */
struct colocation {
	bool pinned;		/* the template is pinned: its children must be unpinned */
	bool self_pinned;
	cpu_set_t self_mask;	/* the calling thread's affinity before */
};

/* The CPU we run on as a mask in *one; false if unknown. */
static bool this_cpu(cpu_set_t *one)
{
	int cpu = sched_getcpu();

	CPU_ZERO(one);
	if (cpu < 0)
		return false;
	CPU_SET(cpu, one);
	return true;
}

/* Pin the calling thread to `one`, its mask before in *saved. */
static bool pin_self(const cpu_set_t *one, cpu_set_t *saved)
{
	return sched_getaffinity(0, sizeof(*saved), saved) == 0 &&
	       sched_setaffinity(0, sizeof(*one), one) == 0;
}

static void colocate(struct colocation *c, struct dbxcr_template *tpl)
{
	cpu_set_t one;

	c->pinned = c->self_pinned = false;
	if (!this_cpu(&one))
		return;
	if (!tpl->affinity_known &&
	    sched_getaffinity(tpl->pid, sizeof(tpl->affinity), &tpl->affinity) == 0)
		tpl->affinity_known = true;
	c->self_pinned = pin_self(&one, &c->self_mask);
	if (tpl->affinity_known && sched_setaffinity(tpl->pid, sizeof(one), &one) == 0)
		c->pinned = true;
}

void pin_beside(struct pinning *p, pid_t pid)
{
	cpu_set_t one;

	p->pid = pid;
	p->self = p->other = false;
	if (!this_cpu(&one))
		return;
	p->self = pin_self(&one, &p->self_mask);
	p->other = sched_getaffinity(pid, sizeof(p->mask), &p->mask) == 0 &&
		   sched_setaffinity(pid, sizeof(one), &one) == 0;
}

int unpin_beside(struct pinning *p, struct dbxcr_error *err)
{
	int rc = 0;

	if (p->other && sched_setaffinity(p->pid, sizeof(p->mask), &p->mask) < 0)
		rc = fail(err, errno, p->pid, "restoring its CPU affinity");
	if (p->self)
		sched_setaffinity(0, sizeof(p->self_mask), &p->self_mask);
	p->self = p->other = false;
	return rc;
}

/* The template's own affinity for a child born while it was pinned. */
static int unpin_child(const struct colocation *c, const struct dbxcr_template *tpl,
		       pid_t child, struct dbxcr_error *err)
{
	if (c->pinned && sched_setaffinity(child, sizeof(tpl->affinity), &tpl->affinity) < 0)
		return fail(err, errno, child, "restoring its CPU affinity");
	return 0;
}

/* Our own affinity back (only where this thread runs is at stake: nothing to report). */
static void colocation_end(struct colocation *c)
{
	if (c->self_pinned)
		sched_setaffinity(0, sizeof(c->self_mask), &c->self_mask);
	c->self_pinned = false;
}

/* ---------- spawning ---------- */

int transfer_fds(struct tracee *c, unsigned long scratch, const int *src, size_t n,
			int *out, struct dbxcr_error *err);

/* The template's pid namespace for children, switched to a nested one for one clone3 and
 * back.  setns(CLONE_NEWPID) accepts only the caller's active pid namespace or one nested
 * below it, and changes only where the caller's *children* are born. */
struct pidns_switch {
	int target;	/* in the template: fd of the namespace to be born in, or -1 */
	int own;	/* in the template: fd of its active pid namespace, or -1 */
};

static int switch_pidns_in(struct tracee *t, struct dbxcr_template *tpl, int pidns_fd,
			   struct pidns_switch *sw, struct dbxcr_error *err)
{
	char path[64];
	int src[2], got[2], own;
	long a[6] = { 0 };

	sw->target = sw->own = -1;
	snprintf(path, sizeof(path), "/proc/%d/ns/pid", (int)tpl->pid);
	own = open(path, O_RDONLY | O_CLOEXEC);
	if (own < 0)
		return fail(err, errno, tpl->pid, "open %s", path);
	src[0] = pidns_fd;
	src[1] = own;
	if (transfer_fds(t, tpl->scratch, src, 2, got, err) < 0) {
		close(own);
		return -1;
	}
	close(own);
	sw->target = got[0];
	sw->own = got[1];
	a[0] = sw->target;
	a[1] = CLONE_NEWPID;
	if (rsys(t, SYS_setns, a, err, "setns into the target pid namespace") < 0)
		return -1;
	return 0;
}

/* Back to the template's own pid namespace; close the two fds (best effort on error). */
static int switch_pidns_back(struct tracee *t, struct pidns_switch *sw, struct dbxcr_error *err)
{
	long a[6] = { 0 };
	int rc = 0;

	if (sw->own >= 0) {
		a[0] = sw->own;
		a[1] = CLONE_NEWPID;
		if (rsys(t, SYS_setns, a, err, "setns back into the template's pid namespace") < 0)
			rc = -1;
	}
	for (int i = 0; i < 2; i++) {
		struct dbxcr_error e2;

		a[0] = i ? sw->own : sw->target;
		a[1] = 0;
		if (a[0] >= 0 && rsys(t, SYS_close, a, &e2, "close pid namespace fd %ld", a[0]) < 0 &&
		    rc == 0) {
			*err = e2;
			rc = -1;
		}
	}
	return rc;
}

/* clone3 in the stopped tracee t with the arguments *ca, written to the scratch page at
 * `scratch` with set_tid's n pids right after them: the call's return value in *ret, the
 * new task (traced from its birth, by the fork or clone event) in t->new_child. */
int remote_clone3(struct tracee *t, unsigned long scratch, struct dbx_clone_args *ca,
		  const pid_t *set_tid, size_t n, long *ret, struct dbxcr_error *err)
{
	unsigned long tid_addr = scratch + sizeof(*ca);
	long a[6] = { (long)scratch, sizeof(*ca), 0, 0, 0, 0 };

	t->new_child = 0;
	if (n) {
		ca->set_tid = tid_addr;
		ca->set_tid_size = n;
		if (mem_write(t->pid, tid_addr, set_tid, n * sizeof(pid_t), err) < 0)
			return -1;
	}
	if (mem_write(t->pid, scratch, ca, sizeof(*ca), err) < 0)
		return -1;
	return remote_syscall(t, SYS_clone3, a, ret, err);
}

static pid_t clone_from_template(struct dbxcr_template *tpl, const struct dbxcr_spawn_opts *o,
				 unsigned long flags, struct pidns_switch *sw,
				 struct dbxcr_error *err)
{
	struct dbx_clone_args ca;
	struct tracee t;
	long ret;

	sw->target = sw->own = -1;
	if (o->set_tid_size > 32)
		return fail(err, EINVAL, tpl->pid, "set_tid has %zu entries (max 32)",
			    o->set_tid_size);
	if (template_scratch(tpl, err) < 0)
		return -1;
	if (adopt(&t, tpl->pid, tpl->site, err) < 0)
		return -1;
	t.regs = tpl->park;
	if (o->pidns_fd > 0 && switch_pidns_in(&t, tpl, o->pidns_fd, sw, err) < 0) {
		struct dbxcr_error ignored;

		switch_pidns_back(&t, sw, &ignored);
		park(tpl, &ignored);
		return -1;
	}
	memset(&ca, 0, sizeof(ca));
	/* CLONE_PARENT: the child takes the template's (= the original's) parent and exit
	 * signal; clone3 requires exit_signal == 0 with CLONE_PARENT. */
	ca.flags = CLONE_PARENT | flags;
	if (remote_clone3(&t, tpl->scratch, &ca, o->set_tid, o->set_tid_size, &ret, err) < 0) {
		kill_traced(t.new_child);
		goto undo;
	}
	if (sw->own >= 0 && switch_pidns_back(&t, sw, err) < 0) {
		kill_traced(t.new_child);
		park(tpl, err);
		return -1;
	}
	if (park(tpl, err) < 0) {
		kill_traced(t.new_child);
		return -1;
	}
	if (t.deferred_sig)	/* e.g. SIGSTOP sent to the template's process group */
		t.deferred_sig = 0;
	if (ret < 0) {
		int e = (int)-ret;

		if (e == EEXIST)
			return fail(err, e, tpl->pid,
				    "clone3 set_tid: pid %d is in use in the target pid namespace",
				    o->set_tid[0]);
		if (e == EPERM)
			return fail(err, e, tpl->pid,
				    "clone3 set_tid: no CAP_SYS_ADMIN over the target pid namespace");
		if (e == EINVAL && o->set_tid_size)
			return fail(err, e, tpl->pid,
				    "clone3 set_tid: %zu entries exceed the template's pid namespace "
				    "depth, or a pid is invalid", o->set_tid_size);
		return fail(err, e, tpl->pid, "injected clone3");
	}
	if (t.new_child <= 0)
		return fail(err, EPROTO, tpl->pid, "clone3 returned %ld but no fork event", ret);
	return t.new_child;
undo:
	{
		struct dbxcr_error ignored;

		if (sw->own >= 0)
			switch_pidns_back(&t, sw, &ignored);
		park(tpl, &ignored);
	}
	return -1;
}

/* Move a newborn child into the target sandbox's cgroups before it runs a single
 * instruction of its own (a cgroup.procs write takes a pid in the writer's namespace). */
static int move_to_cgroups(pid_t child, const struct dbxcr_spawn_opts *o,
			   struct dbxcr_error *err)
{
	char buf[32];
	int len = snprintf(buf, sizeof(buf), "%d", (int)child);

	for (size_t i = 0; i < o->ncgroup_fds; i++)
		if (write(o->cgroup_fds[i], buf, (size_t)len) != len)
			return fail(err, errno, child, "move into cgroup (cgroup.procs fd %d)",
				    o->cgroup_fds[i]);
	return 0;
}

/* One SCM_RIGHTS message's worth of transfer_fds (n <= MAX_XFER_FDS). */
static int transfer_chunk(struct tracee *c, unsigned long scratch, const int *src, size_t n,
			  int *out, struct dbxcr_error *err)
{
	long a[6] = { 0 };
	int sv[2], pidfd = -1, local = -1, rc = -1;
	unsigned long msg_addr = scratch + 64, iov_addr = scratch + 128, data_addr = scratch + 160;
	unsigned long ctl_addr = scratch + 256;
	size_t ctl_len = CMSG_SPACE(sizeof(int) * MAX_XFER_FDS);
	char byte = 'x';

	a[0] = AF_UNIX;
	a[1] = SOCK_DGRAM | SOCK_CLOEXEC;
	a[3] = (long)scratch;
	if (rsys(c, SYS_socketpair, a, err, "socketpair in child") < 0)
		return -1;
	if (mem_read(c->pid, scratch, sv, sizeof(sv), err) < 0)
		return -1;
	/* Our end of the pair: pidfd_getfd copies a descriptor *out of* another process. */
	pidfd = (int)syscall(SYS_pidfd_open, c->pid, 0);
	if (pidfd < 0) {
		fail(err, errno, c->pid, "pidfd_open");
		goto close_child;
	}
	local = (int)syscall(SYS_pidfd_getfd, pidfd, sv[0], 0);
	if (local < 0) {
		fail(err, errno, c->pid, "pidfd_getfd of child socket %d", sv[0]);
		goto close_child;
	}
	{
		union {
			char buf[CMSG_SPACE(sizeof(int) * MAX_XFER_FDS)];
			struct cmsghdr align;
		} u;
		struct iovec iov = { &byte, 1 };
		struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
				     .msg_controllen = CMSG_SPACE(sizeof(int) * n) };
		struct cmsghdr *cm;

		memset(u.buf, 0, sizeof(u.buf));
		cm = CMSG_FIRSTHDR(&mh);
		cm->cmsg_level = SOL_SOCKET;
		cm->cmsg_type = SCM_RIGHTS;
		cm->cmsg_len = CMSG_LEN(sizeof(int) * n);
		memcpy(CMSG_DATA(cm), src, sizeof(int) * n);
		if (sendmsg(local, &mh, MSG_NOSIGNAL) < 0) {
			fail(err, errno, c->pid, "sendmsg SCM_RIGHTS to child");
			goto close_child;
		}
	}
	{
		/* Child side: recvmsg(sv[1], &msg, MSG_CMSG_CLOEXEC) with msghdr, iovec and a
		 * control buffer laid out in the scratch area. */
		struct msghdr rm = { 0 };
		struct iovec riov = { (void *)data_addr, 1 };
		union {
			char buf[CMSG_SPACE(sizeof(int) * MAX_XFER_FDS)];
			struct cmsghdr align;
		} u;
		struct cmsghdr *cm;

		rm.msg_iov = (struct iovec *)iov_addr;
		rm.msg_iovlen = 1;
		rm.msg_control = (void *)ctl_addr;
		rm.msg_controllen = ctl_len;
		if (mem_write(c->pid, iov_addr, &riov, sizeof(riov), err) < 0 ||
		    mem_write(c->pid, msg_addr, &rm, sizeof(rm), err) < 0)
			goto close_child;
		a[0] = sv[1];
		a[1] = (long)msg_addr;
		a[2] = MSG_CMSG_CLOEXEC | MSG_DONTWAIT;
		if (rsys(c, SYS_recvmsg, a, err, "recvmsg in child") < 0)
			goto close_child;
		if (mem_read(c->pid, msg_addr, &rm, sizeof(rm), err) < 0 ||
		    mem_read(c->pid, ctl_addr, u.buf, ctl_len, err) < 0)
			goto close_child;
		if (rm.msg_flags & MSG_CTRUNC) {
			fail(err, EMFILE, c->pid, "child could not receive all descriptors");
			goto close_child;
		}
		rm.msg_control = u.buf;
		cm = CMSG_FIRSTHDR(&rm);
		if (!cm || cm->cmsg_type != SCM_RIGHTS || cm->cmsg_len != CMSG_LEN(sizeof(int) * n)) {
			fail(err, EPROTO, c->pid, "child received no descriptors");
			goto close_child;
		}
		memcpy(out, CMSG_DATA(cm), sizeof(int) * n);
	}
	rc = 0;
close_child:
	if (local >= 0)
		close(local);
	if (pidfd >= 0)
		close(pidfd);
	for (int i = 0; i < 2; i++) {
		struct dbxcr_error e2;

		a[0] = sv[i];
		if (rsys(c, SYS_close, a, &e2, "close child socket %d", sv[i]) < 0 && rc == 0) {
			*err = e2;
			rc = -1;
		}
	}
	return rc;
}

/* Give the child copies of the caller's descriptors through a socketpair made in the
 * child, MAX_XFER_FDS (the kernel's SCM_MAX_FD) per message.  out[i] receives the child's
 * fd number for src[i]. */
int transfer_fds(struct tracee *c, unsigned long scratch, const int *src, size_t n,
		 int *out, struct dbxcr_error *err)
{
	for (size_t done = 0; done < n; done += MAX_XFER_FDS) {
		size_t k = n - done < MAX_XFER_FDS ? n - done : MAX_XFER_FDS;

		if (transfer_chunk(c, scratch, src + done, k, out + done, err) < 0)
			return -1;
	}
	return 0;
}

static bool is_target(const struct dbxcr_spawn_opts *o, int fd)
{
	for (size_t i = 0; i < o->nfiles; i++)
		if (o->files[i].fd == fd)
			return true;
	for (size_t i = 0; i < o->nfds; i++)
		if (o->fds[i].target == fd)
			return true;
	for (size_t i = 0; i < o->nepolls; i++)
		if (o->epolls[i].fd == fd)
			return true;
	for (size_t i = 0; i < o->nlistens; i++)
		if (o->listens[i].fd == fd)
			return true;
	return false;
}

static int max_target(const struct dbxcr_spawn_opts *o)
{
	int m = 2;

	for (size_t i = 0; i < o->nfiles; i++)
		if (o->files[i].fd > m)
			m = o->files[i].fd;
	for (size_t i = 0; i < o->nfds; i++)
		if (o->fds[i].target > m)
			m = o->fds[i].target;
	for (size_t i = 0; i < o->nepolls; i++)
		if (o->epolls[i].fd > m)
			m = o->epolls[i].fd;
	for (size_t i = 0; i < o->nlistens; i++)
		if (o->listens[i].fd > m)
			m = o->listens[i].fd;
	return m;
}

/* Received descriptors land on the lowest free numbers; move any that sits on a number we
 * are about to fill so a later dup3 cannot close it. */
static int move_off_targets(struct tracee *c, const struct dbxcr_spawn_opts *o, int *fds,
			    size_t n, struct dbxcr_error *err)
{
	for (size_t i = 0; i < n; i++) {
		long a[6] = { fds[i], F_DUPFD_CLOEXEC, max_target(o) + 1, 0, 0, 0 };
		long nfd;

		if (!is_target(o, fds[i]))
			continue;
		nfd = rsys(c, SYS_fcntl, a, err, "move received fd %d", fds[i]);
		if (nfd < 0)
			return -1;
		a[1] = 0;
		if (rsys(c, SYS_close, a, err, "close received fd %d", fds[i]) < 0)
			return -1;
		fds[i] = (int)nfd;
	}
	return 0;
}

/* A string at `at` of the scratch area, `room` bytes of it left from there. */
static int put_at(struct tracee *c, unsigned long at, size_t room, const char *s,
		  const char *what, struct dbxcr_error *err)
{
	size_t len = strlen(s) + 1;

	if (len > room)
		return fail(err, ENAMETOOLONG, c->pid, "%s is %zu bytes", what, len);
	return mem_write(c->pid, at, s, len, err);
}

static int put_string(struct tracee *c, unsigned long scratch, const char *s, const char *what,
		      struct dbxcr_error *err)
{
	return put_at(c, scratch, SCRATCH_LEN, s, what, err);
}

/* The access and modification times of the directory `first` (the outermost stand-in) is
 * made in, read in the child (the restored tree is its view): `anchor` gets its path. */
static int anchor_times(struct tracee *c, unsigned long scratch, const char *first,
			char anchor[PATH_MAX], struct timespec times[2], struct dbxcr_error *err)
{
	const char *slash = strrchr(first, '/');
	size_t len = slash ? (size_t)(slash - first) : 0;
	struct stat st;
	long a[6] = { AT_FDCWD, 0, 0, AT_SYMLINK_NOFOLLOW, 0, 0 };

	if (!slash || len >= PATH_MAX - 1)
		return fail(err, EINVAL, c->pid, "stand-in %s of a deleted cwd: not an absolute "
			    "path", first);
	memcpy(anchor, first, len);
	strcpy(anchor + len, len ? "" : "/");
	a[1] = (long)(scratch + sizeof(st));
	a[2] = (long)scratch;
	if (put_at(c, scratch + sizeof(st), SCRATCH_LEN - sizeof(st), anchor, anchor, err) < 0 ||
	    rsys(c, SYS_newfstatat, a, err, "stat %s (holding a deleted cwd)", anchor) < 0 ||
	    mem_read(c->pid, scratch, &st, sizeof(st), err) < 0)
		return -1;
	times[0] = st.st_atim;
	times[1] = st.st_mtim;
	return 0;
}

static int set_anchor_times(struct tracee *c, unsigned long scratch, const char *anchor,
			    const struct timespec times[2], struct dbxcr_error *err)
{
	long a[6] = { AT_FDCWD, (long)(scratch + 2 * sizeof(*times)), (long)scratch,
		      AT_SYMLINK_NOFOLLOW, 0, 0 };

	if (mem_write(c->pid, scratch, times, 2 * sizeof(*times), err) < 0 ||
	    put_at(c, scratch + 2 * sizeof(*times), SCRATCH_LEN - 2 * sizeof(*times), anchor,
		   anchor, err) < 0)
		return -1;
	return rsys(c, SYS_utimensat, a, err, "set the times of %s back", anchor) < 0 ? -1 : 0;
}

/* chdir to o->cwd in the child.  A directory removed while a process is in it stays
 * alive, empty and nameless, as that process's cwd (lookups in it fail with ENOENT, its
 * ".." still leads to the directory that held it); the restored tree has no path to it.
 * For such a cwd the caller names stand-ins (o->cwd_made, outermost first, the last being
 * o->cwd): the child makes them, enters the innermost and removes them all again, so its
 * cwd is once more a removed directory before it runs (deltabox/cr/deleted_cwd.py).  What
 * was made is removed even when a step fails, and the directory they were made in gets
 * back the access and modification times mkdir and rmdir changed: nothing is left. */
static int enter_cwd(struct tracee *c, unsigned long scratch, const struct dbxcr_spawn_opts *o,
		     struct dbxcr_error *err)
{
	struct timespec times[2];
	char anchor[PATH_MAX];
	long a[6] = { 0 };
	size_t made = 0;
	int rc = 0;

	if (o->ncwd_made && anchor_times(c, scratch, o->cwd_made[0], anchor, times, err) < 0)
		return -1;
	a[0] = (long)scratch;
	a[1] = 0700;
	for (; made < o->ncwd_made; made++) {
		if (put_string(c, scratch, o->cwd_made[made], "stand-in of a deleted cwd", err) < 0 ||
		    rsys(c, SYS_mkdir, a, err, "mkdir %s (stand-in of a deleted cwd)",
			 o->cwd_made[made]) < 0) {
			rc = -1;
			break;
		}
	}
	if (rc == 0 && (put_string(c, scratch, o->cwd, "cwd", err) < 0 ||
			rsys(c, SYS_chdir, a, err, "chdir %s", o->cwd) < 0))
		rc = -1;
	while (made > 0) {
		struct dbxcr_error ignored;
		struct dbxcr_error *e = rc == 0 ? err : &ignored;

		made--;
		if (put_string(c, scratch, o->cwd_made[made], "stand-in of a deleted cwd", e) < 0 ||
		    rsys(c, SYS_rmdir, a, e, "rmdir %s (stand-in of a deleted cwd)",
			 o->cwd_made[made]) < 0)
			rc = -1;
	}
	if (o->ncwd_made) {
		struct dbxcr_error ignored;

		if (set_anchor_times(c, scratch, anchor, times, rc == 0 ? err : &ignored) < 0)
			rc = -1;
	}
	return rc;
}

/* /dev/tty opens the opener's controlling terminal (ENXIO without one): a child reopens
 * it once it has its terminal (take_terminal, or inherited from its restored parent). */
static bool is_dev_tty(const struct dbxcr_file *f)
{
	return strcmp(f->path, "/dev/tty") == 0;
}

/* Reopen one regular file at its fd number with its own file description and offset. */
static int reopen_file(struct tracee *c, unsigned long scratch, const struct dbxcr_file *f,
		       struct dbxcr_error *err)
{
	int flags = f->flags & ~(O_CREAT | O_EXCL | O_TRUNC);
	long a[6] = { AT_FDCWD, (long)scratch, flags, 0, 0, 0 };
	long nfd;

	if (put_string(c, scratch, f->path, "file path", err) < 0)
		return -1;
	nfd = rsys(c, SYS_openat, a, err, "reopen fd %d: open %s", f->fd, f->path);
	if (nfd < 0)
		return -1;
	if (nfd != f->fd) {
		long d[6] = { nfd, f->fd, flags & O_CLOEXEC, 0, 0, 0 };

		if (rsys(c, SYS_dup3, d, err, "reopen fd %d: dup3", f->fd) < 0)
			return -1;
		d[1] = 0;
		d[2] = 0;
		if (rsys(c, SYS_close, d, err, "reopen fd %d: close %ld", f->fd, nfd) < 0)
			return -1;
	}
	if (!(flags & O_APPEND) && f->offset >= 0) {
		long s[6] = { f->fd, (long)f->offset, SEEK_SET, 0, 0, 0 };

		if (rsys(c, SYS_lseek, s, err, "reopen fd %d: lseek %lld", f->fd, f->offset) < 0)
			return -1;
	}
	return 0;
}

/* Queue the origin's pending signals (with their siginfo) in the child; its mask is still
 * all-blocked, so they wait for the checkpointed mask.  Sending to itself, the child may
 * queue any si_code. */
static int requeue_pending(struct tracee *c, struct dbxcr_template *tpl,
			   struct dbxcr_error *err)
{
	long a[6] = { 0 }, self;

	if (tpl->pend.n == 0)
		return 0;
	self = rsys(c, SYS_getpid, a, err, "getpid to queue pending signals");
	if (self < 0)
		return -1;
	for (int i = 0; i < tpl->pend.n; i++) {
		const siginfo_t *si = &tpl->pend.info[i];

		if (mem_write(c->pid, tpl->scratch, si, sizeof(*si), err) < 0)
			return -1;
		if (tpl->pend.shared[i]) {
			long q[6] = { self, si->si_signo, (long)tpl->scratch, 0, 0, 0 };

			if (rsys(c, SYS_rt_sigqueueinfo, q, err, "queue pending signal %d",
				 si->si_signo) < 0)
				return -1;
		} else {
			long q[6] = { self, self, si->si_signo, (long)tpl->scratch, 0, 0 };

			if (rsys(c, SYS_rt_tgsigqueueinfo, q, err, "queue pending signal %d",
				 si->si_signo) < 0)
				return -1;
		}
	}
	return 0;
}

static bool is_listener(const struct dbxcr_listen *l)
{
	return (l->type & 0xf) == SOCK_STREAM;
}

static const char *sock_kind(const struct dbxcr_listen *l)
{
	if (l->family == AF_NETLINK)
		return "netlink socket";
	return is_listener(l) ? "listening socket" : "UDP socket";
}

/* setsockopt(s, level, name, &value) in the child, the value passed through scratch. */
static int set_sockopt(struct tracee *c, unsigned long scratch, long s, const struct dbxcr_listen *l,
		       int level, int name, int value, struct dbxcr_error *err)
{
	long d[6] = { s, level, name, (long)scratch, sizeof(int), 0 };

	if (mem_write(c->pid, scratch, &value, sizeof(value), err) < 0)
		return -1;
	if (rsys(c, SYS_setsockopt, d, err, "%s fd %d: setsockopt(%d, %d) = %d", sock_kind(l),
		 l->fd, level, name, value) < 0)
		return -1;
	return 0;
}

/* One of the original's options on the child's socket s: an int, or its struct's bytes
 * (passed through scratch, as the int). */
static int set_option(struct tracee *c, unsigned long scratch, long s, const struct dbxcr_listen *l,
		      const struct dbxcr_sockopt *o, struct dbxcr_error *err)
{
	long d[6] = { s, o->level, o->name, (long)scratch, o->len, 0 };

	if (!o->len)
		return set_sockopt(c, scratch, s, l, o->level, o->name, o->value, err);
	if (o->len > sizeof(o->bytes))
		return fail(err, EINVAL, c->pid, "%s fd %d: option (%d, %d) of %u bytes",
			    sock_kind(l), l->fd, o->level, o->name, o->len);
	if (mem_write(c->pid, scratch, o->bytes, o->len, err) < 0)
		return -1;
	if (rsys(c, SYS_setsockopt, d, err, "%s fd %d: setsockopt(%d, %d) of %u bytes",
		 sock_kind(l), l->fd, o->level, o->name, o->len) < 0)
		return -1;
	return 0;
}

/* bind or connect (nr) the child's socket s to a raw sockaddr, passed at scratch + 64 (the
 * option values use the first bytes). */
static int set_address(struct tracee *c, unsigned long scratch, long s, const struct dbxcr_listen *l,
		       long nr, const unsigned char *addr, unsigned int len, struct dbxcr_error *err)
{
	long d[6] = { s, (long)(scratch + 64), len, 0, 0, 0 };

	if (mem_write(c->pid, scratch + 64, addr, len, err) < 0)
		return -1;
	if (rsys(c, nr, d, err, "%s fd %d: %s", sock_kind(l), l->fd,
		 nr == SYS_bind ? "bind" : "connect") < 0)
		return -1;
	return 0;
}

/* Join the child's socket s to the multicast group g (MCAST_JOIN_GROUP: by interface
 * index, for either family; an IPv4 group on an IPv6 socket at the IP level, as the
 * original's membership is kept there), the group_req at scratch + 64. */
static int join_mcast(struct tracee *c, unsigned long scratch, long s, const struct dbxcr_listen *l,
		     const struct dbxcr_mcast_group *g, struct dbxcr_error *err)
{
	struct group_req req;
	long d[6] = { s, 0, MCAST_JOIN_GROUP, (long)(scratch + 64), sizeof(req), 0 };

	memset(&req, 0, sizeof(req));
	req.gr_interface = g->ifindex;
	if (g->family == AF_INET) {
		struct sockaddr_in *a = (struct sockaddr_in *)&req.gr_group;

		a->sin_family = AF_INET;
		memcpy(&a->sin_addr, g->addr, sizeof(a->sin_addr));
		d[1] = IPPROTO_IP;
	} else if (g->family == AF_INET6) {
		struct sockaddr_in6 *a = (struct sockaddr_in6 *)&req.gr_group;

		a->sin6_family = AF_INET6;
		memcpy(&a->sin6_addr, g->addr, sizeof(a->sin6_addr));
		d[1] = IPPROTO_IPV6;
	} else {
		return fail(err, EINVAL, c->pid, "%s fd %d: a multicast group of family %d",
			    sock_kind(l), l->fd, g->family);
	}
	if (mem_write(c->pid, scratch + 64, &req, sizeof(req), err) < 0)
		return -1;
	if (rsys(c, SYS_setsockopt, d, err, "%s fd %d: join multicast group (interface %u)",
		 sock_kind(l), l->fd, g->ifindex) < 0)
		return -1;
	return 0;
}

/* Attach the original's socket filter to the child's socket s (SO_ATTACH_FILTER: the
 * kernel copies the program, so it may live in scratch): the struct sock_fprog at
 * scratch + 64, its instructions from scratch + 256 (set_address uses 64..192 later). */
static int attach_filter(struct tracee *c, unsigned long scratch, long s,
			 const struct dbxcr_listen *l, struct dbxcr_error *err)
{
	struct sock_fprog prog = { .len = (unsigned short)l->nfilter,
				   .filter = (struct sock_filter *)(scratch + 256) };
	long d[6] = { s, SOL_SOCKET, SO_ATTACH_FILTER, (long)(scratch + 64), sizeof(prog), 0 };

	if (l->nfilter > DBXCR_FILTER_MAX || !l->filter)
		return fail(err, EINVAL, c->pid, "%s fd %d: a socket filter of %u instructions",
			    sock_kind(l), l->fd, l->nfilter);
	if (mem_write(c->pid, scratch + 256, l->filter, l->nfilter * sizeof(*l->filter), err) < 0 ||
	    mem_write(c->pid, scratch + 64, &prog, sizeof(prog), err) < 0)
		return -1;
	if (rsys(c, SYS_setsockopt, d, err, "%s fd %d: attach its socket filter (%u instructions)",
		 sock_kind(l), l->fd, l->nfilter) < 0)
		return -1;
	return 0;
}

/* Create a listening TCP socket, a UDP socket or a netlink socket like the original's and
 * install it at l->fd.  Its filter is attached before anything can arrive.  Bound with
 * SO_REUSEADDR so connections of the killed original lingering in TIME_WAIT cannot block
 * the port; the original's own SO_REUSEADDR value is set afterwards.  A UDP socket's
 * connect() only records its peer: the peer need not exist yet.  A netlink socket's bind
 * takes its port id (free: the killed original's socket is closed, and a fork has its own
 * network namespace) and sets its first 32 groups, keeping those the options added
 * (NETLINK_ADD_MEMBERSHIP, for groups past 32). */
static int recreate_listen(struct tracee *c, unsigned long scratch, const struct dbxcr_listen *l,
			   struct dbxcr_error *err)
{
	long a[6] = { l->family, l->type, l->protocol, 0, 0, 0 };
	long s, d[6] = { 0 };

	if (l->addrlen > sizeof(l->addr) || l->peerlen > sizeof(l->peer) ||
	    l->nopts > DBXCR_SOCKOPTS || l->ngroups > DBXCR_MCAST_GROUPS)
		return fail(err, EINVAL, c->pid, "%s fd %d: address of %u bytes, peer of %u, "
			    "%u options, %u multicast groups", sock_kind(l), l->fd, l->addrlen,
			    l->peerlen, l->nopts, l->ngroups);
	s = rsys(c, SYS_socket, a, err, "%s fd %d: socket", sock_kind(l), l->fd);
	if (s < 0)
		return -1;
	if (l->nfilter && attach_filter(c, scratch, s, l, err) < 0)
		return -1;
	if (set_sockopt(c, scratch, s, l, SOL_SOCKET, SO_REUSEADDR, 1, err) < 0 ||
	    (l->reuseport && set_sockopt(c, scratch, s, l, SOL_SOCKET, SO_REUSEPORT, 1, err) < 0) ||
	    (l->family == AF_INET6 &&
	     set_sockopt(c, scratch, s, l, IPPROTO_IPV6, IPV6_V6ONLY, l->v6only, err) < 0))
		return -1;
	for (unsigned int i = 0; i < l->nopts; i++)
		if (set_option(c, scratch, s, l, &l->opts[i], err) < 0)
			return -1;
	if (l->addrlen && set_address(c, scratch, s, l, SYS_bind, l->addr, l->addrlen, err) < 0)
		return -1;
	for (unsigned int i = 0; i < l->ngroups; i++)
		if (join_mcast(c, scratch, s, l, &l->groups[i], err) < 0)
			return -1;
	if (is_listener(l)) {
		d[0] = s;
		d[1] = l->backlog;
		if (rsys(c, SYS_listen, d, err, "listening socket fd %d: listen", l->fd) < 0)
			return -1;
	}
	if (l->peerlen && set_address(c, scratch, s, l, SYS_connect, l->peer, l->peerlen, err) < 0)
		return -1;
	if (!l->reuseaddr && set_sockopt(c, scratch, s, l, SOL_SOCKET, SO_REUSEADDR, 0, err) < 0)
		return -1;
	if (s != l->fd) {
		d[0] = s;
		d[1] = l->fd;
		d[2] = (l->type & SOCK_CLOEXEC) ? O_CLOEXEC : 0;
		if (rsys(c, SYS_dup3, d, err, "%s fd %d: dup3", sock_kind(l), l->fd) < 0)
			return -1;
		d[1] = d[2] = 0;
		if (rsys(c, SYS_close, d, err, "%s fd %d: close %ld", sock_kind(l), l->fd, s) < 0)
			return -1;
	}
	return 0;
}

/* Take the original's file locks again (see struct dbxcr_lock), never waiting: the files
 * are this restore's own, so a lock that is taken already means two restored descriptors
 * claim one lock, which must fail the restore rather than hang it. */
static int take_locks(struct tracee *c, unsigned long scratch, const struct dbxcr_lock *locks,
		      size_t n, struct dbxcr_error *err)
{
	for (size_t i = 0; i < n; i++) {
		const struct dbxcr_lock *l = &locks[i];
		bool write = l->type == F_WRLCK;
		long a[6] = { l->fd, 0, 0, 0, 0, 0 };
		struct flock fl = { .l_type = (short)l->type, .l_whence = SEEK_SET,
				    .l_start = l->start, .l_len = l->len };

		if (l->kind == DBXCR_LOCK_FLOCK) {
			a[1] = (write ? LOCK_EX : LOCK_SH) | LOCK_NB;
			if (rsys(c, SYS_flock, a, err, "flock fd %d (%s)", l->fd,
				 write ? "exclusive" : "shared") < 0)
				return -1;
			continue;
		}
		a[1] = l->kind == DBXCR_LOCK_OFD ? F_OFD_SETLK : F_SETLK;
		a[2] = (long)scratch;
		if (mem_write(c->pid, scratch, &fl, sizeof(fl), err) < 0 ||
		    rsys(c, SYS_fcntl, a, err, "%s lock fd %d bytes %lld+%lld",
			 l->kind == DBXCR_LOCK_OFD ? "OFD" : "POSIX", l->fd, l->start, l->len) < 0)
			return -1;
	}
	return 0;
}

/* In the child, epoll_ctl(epfd, EPOLL_CTL_ADD, w->fd) with w's events and data. */
static int add_watch(struct tracee *c, unsigned long scratch, int epfd,
		     const struct dbxcr_epoll_watch *w, struct dbxcr_error *err)
{
	struct epoll_event ev = { .events = w->events, .data.u64 = w->data };
	long ctl[6] = { epfd, EPOLL_CTL_ADD, w->fd, (long)scratch, 0, 0 };

	if (mem_write(c->pid, scratch, &ev, sizeof(ev), err) < 0)
		return -1;
	return rsys(c, SYS_epoll_ctl, ctl, err, "epoll fd %d: watch fd %d (events %#x)", epfd,
		    w->fd, w->events) < 0 ? -1 : 0;
}

/* Create an epoll instance like the original's at e->fd and add its watches.  The child
 * still holds the template's copy at e->fd (one instance with the original process: an
 * epoll_ctl on it would change the original's), replaced by dup3 before any watch is
 * added.  Each watch names a descriptor already installed in the child. */
static int recreate_epoll(struct tracee *c, unsigned long scratch, const struct dbxcr_epoll *e,
			  struct dbxcr_error *err)
{
	long a[6] = { e->cloexec ? EPOLL_CLOEXEC : 0, 0, 0, 0, 0, 0 };
	long efd;

	if (e->dup_of > 0) {	/* a second descriptor of one instance (mio dups its own) */
		long d[6] = { e->dup_of - 1, e->fd, e->cloexec ? O_CLOEXEC : 0, 0, 0, 0 };

		return rsys(c, SYS_dup3, d, err, "epoll fd %d: dup3 of epoll fd %d", e->fd,
			    e->dup_of - 1) < 0 ? -1 : 0;
	}
	efd = rsys(c, SYS_epoll_create1, a, err, "epoll fd %d: epoll_create1", e->fd);
	if (efd < 0)
		return -1;
	if (efd != e->fd) {
		long d[6] = { efd, e->fd, e->cloexec ? O_CLOEXEC : 0, 0, 0, 0 };

		if (rsys(c, SYS_dup3, d, err, "epoll fd %d: dup3", e->fd) < 0)
			return -1;
		d[1] = d[2] = 0;
		if (rsys(c, SYS_close, d, err, "epoll fd %d: close %ld", e->fd, efd) < 0)
			return -1;
	}
	for (size_t i = 0; i < e->nwatches; i++)
		if (add_watch(c, scratch, e->fd, &e->watches[i], err) < 0)
			return -1;
	return 0;
}

/* Attach the System V segment m->shmid at m->start over the template's attachment, which
 * is the checkpointed process's own segment (or, in a fork, the source sandbox's): the
 * child is in the target IPC namespace by now, where the restore made the segment again
 * with its id and content.  SHM_REMAP replaces the old attachment in one step (its
 * attach count drops, the new one's rises, as for the original); the protection follows
 * from the flags as the original's shmat gave it (capture refuses any other). */
static int attach_segment(struct tracee *c, const struct dbxcr_remap *m,
			  struct dbxcr_error *err)
{
	long a[6] = { m->shmid, (long)m->start,
		      SHM_REMAP | (m->prot & PROT_WRITE ? 0 : SHM_RDONLY) |
		      (m->prot & PROT_EXEC ? SHM_EXEC : 0), 0, 0, 0 };
	long got = rsys(c, SYS_shmat, a, err, "shmat System V segment %d at %#lx", m->shmid,
			m->start);

	if (got < 0)
		return -1;
	if ((unsigned long)got != m->start)
		return fail(err, EFAULT, c->pid, "System V segment %d attached at %#lx, not %#lx",
			    m->shmid, (unsigned long)got, m->start);
	return 0;
}

/* Map the received descriptor fd over the mapping [start, end) and close it.  The child
 * inherited the template's mapping: for a shared one, the original's own object, which it
 * went on writing after the checkpoint; for a private one, a file written in place since,
 * whose pages the template never wrote show the new bytes (a private mapping reads the
 * page cache until written).  MAP_FIXED replaces it in one step; a mapping keeps its file
 * without the descriptor.  A private one then gets back the pages the original had
 * written, from the template (tpl). */
static int remap(struct tracee *c, pid_t tpl, const struct dbxcr_remap *m, int fd,
		 struct dbxcr_error *err)
{
	long a[6] = { (long)m->start, (long)(m->end - m->start), m->prot,
		      (m->private_map ? MAP_PRIVATE : MAP_SHARED) | MAP_FIXED, fd,
		      (long)m->offset };
	long got;

	if (m->end <= m->start)
		return fail(err, EINVAL, c->pid, "mapping %#lx-%#lx: empty", m->start, m->end);
	if (m->sysv)
		return attach_segment(c, m, err);
	got = rsys(c, SYS_mmap, a, err, "map %#lx-%#lx again", m->start, m->end);
	if (got < 0)
		return -1;
	if ((unsigned long)got != m->start)
		return fail(err, EFAULT, c->pid, "mapping made again at %#lx, not %#lx",
			    (unsigned long)got, m->start);
	if (m->private_map && copy_private_pages(tpl, c->pid, m->start, m->end, err) < 0)
		return -1;
	a[0] = fd;
	return rsys(c, SYS_close, a, err, "close the fd of mapping %#lx", m->start) < 0 ? -1 : 0;
}

/* Join the target sandbox's namespaces other than pid (born there) and mount (a
 * generation of its file system, joined next). */
static int join_sandbox_ns(struct tracee *c, int pidfd, struct dbxcr_error *err)
{
	long a[6] = { pidfd, CLONE_NEWNET | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWCGROUP,
		      0, 0, 0, 0 };

	if (rsys(c, SYS_setns, a, err, "setns into the sandbox's net/uts/ipc/cgroup namespaces") < 0)
		return -1;
	a[1] = 0;
	return rsys(c, SYS_close, a, err, "close sandbox init pidfd") < 0 ? -1 : 0;
}

/* Last steps in a child before it gets the checkpointed registers: queue the original's
 * pending signals again and arm its timers (fork copies neither: timers.c), give back the
 * original's name and command line (the template's disguise) and unmap the scratch page. */
/* `thr`: the child's other threads (NULL: it has none), still stopped: they get the
 * template's credentials too, while the scratch page is still mapped. */
static int finish_child(struct tracee *c, struct dbxcr_template *tpl, struct tracee *thr,
			bool born_of_parent, struct dbxcr_error *err)
{
	long a[6] = { (long)tpl->scratch, SCRATCH_LEN, 0, 0, 0, 0 };

	if (requeue_pending(c, tpl, err) < 0 || arm_itimers(c, tpl, err) < 0 ||
	    arm_ptimers(c, tpl, err) < 0)
		return -1;
	if (madvise_runs(c, tpl->dontfork, tpl->ndontfork, MADV_DONTFORK, err) < 0)
		return -1;
	if (tpl->comm[0] && set_comm(c, tpl->scratch, tpl->comm, err) < 0)
		return -1;
	if (tpl->args_hidden && set_mm_bounds(c, tpl->scratch, tpl->mm, false, err) < 0)
		return -1;
	/* Last: after it, the child may lack the rights every step above needs. */
	for (int i = 0; thr && i < tpl->threads->n; i++)
		if (creds_give(&thr[i], tpl->scratch, &tpl->creds, err) < 0)
			return -1;
	if (creds_give(c, tpl->scratch, &tpl->creds, err) < 0 ||
	    give_parent_death(c, tpl, born_of_parent, err) < 0)
		return -1;
	if (rsys(c, SYS_munmap, a, err, "munmap scratch") < 0)
		return -1;
	return 0;
}

/* pgid -1: lead a group of our own (setpgid(0, 0)); > 0: join that group.  Joining fails
 * (EPERM) when the group's restored members have all exited already, e.g. a shell whose
 * children are no longer its children: lead a group of our own then, never stay in the
 * template's group (another sandbox's, or one the template left: see
 * dbxcr_template_own_group). */
static int join_group(struct tracee *c, int pgid, struct dbxcr_error *err)
{
	long g[6] = { 0, pgid > 0 ? pgid : 0, 0, 0, 0, 0 };
	long ret;

	if (pgid == DBXCR_NEW_SESSION)	/* a fresh child is no group leader: setsid works */
		return rsys(c, SYS_setsid, g, err, "setsid()") < 0 ? -1 : 0;

	if (remote_syscall(c, SYS_setpgid, g, &ret, err) < 0)
		return -1;
	if (ret == -EPERM && pgid > 0) {
		g[1] = 0;
		if (remote_syscall(c, SYS_setpgid, g, &ret, err) < 0)
			return -1;
	}
	if (ret < 0)
		return fail(err, (int)-ret, c->pid, "setpgid(0, %d)", pgid > 0 ? pgid : 0);
	return 0;
}

/* Put a descriptor the child received (transfer_fds: close-on-exec) at its target number,
 * close-on-exec as the original's was. */
static int install_fd(struct tracee *c, int got, int target, int cloexec,
		      struct dbxcr_error *err)
{
	long d[6] = { got, target, cloexec ? O_CLOEXEC : 0, 0, 0, 0 };

	if (got == target) {
		d[1] = F_SETFD;
		d[2] = cloexec ? FD_CLOEXEC : 0;
		return rsys(c, SYS_fcntl, d, err, "fd %d: F_SETFD", target) < 0 ? -1 : 0;
	}
	if (rsys(c, SYS_dup3, d, err, "install fd %d", target) < 0)
		return -1;
	d[1] = 0;
	d[2] = 0;
	return rsys(c, SYS_close, d, err, "close received fd %d", got) < 0 ? -1 : 0;
}

/* Make the pty slave at the child's fd its controlling terminal.  The kernel gives a
 * terminal only to a session leader that has none (a fresh setsid() has none) and only if
 * no other session has it (a pty made for this restore has no session yet); the terminal's
 * foreground process group becomes the leader's, as the capture required (cr/ptys.py). */
static int take_terminal(struct tracee *c, int fd, struct dbxcr_error *err)
{
	long a[6] = { fd, TIOCSCTTY, 0, 0, 0, 0 };

	return rsys(c, SYS_ioctl, a, err, "ioctl(%d, TIOCSCTTY): its controlling terminal", fd)
		< 0 ? -1 : 0;
}

/* Lock the original's locked memory again (see struct dbxcr_mlock). mlock2 faults the
 * range in (a private page copied from the template on write access), as the original's
 * mlock did; MLOCK_ONFAULT only marks it. */
static int lock_memory(struct tracee *c, const struct dbxcr_mlock *m, size_t n,
		       struct dbxcr_error *err)
{
	for (size_t i = 0; i < n; i++) {
		long a[6] = { (long)m[i].start, (long)(m[i].end - m[i].start),
			      m[i].onfault ? MLOCK_ONFAULT : 0, 0, 0, 0 };

		if (rsys(c, SYS_mlock2, a, err, "mlock2 %#lx-%#lx%s", m[i].start, m[i].end,
			 m[i].onfault ? " (on fault)" : "") < 0)
			return -1;
	}
	return 0;
}

/* What a spawn leaves: a running child, a carrier (stopped; a birth gives the process),
 * or a held child (stopped with its threads; it may fork adopted children: see the held
 * section below). */
/* SPAWN_HELD_SHARED: held, and sharing the template's address space (CLONE_VM) until it
 * is given another one (held_exec): a chain's ancestor (dbxcr_held_chain). */
enum spawn_kind { SPAWN_RUN, SPAWN_CARRIER, SPAWN_HELD, SPAWN_HELD_SHARED };

static int setup_child(struct tracee *c, struct dbxcr_template *tpl,
		       const struct dbxcr_spawn_opts *o, const struct pidns_switch *sw,
		       enum spawn_kind kind, struct tracee **thr, struct dbxcr_error *err)
{
	bool carrier = kind == SPAWN_CARRIER;
	int src[MAX_SPAWN_FDS], got[MAX_SPAWN_FDS];
	size_t n = 0, first_fd = 0;
	int mnt_at = -1, ns_at = -1;
	unsigned long scratch = tpl->scratch;
	long a[6] = { 0 };

	if (carrier && set_comm(c, scratch, CARRIER_COMM, err) < 0)
		return -1;
	/* The child was born holding the template's two pid namespace fds. */
	for (int i = 0; i < 2; i++) {
		a[0] = i ? sw->own : sw->target;
		if (a[0] >= 0 && rsys(c, SYS_close, a, err, "close inherited pid namespace fd") < 0)
			return -1;
	}
	if (o->mntns_fd >= 0) {
		mnt_at = (int)n;
		src[n++] = o->mntns_fd;
	}
	if (o->ns_pidfd > 0) {
		ns_at = (int)n;
		src[n++] = o->ns_pidfd;
	}
	first_fd = n;
	if (o->nfds + o->nremaps + n > MAX_SPAWN_FDS)
		return fail(err, E2BIG, c->pid, "%zu descriptors and %zu shared mappings to "
			    "install (max %zu together)", o->nfds, o->nremaps, MAX_SPAWN_FDS - n);
	for (size_t i = 0; i < o->nfds; i++)
		src[n++] = o->fds[i].src;
	for (size_t i = 0; i < o->nremaps; i++)
		if (!o->remaps[i].sysv)		/* an attach passes no descriptor */
			src[n++] = o->remaps[i].src;
	if (n && transfer_fds(c, scratch, src, n, got, err) < 0)
		return -1;
	if (n && move_off_targets(c, o, got, n, err) < 0)
		return -1;
	if (ns_at >= 0 && join_sandbox_ns(c, got[ns_at], err) < 0)
		return -1;
	if (mnt_at >= 0) {
		/* A fresh fork is single-threaded with its own fs_struct, as setns(CLONE_NEWNS)
		 * requires; it also resets root and cwd to the namespace's root. */
		a[0] = got[mnt_at];
		a[1] = CLONE_NEWNS;
		if (rsys(c, SYS_setns, a, err, "setns into mount namespace") < 0)
			return -1;
		a[1] = 0;
		if (rsys(c, SYS_close, a, err, "close mount namespace fd") < 0)
			return -1;
	}
	if (o->cwd && enter_cwd(c, scratch, o, err) < 0)
		return -1;
	for (size_t i = 0; i < o->nfiles; i++)
		if (!is_dev_tty(&o->files[i]) && reopen_file(c, scratch, &o->files[i], err) < 0)
			return -1;
	for (size_t i = 0; i < o->nlistens; i++)
		if (recreate_listen(c, scratch, &o->listens[i], err) < 0)
			return -1;
	for (size_t i = 0; i < o->nfds; i++)
		if (install_fd(c, got[first_fd + i], o->fds[i].target, o->fds[i].cloexec, err) < 0)
			return -1;
	for (size_t i = 0, k = first_fd + o->nfds; i < o->nremaps; i++)
		if (remap(c, tpl->pid, &o->remaps[i], o->remaps[i].sysv ? -1 : got[k++], err) < 0)
			return -1;
	for (size_t i = 0; i < o->nepolls; i++)
		if (recreate_epoll(c, scratch, &o->epolls[i], err) < 0)
			return -1;
	if (o->pgid && join_group(c, o->pgid, err) < 0)
		return -1;
	if (lock_memory(c, o->mlocks, o->nmlocks, err) < 0)
		return -1;
	if (carrier)	/* pending signals, locks, the scratch page and the controlling
			 * terminal are the birth's business */
		return 0;
	if (o->ctty && take_terminal(c, o->ctty - 1, err) < 0)
		return -1;
	for (size_t i = 0; i < o->nfiles; i++)	/* its controlling terminal's, now it has one */
		if (is_dev_tty(&o->files[i]) && reopen_file(c, scratch, &o->files[i], err) < 0)
			return -1;
	if (take_locks(c, scratch, o->locks, o->nlocks, err) < 0)
		return -1;
	if (threads_recreate(c, tpl, o->set_tid_size > 0, false, thr, err) < 0)
		return -1;
	if (kind == SPAWN_HELD || kind == SPAWN_HELD_SHARED)	/* its scratch page serves its
								 * adoptions; finish at release */
		return 0;
	if (finish_child(c, tpl, *thr, false, err) < 0) {
		if (*thr) {
			threads_kill(c->pid, *thr, tpl->threads->n);
			free(*thr);
			*thr = NULL;
		}
		return -1;
	}
	return 0;
}

/* glibc keeps each thread's tid in its TLS (pthread_kill, mutex owners): the threads of a
 * multi-threaded process come back with theirs, which its pid namespace has free only
 * with the process's own pid. */
static int own_pid_only(const struct dbxcr_template *tpl, struct dbxcr_error *err)
{
	return fail(err, ENOTSUP, tpl->origin, "a multi-threaded process comes back only with "
		    "its own pid (its threads keep their tids)");
}

/* Fork and re-root a child, leaving it stopped in our trace with the template's registers,
 * mask and xstate in `c` (xstate still the template's buffer), ready for restore_and_detach,
 * and its other threads (if the template has any) in *thr, ready for threads_release.
 * A carrier (see dbxcr_spawn_carrier) keeps its scratch page and queues no signals. */
static pid_t spawn_prepared(struct dbxcr_template *tpl, const struct dbxcr_spawn_opts *opts,
			    enum spawn_kind kind, struct tracee *c, struct tracee **thr,
			    struct dbxcr_error *err)
{
	bool carrier = kind == SPAWN_CARRIER;
	static const struct dbxcr_spawn_opts none = { .mntns_fd = -1 };
	const struct dbxcr_spawn_opts *o = opts ? opts : &none;
	struct colocation col;
	struct pidns_switch sw;
	pid_t child;

	clear_error(err);
	*thr = NULL;
	if (check_owner(tpl, err) < 0)
		return -1;
	/* A carrier's threads are made at its birth (dbxcr_carrier_birth). */
	if (tpl->threads && !carrier && o->set_tid_size == 0)
		return own_pid_only(tpl, err);
	colocate(&col, tpl);
	child = clone_from_template(tpl, o, kind == SPAWN_HELD_SHARED ? CLONE_VM : 0, &sw, err);
	if (child < 0) {
		colocation_end(&col);
		return -1;
	}
	if (wait_birth(child, err) < 0 || move_to_cgroups(child, o, err) < 0 ||
	    adopt(c, child, tpl->site, err) < 0)
		goto kill;
	if (setup_child(c, tpl, o, &sw, kind, thr, err) < 0)
		goto kill;
	if (unpin_child(&col, tpl, child, err) < 0) {
		if (*thr) {
			threads_kill(child, *thr, tpl->threads->n);
			free(*thr);
			*thr = NULL;
		}
		goto kill;
	}
	colocation_end(&col);
	/* Hand the child the original's checkpointed state (see the file comment on why the
	 * exact registers give the right restart semantics). */
	c->regs = tpl->regs;
	c->sigmask = tpl->sigmask;
	c->xstate = tpl->xstate;
	c->xstate_len = tpl->xstate_len;
	c->deferred_sig = 0;	/* a SIGSTOP aimed at the child's group while we worked */
	return child;
kill:
	kill_traced(child);
	colocation_end(&col);
	return -1;
}

pid_t dbxcr_spawn(struct dbxcr_template *tpl, const struct dbxcr_spawn_opts *opts,
		  struct dbxcr_error *err)
{
	struct tracee c, *thr;
	pid_t child = spawn_prepared(tpl, opts, SPAWN_RUN, &c, &thr, err);

	if (child < 0)
		return -1;
	if (thr && threads_release(child, tpl, thr, err) < 0)
		return -1;
	stop_again(&c, tpl);
	if (restore_and_detach(&c, err) < 0) {
		kill_traced(child);
		return -1;
	}
	return child;
}

/* ---------- held processes and adopted children (a restored parent's own children) ----------
 *
 * A child spawned from its template is the template's sibling (CLONE_PARENT), and the
 * template's parent is the checkpoint's parent process, which a rollback kills: the
 * restored child ends up a child of the sandbox's init, and its restored parent cannot
 * wait for it (wait4 fails with ECHILD: a shell loop's `sleep`, subprocess.run, a shell's
 * background jobs).  No call re-parents a process, and every process holding the child's
 * memory descends from the child's original, so the restored parent's own child gets
 * that memory by copy: the parent is spawned *held* (re-rooted, its threads made, all
 * stopped in our trace with the checkpoint's registers, its scratch page still mapped);
 * an injected clone3 in it (exit signal SIGCHLD, the child's pid by set_tid) gives a
 * child, into which the child's image is restored (dbxcr_held_adopt, criu_incr.c) and
 * which is then re-rooted like a spawn and held in turn, so that it can adopt its own
 * children.  Releasing a held process finishes it as a spawn finishes its child and lets
 * it run: nothing runs before its children exist.
 */
struct dbxcr_held {
	struct tracee c;		/* stopped; regs, mask and xstate: the checkpoint's */
	struct tracee *thr;		/* its other threads, stopped (NULL: it has one) */
	struct dbxcr_template *tpl;	/* what finish_child gives it; scratch page mapped */
	bool own_tpl;	/* an adopted child's template struct describes the child itself:
			 * freed with the held, never killed */
	bool shared;	/* shares its template's address space (CLONE_VM): no rseq
			 * registration or sigaltstack of its own, nor will its forks have
			 * them (held_spawn_child gives them back) */
	bool born_of_parent;	/* born of its restored parent (an adopted child, a chain's
				 * member but its root): gets its parent-death signal back */
};

static void held_free(struct dbxcr_held *h)
{
	if (h->own_tpl)
		template_free(h->tpl);
	free(h->thr);
	free(h);
}

/* The state the held process resumes with at its release (as spawn_prepared gives it). */
static void held_ready(struct dbxcr_held *h)
{
	h->c.regs = h->tpl->regs;
	h->c.sigmask = h->tpl->sigmask;
	h->c.xstate = h->tpl->xstate;
	h->c.xstate_len = h->tpl->xstate_len;
	h->c.deferred_sig = 0;
}

static pid_t spawn_held_as(struct dbxcr_template *tpl, const struct dbxcr_spawn_opts *opts,
			   enum spawn_kind kind, struct dbxcr_held **out, struct dbxcr_error *err)
{
	struct dbxcr_held *h;
	pid_t child;

	*out = NULL;
	h = calloc(1, sizeof(*h));
	if (!h)
		return fail(err, ENOMEM, tpl->pid, "allocating a held child");
	child = spawn_prepared(tpl, opts, kind, &h->c, &h->thr, err);
	h->shared = kind == SPAWN_HELD_SHARED;
	if (child < 0) {
		free(h);
		return -1;
	}
	h->tpl = tpl;
	*out = h;
	return child;
}

pid_t dbxcr_spawn_held(struct dbxcr_template *tpl, const struct dbxcr_spawn_opts *opts,
		       struct dbxcr_held **out, struct dbxcr_error *err)
{
	return spawn_held_as(tpl, opts, SPAWN_HELD, out, err);
}

pid_t held_spawn_shared(struct dbxcr_template *tpl, const struct dbxcr_spawn_opts *opts,
			struct dbxcr_held **out, struct dbxcr_error *err)
{
	return spawn_held_as(tpl, opts, SPAWN_HELD_SHARED, out, err);
}

pid_t dbxcr_held_pid(const struct dbxcr_held *h)
{
	return h->c.pid;
}

/* A held leader of a pty's session takes its terminal before it has its descriptors (a
 * chain's root: its children, born next, inherit the terminal): the one descriptor of o's
 * that is its terminal is installed at its number, then TIOCSCTTY (take_terminal).  The
 * full setup later installs it again and takes the terminal again, which the kernel
 * accepts from the session's leader. */
int held_take_terminal(struct dbxcr_held *h, const struct dbxcr_spawn_opts *o,
		       struct dbxcr_error *err)
{
	int target = o->ctty - 1, got;

	for (size_t i = 0; i < o->nfds; i++) {
		if (o->fds[i].target != target)
			continue;
		if (transfer_fds(&h->c, h->tpl->scratch, &o->fds[i].src, 1, &got, err) < 0 ||
		    install_fd(&h->c, got, target, o->fds[i].cloexec, err) < 0)
			return -1;
		return take_terminal(&h->c, target, err);
	}
	return fail(err, EINVAL, h->c.pid, "its controlling terminal's fd %d is not among its "
		    "descriptors", target);
}

/* clone3 in the held process: its own child (exit signal SIGCHLD, pid set_tid[0] in its
 * pid namespace; sharing its address space given CLONE_VM in flags), attached at birth
 * and stopped before it runs any code.  The held
 * process has the options of the template it was forked from (auto-attached children
 * inherit them): fork events, and seccomp suspended for our calls. */
pid_t held_fork(struct dbxcr_held *h, const pid_t *set_tid, size_t n, unsigned long flags,
		struct dbxcr_error *err)
{
	struct dbx_clone_args ca = { .flags = flags, .exit_signal = SIGCHLD };
	long ret;
	pid_t child;

	if (n > 32)
		return fail(err, EINVAL, h->c.pid, "set_tid has %zu entries (max 32)", n);
	if (remote_clone3(&h->c, h->tpl->scratch, &ca, set_tid, n, &ret, err) < 0) {
		kill_traced(h->c.new_child);
		return -1;
	}
	child = h->c.new_child;
	if (ret < 0) {
		kill_traced(child);
		return fail(err, (int)-ret, h->c.pid, "clone3 of its adopted child (pid %d)",
			    n ? (int)set_tid[0] : 0);
	}
	if (child <= 0)
		return fail(err, EPROTO, h->c.pid, "clone3 returned %ld but no fork event", ret);
	if (wait_birth(child, err) < 0) {
		kill_traced(child);
		return -1;
	}
	return child;
}

/* The restored template `tpl` (a child of a held process, holding the image's memory)
 * becomes the process itself: re-rooted as a spawn's child would be (no namespace or
 * cgroup to change: it was born in its parent's), held.  Takes tpl. */
int held_become(struct dbxcr_template *tpl, const struct dbxcr_spawn_opts *o,
		bool born_of_parent, struct dbxcr_held **out, struct dbxcr_error *err)
{
	struct pidns_switch none = { -1, -1 };
	struct pinning pin = { 0 };
	struct dbxcr_held *h;

	*out = NULL;
	h = calloc(1, sizeof(*h));
	if (!h) {
		dbxcr_release_template(tpl, NULL);
		return fail(err, ENOMEM, tpl->pid, "allocating a held child");
	}
	h->tpl = tpl;
	h->own_tpl = true;
	h->born_of_parent = born_of_parent;
	h->c.pid = tpl->pid;	/* what dbxcr_held_kill kills, whatever fails below */
	if (tpl->threads && o->set_tid_size == 0) {
		own_pid_only(tpl, err);
		dbxcr_held_kill(h);
		return -1;
	}
	/* Its re-rooting injects calls one by one: beside us (colocate), unless it has
	 * threads to make, which would inherit the pin. */
	if (!tpl->threads)
		pin_beside(&pin, tpl->pid);
	if (adopt(&h->c, tpl->pid, tpl->site, err) < 0 ||
	    setup_child(&h->c, tpl, o, &none, SPAWN_HELD, &h->thr, err) < 0 ||
	    unpin_beside(&pin, err) < 0) {
		unpin_beside(&pin, NULL);
		dbxcr_held_kill(h);
		return -1;
	}
	held_ready(h);
	*out = h;
	return 0;
}

/* The parked template's sigaltstack (its main thread's, as the original had it). */
static int template_altstack(struct dbxcr_template *tpl, stack_t *out, struct dbxcr_error *err)
{
	struct dbxcr_error ignored;
	struct tracee t;
	int rc;

	if (adopt(&t, tpl->pid, tpl->site, err) < 0)
		return -1;
	t.regs = tpl->park;	/* the original's stack pointer: query_on_stack's area */
	rc = main_altstack(&t, out, err);
	if (park(tpl, rc < 0 ? &ignored : err) < 0)
		rc = -1;
	return rc;
}

/* The held process `h` forks a child that becomes what a spawn from `tpl` gives: h's
 * memory is tpl's (h was spawned from tpl, not yet given another image), so the child is
 * that template's copy-on-write copy (or shares it, with CLONE_VM in flags), re-rooted
 * with o and held; only its parent differs: h, not the template's parent
 * (dbxcr_held_chain).  Born in h's namespaces and cgroup. */
int held_spawn_child(struct dbxcr_held *h, struct dbxcr_template *tpl,
		     const struct dbxcr_spawn_opts *o, unsigned long flags,
		     struct dbxcr_held **out, struct dbxcr_error *err)
{
	struct pidns_switch none = { -1, -1 };
	struct dbxcr_held *c;
	stack_t ss;
	pid_t child;

	*out = NULL;
	if (tpl->threads)
		return fail(err, ENOTSUP, tpl->origin, "only a single-threaded process is born "
			    "from its parent's copy of its template");
	c = calloc(1, sizeof(*c));
	if (!c)
		return fail(err, ENOMEM, h->c.pid, "allocating a held child");
	child = held_fork(h, o->set_tid, o->set_tid_size, flags, err);
	if (child < 0) {
		free(c);
		return -1;
	}
	c->tpl = tpl;
	c->c.pid = child;	/* what dbxcr_held_kill kills, whatever fails below */
	c->shared = h->shared && (flags & CLONE_VM);
	c->born_of_parent = true;
	if (adopt(&c->c, child, tpl->site, err) < 0 ||
	    setup_child(&c->c, tpl, o, &none, SPAWN_HELD, &c->thr, err) < 0 ||
	    (h->shared && !c->shared && (template_altstack(tpl, &ss, err) < 0 ||
					 main_reborn(&c->c, tpl, &ss, err) < 0))) {
		dbxcr_held_kill(c);
		return -1;
	}
	held_ready(c);
	*out = c;
	return 0;
}

/* A held process that shares its template's address space (SPAWN_HELD_SHARED, or a
 * CLONE_VM child of one) gets one of its own, small: an execveat of the static program
 * exe_fd (ours).  The program never runs: the system call is single-stepped, so the
 * tracee stops with the new image's registers, at its entry (the same SIGTRAP as for any
 * injected call).  Dropping the shared address space costs nothing (the template keeps
 * it), where an munmap of a copy would zap every page-table entry. */
int held_exec(struct dbxcr_held *h, int exe_fd, struct dbxcr_error *err)
{
	static const char empty[16];	/* "" and argv = { NULL } */
	unsigned long scratch = h->tpl->scratch;
	long a[6] = { 0 };
	int fd;

	if (transfer_fds(&h->c, scratch, &exe_fd, 1, &fd, err) < 0)
		return -1;
	if (mem_write(h->c.pid, scratch, empty, sizeof(empty), err) < 0)
		return -1;
	a[0] = fd;
	a[1] = (long)scratch;		/* "" */
	a[2] = (long)(scratch + 8);	/* argv: { NULL } */
	a[3] = (long)(scratch + 8);	/* envp: { NULL } */
	a[4] = AT_EMPTY_PATH;
	return rsys(&h->c, SYS_execveat, a, err, "execveat (a fresh address space)") < 0 ? -1 : 0;
}

/* Drop the struct of a held process that now belongs to another one (the same process,
 * restored in place from an image: dbxcr_held_chain), or that is gone. */
void held_forget(struct dbxcr_held *h)
{
	held_free(h);
}

/* The terminal's foreground process group, as the checkpoint found it: TIOCSPGRP needs a
 * caller whose controlling terminal it is, in the terminal's session; from the leader,
 * whose group the terminal took with it (take_terminal), the kernel sends no SIGTTOU.  The
 * group must exist in the session by now (its members restored, held). */
int dbxcr_held_foreground(struct dbxcr_held *h, int fd, pid_t pgrp, struct dbxcr_error *err)
{
	long a[6] = { fd, TIOCSPGRP, (long)h->tpl->scratch, 0, 0, 0 };

	clear_error(err);
	if (mem_write(h->c.pid, h->tpl->scratch, &pgrp, sizeof(pgrp), err) < 0)
		return -1;
	return rsys(&h->c, SYS_ioctl, a, err, "ioctl(%d, TIOCSPGRP, %d): its terminal's "
		    "foreground process group", fd, (int)pgrp) < 0 ? -1 : 0;
}

int dbxcr_held_set_prctls(struct dbxcr_held *h, const struct dbxcr_prctls *want,
			  struct dbxcr_error *err)
{
	struct pinning pin;
	int rc;

	clear_error(err);
	pin_beside(&pin, h->c.pid);	/* its calls one by one: beside us (colocate) */
	rc = tracee_set_prctls(&h->c, want, err);
	if (unpin_beside(&pin, rc < 0 ? NULL : err) < 0)
		rc = -1;
	return rc;
}

int dbxcr_held_install_fd(struct dbxcr_held *h, int src, int target, int cloexec,
			  const struct dbxcr_epoll_watch *adds, size_t nadds,
			  struct dbxcr_error *err)
{
	struct tracee *c = &h->c;
	unsigned long scratch = h->tpl->scratch;
	int got;

	clear_error(err);
	if (transfer_fds(c, scratch, &src, 1, &got, err) < 0 ||
	    install_fd(c, got, target, cloexec, err) < 0)
		return -1;
	for (size_t i = 0; i < nadds; i++) {
		struct dbxcr_epoll_watch w = { target, adds[i].events, adds[i].data };

		if (add_watch(c, scratch, adds[i].fd, &w, err) < 0)
			return -1;
	}
	return 0;
}

int dbxcr_held_release(struct dbxcr_held *h, struct dbxcr_error *err)
{
	pid_t pid = h->c.pid;
	struct tracee *thr = h->thr;

	clear_error(err);
	if (finish_child(&h->c, h->tpl, thr, h->born_of_parent, err) < 0) {
		dbxcr_held_kill(h);
		return -1;
	}
	held_ready(h);
	h->thr = NULL;
	if (thr && threads_release(pid, h->tpl, thr, err) < 0) {	/* frees thr */
		kill_traced(pid);
		held_free(h);
		return -1;
	}
	stop_again(&h->c, h->tpl);
	if (restore_and_detach(&h->c, err) < 0) {
		kill_traced(pid);
		held_free(h);
		return -1;
	}
	held_free(h);
	return 0;
}

void dbxcr_held_kill(struct dbxcr_held *h)
{
	if (!h)
		return;
	if (h->thr)
		threads_kill(h->c.pid, h->thr, h->tpl->threads->n);
	kill_traced(h->c.pid);
	held_free(h);
}

/* ---------- zombies ----------
 *
 * A child that had exited when the checkpoint was taken, its parent not having waited for
 * it yet, is no process to restore; but its parent's next wait must find it, with its pid
 * and its status (Python's subprocess takes a wait's ECHILD for exit status 0).  It is made
 * again as a child of the held parent that ends at once: born sharing the parent's address
 * space (CLONE_VM: nothing copied), it runs exit_group with the code, or dies of the
 * signal (its default action, no core: RLIMIT_CORE 0).  The SIGCHLD its death sends the
 * parent is taken back (the original's, if it was pending at the checkpoint, is queued
 * again with the parent's other pending signals at its release). */

/* Wait until `pid` is a zombie (no child of ours to wait for) with wait status `status`
 * (/proc/PID/stat's last field, exit_code). */
static int wait_zombie(pid_t pid, int status, struct dbxcr_error *err)
{
	char path[64], buf[1024], *p;

	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	for (int i = 0; i < 20000; i++) {
		if (read_small_file(path, buf, sizeof(buf)) < 0)
			return fail(err, errno, pid, "read %s", path);
		p = strrchr(buf, ')');
		if (p && p[1] == ' ' && p[2] == 'Z') {
			p = strrchr(buf, ' ');
			if (!p || atoi(p + 1) != status)
				return fail(err, EPROTO, pid, "the zombie child ended with status "
					    "%s, not %#x", p ? p + 1 : "?", status);
			return 0;
		}
		usleep(50);
	}
	return fail(err, ETIMEDOUT, pid, "the zombie child never exited");
}

static int zombie_exits(struct tracee *z, unsigned long scratch, int status,
			struct dbxcr_error *err)
{
	if (WIFSIGNALED(status)) {
		static const unsigned char dfl[32];	/* struct kernel_sigaction: SIG_DFL */
		struct rlimit none = { 0, 0 };
		int sig = WTERMSIG(status);
		long a[6] = { sig, (long)scratch, 0, 8, 0, 0 };

		if (prlimit(z->pid, RLIMIT_CORE, &none, NULL) < 0)
			return fail(err, errno, z->pid, "prlimit(RLIMIT_CORE, 0)");
		/* SIGKILL's action is the default, always: the kernel refuses to set it
		 * (EINVAL), and a child killed by it (an agent's timeout) is common. */
		if (sig != SIGKILL &&
		    (mem_write(z->pid, scratch, dfl, sizeof(dfl), err) < 0 ||
		     rsys(z, SYS_rt_sigaction, a, err, "rt_sigaction(%d, SIG_DFL)", sig) < 0))
			return -1;
		/* Handed back at the detach, from the injected call's signal-delivery-stop
		 * (queued again instead if blocked: nothing is). */
		if (set_sigmask(z->pid, 0, err) < 0)
			return -1;
		memset(&z->deferred_info, 0, sizeof(z->deferred_info));
		z->deferred_info.si_signo = sig;
		z->deferred_info.si_code = SI_USER;
		z->deferred_sig = sig;
		return 0;
	}
	z->regs.rip = z->site;
	z->regs.rax = SYS_exit_group;
	z->regs.orig_rax = (unsigned long)-1;
	z->regs.rdi = (unsigned long)WEXITSTATUS(status);
	if (set_sigmask(z->pid, ~0ULL, err) < 0)	/* nothing runs before the exit */
		return -1;
	if (ptrace(PTRACE_SETREGS, z->pid, 0, &z->regs) < 0)
		return fail(err, errno, z->pid, "PTRACE_SETREGS (exit_group)");
	return 0;
}

int take_back_sigchld(struct tracee *t, unsigned long at, pid_t child,
		      struct dbxcr_error *err)
{
	struct {
		uint64_t set;
		struct timespec zero;
	} in = { 1ULL << (SIGCHLD - 1), { 0, 0 } };
	long a[6] = { (long)at, 0, (long)(at + offsetof(typeof(in), zero)), 8, 0, 0 };
	long got;

	if (mem_write(t->pid, at, &in, sizeof(in), err) < 0 ||
	    remote_syscall(t, SYS_rt_sigtimedwait, a, &got, err) < 0)
		return -1;
	if (got != SIGCHLD && got != -EAGAIN)
		return fail(err, got < 0 ? (int)-got : EPROTO, t->pid, "taking back the SIGCHLD "
			    "of child %d: %ld", (int)child, got);
	return 0;
}

int dbxcr_held_zombie(struct dbxcr_held *h, pid_t nspid, int status, const char *comm,
		      struct dbxcr_error *err)
{
	unsigned long scratch = h->tpl->scratch;
	struct tracee z;
	pid_t child;

	clear_error(err);
	if (!WIFEXITED(status) && !(WIFSIGNALED(status) && !WCOREDUMP(status)))
		return fail(err, EINVAL, h->c.pid, "zombie child %d: status %#x is no exit or "
			    "death by a signal without a core dump", (int)nspid, status);
	child = held_fork(h, &nspid, 1, CLONE_VM, err);
	if (child < 0)
		return -1;
	if (adopt(&z, child, h->c.site, err) < 0 ||
	    (comm[0] && set_comm(&z, scratch, comm, err) < 0) ||	/* ps: [comm] <defunct> */
	    zombie_exits(&z, scratch, status, err) < 0 || detach_tracee(&z, err) < 0) {
		kill_traced(child);
		return -1;
	}
	if (wait_zombie(child, status, err) < 0) {
		kill(child, SIGKILL);	/* no tracee of ours now: not left running */
		return -1;
	}
	return take_back_sigchld(&h->c, scratch, nspid, err);
}

/* ---------- carriers and keepers (spawned ahead of a rollback) ----------
 *
 * A carrier is a child of a template, re-rooted like any spawn (namespaces, cwd, files,
 * pipes) but left stopped in our trace.  Its birth gives the real process: an injected
 * clone3(CLONE_VM | CLONE_PARENT) with the wanted pid (set_tid) -- no page tables to copy,
 * the child shares the carrier's address space -- which gets its own copies of the
 * carrier's descriptor table and fs_struct, the original's pending signals, registers,
 * xstate and mask, and runs.  Then (dbxcr_carrier_keep, off a rollback's critical path)
 * the carrier closes all its descriptors and stays, stopped, as the *keeper* of that
 * address space: while it lives, the process's exit (a rollback
 * killing it) only drops a reference to its mm instead of tearing down every page
 * mapping, so its pid is free (once reaped) in microseconds rather than milliseconds per
 * 100 MB.  Kill the keeper after the process has exited; the teardown runs then, off the
 * rollback's path.  The carrier holds a copy of the template's state: the template may be
 * released before the birth. */

struct dbxcr_carrier {
	struct dbxcr_template t;	/* pid = the carrier; regs/xstate/mask/pend: origin's */
	struct dbxcr_lock *locks;	/* taken by its birth (POSIX locks are the process's) */
	size_t nlocks;
	int ctty;	/* dbxcr_spawn_opts.ctty: its birth, a session leader, takes it */
	bool born;
	bool kept;	/* a keeper now: its descriptors closed */
};

pid_t dbxcr_spawn_carrier(struct dbxcr_template *tpl, const struct dbxcr_spawn_opts *opts,
			  struct dbxcr_carrier **out, struct dbxcr_error *err)
{
	struct dbxcr_carrier *k;
	struct tracee c, *thr;
	pid_t child;

	*out = NULL;
	k = calloc(1, sizeof(*k));
	if (!k)
		return fail(err, ENOMEM, tpl->pid, "allocating a carrier");
	child = spawn_prepared(tpl, opts, SPAWN_CARRIER, &c, &thr, err);
	if (child < 0) {
		free(k);
		return -1;
	}
	if (dup_template(&k->t, tpl, err) < 0) {
		kill_traced(child);
		free(k);
		return -1;
	}
	k->t.pid = child;
	k->t.tracer_tid = current_tid();
	k->ctty = opts ? opts->ctty : 0;
	if (opts && opts->nlocks) {
		k->locks = malloc(opts->nlocks * sizeof(*k->locks));
		if (!k->locks) {
			fail(err, ENOMEM, tpl->pid, "copying %zu file locks", opts->nlocks);
			goto fail;
		}
		memcpy(k->locks, opts->locks, opts->nlocks * sizeof(*k->locks));
		k->nlocks = opts->nlocks;
	}
	/* Its birth shares its address space (CLONE_VM), which clears the child's
	 * sigaltstack: the one this fork copied from the template is given back then. */
	if (main_altstack(&c, &k->t.main.altstack, err) < 0)
		goto fail;
	/* Idle like a template: if it ever ran unsupervised it would exit at once. */
	park_regs(&k->t, &c.regs);
	if (park(&k->t, err) < 0)
		goto fail;
	*out = k;
	return child;
fail:
	kill_traced(child);
	free(k->t.xstate);
	threads_free(k->t.threads);
	free(k->t.dontfork);
	free(k->locks);
	free(k);
	return -1;
}

pid_t dbxcr_carrier_pid(const struct dbxcr_carrier *k)
{
	return k->t.pid;
}

/* The carrier drops every descriptor: the process has its own copies, and a keeper must
 * not hold a pipe open (a reader would never see EOF) or a file of the old generation. */
static int become_keeper(struct dbxcr_carrier *k, struct dbxcr_error *err)
{
	struct tracee t;
	long a[6] = { 0, ~0L, 0, 0, 0, 0 };

	if (adopt(&t, k->t.pid, k->t.site, err) < 0)
		return -1;
	t.regs = k->t.park;
	if (rsys(&t, SYS_close_range, a, err, "close_range in the keeper") < 0)
		return -1;
	return park(&k->t, err);
}

int dbxcr_carrier_install_fds(struct dbxcr_carrier *k, const int *src, const int *target,
			      const int *cloexec, size_t n, struct dbxcr_error *err)
{
	struct tracee t;
	int got[n ? n : 1];

	clear_error(err);
	if (check_owner(&k->t, err) < 0)
		return -1;
	if (k->born)
		return fail(err, EINVAL, k->t.pid, "carrier has given birth already");
	if (n > 256)
		return fail(err, E2BIG, k->t.pid, "%zu descriptors to install (256 at most)", n);
	if (adopt(&t, k->t.pid, k->t.site, err) < 0)
		return -1;
	t.regs = k->t.park;
	/* Its birth is a clone without CLONE_FILES: a copy of this descriptor table. */
	if (transfer_fds(&t, k->t.scratch, src, n, got, err) < 0)
		return -1;
	for (size_t i = 0; i < n; i++)
		if (install_fd(&t, got[i], target[i], cloexec[i], err) < 0)
			return -1;
	return park(&k->t, err);
}

pid_t dbxcr_carrier_birth(struct dbxcr_carrier *k, const pid_t *set_tid, size_t set_tid_size,
			  int pgid, struct dbxcr_error *err)
{
	struct dbxcr_spawn_opts o = { .mntns_fd = -1, .pidns_fd = -1, .ns_pidfd = -1,
				      .set_tid = set_tid, .set_tid_size = set_tid_size };
	struct colocation col;
	struct pidns_switch sw;
	struct tracee c, *thr = NULL;
	pid_t child;

	clear_error(err);
	if (check_owner(&k->t, err) < 0)
		return -1;
	if (k->born)
		return fail(err, EINVAL, k->t.pid, "carrier has given birth already");
	if (k->t.threads && set_tid_size == 0)
		return own_pid_only(&k->t, err);
	colocate(&col, &k->t);
	/* EEXIST (the pid is still taken) leaves the carrier as it was: retry later. */
	child = clone_from_template(&k->t, &o, CLONE_VM, &sw, err);
	if (child < 0) {
		colocation_end(&col);
		return -1;
	}
	if (wait_birth(child, err) < 0 || adopt(&c, child, k->t.site, err) < 0 ||
	    (pgid && join_group(&c, pgid, err) < 0) ||
	    (k->ctty && take_terminal(&c, k->ctty - 1, err) < 0) ||
	    threads_recreate(&c, &k->t, true, true, &thr, err) < 0)
		goto kill;
	if (take_locks(&c, k->t.scratch, k->locks, k->nlocks, err) < 0 ||
	    finish_child(&c, &k->t, thr, false, err) < 0 || unpin_child(&col, &k->t, child, err) < 0)
		goto kill_threads;
	colocation_end(&col);
	c.regs = k->t.regs;
	c.sigmask = k->t.sigmask;
	c.xstate = k->t.xstate;
	c.xstate_len = k->t.xstate_len;
	c.deferred_sig = 0;
	if (thr && threads_release(child, &k->t, thr, err) < 0)
		return -1;	/* killed and reaped */
	stop_again(&c, &k->t);
	if (restore_and_detach(&c, err) < 0) {
		kill_traced(child);
		return -1;
	}
	k->born = true;
	return child;
kill_threads:
	if (thr) {
		threads_kill(child, thr, k->t.threads->n);
		free(thr);
	}
kill:
	kill_traced(child);
	colocation_end(&col);
	return -1;
}

int dbxcr_carrier_keep(struct dbxcr_carrier *k, struct dbxcr_error *err)
{
	clear_error(err);
	if (check_owner(&k->t, err) < 0)
		return -1;
	if (!k->born)
		return fail(err, EINVAL, k->t.pid, "carrier has not given birth yet");
	if (k->kept)
		return 0;
	if (become_keeper(k, err) < 0) {
		/* The process runs fine without a keeper (its exit is just slower); but a
		 * carrier we cannot drive any more must not hold its descriptors: kill it now,
		 * reaped (and its pid freed) only by dbxcr_carrier_kill. */
		kill(k->t.pid, SIGKILL);
		return -1;
	}
	k->kept = true;
	return 0;
}

int dbxcr_carrier_kill(struct dbxcr_carrier *k, struct dbxcr_error *err)
{
	clear_error(err);
	if (check_owner(&k->t, err) < 0)
		return -1;
	/* Best effort, as kill_traced: a carrier is its template's sibling (same parent). */
	reap_unseen(k->t.pid, &(struct dbxcr_error){ 0 });
	free(k->t.xstate);
	threads_free(k->t.threads);
	free(k->t.dontfork);
	free(k->locks);
	free(k);
	return 0;
}

/* ---------- a socket in a sandbox's network namespace ----------
 *
 * setns(CLONE_NEWNET) changes the namespace of the calling thread only, and a socket stays
 * in the namespace it was created in.  A thread made for the call joins the namespace and
 * creates the socket, so no thread of the daemon ever runs in a sandbox's namespace (not
 * even after a failure halfway). */

struct netns_socket_job {
	int netns_fd, domain, type, protocol;
	bool pair;		/* socketpair instead of socket */
	int fd[2], code;
	const char *step;
};

static void *netns_socket_thread(void *arg)
{
	struct netns_socket_job *j = arg;
	int rc;

	if (setns(j->netns_fd, CLONE_NEWNET) < 0) {
		j->code = errno;
		j->step = "setns into the network namespace";
		return NULL;
	}
	if (j->pair)
		rc = socketpair(j->domain, j->type | SOCK_CLOEXEC, j->protocol, j->fd);
	else
		rc = j->fd[0] = socket(j->domain, j->type | SOCK_CLOEXEC, j->protocol);
	if (rc < 0) {
		j->code = errno;
		j->step = j->pair ? "socketpair" : "socket";
	}
	return NULL;
}

/* Run fn(arg) on a thread made for the call, and join it: what the call changes of its
 * thread's namespaces, root or cwd (setns, unshare(CLONE_FS), chroot) ends with it. */
int on_own_thread(void *(*fn)(void *), void *arg, const char *what, struct dbxcr_error *err)
{
	pthread_t th;
	int rc;

	rc = pthread_create(&th, NULL, fn, arg);
	if (rc != 0)
		return fail(err, rc, current_tid(), "%s: pthread_create", what);
	rc = pthread_join(th, NULL);
	if (rc != 0)
		return fail(err, rc, current_tid(), "%s: pthread_join", what);
	return 0;
}

static int netns_socket_run(struct netns_socket_job *j, struct dbxcr_error *err)
{
	clear_error(err);
	if (on_own_thread(netns_socket_thread, j, "netns socket", err) < 0)
		return -1;
	if (j->code)
		return fail(err, j->code, current_tid(), "netns socket (fd %d, domain %d): %s",
			    j->netns_fd, j->domain, j->step);
	return 0;
}

int dbxcr_netns_socket(int netns_fd, int domain, int type, int protocol,
		       struct dbxcr_error *err)
{
	struct netns_socket_job j = { netns_fd, domain, type, protocol, false, { -1, -1 }, 0,
				      NULL };

	return netns_socket_run(&j, err) < 0 ? -1 : j.fd[0];
}

int dbxcr_netns_socketpair(int netns_fd, int domain, int type, int sv[2],
			   struct dbxcr_error *err)
{
	struct netns_socket_job j = { netns_fd, domain, type, 0, true, { -1, -1 }, 0, NULL };

	if (netns_socket_run(&j, err) < 0)
		return -1;
	sv[0] = j.fd[0];
	sv[1] = j.fd[1];
	return 0;
}

/* ---------- a file in a sandbox's mount namespace ----------
 *
 * A generation's /dev/shm is a tmpfs mounted in its own mount namespace only.  As for a
 * socket above, a thread made for the call joins that namespace: it first stops sharing
 * its file-system attributes with the daemon's other threads (unshare CLONE_FS; setns
 * refuses a mount namespace to a thread that shares them), then opens the path from the
 * namespace's root (setns moves the thread's root and cwd there) with no symlink followed.
 * The thread ends with the call. */

struct mntns_open_job {
	int mntns_fd;
	const char *path;
	int flags, mode, fd, code;
	const char *step;
};

static void *mntns_open_thread(void *arg)
{
	struct mntns_open_job *j = arg;
	struct open_how how;

	if (unshare(CLONE_FS) < 0) {
		j->code = errno;
		j->step = "unshare CLONE_FS";
		return NULL;
	}
	if (setns(j->mntns_fd, CLONE_NEWNS) < 0) {
		j->code = errno;
		j->step = "setns into the mount namespace";
		return NULL;
	}
	memset(&how, 0, sizeof(how));
	how.flags = (uint64_t)(j->flags | O_CLOEXEC | O_NOFOLLOW);
	how.mode = (j->flags & O_CREAT) ? (uint64_t)j->mode : 0;
	how.resolve = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
	j->fd = (int)syscall(SYS_openat2, AT_FDCWD, j->path, &how, sizeof(how));
	if (j->fd < 0) {
		j->code = errno;
		j->step = "openat2";
	}
	return NULL;
}

/* ---------- binding (or connecting) a unix socket to a path of a sandbox's tree ----------
 *
 * The kernel keeps the path given to bind() as the socket's name (getsockname, sock_diag):
 * binding through a directory's magic link (/proc/self/fd/N/name) would name it so.  A
 * thread of our own with its own fs_struct (unshare(CLONE_FS)) chroots into the tree and
 * binds the socket to the path itself, resolved in that tree only.  A connect() is made
 * the same way: resolved from our own root, a symlink the sandbox put at the path could
 * lead to a socket of the host. */
struct root_bind_job {
	int root_fd;
	int sock_fd;
	const char *path;
	bool connect;
	int code;
	const char *step;
};

static void *root_bind_thread(void *arg)
{
	struct root_bind_job *j = arg;
	struct sockaddr_un sun = { .sun_family = AF_UNIX };

	if (unshare(CLONE_FS) < 0) {
		j->code = errno;
		j->step = "unshare CLONE_FS";
		return NULL;
	}
	if (fchdir(j->root_fd) < 0 || chroot(".") < 0) {
		j->code = errno;
		j->step = "chroot into the tree";
		return NULL;
	}
	memcpy(sun.sun_path, j->path, strlen(j->path));
	socklen_t len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + strlen(j->path) + 1);
	if ((j->connect ? connect(j->sock_fd, (struct sockaddr *)&sun, len)
			: bind(j->sock_fd, (struct sockaddr *)&sun, len)) < 0) {
		j->code = errno;
		j->step = j->connect ? "connect" : "bind";
	}
	return NULL;
}

static int root_sockaddr(int root_fd, int sock_fd, const char *path, bool connect,
			 struct dbxcr_error *err)
{
	struct root_bind_job j = { root_fd, sock_fd, path, connect, 0, NULL };
	const char *what = connect ? "connect" : "bind";

	clear_error(err);
	if (path[0] != '/' || strlen(path) >= sizeof(((struct sockaddr_un *)0)->sun_path))
		return fail(err, EINVAL, current_tid(), "%s to %s: not an absolute path that "
			    "fits a unix socket's name", what, path);
	if (on_own_thread(root_bind_thread, &j, connect ? "connect a unix socket" :
			  "bind a unix socket", err) < 0)
		return -1;
	if (j.code)
		return fail(err, j.code, current_tid(), "%s socket fd %d to %s in the tree at fd "
			    "%d: %s", what, sock_fd, path, root_fd, j.step);
	return 0;
}

int dbxcr_root_bind(int root_fd, int sock_fd, const char *path, struct dbxcr_error *err)
{
	return root_sockaddr(root_fd, sock_fd, path, false, err);
}

int dbxcr_root_connect(int root_fd, int sock_fd, const char *path, struct dbxcr_error *err)
{
	return root_sockaddr(root_fd, sock_fd, path, true, err);
}

int dbxcr_mntns_open(int mntns_fd, const char *path, int flags, int mode,
		     struct dbxcr_error *err)
{
	struct mntns_open_job j = { mntns_fd, path, flags, mode, -1, 0, NULL };

	clear_error(err);
	if (on_own_thread(mntns_open_thread, &j, "open in a mount namespace", err) < 0)
		return -1;
	if (j.code)
		return fail(err, j.code, current_tid(), "open %s in mount namespace fd %d: %s",
			    path, mntns_fd, j.step);
	return j.fd;
}
