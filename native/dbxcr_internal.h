/* Private interface shared by fork_template.c and criu_incr.c (not installed, not part of
 * the library's ABI: every symbol here has hidden visibility). */
#ifndef DBX_INTERNAL_H
#define DBX_INTERNAL_H

#include "fork_template.h"

#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/time.h>
#include <time.h>
#include <sys/user.h>

#pragma GCC visibility push(hidden)

/* Kernel-internal restart codes, as seen in rax at a stop inside an interrupted syscall. */
#define KERN_ERESTARTSYS 512
#define KERN_ERESTARTNOINTR 513
#define KERN_ERESTARTNOHAND 514
#define KERN_ERESTART_RESTARTBLOCK 516

#define USER_CS_64 0x33		/* __USER_CS: a 64-bit task; 0x23 would be ia32 */
/* An mm's bounds, in the order of struct prctl_mm_map's first fields: start_code end_code
 * start_data end_data start_brk brk start_stack arg_start arg_end env_start env_end. */
#define MM_BOUNDS 11
#define MM_BRK 5
#define MM_ARG_START 7
#define MM_ARG_END 8
#define SCRATCH_LEN (4 * 4096)	/* template-private page(s) for syscall arguments */
/* Descriptors handed to a child in one SCM_RIGHTS message (transfer_fds sends as many
 * messages as it takes): the kernel's SCM_MAX_FD.  The message's control buffer, at
 * scratch + 256, ends well before the batch table (SCRATCH_LEN / 2). */
#define MAX_XFER_FDS 253
/* Descriptors and shared mappings one spawn installs (a Chromium browser process: ~165
 * and ~150 in a fork). */
#define MAX_SPAWN_FDS 1024
#define MAX_EXTRA_SIGS 8
/* Task names (comm, 15 bytes at most) of the processes we hold in a sandbox: `ps -o comm`
 * and `pgrep NAME` there tell them from the processes they copy (their command lines are
 * the copied process's: /proc/pid/cmdline reads the shared address space). */
#define TEMPLATE_COMM "dbx-template"
#define CARRIER_COMM "dbx-carrier"

/* Layout of struct clone_args (CLONE_ARGS_SIZE_VER2, 88 bytes), kept local so we do not
 * depend on the installed uapi headers' version. */
struct dbx_clone_args {
	uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls,
		set_tid, set_tid_size, cgroup;
};

/* One stopped tracee and what we must give back to it. */
struct tracee {
	pid_t pid;
	struct user_regs_struct regs;	/* registers at attach (what the program sees) */
	void *xstate;			/* NT_X86_XSTATE image, xstate_len bytes */
	size_t xstate_len;
	uint64_t sigmask;		/* blocked signals at attach */
	unsigned long site;		/* address of a 0f 05 pair */
	bool in_signal_stop;		/* current stop is a signal-delivery-stop */
	bool in_get_signal;		/* current stop was taken inside get_signal() */
	int deferred_sig;		/* dequeued by a signal-delivery-stop, to hand back */
	siginfo_t deferred_info;
	int extra_sigs[MAX_EXTRA_SIGS];	/* further stop signals to re-raise */
	int nextra;
	pid_t new_child;		/* set by PTRACE_EVENT_{FORK,VFORK,CLONE} */
};

/* Signals queued for a process at its stop (PTRACE_PEEKSIGINFO), to queue again in the
 * template's children: fork() does not copy pending signals. */
#define MAX_PENDING 64
struct pending_sigs {
	siginfo_t info[MAX_PENDING];
	bool shared[MAX_PENDING];	/* process-wide queue (kill) vs thread queue (tgkill) */
	int n;
};

/* A thread of a multi-threaded process as captured at its checkpoint: what a child
 * spawned from the template needs to create it again (threads.c).  fork() copies only the
 * calling thread; the others' stacks and TLS are in the copied memory, their registers,
 * FPU state, mask, private signals and kernel-side registrations are not. */
struct thread_state {
	pid_t tid;			/* host tid at the checkpoint */
	pid_t nstid;			/* tid in its innermost pid namespace */
	struct user_regs_struct regs;	/* fs_base included: its TLS */
	void *xstate;
	size_t xstate_len;
	uint64_t sigmask;
	struct pending_sigs pend;	/* its own queue (tgkill) and a dequeued signal */
	unsigned long clear_tid;	/* set_tid_address: what pthread_join waits on */
	unsigned long robust_head;	/* set_robust_list */
	size_t robust_len;
	uint64_t rseq_ptr;		/* rseq registration (0: none) */
	uint32_t rseq_len, rseq_sig;
	stack_t altstack;
	char comm[16];
	bool affinity_known;		/* its CPU affinity (threads may differ) */
	cpu_set_t affinity;
};

/* The main thread's registrations fork() does not carry (robust list, clear_tid; rseq too
 * when it is born from a carrier: clone(CLONE_VM) drops it), of every process. */
struct main_regs {
	unsigned long clear_tid;	/* 0: none, or not asked (a single thread: nobody joins
					 * it, and asking costs an injected call) */
	unsigned long robust_head;	/* 0: none */
	size_t robust_len;
	uint64_t rseq_ptr;		/* 0: none */
	uint32_t rseq_len, rseq_sig;
	/* A carrier's (main_altstack): a birth by CLONE_VM clears the child's, where a fork
	 * copies it.  ss_size 0: none, or not asked. */
	stack_t altstack;
};

/* The other threads of a multi-threaded process. */
struct thread_set {
	int n;
	struct thread_state t[];
};

/* A range of consecutive mappings a fork leaves out (MADV_DONTFORK): dontfork.c. */
struct vma_run {
	unsigned long start, end;
};

/* The most threads a process may have to be captured. */
#define MAX_THREADS 256

/* One POSIX timer of a process (timers.c). */
struct ptimer {
	int id, clock;
	int notify;		/* SIGEV_SIGNAL, _NONE or _THREAD, | SIGEV_THREAD_ID: one thread */
	pid_t thread;		/* that thread's tid in its pid namespace; 0: the main thread */
	int signo;
	uint64_t value;		/* sigev_value */
	struct itimerspec spec;	/* interval and time left at the checkpoint */
};

/* The most POSIX timers a process may have to be captured. */
#define MAX_PTIMERS 8

struct dbxcr_template {
	pid_t pid;		/* the template, ptrace-stopped, traced by tracer_tid */
	pid_t origin;		/* the process it was forked from */
	pid_t tracer_tid;	/* thread that owns the ptrace link */
	struct user_regs_struct regs;	/* origin's registers at checkpoint */
	void *xstate;
	size_t xstate_len;
	uint64_t sigmask;	/* origin's blocked mask at checkpoint */
	unsigned long site;	/* syscall site, valid in the template and its children */
	unsigned long scratch;	/* SCRATCH_LEN bytes mapped in the template (and children) */
	struct user_regs_struct park;	/* template's registers while idle */
	struct pending_sigs pend;	/* origin's pending signals at checkpoint */
	/* The origin was in a job-control stop at the checkpoint (kill -STOP, a shell's ^Z):
	 * every child stops again once let go (stop_again).  0: it ran. */
	bool group_stop;
	char comm[16];		/* origin's name; the template itself is named TEMPLATE_COMM */
	bool named;		/* ... already (see name_new_template) */
	/* The template's command line is empty (its mm's argument bounds cut to nothing), so
	 * `pgrep -f` / `pkill -f` in the sandbox never take it for the program; mm: the
	 * origin's bounds, which finish_child gives back to every child (see disguise). */
	bool args_hidden;
	uint64_t mm[MM_BOUNDS];
	/* The origin's CPU affinity, which children get (the template itself may be left
	 * pinned: see colocate in fork_template.c); read at the first spawn. */
	bool affinity_known;
	cpu_set_t affinity;
	/* The origin's main thread's registrations, given back to every child. */
	struct main_regs main;
	/* Forked through an intermediate (orphan.c): the origin's rseq registration (in main)
	 * and sigaltstack are to be given to the template itself at its scratch mapping. */
	bool rehome;
	stack_t rehome_ss;
	/* The origin's other threads (NULL: it had one), recreated in every child. */
	struct thread_set *threads;
	/* The origin's MADV_DONTFORK mappings, which the template holds (made without the
	 * mark) and every child gets marked again (dontfork.c). */
	struct vma_run *dontfork;
	int ndontfork;
	/* The origin's interval timers at the checkpoint (ITIMER_REAL, _VIRTUAL, _PROF): fork
	 * does not pass them on, so finish_child arms them again in every child. */
	struct itimerval itimers[3];
	/* Its POSIX timers (timers.c), made again with their ids in every child; ptimers_ok
	 * false: one cannot be (a child then fails rather than run without it). */
	int nptimers;
	bool ptimers_ok;
	struct ptimer ptimers[MAX_PTIMERS];
	/* What its children get back last (creds.c); creds.set 0: the template's own. */
	struct dbxcr_creds creds;
	/* What fork drops and no /proc file shows (prctls.c): the origin's parent-death
	 * signal (its main thread's: the kernel keeps one per thread), given back to a child
	 * born of its restored parent only, and its child-subreaper flag, given back to every
	 * child. */
	int pdeathsig;
	bool subreaper;
};

/* Options for every tracee we inject into (see fork_template.c). */
#define BASE_OPTIONS (PTRACE_O_TRACEFORK | PTRACE_O_TRACEVFORK | PTRACE_O_TRACECLONE | \
		      PTRACE_O_EXITKILL)

__attribute__((format(printf, 4, 5)))
int fail(struct dbxcr_error *err, int code, pid_t pid, const char *fmt, ...);
void clear_error(struct dbxcr_error *err);
pid_t current_tid(void);
int read_small_file(const char *path, char *buf, size_t len);
int full_write(int fd, const void *data, size_t len);
/* The value after "name:" in a /proc status text, or NULL. */
const char *status_field(const char *status, const char *name);
int wait_stop(pid_t pid, int *status, struct dbxcr_error *err);
int mem_write(pid_t pid, unsigned long addr, const void *buf, size_t len,
	      struct dbxcr_error *err);
int mem_read(pid_t pid, unsigned long addr, void *buf, size_t len, struct dbxcr_error *err);
int find_vdso(pid_t pid, unsigned long *start, unsigned long *end);
int copy_private_pages(pid_t from, pid_t to, unsigned long start, unsigned long end,
		       struct dbxcr_error *err);
int find_syscall_site(struct tracee *t, struct dbxcr_error *err);
int save_xstate(pid_t pid, void **out, size_t *out_len, struct dbxcr_error *err);
int set_xstate(pid_t pid, void *xstate, size_t len, struct dbxcr_error *err);
int set_sigmask(pid_t pid, uint64_t mask, struct dbxcr_error *err);
int seize(pid_t pid, long opts, long *got, struct dbxcr_error *err);
int block_all(struct tracee *t, struct dbxcr_error *err);
void detach_unchanged(struct tracee *t);
int attach(struct tracee *t, pid_t pid, struct dbxcr_error *err);
int adopt(struct tracee *t, pid_t pid, unsigned long site, struct dbxcr_error *err);
/* The template's scratch area, mapped at its first use (a spawn, a dump) rather than in the
 * checkpoint's freeze window. */
int template_scratch(struct dbxcr_template *tpl, struct dbxcr_error *err);
/* The mm bounds of pid from /proc/pid/stat; brk (not there) is left 0: ask brk(0). */
int read_mm_bounds(pid_t pid, uint64_t mm[MM_BOUNDS], struct dbxcr_error *err);
/* A struct prctl_mm_map with these bounds (the command line empty if hide_args), exe and
 * auxv left unchanged. */
struct prctl_mm_map;
void mm_map_of(const uint64_t mm[MM_BOUNDS], bool hide_args, struct prctl_mm_map *map);
/* prctl(PR_SET_MM, PR_SET_MM_MAP) with mm_map_of's map injected into a stopped tracee,
 * passed through the struct prctl_mm_map-sized area at `scratch`. */
int set_mm_bounds(struct tracee *t, unsigned long scratch, const uint64_t mm[MM_BOUNDS],
		  bool hide_args, struct dbxcr_error *err);
/* prctl(PR_SET_NAME) injected into a stopped tracee, the name passed through `scratch`. */
int set_comm(struct tracee *t, unsigned long scratch, const char *name, struct dbxcr_error *err);
int remote_syscall(struct tracee *t, long nr, const long a[6], long *ret,
		   struct dbxcr_error *err);
__attribute__((format(printf, 5, 6)))
long rsys(struct tracee *t, long nr, const long a[6], struct dbxcr_error *err,
	  const char *fmt, ...);
int restore_and_detach(struct tracee *t, struct dbxcr_error *err);
int remote_clone3(struct tracee *t, unsigned long scratch, struct dbx_clone_args *ca,
		  const pid_t *set_tid, size_t n, long *ret, struct dbxcr_error *err);
void tracee_free(struct tracee *t);
void kill_traced(pid_t pid);
/* SIGKILL a task we trace and reap it; while its parent is a live process (not an init),
 * that parent sees nothing of it (no zombie, no SIGCHLD): reap_unseen.c. */
int reap_unseen(pid_t pid, struct dbxcr_error *err);
/* The main thread of a process stopped by dbxcr_stop_wait, ready for injected calls; its
 * dbxcr_stop_resume gives everything back. */
struct tracee *stop_for_calls(struct dbxcr_stop *s, struct dbxcr_error *err);
/* Dequeue a SIGCHLD queued for the stopped tracee t by a child we made or ended for it
 * (or nothing, if none is): rt_sigtimedwait with a zero timeout, its 24 bytes of arguments
 * written at `at` (a scratch page, or t's stack below the red zone). */
int take_back_sigchld(struct tracee *t, unsigned long at, pid_t child,
		      struct dbxcr_error *err);
int wait_birth(pid_t child, struct dbxcr_error *err);
/* Start a system call in a stopped tracee and return at once; syscall_finish waits for it
 * (its return value in *ret). */
int syscall_start(struct tracee *t, long nr, const long a[6], struct dbxcr_error *err);
int syscall_finish(struct tracee *t, long nr, long *ret, struct dbxcr_error *err);
/* The NSpid entry at `level` of a /proc status text (1: the host's pid namespace), 0 if
 * none; level 0: how many entries there are (reap_unseen.c). */
pid_t nspid_at(const char *status, int level);

/* orphan.c: a template forked through a short-lived intermediate, so that it is init's
 * child rather than a sibling of its original. */
struct via {
	struct tracee t;	/* the intermediate, stopped (t.pid 0: none) */
	pid_t seen;		/* its pid in the original's pid namespace */
};
/* Whether pid's template is to be an orphan: its parent is a live process other than an
 * init and the caller, and its exit signal is SIGCHLD. */
bool orphan_wanted(pid_t pid);
/* In the stopped (modified) original: the intermediate made, its clone started. */
int via_start(struct tracee *orig, struct via *v, struct dbxcr_error *err);
/* The template's pid (stopped at its birth, not yet waited for), the intermediate gone
 * and reaped; -1 with nothing left on failure. */
pid_t via_finish(struct tracee *orig, struct via *v, struct dbxcr_error *err);
void park_regs(struct dbxcr_template *tpl, const struct user_regs_struct *base);
int park(struct dbxcr_template *tpl, struct dbxcr_error *err);
int check_owner(const struct dbxcr_template *tpl, struct dbxcr_error *err);
int transfer_fds(struct tracee *c, unsigned long scratch, const int *src, size_t n, int *out,
		 struct dbxcr_error *err);
/* Resume a running tracee's stops with `how` (PTRACE_SINGLESTEP or PTRACE_CONT) until it
 * traps (SIGTRAP): a fork event notes the new task in t->new_child, another signal is
 * kept to be handed back, interrupts and group stops are resumed through.  Its registers
 * at the trap in *r. */
int wait_trap(struct tracee *t, int how, struct user_regs_struct *r, struct dbxcr_error *err);

/* A process pinned to the CPU we run on, and the calling thread with it, for a run of
 * injected calls (fork_template.c: "tracer and template on one CPU"); unpin_beside puts
 * both masks back (the process's before it runs). */
struct pinning {
	pid_t pid;
	bool self, other;
	cpu_set_t self_mask, mask;
};
void pin_beside(struct pinning *p, pid_t pid);
int unpin_beside(struct pinning *p, struct dbxcr_error *err);

/* batch.c: calls injected into a stopped tracee many at once, by a loop in a code page of
 * ours in it (batch_loop, written there by its caller) over a table in its scratch area
 * (BATCH_MAX calls from BATCH_TABLE_OFF: the area's lower half stays free for the calls'
 * arguments).  Calls run in the order added, when the table is full or at batch_run; the
 * first that fails stops them and is reported with its step's text. */
#define BATCH_LOOP_LEN 64
#define BATCH_TABLE_OFF (SCRATCH_LEN / 2)
#define BATCH_MAX ((SCRATCH_LEN - BATCH_TABLE_OFF) / 64)
extern const unsigned char batch_loop[BATCH_LOOP_LEN];
struct batch_call {
	int64_t nr, a[6], ret;
};
struct batch {
	struct tracee *t;
	unsigned long loop, table;	/* in the tracee */
	size_t n;
	struct batch_call calls[BATCH_MAX];
	unsigned long expect[BATCH_MAX];	/* the result a call must have (mmap's address), or 0 */
	char step[BATCH_MAX][120];	/* each call's step, for its error */
};
void batch_init(struct batch *b, struct tracee *t, unsigned long loop, unsigned long table);
__attribute__((format(printf, 6, 7)))
int batch_add(struct batch *b, long nr, const long a[6], unsigned long expect,
	      struct dbxcr_error *err, const char *fmt, ...);
int batch_run(struct batch *b, struct dbxcr_error *err);

/* prctls.c: read (all) or set (those that differ) in a stopped tracee by injected calls. */
int tracee_prctls(struct tracee *t, struct dbxcr_prctls *out, struct dbxcr_error *err);
/* The stopped process's parent-death signal and child-subreaper flag (injected calls; t
 * must be ours to inject with), and their giving back to a child before it runs. */
int tracee_parent_death(struct tracee *t, int *pdeathsig, bool *subreaper,
			struct dbxcr_error *err);
int give_parent_death(struct tracee *c, const struct dbxcr_template *tpl, bool born_of_parent,
		      struct dbxcr_error *err);
int tracee_set_prctls(struct tracee *t, const struct dbxcr_prctls *want,
		      struct dbxcr_error *err);

/* creds.c: the credentials c (if set) given to the stopped tracee t, one of a child's
 * threads, by injected calls using the scratch page at `scratch`; checked. */
int creds_give(struct tracee *t, unsigned long scratch, const struct dbxcr_creds *c,
	       struct dbxcr_error *err);

/* dontfork.c */
/* The runs of mappings of `orig` its fresh fork `tpl` does not have (none: *n = 0). */
int dontfork_runs(pid_t orig, pid_t tpl, struct vma_run **runs, int *n, struct dbxcr_error *err);
/* madvise(advice) over each run, injected into the stopped tracee t. */
int madvise_runs(struct tracee *t, const struct vma_run *runs, int n, int advice,
		 struct dbxcr_error *err);

/* timers.c: what fork does not pass on, read at the stop and armed in every child. */
int capture_itimers(struct tracee *t, struct itimerval out[3], struct dbxcr_error *err);
int arm_itimers(struct tracee *c, const struct dbxcr_template *tpl, struct dbxcr_error *err);
int capture_ptimers(struct tracee *t, struct dbxcr_template *tpl, struct dbxcr_error *err);
int arm_ptimers(struct tracee *c, const struct dbxcr_template *tpl, struct dbxcr_error *err);

/* threads.c */
/* What a stopped thread's kernel holds besides registers and mask: robust list, rseq,
 * name and innermost tid (read from outside), and (injected into it, through a word of
 * its stack below the red zone, put back after) clear_tid and, unless `main`, its
 * sigaltstack.  t must be ours and stopped with every signal blocked. */
int thread_capture(struct tracee *t, pid_t tgid, bool main, struct thread_state *out,
		   struct dbxcr_error *err);
/* Run `nr` in the stopped thread t with argument `outarg` pointing at memory of its own,
 * and copy `len` (<= 64) bytes of what the call wrote there to `out`: the stack below the
 * red zone, its bytes put back after, or (none there) a page mapped for the call. */
int query_on_stack(struct tracee *t, long nr, const long args[6], int outarg,
		   void *out, size_t len, const char *what, struct dbxcr_error *err);
/* rseq: a thread stopped inside a restartable sequence resumes at its abort handler, as
 * the kernel would make it on its next return to user mode. */
int rseq_fixup(pid_t tid, uint64_t rseq_ptr, struct user_regs_struct *regs,
	       struct dbxcr_error *err);
/* Registers of a thread resumed as a new task (a recreated thread, a process rebuilt from
 * an image), which has no restart_block: a call it would continue through
 * restart_syscall() is executed again instead (threads.c). */
void restart_without_block(struct user_regs_struct *regs);
/* The main registrations of a stopped single-threaded process, read from outside (its
 * clear_tid is not asked). */
int main_capture(pid_t pid, struct main_regs *m, struct dbxcr_error *err);
/* The main registrations out of a thread_capture of the main thread. */
void main_from_thread(struct main_regs *m, const struct thread_state *ts);
/* The main thread's rseq registration and sigaltstack (altstack) for a child born of a
 * process that had neither (a CLONE_VM clone drops both; so do its forks). */
int main_reborn(struct tracee *c, const struct dbxcr_template *tpl, const stack_t *altstack,
		struct dbxcr_error *err);
/* The stopped main thread's sigaltstack (an injected sigaltstack(NULL, &old)): *out, with
 * ss_size 0 when it has none. */
int main_altstack(struct tracee *t, stack_t *out, struct dbxcr_error *err);
/* In a spawned child c (stopped, ours, all signals blocked, scratch mapped): give the main
 * thread its registrations back (rseq too if `born`: a carrier's birth) and clone every
 * other thread of tpl with its tid (when keep_tids), stopped in our trace with its final
 * state set: *out (n = tpl's count) for threads_release.  On failure every thread made so
 * far is killed with the child. */
int threads_recreate(struct tracee *c, const struct dbxcr_template *tpl, bool keep_tids,
		     bool born, struct tracee **out, struct dbxcr_error *err);
/* Let the recreated threads run (their registers, xstate and mask are set) with their CPU
 * affinity (cloned while the child was pinned next to us: see colocate in
 * fork_template.c); frees thr.  On failure the child is killed and reaped. */
int threads_release(pid_t child, const struct dbxcr_template *tpl, struct tracee *thr,
		    struct dbxcr_error *err);
/* SIGKILL the child, reap its threads we trace, then the child. */
void threads_kill(pid_t child, const struct tracee *thr, int n);
/* Held processes and adoption (fork_template.c: the held section). */
pid_t held_fork(struct dbxcr_held *h, const pid_t *set_tid, size_t n, unsigned long flags,
		struct dbxcr_error *err);
int held_become(struct dbxcr_template *tpl, const struct dbxcr_spawn_opts *o,
		bool born_of_parent, struct dbxcr_held **out, struct dbxcr_error *err);
int held_spawn_child(struct dbxcr_held *h, struct dbxcr_template *tpl,
		     const struct dbxcr_spawn_opts *o, unsigned long flags,
		     struct dbxcr_held **out, struct dbxcr_error *err);
pid_t held_spawn_shared(struct dbxcr_template *tpl, const struct dbxcr_spawn_opts *opts,
			struct dbxcr_held **out, struct dbxcr_error *err);
int held_take_terminal(struct dbxcr_held *h, const struct dbxcr_spawn_opts *o,
		       struct dbxcr_error *err);
/* Run fn(arg) on a thread of its own, joined (namespace and root changes end with it). */
int on_own_thread(void *(*fn)(void *), void *arg, const char *what, struct dbxcr_error *err);
int held_exec(struct dbxcr_held *h, int exe_fd, struct dbxcr_error *err);
void held_forget(struct dbxcr_held *h);
struct thread_set *threads_dup(const struct thread_set *src);
void threads_free(struct thread_set *set);

#pragma GCC visibility pop

#endif
