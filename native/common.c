#include "common.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/audit.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *progname = "dbx";

void dbx_set_progname(const char *name) { progname = name; }

void dbx_die_errno(const char *fmt, ...)
{
	int saved = errno;
	va_list ap;
	fprintf(stderr, "%s: ", progname);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fprintf(stderr, ": %s\n", strerror(saved));
	_exit(DBX_EXIT_SETUP);
}

void dbx_die(const char *fmt, ...)
{
	va_list ap;
	fprintf(stderr, "%s: ", progname);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	_exit(DBX_EXIT_SETUP);
}

int dbx_write_all(int fd, const char *buf, size_t len)
{
	while (len > 0) {
		ssize_t n = write(fd, buf, len);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			return -1;
		}
		buf += n;
		len -= (size_t)n;
	}
	return 0;
}

int dbx_join_cgroup(const char *procs_file)
{
	char pid[32];
	int fd, rc, saved;
	int len = snprintf(pid, sizeof(pid), "%d\n", getpid());

	fd = open(procs_file, O_WRONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	rc = dbx_write_all(fd, pid, (size_t)len);
	saved = errno;
	close(fd);
	errno = saved;
	return rc;
}

int dbx_parse_fd(const char *arg, const char *what)
{
	char *end = NULL;
	long v;

	errno = 0;
	v = strtol(arg, &end, 10);
	if (errno != 0 || end == arg || *end != '\0' || v < 0 || v > 1 << 20)
		dbx_die("%s: not a file descriptor number: '%s'", what, arg);
	return (int)v;
}

void dbx_become_userns_root(void)
{
	/* gid first: after setresuid the capability to change it may be gone. setgroups is
	 * allowed because deltaboxd (privileged in the parent namespace) wrote gid_map. */
	if (setresgid(0, 0, 0) < 0)
		dbx_die_errno("setresgid(0) in the sandbox's user namespace");
	if (setgroups(0, NULL) < 0)
		dbx_die_errno("setgroups(0) in the sandbox's user namespace");
	if (setresuid(0, 0, 0) < 0)
		dbx_die_errno("setresuid(0) in the sandbox's user namespace");
}

int dbx_exit_code(int status)
{
	if (WIFEXITED(status))
		return WEXITSTATUS(status);
	if (WIFSIGNALED(status))
		return 128 + WTERMSIG(status);
	return DBX_EXIT_SETUP;
}

/* ---- confinement of sandbox processes ------------------------------------------------
 *
 * What runc/crun do for a container, minus what DeltaCR needs (README.md, "Security"):
 * capabilities cut to DBX_KEPT_CAPS (bounding set too, so an execve as root cannot get the
 * rest back), no_new_privs, and a seccomp filter (raw classic BPF, x86_64 only).
 *
 * The filter is a deny list: the calls below fail with EPERM (ENOSYS where programs probe
 * and fall back), a handful are checked by argument, everything else is allowed.  A
 * process of another architecture (i386 int 0x80, x32) is killed.
 *
 * System calls that deltaboxd itself makes *inside* sandbox processes (ptrace-injected by
 * native/fork_template.c: setns, clone3 with set_tid, unshare, userfaultfd) are in
 * dbx_injected_syscalls and get DBX_INJECTED_ACTION.  The daemon seizes its tracees with
 * PTRACE_O_SUSPEND_SECCOMP, which switches the filter off for an injected call; untraced
 * sandbox code gets SECCOMP_RET_TRACE's ENOSYS.  A tracer inside the sandbox cannot approve
 * those calls: ptrace options PTRACE_O_TRACESECCOMP / PTRACE_O_SUSPEND_SECCOMP are refused
 * to sandbox code (and SUSPEND_SECCOMP needs a tracer without a filter anyway), and without
 * TRACESECCOMP a traced process gets ENOSYS too.  On a host where the daemon cannot use
 * SUSPEND_SECCOMP (itself under seccomp), fork_template.c must add PTRACE_O_TRACESECCOMP to
 * its seize options; or switch DBX_INJECTED_ACTION to SECCOMP_RET_ALLOW (one line, weaker).
 */
#ifndef PTRACE_O_SUSPEND_SECCOMP
#define PTRACE_O_SUSPEND_SECCOMP (1 << 21)
#endif
#ifndef __NR_open_tree_attr
#define __NR_open_tree_attr 467
#endif
#ifndef AF_VSOCK
#define AF_VSOCK 40
#endif

#define DBX_INJECTED_ACTION SECCOMP_RET_TRACE

/* Calls only the daemon may make in a sandbox process (see above). */
static const int dbx_injected_syscalls[] = {
	__NR_setns, __NR_unshare, __NR_clone3, __NR_userfaultfd,
};

/* Calls sandbox code never gets: EPERM. */
static const int dbx_denied_syscalls[] = {
	/* mounts: the sandbox's mount tree (masks, read-only /proc/sys, /sys) is fixed */
	__NR_mount, __NR_umount2, __NR_pivot_root, __NR_move_mount, __NR_fsopen, __NR_fsmount,
	__NR_fsconfig, __NR_fspick, __NR_open_tree, __NR_open_tree_attr, __NR_mount_setattr,
	/* the host kernel itself */
	__NR_kexec_load, __NR_kexec_file_load, __NR_init_module, __NR_finit_module,
	__NR_delete_module, __NR_create_module, __NR_get_kernel_syms, __NR_query_module,
	__NR_reboot, __NR_swapon, __NR_swapoff, __NR_syslog, __NR_iopl, __NR_ioperm, __NR_acct,
	__NR_quotactl, __NR_quotactl_fd, __NR_settimeofday, __NR_clock_settime, __NR_adjtimex,
	__NR_clock_adjtime, __NR_lookup_dcookie, __NR_nfsservctl, __NR_vhangup, __NR_uselib,
	__NR_ustat, __NR_sysfs, __NR__sysctl, __NR_modify_ldt,
	/* tracing and observation of the whole host */
	__NR_bpf, __NR_perf_event_open, __NR_fanotify_init,
	/* kernel keyrings are not namespaced */
	__NR_keyctl, __NR_add_key, __NR_request_key,
	/* file handles bypass the mount tree */
	__NR_open_by_handle_at,
};

/* Calls refused with ENOSYS, so that programs that probe for them fall back. */
static const int dbx_enosys_syscalls[] = {
	/* io_uring runs operations outside this filter's view */
	__NR_io_uring_setup, __NR_io_uring_enter, __NR_io_uring_register,
	/* A Linux AIO context (a ring the kernel maps, requests in flight in the kernel) can
	 * be neither templated nor made again, so a process holding one could never be
	 * checkpointed; without it, programs use their synchronous or threaded I/O (InnoDB:
	 * "Linux Native AIO disabled"). */
	__NR_io_setup, __NR_io_destroy, __NR_io_submit, __NR_io_cancel, __NR_io_getevents,
	__NR_io_pgetevents,
};

#define NS_CLONE_FLAGS                                                                       \
	(CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER |       \
	 CLONE_NEWPID | CLONE_NEWNET)

#define MAX_INSNS 512
struct bpf_prog_buf {
	struct sock_filter insn[MAX_INSNS];
	unsigned int n;
};

static void emit(struct bpf_prog_buf *p, struct sock_filter f)
{
	if (p->n == MAX_INSNS)
		dbx_die("seccomp filter too long");
	p->insn[p->n++] = f;
}

#define STMT(code, k) ((struct sock_filter)BPF_STMT(code, k))
#define JUMP(code, k, jt, jf) ((struct sock_filter)BPF_JUMP(code, k, jt, jf))
#define LD_NR STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr))
/* The low 32 bits of argument i (x86_64 is little-endian). */
#define LD_ARG(i) STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[i]))
#define RET(v) STMT(BPF_RET | BPF_K, v)
#define EPERM_ ((unsigned)SECCOMP_RET_ERRNO | EPERM)

static void emit_list(struct bpf_prog_buf *p, const int *nrs, size_t n, unsigned int action)
{
	for (size_t i = 0; i < n; i++) {
		emit(p, JUMP(BPF_JMP | BPF_JEQ | BPF_K, (unsigned)nrs[i], 0, 1));
		emit(p, RET(action));
	}
}

/* Syscall nr with the low word of argument arg equal to one of vals: EPERM. The block
 * returns on every path once nr matched (A is overwritten). */
static void emit_arg_equals(struct bpf_prog_buf *p, int nr, int arg, const unsigned *vals,
			    unsigned int nvals)
{
	emit(p, JUMP(BPF_JMP | BPF_JEQ | BPF_K, (unsigned)nr, 0, (unsigned char)(nvals + 3)));
	emit(p, LD_ARG(arg));
	for (unsigned int i = 0; i < nvals; i++)
		emit(p, JUMP(BPF_JMP | BPF_JEQ | BPF_K, vals[i], (unsigned char)(nvals - i), 0));
	emit(p, RET(SECCOMP_RET_ALLOW));
	emit(p, RET(EPERM_));
}

static void build_filter(struct bpf_prog_buf *p)
{
	static const unsigned vsock[] = { AF_VSOCK };
	static const unsigned tty_inject[] = { TIOCSTI, TIOCLINUX };
	static const unsigned init_pid[] = { 1 };

	p->n = 0;
	emit(p, STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)));
	emit(p, JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0));
	emit(p, RET(SECCOMP_RET_KILL_PROCESS));
	emit(p, LD_NR);
	emit(p, JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000u /* __X32_SYSCALL_BIT */, 0, 1));
	emit(p, RET(SECCOMP_RET_KILL_PROCESS));
	emit_list(p, dbx_denied_syscalls, sizeof(dbx_denied_syscalls) / sizeof(int), EPERM_);
	emit_list(p, dbx_enosys_syscalls, sizeof(dbx_enosys_syscalls) / sizeof(int),
		  SECCOMP_RET_ERRNO | ENOSYS);
	emit_list(p, dbx_injected_syscalls, sizeof(dbx_injected_syscalls) / sizeof(int),
		  DBX_INJECTED_ACTION);

	/* clone with a namespace flag (clone3 is in the injected list: glibc falls back to
	 * clone on its ENOSYS). CLONE_NEWTIME (0x80) is part of clone's exit signal byte. */
	emit(p, JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone, 0, 4));
	emit(p, LD_ARG(0));
	emit(p, JUMP(BPF_JMP | BPF_JSET | BPF_K, NS_CLONE_FLAGS, 0, 1));
	emit(p, RET(EPERM_));
	emit(p, RET(SECCOMP_RET_ALLOW));

	/* ptrace: not of the sandbox's init (pid 1), and never with options that would let a
	 * tracer inside the sandbox approve (TRACESECCOMP) or switch off (SUSPEND_SECCOMP) this
	 * filter for its tracee. */
	emit(p, JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_ptrace, 0, 10));
	emit(p, LD_ARG(1));
	emit(p, JUMP(BPF_JMP | BPF_JEQ | BPF_K, 1, 0, 1));
	emit(p, RET(EPERM_));
	emit(p, LD_ARG(0));
	emit(p, JUMP(BPF_JMP | BPF_JEQ | BPF_K, PTRACE_SEIZE, 1, 0));
	emit(p, JUMP(BPF_JMP | BPF_JEQ | BPF_K, PTRACE_SETOPTIONS, 0, 3));
	emit(p, LD_ARG(3));
	emit(p, JUMP(BPF_JMP | BPF_JSET | BPF_K,
		     PTRACE_O_TRACESECCOMP | PTRACE_O_SUSPEND_SECCOMP, 0, 1));
	emit(p, RET(EPERM_));
	emit(p, RET(SECCOMP_RET_ALLOW));

	/* personality: only the values docker allows (Linux, UNAME26, PER_LINUX32, query). */
	emit(p, JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_personality, 0, 8));
	emit(p, LD_ARG(0));
	emit(p, JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0x0, 5, 0));
	emit(p, JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0x8, 4, 0));
	emit(p, JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0x20000, 3, 0));
	emit(p, JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0x20008, 2, 0));
	emit(p, JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0xffffffffu, 1, 0));
	emit(p, RET(EPERM_));
	emit(p, RET(SECCOMP_RET_ALLOW));

	/* vsock is not network-namespaced: it would reach the VM host or local services. */
	emit_arg_equals(p, __NR_socket, 0, vsock, 1);
	emit_arg_equals(p, __NR_socketpair, 0, vsock, 1);
	/* Faking terminal input (TIOCSTI needs CAP_SYS_ADMIN, which sandbox processes keep). */
	emit_arg_equals(p, __NR_ioctl, 1, tty_inject, 2);
	/* Memory of the sandbox's init (its pid 1). */
	emit_arg_equals(p, __NR_process_vm_readv, 0, init_pid, 1);
	emit_arg_equals(p, __NR_process_vm_writev, 0, init_pid, 1);

	emit(p, RET(SECCOMP_RET_ALLOW));
}

static void drop_capabilities(void)
{
	static const int kept[] = {
#define X(c) c,
		DBX_KEPT_CAPS
#undef X
	};
	struct __user_cap_header_struct hdr = { _LINUX_CAPABILITY_VERSION_3, 0 };
	struct __user_cap_data_struct data[2];
	uint64_t keep = 0;

	for (size_t i = 0; i < sizeof(kept) / sizeof(kept[0]); i++)
		keep |= 1ULL << kept[i];
	/* The bounding set first (needs CAP_SETPCAP, still ours): for root, execve grants
	 * the whole bounding set. Stop at the first capability this kernel does not know. */
	for (int c = 0; c < 64; c++) {
		if (keep & (1ULL << c))
			continue;
		if (prctl(PR_CAPBSET_DROP, c, 0, 0, 0) < 0) {
			if (errno == EINVAL)
				break;
			dbx_die_errno("drop capability %d from the bounding set", c);
		}
	}
	if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
		dbx_die_errno("clear ambient capabilities");
	memset(data, 0, sizeof(data));
	for (int i = 0; i < 2; i++)
		data[i].effective = data[i].permitted = (uint32_t)(keep >> (32 * i));
	if (syscall(SYS_capset, &hdr, data) < 0)
		dbx_die_errno("capset");
}

/* The daemon raises its own RLIMIT_NOFILE (it holds descriptors for every sandbox) and
 * passes the soft limit it was started with in DBX_SANDBOX_NOFILE: the sandbox's processes
 * get that one back, as if they had been started beside the daemon rather than by it. */
static void restore_nofile(void)
{
	const char *v = getenv("DBX_SANDBOX_NOFILE");
	unsigned long long soft;
	struct rlimit r;
	char *end;

	if (!v || !*v)
		return;
	errno = 0;
	soft = strtoull(v, &end, 10);
	if (errno || *end)
		dbx_die("DBX_SANDBOX_NOFILE=%s: not a number", v);
	if (getrlimit(RLIMIT_NOFILE, &r) < 0)
		dbx_die_errno("getrlimit(RLIMIT_NOFILE)");
	if (soft >= r.rlim_cur)
		return;
	r.rlim_cur = (rlim_t)soft;
	if (setrlimit(RLIMIT_NOFILE, &r) < 0)
		dbx_die_errno("setrlimit(RLIMIT_NOFILE, %llu)", soft);
}

void dbx_confine(void)
{
	struct bpf_prog_buf p;
	struct sock_fprog prog;

	restore_nofile();
	drop_capabilities();
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
		dbx_die_errno("PR_SET_NO_NEW_PRIVS");
	build_filter(&p);
	prog.len = (unsigned short)p.n;
	prog.filter = p.insn;
	if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) < 0)
		dbx_die_errno("install the seccomp filter");
}
