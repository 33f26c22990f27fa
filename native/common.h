/* Shared helpers for the small setuid-free root helpers in native/.
 * Each helper is a short-lived process spawned by deltaboxd; on failure it prints one line
 * "dbx-<name>: <step>: <reason>" to stderr and exits with DBX_EXIT_SETUP, so the daemon can
 * tell a setup failure apart from the exit code of the command it ran. */
#ifndef DBX_COMMON_H
#define DBX_COMMON_H

#include <stdarg.h>
#include <stddef.h>

/* Exit code of a helper whose own setup failed (before or instead of running a command). */
#define DBX_EXIT_SETUP 125

/* The signal deltaboxd queues (SI_QUEUE) to a sandbox's init with a pid in si_value: init
 * raises its pid namespace's counter (ns_last_pid) to that pid if it is lower (init.c). */
#define DBX_SIG_PID_FLOOR SIGUSR2
/* Namespaces a sandbox process shares with the sandbox's init (all but mount). */
#define DBX_NS_FLAGS (CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWCGROUP)

void dbx_set_progname(const char *name);
/* Print "<prog>: <formatted>: strerror(errno)" and exit DBX_EXIT_SETUP. */
__attribute__((noreturn, format(printf, 1, 2))) void dbx_die_errno(const char *fmt, ...);
/* Print "<prog>: <formatted>" and exit DBX_EXIT_SETUP. */
__attribute__((noreturn, format(printf, 1, 2))) void dbx_die(const char *fmt, ...);

/* Write our pid into a cgroup.procs (v1 or v2) file; returns 0 or -1 with errno. */
int dbx_join_cgroup(const char *procs_file);
/* Parse a decimal fd number given on the command line; dies on garbage. */
int dbx_parse_fd(const char *arg, const char *what);
/* Write all of buf to fd, retrying on EINTR/short writes. Returns 0 or -1. */
int dbx_write_all(int fd, const char *buf, size_t len);
/* Map a wait status to a shell-style exit code: code, or 128+signal. */
int dbx_exit_code(int status);
/* Right after joining or creating a sandbox's user namespace (optional; deltaboxd
 * --userns): become its root, uid and gid 0 with no supplementary groups. Until then the
 * caller's host ids are unmapped there, so the files it would create could not be owned by
 * anyone inside. Dies (DBX_EXIT_SETUP) on failure. */
void dbx_become_userns_root(void);


/* Confinement of sandbox processes (native/common.c: dbx_confine).
 *
 * Capabilities kept in every sandbox process (bounding, permitted, effective; inheritable and
 * ambient empty). The list and the reason for each is in README.md, "Security". */
#define DBX_KEPT_CAPS                                                                        \
	X(CAP_CHOWN) X(CAP_DAC_OVERRIDE) X(CAP_FOWNER) X(CAP_FSETID) X(CAP_KILL)              \
	X(CAP_SETGID) X(CAP_SETUID) X(CAP_SETPCAP) X(CAP_NET_BIND_SERVICE) X(CAP_NET_RAW)     \
	X(CAP_SYS_CHROOT) X(CAP_AUDIT_WRITE) X(CAP_SETFCAP) X(CAP_SYS_ADMIN)

/* Set RLIMIT_NOFILE back to the daemon's original soft limit (DBX_SANDBOX_NOFILE), drop
 * capabilities to DBX_KEPT_CAPS, set no_new_privs and install the sandbox's seccomp
 * filter, in this order. Dies (DBX_EXIT_SETUP) on failure. Single-threaded callers only. */
void dbx_confine(void);

#endif
