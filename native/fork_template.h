/* DeltaCR process templates: ptrace-injected fork of a live process into a stopped,
 * copy-on-write "template", and children forked again from that template that continue
 * exactly where the original process was at checkpoint time.  x86_64 only.
 *
 * Threading rule (kernel): a ptrace tracee is owned by the *thread* that attached it.  A
 * template stays ptrace-stopped for its whole life, so every call taking a template must be
 * made from the thread that created it (checked; EPERM otherwise).  Calls on plain pids
 * attach and detach within the call and may come from any thread.
 *
 * Errors: every function returns -1 (or NULL) and fills struct dbxcr_error with an errno
 * value and one line "pid N: step: reason". */
#ifndef DBX_FORK_TEMPLATE_H
#define DBX_FORK_TEMPLATE_H

#include <stddef.h>
#include <sys/types.h>

struct dbxcr_error {
	int code;	/* errno value */
	char msg[512];	/* "pid N: step: strerror" */
};

struct dbxcr_info {
	int threads;	/* entries in /proc/pid/task */
	int tracer_pid;	/* TracerPid from /proc/pid/status, 0 if untraced */
	int ppid;
	int seccomp;	/* Seccomp: 0 none, 1 strict, 2 filter */
	int nspid_depth;/* number of pid namespaces the process is in (NSpid entries) */
	int nspid;	/* pid in its innermost pid namespace */
	char state;	/* State letter (R, S, D, T, t, Z, ...) */
};

/* Read /proc facts the daemon needs to decide whether a process can be templated. */
int dbxcr_describe(pid_t pid, struct dbxcr_info *out, struct dbxcr_error *err);

/* Attach to pid, run one system call inside it, restore it exactly and detach.
 * *ret gets the raw return value (-errno on failure of the injected call). */
int dbxcr_inject_syscall(pid_t pid, long nr, const long args[6], long *ret,
			 struct dbxcr_error *err);

struct dbxcr_template;

/* Fork pid into a ptrace-stopped template (a sibling of pid: same parent, same exit signal,
 * same pid namespace).  pid resumes unchanged.  Refuses multi-threaded or traced processes. */
struct dbxcr_template *dbxcr_make_template(pid_t pid, struct dbxcr_error *err);
pid_t dbxcr_template_pid(const struct dbxcr_template *tpl);
pid_t dbxcr_template_origin(const struct dbxcr_template *tpl);

/* A regular file to reopen in the child at fd, with open(2) flags and a file offset.
 * The path is resolved in the child after the optional setns and chdir. */
struct dbxcr_file {
	int fd;
	int flags;
	long long offset;
	const char *path;
};

/* A descriptor of the caller (src) to install in the child at target. */
struct dbxcr_fdmap {
	int src;
	int target;
	int cloexec;
};

struct dbxcr_spawn_opts {
	int mntns_fd;			/* caller's fd of a mount namespace to join, or -1 */
	const char *cwd;		/* directory to chdir to (after setns), or NULL */
	const struct dbxcr_file *files;	/* regular files to reopen */
	size_t nfiles;
	const struct dbxcr_fdmap *fds;	/* caller fds to install (stdio pipes, pty, ...) */
	size_t nfds;
	const pid_t *set_tid;		/* clone3 set_tid: [0] innermost namespace, or NULL */
	size_t set_tid_size;
};

/* Fork a child from the template, re-root it as asked, restore the checkpointed registers
 * and signal mask and let it run.  Returns the child's pid in the caller's namespace. */
pid_t dbxcr_spawn(struct dbxcr_template *tpl, const struct dbxcr_spawn_opts *opts,
		  struct dbxcr_error *err);

/* SIGKILL the template, reap it as its tracer and free tpl (always freed). */
int dbxcr_release_template(struct dbxcr_template *tpl, struct dbxcr_error *err);

#endif
