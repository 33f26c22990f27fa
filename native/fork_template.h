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
#include <stdint.h>
#include <sys/types.h>
#include <linux/filter.h>

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
 * same pid namespace; init's child instead when pid's parent is a live process other than
 * an init and the caller: orphan.c).  pid resumes unchanged.  Refuses traced processes and ones with more
 * than MAX_THREADS threads; the other threads' state is kept in the template (threads.c).
 * The template holds copies of pid's descriptors until dbxcr_template_drop_fds. */
struct dbxcr_template *dbxcr_make_template(pid_t pid, struct dbxcr_error *err);
pid_t dbxcr_template_pid(const struct dbxcr_template *tpl);
pid_t dbxcr_template_origin(const struct dbxcr_template *tpl);
/* The system call the origin's thread `thread` (0: the main one, 1..n: the others) was
 * stopped in at the checkpoint (one it re-enters when resumed, or gets EINTR from and
 * calls again), and its arguments: -1 if none (also if the call had returned: the thread
 * runs on in user mode), -2 past the last thread. */
long dbxcr_template_syscall(const struct dbxcr_template *tpl, int thread, long args[6]);

/* ---------- stopping a whole process tree at one instant ----------
 *
 * For a consistent checkpoint of a sandbox (memory and files agree):
 *   1. freeze the sandbox cgroup (v1: freezer.state = FROZEN, wait until it reads FROZEN);
 *   2. dbxcr_stop_begin() for every pid: PTRACE_SEIZE + PTRACE_INTERRUPT, no waiting (a
 *      v1-frozen task only reaches the interrupt stop once thawed);
 *   3. thaw: every task leaves the refrigerator straight into the pending interrupt stop,
 *      inside get_signal(), before any user code runs;
 *   4. dbxcr_stop_wait() for every handle;
 *   5. (snapshot the file system: every task is stopped);
 *   6. dbxcr_template_stopped() for every handle (or dbxcr_template_start() for all of
 *      them, then dbxcr_template_finish() for each: their forks run at the same time);
 *   7. dbxcr_stop_resume() for every handle, then dbxcr_stop_abort() to free it.
 * On any error: dbxcr_stop_abort() every handle (any state), thaw, and if some handle had
 * not stopped yet, dbxcr_stop_sweep() to detach it once it stops.
 *
 * All calls on a handle (and on templates made from it) must come from the thread that
 * called dbxcr_stop_begin (ptrace rule; checked, EPERM otherwise).
 *
 * While merely stopped (between wait and template/resume) nothing of the tracee is
 * changed and PTRACE_O_EXITKILL is not set: if the tracer dies, the process just goes on.
 * During dbxcr_template_stopped EXITKILL is set (injected registers must never run).
 * A process frozen while in a group stop (SIGSTOP/SIGTSTP) is seized only in
 * dbxcr_stop_wait, after the thaw: the kernel re-traps a stopped task only when it is
 * seized outside the refrigerator.  It stays group-stopped after resume. */

struct dbxcr_stop;

enum dbxcr_stop_kind {
	DBXCR_STOP_NONE = 0,		/* not stopped (yet) */
	DBXCR_STOP_INTERRUPT = 1,	/* our PTRACE_INTERRUPT trap */
	DBXCR_STOP_SIGNAL = 2,		/* a signal-delivery-stop: signal dequeued, handed back
					 * on resume */
	DBXCR_STOP_GROUP = 3,		/* the task is in a group stop (job control) */
};

struct dbxcr_stop_info {
	pid_t pid;
	int kind;	/* enum dbxcr_stop_kind */
	int signal;	/* the group-stop signal, or the dequeued signal, or 0 */
	int done;	/* resumed, detached or gone: only dbxcr_stop_abort is left */
};

/* Seize pid and request an interrupt stop; never waits.  Refuses (before seizing)
 * processes with too many threads or in a job-control stop with several (ENOTSUP), already
 * traced (EBUSY) and exiting (ESRCH) processes.  Every thread is seized and interrupted. */
int dbxcr_stop_begin(pid_t pid, struct dbxcr_stop **out, struct dbxcr_error *err);

/* Wait until the tracee reports its stop, then record its registers, xstate and signal
 * mask.  timeout_ms < 0 waits forever; on timeout: ETIMEDOUT (wait again or abort).  A
 * process that exits meanwhile: ESRCH ("exited"/"killed by signal N before it stopped"). */
int dbxcr_stop_wait(struct dbxcr_stop *s, int timeout_ms, struct dbxcr_error *err);

void dbxcr_stop_get_info(const struct dbxcr_stop *s, struct dbxcr_stop_info *out);
/* As dbxcr_template_syscall, from the registers saved at the stop (s stopped, its threads
 * too): -3 if it is not (not stopped yet, resumed, gone). */
long dbxcr_stop_syscall(const struct dbxcr_stop *s, int thread, long args[6]);
/* Make a stopped process (every thread) die with its tracer (PTRACE_O_EXITKILL) until it
 * is resumed: for a process held stopped after its checkpoint was answered. */
int dbxcr_stop_hold(struct dbxcr_stop *s, struct dbxcr_error *err);

/* Fork the stopped process into a template (as dbxcr_make_template does).  The process
 * is put back exactly as it was at its stop and stays stopped.  Signals pending at the
 * stop are queued again in every child spawned from the template (except SIGKILL and
 * SIGSTOP).  A child of a group-stopped process starts running (not stopped). */
struct dbxcr_template *dbxcr_template_stopped(struct dbxcr_stop *s, struct dbxcr_error *err);

/* dbxcr_template_stopped in two halves.  start injects the clone and returns while the
 * process runs it: the fork of a large process (its page tables copied, milliseconds per
 * 100 MB) then proceeds on another CPU while the caller starts or finishes other
 * templates.  finish waits for that clone and makes the template (NULL on failure: the
 * process is put back as it was, with no template).  A handle started and not finished
 * is settled by dbxcr_stop_resume / dbxcr_stop_abort (the clone is waited for and its
 * child killed). */
int dbxcr_template_start(struct dbxcr_stop *s, struct dbxcr_error *err);
struct dbxcr_template *dbxcr_template_finish(struct dbxcr_stop *s, struct dbxcr_error *err);

/* Give the process back its registers, restart semantics, mask and any dequeued signal,
 * and detach.  The handle must still be freed with dbxcr_stop_abort. */
int dbxcr_stop_resume(struct dbxcr_stop *s, struct dbxcr_error *err);

/* Best effort: resume/detach whatever state the handle is in, then free it (NULL is ok).
 * A tracee that has not reached its stop yet (still frozen) cannot be detached by the
 * kernel's rules; it is remembered and detached by dbxcr_stop_sweep once it stops. */
void dbxcr_stop_abort(struct dbxcr_stop *s);

/* Detach aborted tracees (of the calling thread) that have stopped since; wait up to
 * timeout_ms (0: just poll, < 0: forever).  Returns how many are still pending. */
int dbxcr_stop_sweep(int timeout_ms);

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

/* A socket option the original had away from a fresh socket's value: an int (len 0), or
 * a struct of len bytes (SO_RCVTIMEO's struct timeval, SO_LINGER's struct linger). */
#define DBXCR_SOCKOPT_BYTES 16
struct dbxcr_sockopt {
	int level;
	int name;
	int value;
	unsigned int len;
	unsigned char bytes[DBXCR_SOCKOPT_BYTES];
};

#define DBXCR_SOCKOPTS 16

/* A multicast group the original had joined (any source: a source-filtered membership is
 * refused at the checkpoint), on the interface of that index. */
struct dbxcr_mcast_group {
	unsigned int ifindex;
	int family;		/* the group's: AF_INET or AF_INET6 */
	unsigned char addr[16];	/* its address (4 bytes of it for AF_INET) */
};

/* net.ipv4.igmp_max_memberships' default: what a process may join on one socket. */
#define DBXCR_MCAST_GROUPS 20

/* A classic BPF program of at most this many instructions attached to a socket
 * (SO_ATTACH_FILTER) is attached again; a longer one is refused at the checkpoint. */
#define DBXCR_FILTER_MAX 512

/* A listening TCP socket, a UDP socket or a netlink socket, to create afresh in the child
 * (in its network namespace, after joining it) and install at fd.  The template holds no
 * such socket: it would keep the port bound and queue connections (datagrams, messages)
 * nobody takes.  A UDP or netlink socket is bound only if the original was (addrlen: a
 * netlink socket's sockaddr_nl carries its port id and its first 32 groups), connected
 * only if it was (peerlen), and never listens. */
struct dbxcr_listen {
	int fd;
	int family;		/* AF_INET, AF_INET6 or AF_NETLINK */
	int type;		/* SOCK_STREAM, SOCK_DGRAM or SOCK_RAW | SOCK_NONBLOCK /
				 * SOCK_CLOEXEC as the original had */
	int protocol;
	int backlog;
	int reuseaddr;		/* SO_REUSEADDR value to leave set (bind always uses 1) */
	int reuseport;
	int v6only;		/* IPV6_V6ONLY, AF_INET6 only */
	unsigned int addrlen;	/* 0: not bound (a UDP socket only) */
	unsigned char addr[128];	/* the bound address (getsockname) */
	unsigned int peerlen;	/* 0: not connected */
	unsigned char peer[128];	/* a UDP socket's peer (getpeername) */
	unsigned int nopts;
	struct dbxcr_sockopt opts[DBXCR_SOCKOPTS];	/* set before the bind */
	unsigned int ngroups;
	struct dbxcr_mcast_group groups[DBXCR_MCAST_GROUPS];	/* joined after the bind */
	unsigned int nfilter;	/* 0: no socket filter */
	const struct sock_filter *filter;	/* its nfilter instructions, attached first */
};

/* An epoll instance to create afresh in the child and install at fd, with the
 * registrations the original's had at the checkpoint (events as /proc/PID/fdinfo shows
 * them, private bits included: a disarmed EPOLLONESHOT watch stays disarmed).  Created
 * after every other descriptor is in place (the watched fds must be the child's own):
 * the template's copy is shared with the original process and is never touched. */
struct dbxcr_epoll_watch {
	int fd;
	unsigned int events;
	unsigned long long data;
};

struct dbxcr_epoll {
	int fd;
	int cloexec;
	const struct dbxcr_epoll_watch *watches;
	size_t nwatches;
	int dup_of;	/* 1 + the fd of the instance (made earlier in the list) fd is another
			 * descriptor of, no watches of its own; 0: a new instance */
};

/* A shared mapping to replace in the child (MAP_SHARED | MAP_FIXED over [start, end)) by
 * the caller's descriptor src at offset: the template's mapping is the very object the
 * original process still writes, so a restore maps a copy saved at the checkpoint.
 * private_map: a private mapping of a file written in place since the checkpoint, mapped
 * again (MAP_PRIVATE) from the restored tree's file, the pages the original had written
 * copied from the template. */
struct dbxcr_remap {
	unsigned long start;
	unsigned long end;
	int prot;			/* PROT_READ / PROT_WRITE / PROT_EXEC as the original had */
	int src;
	long long offset;		/* file offset of start */
	int private_map;
	int sysv;			/* 1: attach the System V segment shmid over [start, end)
					 * instead (shmat SHM_REMAP; src unused): the segment made
					 * again in the child's IPC namespace (ipcns.c) */
	int shmid;
};

/* A file lock the original held on one of its descriptors, taken again by the restored
 * process once its descriptors are in place: flock(2) and OFD locks belong to the open
 * file description, POSIX record locks to the process (so a birth takes them itself, not
 * its carrier).  The restored files are other inodes than the live ones (a new snapshot),
 * so the original's locks never conflict.  type: F_RDLCK or F_WRLCK; len 0: to the end of
 * the file. */
enum { DBXCR_LOCK_FLOCK = 1, DBXCR_LOCK_POSIX = 2, DBXCR_LOCK_OFD = 3 };
struct dbxcr_lock {
	int fd;
	int kind;
	int type;
	long long start, len;
};

/* A range of the original's memory that was locked (mlock, mlockall's MCL_CURRENT: VM_LOCKED
 * in /proc/PID/smaps), on fault only if onfault (mlock2 MLOCK_ONFAULT): a fork does not
 * inherit memory locks, so every child locks it again. */
struct dbxcr_mlock {
	unsigned long start, end;
	int onfault;
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
	/* Spawning into another sandbox (a fork): */
	int pidns_fd;			/* caller's fd of a pid namespace nested in the
					 * template's to be born in, or -1 (the template's) */
	int ns_pidfd;			/* pidfd of the target sandbox's init: join its net,
					 * uts, ipc and cgroup namespaces; or -1 */
	const int *cgroup_fds;		/* caller's open cgroup.procs files: the child is
					 * moved into each right after birth */
	size_t ncgroup_fds;
	int pgid;			/* 0: keep the template's process group;
					 * -1: setpgid(0, 0); > 0: setpgid(0, pgid);
					 * DBXCR_NEW_SESSION: setsid() */
	const struct dbxcr_listen *listens;	/* listening sockets to recreate */
	size_t nlistens;
	const struct dbxcr_epoll *epolls;	/* epoll instances to recreate, last */
	size_t nepolls;
	const struct dbxcr_remap *remaps;	/* shared mappings to map afresh */
	size_t nremaps;
	const struct dbxcr_lock *locks;		/* file locks to take, once all fds are in */
	size_t nlocks;
	int ctty;			/* 1 + the child's fd of its controlling terminal (a
					 * pty's slave), taken with TIOCSCTTY once it leads its
					 * session (pgid DBXCR_NEW_SESSION); 0: none.  A
					 * carrier keeps it for its birth. */
	const struct dbxcr_mlock *mlocks;	/* memory to lock again (a carrier locks it:
						 * its births share its address space) */
	size_t nmlocks;
	const char *const *cwd_made;	/* a cwd deleted since it was entered: stand-in
					 * directories the child makes (outermost first)
					 * to enter cwd, and removes before it runs */
	size_t ncwd_made;
};

/* Fork a child from the template, re-root it as asked, restore the checkpointed registers
 * and signal mask and let it run.  Returns the child's pid in the caller's namespace.
 * The template of a multi-threaded process also gives the child its other threads, each
 * with its tid in the child's pid namespace: set_tid is required then (ENOTSUP without). */
pid_t dbxcr_spawn(struct dbxcr_template *tpl, const struct dbxcr_spawn_opts *opts,
		  struct dbxcr_error *err);

/* Carriers (a rollback's warm pool; see the section in fork_template.c): a child of the
 * template spawned ahead, re-rooted as dbxcr_spawn would (opts), held stopped.
 * dbxcr_carrier_birth clones the real process out of it (sharing its address space, with
 * the given pid if set_tid_size; EEXIST while that pid is taken, and the carrier stays
 * usable; in the process group pgid as for dbxcr_spawn_opts.pgid, if not 0), which
 * continues from the checkpoint.  dbxcr_carrier_keep, soon after (the
 * carrier still holds copies of the process's descriptors until then: a pipe's reader
 * sees no EOF), makes the carrier drop every descriptor and keep only the address space
 * alive (a *keeper*), so killing the process is quick; if that fails the carrier is
 * killed (the process runs on; its exit is just slower).
 * dbxcr_carrier_kill kills the carrier or keeper, reaps it as its tracer and frees k;
 * kill the process it carried first.  All on the thread that spawned the carrier; the
 * template is not needed after dbxcr_spawn_carrier. */
struct dbxcr_carrier;

pid_t dbxcr_spawn_carrier(struct dbxcr_template *tpl, const struct dbxcr_spawn_opts *opts,
			  struct dbxcr_carrier **out, struct dbxcr_error *err);
pid_t dbxcr_carrier_pid(const struct dbxcr_carrier *k);
pid_t dbxcr_carrier_birth(struct dbxcr_carrier *k, const pid_t *set_tid, size_t set_tid_size,
			  int pgid, struct dbxcr_error *err);
int dbxcr_carrier_keep(struct dbxcr_carrier *k, struct dbxcr_error *err);
int dbxcr_carrier_kill(struct dbxcr_carrier *k, struct dbxcr_error *err);
/* Before its birth: our descriptors src[i] at target[i] in the carrier (close-on-exec if
 * cloexec[i]), which its birth gets, for objects the rollback makes after the carrier was
 * spawned (a POSIX message queue: deltabox/cr/posix_mq.py).  On failure (err set) the
 * carrier is in no known state: kill it. */
int dbxcr_carrier_install_fds(struct dbxcr_carrier *k, const int *src, const int *target,
			      const int *cloexec, size_t n, struct dbxcr_error *err);

/* Held processes (a rollback's restored parents; see the section in fork_template.c):
 * dbxcr_spawn_held spawns like dbxcr_spawn but leaves the child and its threads stopped,
 * with the checkpoint's state, until dbxcr_held_release lets it run; meanwhile
 * dbxcr_held_adopt (criu_incr.h) restores an image into a child of its own.
 * dbxcr_held_kill kills it instead.  Both free h.  All on the thread that spawned it; the
 * template must outlive h. */
struct dbxcr_held;

pid_t dbxcr_spawn_held(struct dbxcr_template *tpl, const struct dbxcr_spawn_opts *opts,
		       struct dbxcr_held **out, struct dbxcr_error *err);
pid_t dbxcr_held_pid(const struct dbxcr_held *h);
int dbxcr_held_release(struct dbxcr_held *h, struct dbxcr_error *err);
/* Before the release: make process group pgrp (in h's pid namespace) the foreground one of
 * h's controlling terminal, which h holds at fd; h leads the terminal's session. */
int dbxcr_held_foreground(struct dbxcr_held *h, int fd, pid_t pgrp, struct dbxcr_error *err);
void dbxcr_held_kill(struct dbxcr_held *h);
/* Before the release: a child of h that had exited, not yet waited for, at the checkpoint
 * (a zombie), made again with its pid (in h's pid namespace), its name and its wait
 * status: an exit, or a death by a signal without a core dump. */
int dbxcr_held_zombie(struct dbxcr_held *h, pid_t nspid, int status, const char *comm,
		      struct dbxcr_error *err);

/* A socket created in the network namespace `netns_fd` refers to (a thread of our own
 * joins it for the call: the caller's namespaces are untouched), e.g. a sock_diag netlink
 * socket to list a sandbox's unix sockets.  Returns the descriptor (close-on-exec). */
int dbxcr_netns_socket(int netns_fd, int domain, int type, int protocol,
		       struct dbxcr_error *err);

/* socketpair(2) the same way: a unix pair belongs to the namespace it was made in (its
 * sock_diag listing), so a restored process's pair is made in its sandbox's. */
int dbxcr_netns_socketpair(int netns_fd, int domain, int type, int sv[2],
			   struct dbxcr_error *err);

/* Bind our unix socket sock_fd to the absolute `path` of the tree at root_fd (resolved
 * there only: a thread of ours chroots into it), so that the socket's name is `path`. */
int dbxcr_root_bind(int root_fd, int sock_fd, const char *path, struct dbxcr_error *err);
/* The same, connect()ing the socket to the path (resolved in that tree only). */
int dbxcr_root_connect(int root_fd, int sock_fd, const char *path, struct dbxcr_error *err);

/* Open `path` as seen in the mount namespace `mntns_fd` (a thread made for the call joins
 * it), no symlink followed: flags (O_CLOEXEC added) and mode as open(2).  Our fd. */
int dbxcr_mntns_open(int mntns_fd, const char *path, int flags, int mode,
		     struct dbxcr_error *err);

/* A process's prctl state that a fork copies and no /proc file shows (native/prctls.c). */
struct dbxcr_prctls {
	int dumpable;		/* PR_GET_DUMPABLE */
	int securebits;		/* PR_GET_SECUREBITS (SECBIT_KEEP_CAPS among them) */
	int thp_disable;	/* PR_GET_THP_DISABLE */
	int memory_merge;	/* PR_GET_MEMORY_MERGE (0 without KSM) */
	int mce_kill;		/* PR_MCE_KILL_GET */
	int no_new_privs;	/* PR_GET_NO_NEW_PRIVS */
};
/* The template's (its origin's at the checkpoint), by injected calls; the owner thread
 * only.  0, or -1 with err set. */
int dbxcr_template_prctls(struct dbxcr_template *tpl, struct dbxcr_prctls *out,
			  struct dbxcr_error *err);
/* Set in the template those that differ from `want` (a template rebuilt from an image is
 * its host's fork), so that its children have them.  0, or -1 with err set. */
int dbxcr_template_set_prctls(struct dbxcr_template *tpl, const struct dbxcr_prctls *want,
			      struct dbxcr_error *err);
/* The origin's parent-death signal (0: none) and child-subreaper flag, which fork drops:
 * read when the template was made, given back to its children (native/prctls.c). */
void dbxcr_template_parent_death(const struct dbxcr_template *tpl, int *pdeathsig,
				 int *subreaper);
/* Give them to a template rebuilt from disk.  0, or -1 (EINVAL: no such signal). */
int dbxcr_template_set_parent_death(struct dbxcr_template *tpl, int pdeathsig, int subreaper,
				    struct dbxcr_error *err);
/* The same in a held process, before its release. */
int dbxcr_held_set_prctls(struct dbxcr_held *h, const struct dbxcr_prctls *want,
			  struct dbxcr_error *err);

/* Before its release: our descriptor src at fd `target` of the held process (close-on-exec
 * if cloexec), then watched by its epoll instances as `adds` say (each watch's fd: the
 * epoll instance's; target is the descriptor watched).  For a descriptor that could not
 * exist when the process was spawned: a pidfd of a child restored after it
 * (deltabox/cr/pidfds.py).  0, or -1 with err set. */
int dbxcr_held_install_fd(struct dbxcr_held *h, int src, int target, int cloexec,
			  const struct dbxcr_epoll_watch *adds, size_t nadds,
			  struct dbxcr_error *err);

/* The System V IPC objects and POSIX message queues of the IPC namespace `ipcns_fd`
 * (native/ipcns.c: a thread made for the call joins it).  clear: remove them all first (the
 * counts are then what is left).  0, or -1 with err set. */
struct dbxcr_ipc_objects {
	int sem_sets;
	int msg_queues;
	int shm_segments;
	int posix_queues;	/* POSIX message queues (mq_open) */
	char posix_names[128];	/* their names, ", "-separated, cut short at the size */
};
int dbxcr_ipcns_objects(int ipcns_fd, int clear, int mq_dir, struct dbxcr_ipc_objects *out,
			struct dbxcr_error *err);
/* clear: 1 removes every object; this, every one but the shared memory segments (a
 * restore makes those of its checkpoint: dbxcr_ipcns_shm_make) */
#define DBXCR_IPC_CLEAR_BUT_SHM 2
/* mq_dir above: a directory fd on the root of the namespace's mqueue file system (a
 * detached mount the fd keeps), which the caller keeps per namespace.  The fd, or -1. */
int dbxcr_ipcns_mqueue_dir(int ipcns_fd, struct dbxcr_error *err);

/* A System V shared memory segment of an IPC namespace (ipcns.c).  shm_list fills these
 * (fd: a read-only descriptor of its memory, ours to close); shm_make makes the namespace's
 * segments exactly these, each with its id, owner and mode, and its content read from fd
 * (-1: zeros), and says which it found removed (IPC_RMID) but still attached, which no
 * call makes whole again. */
struct dbxcr_shm_segment {
	int id;
	int key;
	unsigned int mode;		/* shm_perm.mode: permission bits, SHM_LOCKED */
	unsigned int uid, gid;
	int nattch;			/* list only */
	unsigned long long size;
	int fd;
	int removed;			/* make only (out) */
};
int dbxcr_ipcns_shm_list(int ipcns_fd, struct dbxcr_shm_segment *out, size_t max,
			 size_t *n, struct dbxcr_error *err);
int dbxcr_ipcns_shm_make(int ipcns_fd, struct dbxcr_shm_segment *segs, size_t n,
			 struct dbxcr_error *err);
/* shm_make leaves the segments open to every process, for the restored ones to attach
 * whatever their credentials at that point: this gives them their own modes back. */
int dbxcr_ipcns_shm_modes(int ipcns_fd, struct dbxcr_shm_segment *segs, size_t n,
			  struct dbxcr_error *err);

/* A System V message queue of an IPC namespace (ipcns.c).  msg_list fills these (fd: a
 * memfd of ours holding its messages in order, each as an 8-byte type, an 8-byte length
 * and its bytes; the caller closes it); msg_make makes the namespace's queues exactly
 * these, each with its id, key, owner, mode and size limit, and its messages read from fd
 * (-1: none). */
struct dbxcr_msg_queue {
	int id;
	int key;
	unsigned int mode;		/* msg_perm.mode: permission bits */
	unsigned int uid, gid;
	unsigned long long qbytes;	/* msg_qbytes: its size limit */
	unsigned long long count;	/* list only: messages */
	unsigned long long bytes;	/* list only: their bytes */
	int fd;
};
int dbxcr_ipcns_msg_list(int ipcns_fd, struct dbxcr_msg_queue *out, size_t max, size_t *n,
			 struct dbxcr_error *err);
int dbxcr_ipcns_msg_make(int ipcns_fd, const struct dbxcr_msg_queue *queues, size_t n,
			 struct dbxcr_error *err);

/* A POSIX message queue of an IPC namespace (ipcns.c).  mq_list fills these (fd: a memfd
 * of ours holding its messages in the order a receiver gets them, each an 8-byte priority,
 * an 8-byte length and its bytes; the caller closes it); mq_make makes the namespace's
 * queues exactly these, each with its name, sizes, owner, mode and messages. */
#define DBXCR_MQ_NAME 256
struct dbxcr_posix_queue {
	char name[DBXCR_MQ_NAME];	/* its name without the leading '/' */
	unsigned int mode;		/* permission bits */
	unsigned int uid, gid;
	long long maxmsg, msgsize;	/* mq_attr: its sizes */
	unsigned long long count;	/* list only: messages */
	unsigned long long bytes;	/* list only: their bytes */
	int notify_pid;			/* list only: the process registered for its
					 * notification (mq_notify; a pid as the daemon sees
					 * it) or 0; its messages are then not read (fd -1) */
	int fd;
};
int dbxcr_ipcns_mq_list(int ipcns_fd, struct dbxcr_posix_queue *out, size_t max, size_t *n,
			struct dbxcr_error *err);
int dbxcr_ipcns_mq_make(int ipcns_fd, const struct dbxcr_posix_queue *queues, size_t n,
			struct dbxcr_error *err);
/* Descriptors of the namespace's queues /names[i], opened with flags[i] (O_RDONLY,
 * O_WRONLY or O_RDWR, and O_NONBLOCK), close-on-exec, into fds[i]: a restored process's,
 * installed at their numbers by its spawn (one thread joins the namespace for all).  0,
 * or -1 with err set and none left open. */
int dbxcr_ipcns_mq_open(int ipcns_fd, const char *const *names, const int *flags, int *fds,
			size_t n, struct dbxcr_error *err);
/* Unlink the namespace's queues /names[i] (one gone already is no error).  0, or -1. */
int dbxcr_ipcns_mq_unlink(int ipcns_fd, const char *const *names, size_t n,
			  struct dbxcr_error *err);
/* The queue open at q (a descriptor of ours, read-write: a queue a process holds that has
 * no name any more, opened through /proc/PID/fd) into *out as mq_list fills it, keeping
 * out->name (the name the restore gives it).  0, or -1 with err set. */
int dbxcr_mq_capture_fd(int q, struct dbxcr_posix_queue *out, struct dbxcr_error *err);

/* A System V semaphore set of an IPC namespace (ipcns.c).  sem_list fills these (fd: a
 * memfd of ours holding its nsems values, unsigned shorts in order; the caller closes it);
 * sem_make makes the namespace's sets exactly these, each with its id, key, size, owner,
 * mode and values read from fd (-1: zeros). */
struct dbxcr_sem_set {
	int id;
	int key;
	unsigned int mode;		/* sem_perm.mode: permission bits */
	unsigned int uid, gid;
	int nsems;
	int fd;
};
int dbxcr_ipcns_sem_list(int ipcns_fd, struct dbxcr_sem_set *out, size_t max, size_t *n,
			 struct dbxcr_error *err);
int dbxcr_ipcns_sem_make(int ipcns_fd, const struct dbxcr_sem_set *sets, size_t n,
			 struct dbxcr_error *err);

/* Move the parked template out of its process group into one of its own.  A process group
 * id stays allocated while any member exists, so a template (forked from a group member,
 * in that group) keeps the group leader's pid taken and the leader could not come back
 * with it; its children then join their group (dbxcr_spawn_opts.pgid, or a birth's pgid).
 * Not for a session: no call joins an existing session, so children must be born in it. */
int dbxcr_template_own_group(struct dbxcr_template *tpl, struct dbxcr_error *err);

/* Move the parked template out of its session (and so its group) into one of its own,
 * for a session leader that is the only captured process of its session: the session's
 * id (the leader's pid) is then free once the live leader is gone, and the leader's child
 * comes back with its pid and leads a session again (pgid DBXCR_NEW_SESSION). A session
 * with other members keeps their templates in it: they must be born in it. */
int dbxcr_template_own_session(struct dbxcr_template *tpl, struct dbxcr_error *err);
#define DBXCR_NEW_SESSION (-2)

/* Detach the System V segment the parked template has attached at addr (a fork keeps the
 * process's attachments).  A template attached would keep the segment's id taken, even
 * once the sandbox removed it (the kernel frees an id at the last detach), so a rollback
 * could not make it again, and `ipcs` would count the template; its children attach the
 * segment the restore makes (dbxcr_remap.sysv). */
int dbxcr_template_shmdt(struct dbxcr_template *tpl, unsigned long addr,
			 struct dbxcr_error *err);

/* Close every descriptor of the parked template: its copies would keep the process's open
 * file descriptions alive after the process closes them (no EOF for a pipe's reader, a
 * flock or OFD lock still taken, a port still bound).  Its later children get only what
 * their spawn installs (files, fds, listens, epolls, remaps), as from a template restored
 * from disk, which holds none. */
int dbxcr_template_drop_fds(struct dbxcr_template *tpl, struct dbxcr_error *err);

/* The origin's interval timers at the checkpoint, read by injected getitimer calls when
 * the template was made (fork does not pass them on; every child gets them armed again):
 * for ITIMER_REAL, _VIRTUAL and _PROF in turn, {interval s, us, time left s, us}. A
 * template restored from disk has none until they are set (the daemon keeps them). */
void dbxcr_template_itimers(const struct dbxcr_template *tpl, long out[12]);

/* The credentials a template's children get back last (creds.c): ids as the process's own
 * user namespace sees them (real, effective, saved, filesystem), its supplementary groups,
 * its capability sets.  Set on a template only for a process that ran as another user or
 * without capabilities (the template itself is then root's, or never spawned from). */
#define DBXCR_MAX_GROUPS 64
struct dbxcr_creds {
	int set;		/* 0: none to give (a fork keeps the template's) */
	uint32_t uid[4];
	uint32_t gid[4];
	int ngroups;
	uint32_t groups[DBXCR_MAX_GROUPS];
	uint64_t cap_inh, cap_prm, cap_eff, cap_bnd, cap_amb;
};
int dbxcr_template_set_creds(struct dbxcr_template *tpl, const struct dbxcr_creds *c,
			     struct dbxcr_error *err);

/* Whether the origin sat in a job-control stop at the checkpoint (its children stop
 * again once let go); set it for a template restored from disk, which has no stop. */
int dbxcr_template_group_stop(const struct dbxcr_template *tpl);
void dbxcr_template_set_group_stop(struct dbxcr_template *tpl, int stopped);
int dbxcr_template_set_itimers(struct dbxcr_template *tpl, const long in[12],
			       struct dbxcr_error *err);

/* The origin's POSIX timers at the checkpoint (timers.c), made again with their ids in
 * every child, DBXCR_PTIMER_FIELDS longs each: id, clock, notify (SIGEV_*), signal,
 * sigev_value, interval s, ns, time left s, ns, and the tid (in its pid namespace) of the
 * thread it signals if not the main one, else 0.  Returns how many were written (at most
 * max), or -1 if one cannot be made again.  dbxcr_ptimers_supported: how many timers a
 * process may have to be captured, 0 if this kernel cannot give a timer its id back. */
#define DBXCR_PTIMER_FIELDS 10
int dbxcr_template_ptimers(const struct dbxcr_template *tpl, long *out, int max);
int dbxcr_template_set_ptimers(struct dbxcr_template *tpl, const long *in, int n,
			       struct dbxcr_error *err);
int dbxcr_ptimers_supported(void);

/* A second template of the same process (a fork lane: two templates fork children on
 * two CPUs at once).  The copy is handed over: it comes back owned by no thread, and the
 * thread that is to drive it calls dbxcr_template_adopt once; until then only
 * dbxcr_release_template (from any thread) may be called on it. */
struct dbxcr_template *dbxcr_template_copy(struct dbxcr_template *tpl, struct dbxcr_error *err);
int dbxcr_template_adopt(struct dbxcr_template *cp, struct dbxcr_error *err);

/* SIGKILL the template, reap it as its tracer and free tpl (always freed). */
int dbxcr_release_template(struct dbxcr_template *tpl, struct dbxcr_error *err);

/* ---------- the ptrace thread's job queue (ptrace_jobs.c) ----------
 *
 * The thread that owns the carriers waits in dbxcr_jobs_wait, which runs the births jobs
 * posted (in the order posted) and returns 1 at a job posted with births NULL: one the
 * caller runs itself (a Python job) before it waits again.  Posting is thread-safe.  A
 * births job: each carrier gives birth once (dbxcr_carrier_birth; set_tid[i] 0: any pid),
 * those with a pid to take once the processes behind the pidfds `victims` have exited
 * (or timeout_ms passed: EEXIST then), reaping those that are the caller's children;
 * born[i] gets the pid or -1 with errs[i].  Then done_fd (an eventfd) is written; the
 * job must stay allocated until then. */
struct dbxcr_births {
	size_t n;
	struct dbxcr_carrier **carriers;
	const pid_t *set_tid;
	const int *pgid;
	const int *victims;
	size_t n_victims;
	int timeout_ms;
	int done_fd;
	pid_t *born;
	struct dbxcr_error *errs;
};
struct dbxcr_jobs;

struct dbxcr_jobs *dbxcr_jobs_new(struct dbxcr_error *err);
int dbxcr_jobs_post(struct dbxcr_jobs *q, struct dbxcr_births *births, struct dbxcr_error *err);
int dbxcr_jobs_wait(struct dbxcr_jobs *q, struct dbxcr_error *err);
void dbxcr_jobs_free(struct dbxcr_jobs *q);

#endif
