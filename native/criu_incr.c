/* DeltaCR images: incremental dumps of process templates and restore from disk.
 * See criu_incr.h for the API and IMAGE_FORMAT.md for the files.  x86_64 only.
 *
 * Dump
 * ----
 * A template (fork_template.c) is a ptrace-stopped fork of the process at checkpoint time:
 * its address space *is* the checkpointed memory (copy-on-write shared with the live
 * process) and its struct holds the checkpointed registers, xstate, signal mask and
 * pending signals.  Dumping reads it from outside and by injected system calls:
 *   - /proc/T/smaps: the VMAs with protections, flags (VmFlags: gd, hg, nh, wf, dd), file
 *     path and offset; the template's own scratch area is cut out.
 *   - /proc/T/pagemap: which pages to store.  Private anonymous VMAs: every present or
 *     swapped page.  Private file VMAs: only present pages that are not page-cache pages
 *     (PM_FILE clear: the copy-on-write anonymous copies), so text and read-only data
 *     come back from the file.  Shared file VMAs: nothing (the file is the content).
 *     Shared anonymous memory (/dev/zero, memfd, deleted files): every page holding data
 *     in the object (its holes, never written, are zeros: data_segments), restored as a
 *     fresh anonymous mapping of the same kind (its sharing with other processes, and
 *     its content, are the daemon's: the template's pages are the live process's later
 *     writes, so every child gets the daemon's copy mapped over it: dbxcr_remap).
 *     A System V segment's attachment the same (the daemon makes the segment again and
 *     every child attaches it over the mapping).  Device mappings are refused.
 *   - page contents with process_vm_readv (or /proc/T/mem for unreadable VMAs); all-zero
 *     pages are recorded without data (anonymous: not at all, fresh memory is zero).
 *   - injected into the parked template: brk(0), rt_sigaction(sig, NULL, &old) for every
 *     signal, sigaltstack(NULL, &old); from ptrace: the rseq registration; from /proc:
 *     mm fields (stat), auxv, exe, comm, umask, personality, credentials.
 *
 * Incremental dumps: per-page content hashes
 * ------------------------------------------
 * Every page an image stores has a 128-bit content hash in its pagemap.img (in pages.img
 * order).  A dump given the parent image hashes each candidate page and, when the parent's
 * run for that address points at a page with the same hash, references that page (its
 * level and offset) instead of writing it.  Why hashes and not uffd write-protect +
 * PAGEMAP_SCAN: a template is a fresh fork at every checkpoint, so dirty tracking would
 * have to live in the *live* process (an injected userfaultfd the program can see, one
 * more descriptor, re-armed at every checkpoint, lost on exec and not inherited by forks),
 * and any gap in that tracking silently loses writes.  Hashing needs nothing from the
 * live process and is self-checking.  Measured here (benchmarks/dump_cr.py --quick, 200
 * MiB python process): the hash alone runs at 7.5-8.5 GB/s; an incremental dump with
 * nothing dirtied (PAGEMAP_SCAN + process_vm_readv + hash of all 200 MiB) takes 60-140
 * ms, i.e. ~1.5-3 GB/s of resident memory, off the critical path (dumps run in the
 * background); bytes written are 1.19x the bytes dirtied at 1 MiB (the interpreter
 * dirties ~200 KB itself per command) and 1.01-1.02x at 10-100 MiB.  The same hashes
 * verify every page at restore, so they double as the checksum of pages.img.  A hash
 * collision at the same address (2^-128 by chance; the hash is not cryptographic, so only
 * a process crafting one against itself could) would keep the parent's bytes.
 *
 * Chains: a run of the index says which ancestor level holds the bytes (0 = this image,
 * 1 = parent, ...).  Each image's index describes the *whole* memory, so restore never
 * merges indexes; it only opens the pages.img of `depth` ancestors.  When the parent's
 * depth + 1 reaches max_chain the dump is full (depth 0) and depends on nothing.
 *
 * Restore
 * -------
 *  1. A fresh process: clone(SIGCHLD) injected into `host` (e.g. the sandbox's init), so
 *     the new process R is host's child in host's pid/mount/net namespaces and cgroup.
 *     PTRACE_O_TRACEFORK attaches R at birth, before it runs any code.
 *  2. In R, by injected calls from a syscall site in its (host-inherited) vdso:
 *     close_range(0, ~0) (a restored template holds no descriptors; spawn installs what
 *     the caller gives); unregister R's rseq area (the kernel would write to it once the
 *     memory under it is gone and kill R); map a one-page code area C (a `syscall`
 *     instruction, our syscall site from now on) and the scratch area D, both at addresses
 *     no dumped VMA uses; munmap everything else except the vdso and its vvar pages.
 *  3. Move [vvar], [vvar_vclock], [vdso] to their dumped addresses with mremap (through a
 *     temporary area if the ranges overlap).  The kernel's vdso mremap hook updates the
 *     mm's vdso pointer.  The vdso must be byte-identical to the dumped one (same kernel):
 *     checked by hash, refused otherwise (saved registers may point into it).
 *  4. mmap every dumped VMA at its address (MAP_FIXED_NOREPLACE), file-backed ones from
 *     files opened here with openat2(root, path, RESOLVE_IN_ROOT) whose size and mtime must
 *     match the dump, and passed into R with SCM_RIGHTS (transfer_fds); VMAs that receive
 *     page contents are mapped writable first and mprotect'ed to their protections after.
 *  5. Page contents: pread from the pages.img of the right level, hash-checked, written
 *     with process_vm_writev.
 *  Adopted (dbxcr_held_adopt), R is a fork of the held parent instead, and steps 2 and 4-5
 *  keep what it already has right: the private mappings holding one of the image's
 *  (anonymous, or of the very file step 4 would map there), their pages still
 *  one frame with the image's template's not written (r_keep_forked), and nothing
 *  written where the spawn maps a shared object afresh (skip_remapped).
 *  6. prctl(PR_SET_MM, PR_SET_MM_MAP): code/data/brk/stack/arg/env bounds, auxv, exe file.
 *     rseq registered again as dumped; sigactions (into a process that has just exec'ed,
 *     only those that differ from what the exec left: SIG_DFL, or SIG_IGN, no flags),
 *     sigaltstack, umask, personality, comm;
 *     credentials last (setgroups/setresgid/setresuid) when they differ from host's.
 *  7. The syscall site moves to the restored vdso, C is unmapped, and R is parked exactly
 *     like a template made by dbxcr_template_stopped (all signals blocked, registers set to
 *     exit_group if ever resumed, EXITKILL).  Registers, xstate (same size as this CPU's,
 *     checked), mask and pending signals come from the image into the template struct.
 * Not restored (documented limits): device mappings, VMA names ([anon:x]),
 * mlock, the protection key of a shared mapping made again over the image's (a spawn's
 * remap: the default key; private mappings keep theirs, r_pkeys), seccomp filters
 * (refused at dump), capabilities other than those implied by the
 * uids, rlimits/session/timers (host's apply). A multi-threaded process's other threads
 * come from core.img's threads section into the template, and every child clones them.
 */
#include "criu_incr.h"
#include "dbxcr_internal.h"

#include <dirent.h>
#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <linux/openat2.h>
#include <linux/prctl.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/user.h>
#include <sys/wait.h>
#include <unistd.h>

#define PAGE 4096UL
#define IMG_MAGIC "DBXCRIMG"
#define IMG_VERSION 1
#define KIND_CORE 1
#define KIND_MM 2
#define KIND_PAGEMAP 3
#define DEFAULT_MAX_CHAIN 8
#define MAX_DEPTH 64
#define CHUNK_PAGES 256		/* 1 MiB of page data per read/write batch */
#define NSIG_K 64
#define MAX_GROUPS 64
#define TASK_TOP 0x7ffffffff000UL

#define PM_PRESENT (1ULL << 63)
#define PM_SWAP (1ULL << 62)
#define PM_FILE (1ULL << 61)

/* VMA flags in mm.img */
#define VMA_SHARED 0x1
#define VMA_FILE 0x2		/* map from the file in the root at restore */
#define VMA_SPECIAL 0x4		/* [vdso], [vvar], [vvar_vclock]: moved, not mapped */
#define VMA_GROWSDOWN 0x8
#define VMA_WHOLE 0x10		/* every page stored; restored as anonymous memory */
#define VMA_HUGE 0x20		/* MADV_HUGEPAGE */
#define VMA_NOHUGE 0x40		/* MADV_NOHUGEPAGE */
#define VMA_WIPEONFORK 0x80
#define VMA_DONTDUMP 0x100
#define VMA_HEAP 0x200
#define VMA_STACK 0x400
/* Its memory protection key (x86 PKU: pkey_mprotect), 0 the default one: bits 16-19. */
#define VMA_PKEY_SHIFT 16
#define VMA_PKEY_MAX 15
#define VMA_PKEY (VMA_PKEY_MAX << VMA_PKEY_SHIFT)

#define RUN_ZERO 0x1
/* Pages not stored in any pages.img: they are in the memory of the template the image was
 * made from (dbxcr_dump_opts.live), at the run's address; only a restore given that
 * template (dbxcr_held_adopt's src) can use the image. */
#define RUN_LIVE 0x2
#define RUN_NODATA (RUN_ZERO | RUN_LIVE)

/* PTRACE_GET_RSEQ_CONFIGURATION's result (linux/ptrace.h clashes with sys/ptrace.h). */
struct rseq_conf {
	uint64_t rseq_abi_pointer;
	uint32_t rseq_abi_size;
	uint32_t signature;
	uint32_t flags;
	uint32_t pad;
};

struct img_hdr {
	char magic[8];
	uint32_t kind;
	uint32_t version;
	uint64_t payload_len;
	uint64_t checksum;	/* first half of dbxcr_hash128(payload) */
	uint8_t image_id[16];	/* the same in every file of one image */
};

struct ksigaction {
	uint64_t handler, flags, restorer, mask;
};

struct core_fixed {
	uint32_t arch;		/* EM_X86_64 */
	uint32_t depth;		/* 0: full dump; else parent's depth + 1 */
	uint8_t parent_id[16];
	int32_t origin_pid;
	int32_t template_pid;
	struct user_regs_struct regs;
	uint64_t sigmask;
	struct ksigaction sig[NSIG_K];	/* index sig-1 */
	uint64_t ss_sp;
	int32_t ss_flags;
	uint32_t has_rseq;
	uint64_t ss_size;
	uint64_t rseq_ptr;
	uint32_t rseq_len, rseq_sig;
	uint64_t mm[MM_BOUNDS];	/* start_code end_code start_data end_data start_brk brk
				 * start_stack arg_start arg_end env_start env_end */
	uint32_t umask, personality;
	uint32_t uid[3], gid[3];	/* real, effective, saved */
	uint32_t ngroups;
	uint32_t groups[MAX_GROUPS];
	char comm[16];
	uint64_t vdso_hash[2];
	uint64_t vdso_size;
	uint32_t xstate_len, npending, auxv_len, exe_len, parent_ref_len;
	uint32_t ndontfork;	/* MADV_DONTFORK runs (dontfork.c); 0 in older images */
	uint8_t pend_shared[64];
	/* followed by: xstate, npending * siginfo_t, auxv, exe path, parent_ref,
	 * ndontfork * struct dontfork_img, and (absent in older images) struct robust_img */
};

struct dontfork_img {
	uint64_t start, end;
};

/* The main thread's robust futex list (set_robust_list), which a fork drops. */
struct robust_img {
	uint64_t head, len;
};

/* After robust_img, in the image of a multi-threaded process only: the other threads
 * (threads.c recreates them in every child), each record followed by its xstate and its
 * own pending signals. */
struct threads_img {
	uint32_t n;
	uint32_t pad;
	uint64_t main_clear_tid;
};

struct thread_img {
	int32_t tid, nstid;
	struct user_regs_struct regs;
	uint64_t sigmask;
	uint64_t clear_tid, robust_head, robust_len, rseq_ptr;
	uint32_t rseq_len, rseq_sig;
	uint64_t ss_sp, ss_size;
	int32_t ss_flags;
	uint32_t affinity_known;
	uint8_t affinity[128];
	char comm[16];
	uint32_t xstate_len, npending;
	uint8_t pend_shared[MAX_PENDING];
};
#define MAX_DONTFORK 65536

struct vma_img {
	uint64_t start, end, pgoff;
	uint32_t prot, flags;
	uint32_t name_off, name_len;	/* in the string table after the records */
	int64_t fsize;			/* file VMAs: size and mtime at dump, checked */
	int64_t mtime_sec, mtime_nsec;
};

struct mm_fixed {
	uint32_t nvma, pad;
	uint64_t strtab_len;
	/* followed by nvma * struct vma_img, then the string table */
};

struct run_img {
	uint64_t vaddr;
	uint32_t npages;
	uint16_t level;		/* 0: this image's pages.img, k: k-th ancestor's */
	uint16_t flags;		/* RUN_ZERO: all-zero pages, no data; RUN_LIVE: see above */
	uint64_t off;		/* page index in that level's pages.img */
};

struct pagemap_fixed {
	uint64_t data_pages;	/* pages in this image's pages.img */
	uint64_t nruns;
	uint64_t npages;	/* sum of run npages (pages the index describes) */
	/* followed by nruns * struct run_img, then data_pages * 2 * uint64_t: the hash of
	 * each page of this image's pages.img, in file order */
};

/* ---------- hash ---------- */

#define HK1 0x9E3779B185EBCA87ULL
#define HK2 0xC2B2AE3D27D4EB4FULL
#define HK3 0x165667B19E3779F9ULL
#define HK4 0xD6E8FEB86659FD93ULL

static inline uint64_t rotl64(uint64_t x, int r)
{
	return (x << r) | (x >> (64 - r));
}

static inline uint64_t fmix64(uint64_t x)
{
	x ^= x >> 31;
	x *= HK2;
	x ^= x >> 29;
	x *= HK3;
	x ^= x >> 32;
	return x;
}

/* Four independent multiply-rotate lanes over 32-byte blocks, folded and finalised twice. */
void dbxcr_hash128(const void *data, size_t len, uint64_t out[2])
{
	const unsigned char *p = data;
	uint64_t a = HK1 ^ len, b = HK2 + len, c = HK3, d = HK4 - len;
	size_t i = 0;

	for (; i + 32 <= len; i += 32) {
		uint64_t w[4];

		memcpy(w, p + i, 32);
		a = rotl64(a + w[0] * HK2, 31) * HK1;
		b = rotl64(b + w[1] * HK2, 31) * HK1;
		c = rotl64(c + w[2] * HK2, 31) * HK1;
		d = rotl64(d + w[3] * HK2, 31) * HK1;
	}
	if (i < len) {
		uint64_t w[4] = { 0, 0, 0, 0 };

		memcpy(w, p + i, len - i);
		a = rotl64(a + w[0] * HK2, 31) * HK1;
		b = rotl64(b + w[1] * HK2, 31) * HK1;
		c = rotl64(c + w[2] * HK2, 31) * HK1;
		d = rotl64(d + w[3] * HK2, 31) * HK1;
		a ^= (uint64_t)(len - i) * HK4;
	}
	out[0] = fmix64(a ^ rotl64(b, 17) ^ rotl64(c, 29) ^ rotl64(d, 43) ^ len);
	out[1] = fmix64(b ^ rotl64(c, 13) ^ rotl64(d, 37) ^ rotl64(a, 51) ^ out[0] ^ HK3);
}

static bool page_is_zero(const void *p)
{
	const uint64_t *w = p;

	for (size_t i = 0; i < PAGE / 8; i += 8)
		if (w[i] | w[i + 1] | w[i + 2] | w[i + 3] | w[i + 4] | w[i + 5] | w[i + 6] | w[i + 7])
			return false;
	return true;
}

static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* ---------- growable buffers ---------- */

struct buf {
	unsigned char *p;
	size_t len, cap;
};

static int buf_add(struct buf *b, const void *data, size_t len)
{
	if (b->len + len > b->cap) {
		size_t cap = b->cap ? b->cap : 4096;
		void *np;

		while (cap < b->len + len)
			cap *= 2;
		np = realloc(b->p, cap);
		if (!np)
			return -1;
		b->p = np;
		b->cap = cap;
	}
	if (data)
		memcpy(b->p + b->len, data, len);
	else
		memset(b->p + b->len, 0, len);
	b->len += len;
	return 0;
}

static void buf_free(struct buf *b)
{
	free(b->p);
	b->p = NULL;
	b->len = b->cap = 0;
}

/* ---------- image files ---------- */

/* All of data written to fd (a short write goes on, EINTR retried).  0, or -1 with errno
 * set.  (Declared in dbxcr_internal.h: ipcns.c writes message copies with it.) */
int full_write(int fd, const void *data, size_t len)
{
	const char *p = data;

	while (len) {
		ssize_t n = write(fd, p, len);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return -1;
		p += n;
		len -= (size_t)n;
	}
	return 0;
}

static int full_pread(int fd, void *data, size_t len, off_t off)
{
	char *p = data;

	while (len) {
		ssize_t n = pread(fd, p, len, off);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return -1;
		if (n == 0) {
			errno = ENODATA;
			return -1;
		}
		p += n;
		len -= (size_t)n;
		off += n;
	}
	return 0;
}

static void fd_path(int fd, char *out, size_t len)
{
	char link[64];
	ssize_t n;

	snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
	n = readlink(link, out, len - 1);
	if (n < 0)
		snprintf(out, len, "(fd %d)", fd);
	else
		out[n] = '\0';
}

static int write_img(int dirfd, const char *name, uint32_t kind, const uint8_t id[16],
		     const void *payload, size_t len, bool do_fsync, uint64_t *bytes,
		     pid_t pid, struct dbxcr_error *err)
{
	struct img_hdr h;
	uint64_t hh[2];
	int fd = openat(dirfd, name, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);

	if (fd < 0)
		return fail(err, errno, pid, "create image file %s", name);
	memset(&h, 0, sizeof(h));
	memcpy(h.magic, IMG_MAGIC, 8);
	h.kind = kind;
	h.version = IMG_VERSION;
	h.payload_len = len;
	dbxcr_hash128(payload, len, hh);
	h.checksum = hh[0];
	memcpy(h.image_id, id, 16);
	if (full_write(fd, &h, sizeof(h)) < 0 || full_write(fd, payload, len) < 0 ||
	    (do_fsync && fsync(fd) < 0)) {
		int e = errno;

		close(fd);
		return fail(err, e, pid, "write image file %s", name);
	}
	close(fd);
	*bytes += sizeof(h) + len;
	return 0;
}

/* Read and check one metadata file; *payload is malloc'ed.  Damage is EBADMSG. */
static int read_img(int dirfd, const char *name, uint32_t kind, const uint8_t *want_id,
		    uint8_t id_out[16], void **payload, size_t *len, pid_t pid,
		    struct dbxcr_error *err)
{
	char where[PATH_MAX];
	struct img_hdr h;
	struct stat st;
	uint64_t hh[2];
	void *p = NULL;
	int fd;

	*payload = NULL;
	fd_path(dirfd, where, sizeof(where));
	fd = openat(dirfd, name, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		if (errno == ENOENT)
			return fail(err, EBADMSG, pid, "image %s: %s is missing", where, name);
		return fail(err, errno, pid, "image %s: open %s", where, name);
	}
	if (fstat(fd, &st) < 0) {
		close(fd);
		return fail(err, errno, pid, "image %s: stat %s", where, name);
	}
	if ((size_t)st.st_size < sizeof(h) || full_pread(fd, &h, sizeof(h), 0) < 0) {
		close(fd);
		return fail(err, EBADMSG, pid, "image %s: %s is truncated (%lld bytes)", where, name,
			    (long long)st.st_size);
	}
	if (memcmp(h.magic, IMG_MAGIC, 8) != 0 || h.kind != kind) {
		close(fd);
		return fail(err, EBADMSG, pid, "image %s: %s has a bad header", where, name);
	}
	if (h.version != IMG_VERSION) {
		close(fd);
		return fail(err, EBADMSG, pid, "image %s: %s has format version %u (want %u)",
			    where, name, h.version, IMG_VERSION);
	}
	if ((uint64_t)st.st_size != sizeof(h) + h.payload_len) {
		close(fd);
		return fail(err, EBADMSG, pid, "image %s: %s is %lld bytes, header says %llu "
			    "(truncated or extended)", where, name, (long long)st.st_size,
			    (unsigned long long)(sizeof(h) + h.payload_len));
	}
	p = malloc(h.payload_len ? h.payload_len : 1);
	if (!p) {
		close(fd);
		return fail(err, ENOMEM, pid, "image %s: allocate %s", where, name);
	}
	if (full_pread(fd, p, h.payload_len, sizeof(h)) < 0) {
		int e = errno;

		close(fd);
		free(p);
		return fail(err, e == ENODATA ? EBADMSG : e, pid, "image %s: read %s", where, name);
	}
	close(fd);
	dbxcr_hash128(p, h.payload_len, hh);
	if (hh[0] != h.checksum) {
		free(p);
		return fail(err, EBADMSG, pid, "image %s: %s checksum mismatch (corrupted)", where,
			    name);
	}
	if (want_id && memcmp(want_id, h.image_id, 16) != 0) {
		free(p);
		return fail(err, EBADMSG, pid, "image %s: %s belongs to another image "
			    "(image id mismatch)", where, name);
	}
	if (id_out)
		memcpy(id_out, h.image_id, 16);
	*payload = p;
	*len = h.payload_len;
	return 0;
}

/* A loaded image: core + mm + pagemap, checked for internal consistency. */
struct image {
	uint8_t id[16];
	void *core_raw, *mm_raw, *pm_raw;
	size_t core_len, mm_len, pm_len;
	struct core_fixed *core;
	const unsigned char *xstate;
	const siginfo_t *pending;	/* may be unaligned-safe: copied on use */
	const unsigned char *auxv;
	char *exe;		/* NUL-terminated copies */
	char *parent_ref;
	const unsigned char *dontfork;	/* ndontfork struct dontfork_img, unaligned */
	const unsigned char *robust;	/* struct robust_img, unaligned; NULL: older image */
	const unsigned char *threads;	/* struct threads_img and its records, unaligned;
					 * NULL: one thread */
	size_t threads_len;
	int max_tid;			/* the threads' highest nstid (0: one thread) */
	struct mm_fixed *mm;
	struct vma_img *vmas;
	const char *strtab;
	struct pagemap_fixed *pm;
	struct run_img *runs;
	uint64_t *hashes;	/* 2 per page of this image's pages.img, in file order */
	struct run_img *runs_own;	/* runs when not pm_raw's (skip_remapped), or NULL */
};

static void image_free(struct image *im)
{
	free(im->runs_own);
	free(im->core_raw);
	free(im->mm_raw);
	free(im->pm_raw);
	free(im->exe);
	free(im->parent_ref);
	memset(im, 0, sizeof(*im));
}

static char *dup_str(const unsigned char *p, size_t n)
{
	char *s = malloc(n + 1);

	if (s) {
		memcpy(s, p, n);
		s[n] = '\0';
	}
	return s;
}

/* The threads section is exactly its records: at most MAX_THREADS, each with the main
 * thread's xstate size and at most MAX_PENDING signals.  *max_tid: the highest nstid. */
static int threads_img_check(const unsigned char *p, size_t len, uint32_t xstate_len,
			     int *max_tid)
{
	struct threads_img h;
	size_t at = sizeof(h);

	if (len < sizeof(h))
		return -1;
	memcpy(&h, p, sizeof(h));
	if (h.n == 0 || h.n > MAX_THREADS)
		return -1;
	for (uint32_t i = 0; i < h.n; i++) {
		struct thread_img t;

		if (len - at < sizeof(t))
			return -1;
		memcpy(&t, p + at, sizeof(t));
		if (t.xstate_len != xstate_len || t.npending > MAX_PENDING)
			return -1;
		if (t.nstid > *max_tid)
			*max_tid = t.nstid;
		at += sizeof(t);
		if (len - at < t.xstate_len + (size_t)t.npending * sizeof(siginfo_t))
			return -1;
		at += t.xstate_len + (size_t)t.npending * sizeof(siginfo_t);
	}
	return at == len ? 0 : -1;
}

static int image_load(int dirfd, const uint8_t *want_id, struct image *im, pid_t pid,
		      struct dbxcr_error *err)
{
	char where[PATH_MAX];
	size_t need;
	const unsigned char *q;

	memset(im, 0, sizeof(*im));
	fd_path(dirfd, where, sizeof(where));
	if (read_img(dirfd, "core.img", KIND_CORE, want_id, im->id, &im->core_raw, &im->core_len,
		     pid, err) < 0)
		goto bad;
	if (read_img(dirfd, "mm.img", KIND_MM, im->id, NULL, &im->mm_raw, &im->mm_len, pid,
		     err) < 0)
		goto bad;
	if (read_img(dirfd, "pagemap.img", KIND_PAGEMAP, im->id, NULL, &im->pm_raw, &im->pm_len,
		     pid, err) < 0)
		goto bad;
	if (im->core_len < sizeof(struct core_fixed))
		goto inconsistent;
	im->core = im->core_raw;
	if (im->core->arch != EM_X86_64 || im->core->npending > 64 || im->core->depth > MAX_DEPTH ||
	    im->core->ndontfork > MAX_DONTFORK)
		goto inconsistent;
	need = sizeof(struct core_fixed) + (size_t)im->core->xstate_len +
	       (size_t)im->core->npending * sizeof(siginfo_t) + im->core->auxv_len +
	       im->core->exe_len + im->core->parent_ref_len +
	       (size_t)im->core->ndontfork * sizeof(struct dontfork_img);
	if (need != im->core_len && need + sizeof(struct robust_img) > im->core_len)
		goto inconsistent;
	q = (const unsigned char *)im->core_raw + sizeof(struct core_fixed);
	im->xstate = q;
	q += im->core->xstate_len;
	im->pending = (const siginfo_t *)q;
	q += (size_t)im->core->npending * sizeof(siginfo_t);
	im->auxv = q;
	q += im->core->auxv_len;
	im->exe = dup_str(q, im->core->exe_len);
	q += im->core->exe_len;
	im->parent_ref = dup_str(q, im->core->parent_ref_len);
	q += im->core->parent_ref_len;
	im->dontfork = q;
	if (need != im->core_len) {
		im->robust = q + (size_t)im->core->ndontfork * sizeof(struct dontfork_img);
		need += sizeof(struct robust_img);
	}
	if (need != im->core_len) {
		im->threads = (const unsigned char *)im->core_raw + need;
		im->threads_len = im->core_len - need;
		if (threads_img_check(im->threads, im->threads_len, im->core->xstate_len,
				      &im->max_tid) < 0)
			goto inconsistent;
	}
	if (!im->exe || !im->parent_ref) {
		fail(err, ENOMEM, pid, "image %s: allocate", where);
		goto bad;
	}
	if ((im->core->depth > 0) != (im->core->parent_ref_len > 0))
		goto inconsistent;
	if (im->mm_len < sizeof(struct mm_fixed))
		goto inconsistent;
	im->mm = im->mm_raw;
	if (sizeof(struct mm_fixed) + (size_t)im->mm->nvma * sizeof(struct vma_img) +
	    im->mm->strtab_len != im->mm_len)
		goto inconsistent;
	im->vmas = (struct vma_img *)((char *)im->mm_raw + sizeof(struct mm_fixed));
	im->strtab = (const char *)(im->vmas + im->mm->nvma);
	for (uint32_t i = 0; i < im->mm->nvma; i++) {
		struct vma_img *v = &im->vmas[i];

		if ((uint64_t)v->name_off + v->name_len > im->mm->strtab_len ||
		    v->start >= v->end || v->start % PAGE || v->end % PAGE ||
		    (i && v->start < im->vmas[i - 1].end))
			goto inconsistent;
	}
	if (im->pm_len < sizeof(struct pagemap_fixed))
		goto inconsistent;
	im->pm = im->pm_raw;
	if (im->pm->nruns > im->pm_len || im->pm->data_pages > im->pm_len ||
	    sizeof(struct pagemap_fixed) + im->pm->nruns * sizeof(struct run_img) +
	    im->pm->data_pages * 16 != im->pm_len)
		goto inconsistent;
	im->runs = (struct run_img *)((char *)im->pm_raw + sizeof(struct pagemap_fixed));
	im->hashes = (uint64_t *)(im->runs + im->pm->nruns);
	{
		uint64_t total = 0;

		for (uint64_t i = 0; i < im->pm->nruns; i++) {
			struct run_img *r = &im->runs[i];

			if (r->level > im->core->depth || r->npages == 0 ||
			    (i && r->vaddr < im->runs[i - 1].vaddr +
				  (uint64_t)im->runs[i - 1].npages * PAGE) ||
			    ((r->flags & RUN_LIVE) && (r->level || im->core->depth)) ||
			    (r->level == 0 && !(r->flags & RUN_NODATA) &&
			     r->off + r->npages > im->pm->data_pages))
				goto inconsistent;
			total += r->npages;
		}
		if (total != im->pm->npages)
			goto inconsistent;
	}
	return 0;
inconsistent:
	fail(err, EBADMSG, pid, "image %s: inconsistent contents (corrupted or mixed images)",
	     where);
bad:
	image_free(im);
	return -1;
}

/* ---------- parsing /proc ---------- */

struct vma {
	uint64_t start, end, pgoff;
	uint32_t prot, flags;
	char *path;		/* NULL for anonymous */
	char special[24];	/* [vdso] etc. */
	int64_t fsize, mtime_sec, mtime_nsec;
};

struct vma_list {
	struct vma *v;
	size_t n, cap;
};

static void vmas_free(struct vma_list *l)
{
	for (size_t i = 0; i < l->n; i++)
		free(l->v[i].path);
	free(l->v);
	memset(l, 0, sizeof(*l));
}

static int vmas_push(struct vma_list *l, const struct vma *v)
{
	if (l->n == l->cap) {
		size_t cap = l->cap ? l->cap * 2 : 64;
		struct vma *nv = realloc(l->v, cap * sizeof(*nv));

		if (!nv)
			return -1;
		l->v = nv;
		l->cap = cap;
	}
	l->v[l->n++] = *v;
	return 0;
}

static bool is_special_name(const char *name)
{
	return strcmp(name, "[vdso]") == 0 || strcmp(name, "[vvar]") == 0 ||
	       strcmp(name, "[vvar_vclock]") == 0;
}

/* Parse /proc/pid/smaps (or maps if !smaps).  Raw: no classification. */
struct raw_vma {
	uint64_t start, end, pgoff;
	char perms[8];
	unsigned int major, minor;	/* the mapped file's device */
	unsigned long inode;
	int pkey;			/* smaps' ProtectionKey (0 without PKU) */
	char name[PATH_MAX];
	char vmflags[256];
};

typedef int (*raw_cb)(const struct raw_vma *r, void *ctx);

static int walk_maps(pid_t pid, bool smaps, raw_cb cb, void *ctx, struct dbxcr_error *err)
{
	char path[64];
	char *line = NULL;
	size_t cap = 0;
	struct raw_vma r;
	bool have = false;
	FILE *f;
	int rc = 0;

	snprintf(path, sizeof(path), "/proc/%d/%s", (int)pid, smaps ? "smaps" : "maps");
	f = fopen(path, "re");
	if (!f)
		return fail(err, errno, pid, "open %s", path);
	memset(&r, 0, sizeof(r));
	while (getline(&line, &cap, f) > 0) {
		unsigned long long s, e, off;
		unsigned long ino;
		unsigned int major, minor;
		char perms[8];
		int pos = 0;

		line[strcspn(line, "\n")] = '\0';
		if (line[0] >= 'A' && line[0] <= 'Z') {	/* smaps' fields: a few dozen per VMA */
			if (strncmp(line, "VmFlags:", 8) == 0)
				snprintf(r.vmflags, sizeof(r.vmflags), " %s ", line + 8);
			else if (strncmp(line, "ProtectionKey:", 14) == 0)
				r.pkey = atoi(line + 14);
			continue;
		}
		if (sscanf(line, "%llx-%llx %7s %llx %x:%x %lu %n", &s, &e, perms, &off, &major,
			   &minor, &ino, &pos) >= 7 && pos > 0) {
			if (have && (rc = cb(&r, ctx)) < 0)
				break;
			r.inode = ino;	/* this line's, once the previous record is done */
			r.major = major;
			r.minor = minor;
			r.start = s;
			r.end = e;
			r.pgoff = off / PAGE;
			snprintf(r.perms, sizeof(r.perms), "%s", perms);
			snprintf(r.name, sizeof(r.name), "%s", line + pos);
			r.vmflags[0] = '\0';
			r.pkey = 0;
			have = true;
		}
	}
	if (rc == 0 && have)
		rc = cb(&r, ctx);
	free(line);
	fclose(f);
	return rc;
}

struct dump_ctx {
	pid_t pid;
	struct vma_list *out;
	unsigned long scratch;
	const char *strip;
	long long files_as_of_ns;	/* dbxcr_dump_opts */
	struct dbxcr_error *err;
};

/* Whether st's file changed after as_of_ns (0: never): its ctime, on the coarse clock
 * that lags by up to a tick, within 50 ms of it counts (deltabox/cr/private_maps.py). */
static bool written_since(const struct stat *st, long long as_of_ns)
{
	long long ctime_ns = (long long)st->st_ctim.tv_sec * 1000000000LL + st->st_ctim.tv_nsec;

	return as_of_ns > 0 && ctime_ns >= as_of_ns - 50000000LL;
}

static bool has_flag(const char *vmflags, const char *fl)
{
	char pat[8];

	snprintf(pat, sizeof(pat), " %s ", fl);
	return strstr(vmflags, pat) != NULL;
}

/* The PROT_* bits of a maps line's permissions ("rwxp"). */
static uint32_t prot_of(const char *perms)
{
	return (perms[0] == 'r' ? PROT_READ : 0) | (perms[1] == 'w' ? PROT_WRITE : 0) |
	       (perms[2] == 'x' ? PROT_EXEC : 0);
}

/* The VMA_* flags smaps' VmFlags give (growing down, the madvise flags kept). */
#define VMA_VMFLAGS (VMA_GROWSDOWN | VMA_HUGE | VMA_NOHUGE | VMA_WIPEONFORK | VMA_DONTDUMP)

static uint32_t vmflags_of(const char *vmflags)
{
	return (has_flag(vmflags, "gd") ? VMA_GROWSDOWN : 0) |
	       (has_flag(vmflags, "hg") ? VMA_HUGE : 0) |
	       (has_flag(vmflags, "nh") ? VMA_NOHUGE : 0) |
	       (has_flag(vmflags, "wf") ? VMA_WIPEONFORK : 0) |
	       (has_flag(vmflags, "dd") ? VMA_DONTDUMP : 0);
}

static int classify_cb(const struct raw_vma *r, void *arg)
{
	struct dump_ctx *c = arg;
	struct vma v;
	const char *name = r->name;
	size_t nl = strlen(name);
	bool deleted = nl > 10 && strcmp(name + nl - 10, " (deleted)") == 0;

	if (r->start >= TASK_TOP)	/* [vsyscall] */
		return 0;
	memset(&v, 0, sizeof(v));
	v.start = r->start;
	v.end = r->end;
	v.pgoff = r->pgoff;
	v.fsize = -1;
	v.prot = prot_of(r->perms);
	if (r->perms[3] == 's')
		v.flags |= VMA_SHARED;
	v.flags |= vmflags_of(r->vmflags);
	if (r->pkey < 0 || r->pkey > VMA_PKEY_MAX)
		return fail(c->err, ENOTSUP, c->pid, "mapping %#llx-%#llx: protection key %d",
			    (unsigned long long)r->start, (unsigned long long)r->end, r->pkey);
	v.flags |= (uint32_t)r->pkey << VMA_PKEY_SHIFT;
	if (has_flag(r->vmflags, "io") || has_flag(r->vmflags, "pf"))
		if (!is_special_name(name))
			return fail(c->err, ENOTSUP, c->pid, "mapping %#llx-%#llx (%s) is device "
				    "memory (VM_IO/VM_PFNMAP); cannot be dumped",
				    (unsigned long long)r->start, (unsigned long long)r->end, name);
	if (name[0] == '[') {
		if (is_special_name(name)) {
			v.flags |= VMA_SPECIAL;
			memcpy(v.special, name, strlen(name));
		} else if (strcmp(name, "[heap]") == 0) {
			v.flags |= VMA_HEAP;
		} else if (strcmp(name, "[stack]") == 0) {
			v.flags |= VMA_STACK;
		} else if (strncmp(name, "[anon:", 6) == 0) {
			/* named private anonymous memory: restored unnamed */
		} else if (strncmp(name, "[anon_shmem:", 12) == 0) {
			v.flags |= VMA_WHOLE;
		} else {
			return fail(c->err, ENOTSUP, c->pid, "mapping %#llx-%#llx: unsupported "
				    "special mapping %s", (unsigned long long)r->start,
				    (unsigned long long)r->end, name);
		}
	} else if (name[0] == '/') {
		/* A System V segment's attachment is kept like shared anonymous memory: the
		 * segment belongs to the IPC namespace, made again there by the daemon with
		 * its id and content (deltabox/cr/sysv_shm.py), and every child attaches it
		 * over this mapping (dbxcr_remap.sysv). */
		bool sysv = strncmp(name, "/SYSV", 5) == 0;
		/* A /dev/shm file, deleted or not (a POSIX semaphore or shared memory segment,
		 * multiprocessing's heap), is memory: no restored tree holds it (each generation's
		 * /dev/shm is a tmpfs of its own, whose held files the daemon makes again and maps
		 * again over this: deltabox/cr/shm_files.py).  A device node is not. */
		bool shm = strncmp(name, "/dev/shm/", 9) == 0;

		if (strncmp(name, "/dev/", 5) == 0 && strcmp(name, "/dev/zero (deleted)") != 0 &&
		    strcmp(name, "/dev/zero") != 0 && !shm)
			return fail(c->err, ENOTSUP, c->pid, "mapping %#llx-%#llx: device %s "
				    "cannot be dumped", (unsigned long long)r->start,
				    (unsigned long long)r->end, name);
		if (deleted || shm || sysv || strncmp(name, "/memfd:", 7) == 0 ||
		    strncmp(name, "/dev/zero", 9) == 0) {
			/* No file to map at restore: keep every page, restore anonymous. */
			v.flags |= VMA_WHOLE;
		} else {
			char mf[96];
			struct stat st;
			const char *p = name;
			size_t sl = c->strip ? strlen(c->strip) : 0;

			v.flags |= VMA_FILE;
			if (sl && strncmp(p, c->strip, sl) == 0 && (p[sl] == '/' || p[sl] == '\0'))
				p += sl;
			v.path = strdup(*p ? p : "/");
			if (!v.path)
				return fail(c->err, ENOMEM, c->pid, "allocate path");
			snprintf(mf, sizeof(mf), "/proc/%d/map_files/%llx-%llx", (int)c->pid,
				 (unsigned long long)r->start, (unsigned long long)r->end);
			/* A shared mapping's pages are the file's, which the restored tree has
			 * as at the checkpoint (the daemon maps it again from there), while the
			 * live file this template maps may have changed since (written through
			 * the mapping, or in place): no check for it. */
			if (!(v.flags & VMA_SHARED) && stat(mf, &st) == 0 &&
			    !written_since(&st, c->files_as_of_ns)) {
				v.fsize = st.st_size;
				v.mtime_sec = st.st_mtim.tv_sec;
				v.mtime_nsec = st.st_mtim.tv_nsec;
			}
		}
	} else if (name[0] != '\0') {
		return fail(c->err, ENOTSUP, c->pid, "mapping %#llx-%#llx: unsupported mapping %s",
			    (unsigned long long)r->start, (unsigned long long)r->end, name);
	}
	if ((v.flags & VMA_SHARED) && !(v.flags & (VMA_FILE | VMA_WHOLE | VMA_SPECIAL))) {
		/* shared anonymous shows as /dev/zero (deleted); anything else is unexpected */
		v.flags |= VMA_WHOLE;
	}
	/* Cut the template's own scratch area out (it may have merged with a neighbour). */
	if (c->scratch && v.start < c->scratch + SCRATCH_LEN && c->scratch < v.end) {
		struct vma lo = v, hi = v;
		int rc = 0;

		lo.end = c->scratch;
		hi.start = c->scratch + SCRATCH_LEN;
		hi.pgoff = v.pgoff + (hi.start - v.start) / PAGE;
		if (v.path && lo.start < lo.end && hi.start < hi.end) {
			hi.path = strdup(v.path);
			if (!hi.path) {
				free(v.path);
				return fail(c->err, ENOMEM, c->pid, "allocate path");
			}
		}
		if (lo.start < lo.end)
			rc = vmas_push(c->out, &lo);
		else
			free(lo.path);
		if (rc == 0 && hi.start < hi.end)
			rc = vmas_push(c->out, &hi);
		else if (hi.path != lo.path)
			free(hi.path);
		return rc < 0 ? fail(c->err, ENOMEM, c->pid, "allocate vma list") : 0;
	}
	if (vmas_push(c->out, &v) < 0) {
		free(v.path);
		return fail(c->err, ENOMEM, c->pid, "allocate vma list");
	}
	return 0;
}

static void parse_ids(const char *v, uint32_t out[3])
{
	unsigned a = 0, b = 0, c = 0;

	sscanf(v, " %u %u %u", &a, &b, &c);
	out[0] = a;
	out[1] = b;
	out[2] = c;
}

/* /proc/pid/status shows ids as the reader's user namespace sees them (the daemon's: the
 * host's). Images keep them as the process's own user namespace sees them, which is what a
 * restore's injected setgroups/setresgid/setresuid take, and which stays right if the
 * daemon's host range for sandboxes changes. /proc/pid/{uid,gid}_map (`map`, read once by
 * the caller) has lines "inside outside count", outside as the reader sees it; outside the
 * sandbox's user namespace (the usual case) it is the identity "0 0 4294967295". */
static int ids_to_ns(pid_t pid, const char *name, const char *map, uint32_t *ids, uint32_t n,
		     struct dbxcr_error *err)
{
	for (uint32_t i = 0; i < n; i++) {
		unsigned long in, out, count;
		const char *line = map;
		int found = 0, used;

		while (!found && sscanf(line, " %lu %lu %lu%n", &in, &out, &count, &used) == 3) {
			if (ids[i] >= out && ids[i] - out < count) {
				ids[i] = (uint32_t)(in + (ids[i] - out));
				found = 1;
			}
			line += used;
		}
		if (!found)
			return fail(err, EOVERFLOW, pid, "id %u is not in /proc/%d/%s: it cannot be "
				    "restored in the process's user namespace", ids[i], (int)pid, name);
	}
	return 0;
}

static int read_id_map(pid_t pid, const char *name, char *map, size_t len,
		       struct dbxcr_error *err)
{
	char path[64];

	snprintf(path, sizeof(path), "/proc/%d/%s", (int)pid, name);
	if (read_small_file(path, map, len) < 0)
		return fail(err, errno, pid, "read %s", path);
	return 0;
}

static int read_status_bits(pid_t pid, struct core_fixed *core, int seccomp_ok,
			    struct dbxcr_error *err)
{
	char path[64], status[8192], map[4096], *v;

	snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
	if (read_small_file(path, status, sizeof(status)) < 0)
		return fail(err, errno, pid, "read %s", path);
	if ((v = strstr(status, "\nUmask:")))
		core->umask = (uint32_t)strtoul(v + 7, NULL, 8);
	if ((v = strstr(status, "\nUid:")))
		parse_ids(v + 5, core->uid);
	if ((v = strstr(status, "\nGid:")))
		parse_ids(v + 5, core->gid);
	if (!seccomp_ok && (v = strstr(status, "\nSeccomp:")) && atoi(v + 9) != 0)
		return fail(err, ENOTSUP, pid, "process has a seccomp filter; it cannot be "
			    "restored from disk");
	core->ngroups = 0;
	if ((v = strstr(status, "\nGroups:"))) {
		char *end = strchr(v + 1, '\n'), *p = v + 8;

		while (core->ngroups < MAX_GROUPS) {
			char *e2;
			unsigned long g = strtoul(p, &e2, 10);

			if (e2 == p || (end && e2 > end))
				break;
			core->groups[core->ngroups++] = (uint32_t)g;
			p = e2;
		}
	}
	if (read_id_map(pid, "uid_map", map, sizeof(map), err) < 0 ||
	    ids_to_ns(pid, "uid_map", map, core->uid, 3, err) < 0 ||
	    read_id_map(pid, "gid_map", map, sizeof(map), err) < 0 ||
	    ids_to_ns(pid, "gid_map", map, core->gid, 3, err) < 0 ||
	    ids_to_ns(pid, "gid_map", map, core->groups, core->ngroups, err) < 0)
		return -1;
	snprintf(path, sizeof(path), "/proc/%d/personality", (int)pid);
	if (read_small_file(path, status, sizeof(status)) == 0)
		core->personality = (uint32_t)strtoul(status, NULL, 16);
	snprintf(path, sizeof(path), "/proc/%d/comm", (int)pid);
	if (read_small_file(path, status, sizeof(status)) == 0) {
		status[strcspn(status, "\n")] = '\0';
		memset(core->comm, 0, sizeof(core->comm));
		memcpy(core->comm, status, strnlen(status, sizeof(core->comm) - 1));
	}
	return 0;
}

static int read_whole(const char *path, struct buf *b)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	char tmp[4096];
	ssize_t n;

	if (fd < 0)
		return -1;
	while ((n = read(fd, tmp, sizeof(tmp))) > 0)
		if (buf_add(b, tmp, (size_t)n) < 0) {
			close(fd);
			errno = ENOMEM;
			return -1;
		}
	close(fd);
	return n < 0 ? -1 : 0;
}

/* Hash of the vdso of pid (read through /proc/pid/mem). */
static int vdso_hash(pid_t pid, uint64_t out[2], uint64_t *size, struct dbxcr_error *err)
{
	unsigned long s, e;
	char path[64];
	unsigned char *b;
	int fd;

	if (find_vdso(pid, &s, &e) < 0) {
		out[0] = out[1] = 0;
		*size = 0;
		return 0;
	}
	b = malloc(e - s);
	if (!b)
		return fail(err, ENOMEM, pid, "allocate vdso copy");
	snprintf(path, sizeof(path), "/proc/%d/mem", (int)pid);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0 || full_pread(fd, b, e - s, (off_t)s) < 0) {
		int e2 = errno;

		if (fd >= 0)
			close(fd);
		free(b);
		return fail(err, e2, pid, "read vdso");
	}
	close(fd);
	dbxcr_hash128(b, e - s, out);
	*size = e - s;
	free(b);
	return 0;
}

/* ---------- chains ---------- */

struct chain {
	struct image im[MAX_DEPTH + 1];		/* [0] the image, [k] its k-th ancestor */
	int pages_fd[MAX_DEPTH + 1];
	int n;
};

static void chain_free(struct chain *c)
{
	for (int i = 0; i < c->n; i++) {
		image_free(&c->im[i]);
		if (c->pages_fd[i] >= 0)
			close(c->pages_fd[i]);
	}
	c->n = 0;
}

/* Load the image and the ancestors its pages live in; check ids and pages.img sizes. */
static int chain_load(int dirfd, struct chain *c, pid_t pid, struct dbxcr_error *err)
{
	int cur = dirfd, depth;

	memset(c, 0, sizeof(*c));
	for (int i = 0; i <= MAX_DEPTH; i++)
		c->pages_fd[i] = -1;
	for (int lv = 0;; lv++) {
		char where[PATH_MAX];
		struct stat st;
		const uint8_t *want = lv ? c->im[lv - 1].core->parent_id : NULL;

		if (image_load(cur, want, &c->im[lv], pid, err) < 0)
			goto bad;
		c->n = lv + 1;
		fd_path(cur, where, sizeof(where));
		c->pages_fd[lv] = openat(cur, "pages.img", O_RDONLY | O_CLOEXEC);
		if (c->pages_fd[lv] < 0 || fstat(c->pages_fd[lv], &st) < 0) {
			fail(err, EBADMSG, pid, "image %s: pages.img is missing", where);
			goto bad;
		}
		if ((uint64_t)st.st_size != c->im[lv].pm->data_pages * PAGE) {
			fail(err, EBADMSG, pid, "image %s: pages.img is %lld bytes, expected %llu "
			     "(truncated or extended)", where, (long long)st.st_size,
			     (unsigned long long)(c->im[lv].pm->data_pages * PAGE));
			goto bad;
		}
		depth = (int)c->im[0].core->depth;
		if (lv >= depth)
			break;
		if (c->im[lv].core->depth != (uint32_t)(depth - lv)) {
			fail(err, EBADMSG, pid, "image %s: chain depth %u, expected %d", where,
			     c->im[lv].core->depth, depth - lv);
			goto bad;
		}
		{
			int next = openat(cur, c->im[lv].parent_ref, O_RDONLY | O_DIRECTORY | O_CLOEXEC);

			if (next < 0) {
				fail(err, EBADMSG, pid, "image %s: parent image %s is missing (%s)",
				     where, c->im[lv].parent_ref, strerror(errno));
				if (cur != dirfd)
					close(cur);
				goto bad;
			}
			if (cur != dirfd)
				close(cur);
			cur = next;
		}
	}
	if (cur != dirfd)
		close(cur);
	/* Every data reference of every level must fall inside the pages.img it names. */
	for (int lv = 0; lv < c->n; lv++)
		for (uint64_t i = 0; i < c->im[lv].pm->nruns; i++) {
			const struct run_img *r = &c->im[lv].runs[i];

			if (r->flags & RUN_NODATA)
				continue;
			if (lv + r->level >= c->n ||
			    r->off + r->npages > c->im[lv + r->level].pm->data_pages) {
				char where[PATH_MAX];

				fd_path(dirfd, where, sizeof(where));
				fail(err, EBADMSG, pid, "image %s (level %d): page run at %#llx points "
				     "outside the pages.img of level %d", where, lv,
				     (unsigned long long)r->vaddr, lv + r->level);
				goto bad;
			}
		}
	return 0;
bad:
	if (cur != dirfd && cur >= 0)
		close(cur);
	chain_free(c);
	return -1;
}

/* ---------- dump ---------- */

/* The parent's index, walked with a cursor in increasing address order. */
struct parent_idx {
	const struct chain *c;		/* the parent image and its ancestors, or NULL */
	uint64_t run;			/* current run of c->im[0] */
};

static bool parent_lookup(struct parent_idx *pi, uint64_t addr, int *level, uint64_t *off,
			  const uint64_t **hash)
{
	const struct image *im;

	if (!pi->c)
		return false;
	im = &pi->c->im[0];
	while (pi->run < im->pm->nruns) {
		const struct run_img *r = &im->runs[pi->run];
		uint64_t end = r->vaddr + (uint64_t)r->npages * PAGE;

		if (addr < r->vaddr)
			return false;
		if (addr < end) {
			uint64_t k = (addr - r->vaddr) / PAGE;

			if (r->flags & RUN_NODATA)
				return false;
			*level = r->level;
			*off = r->off + k;
			*hash = pi->c->im[r->level].hashes + 2 * *off;
			return true;
		}
		pi->run++;
	}
	return false;
}

struct dump_out {
	struct buf runs, hashes;	/* hashes: of the pages written, in file order */
	uint64_t npages;
	int pages_fd;
	uint64_t data_pages;
	struct dbxcr_dump_stats *st;
};

static int add_page(struct dump_out *o, uint64_t addr, int level, uint64_t off, uint16_t flags)
{
	struct run_img *last = o->runs.len ? (struct run_img *)(o->runs.p + o->runs.len -
								sizeof(struct run_img)) : NULL;
	if (last && last->vaddr + (uint64_t)last->npages * PAGE == addr && last->level == level &&
	    last->flags == flags && (flags & RUN_NODATA || last->off + last->npages == off) &&
	    last->npages < UINT32_MAX) {
		last->npages++;
	} else {
		struct run_img r = { .vaddr = addr, .npages = 1, .level = (uint16_t)level,
				     .flags = flags, .off = (flags & RUN_NODATA) ? 0 : off };

		if (buf_add(&o->runs, &r, sizeof(r)) < 0)
			return -1;
	}
	o->npages++;
	return 0;
}

/* PAGEMAP_SCAN (Linux 6.7+; the installed uapi headers predate it). */
#define PM_SCAN_IOCTL _IOWR('f', 16, struct pm_scan_arg_k)
#define PAGE_IS_FILE (1 << 2)
#define PAGE_IS_PRESENT (1 << 3)
#define PAGE_IS_SWAPPED (1 << 4)
#define PAGE_IS_PFNZERO (1 << 5)

struct page_region_k {
	uint64_t start, end, categories;
};

struct pm_scan_arg_k {
	uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages;
	uint64_t category_inverted, category_mask, category_anyof_mask, return_mask;
};

/* Page ranges of a VMA worth storing (see the file comment), as [start, end) segments. */
struct seg {
	uint64_t s, e;
};

static int add_seg(struct buf *b, uint64_t s, uint64_t e)
{
	struct seg *last = b->len ? (struct seg *)(b->p + b->len - sizeof(struct seg)) : NULL;
	struct seg x = { s, e };

	if (last && last->e == s) {
		last->e = e;
		return 0;
	}
	return buf_add(b, &x, sizeof(x));
}

/* Cleared once if the kernel lacks PAGEMAP_SCAN; dumps may finish on several threads. */
static _Atomic bool scan_works = true;

/* The pages of a shared VMA_WHOLE mapping (shared memory: /dev/zero, a memfd, a /dev/shm
 * file, a System V segment) that hold data in its object: the object's holes, pages no
 * process ever wrote, read as zeros, as the restore's fresh mapping does.  Reading them
 * through the mapping would allocate them, in the live process's own object (the
 * template shares it): 160 MiB of PostgreSQL-like shared buffers of which 2 were written
 * would be 160 resident after a dump.  The object is found through /proc/PID/map_files
 * (its range as maps shows it); 1 when it cannot be (the caller stores every page). */
static int data_segments(pid_t pid, const struct vma *v, struct buf *segs,
			 struct dbxcr_error *err)
{
	char path[96];
	off_t base = (off_t)(v->pgoff * PAGE), end = base + (off_t)(v->end - v->start);
	off_t at = base;
	int fd;

	snprintf(path, sizeof(path), "/proc/%d/map_files/%llx-%llx", (int)pid,
		 (unsigned long long)v->start, (unsigned long long)v->end);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 1;
	while (at < end) {
		off_t data = lseek(fd, at, SEEK_DATA), hole;

		if (data < 0 || data >= end)
			break;	/* ENXIO: holes to the end (any other error: same, harmless) */
		hole = lseek(fd, data, SEEK_HOLE);
		if (hole < 0 || hole > end)
			hole = end;
		data &= ~(off_t)(PAGE - 1);
		if (add_seg(segs, v->start + (uint64_t)(data - base),
			    v->start + (uint64_t)(hole - base + PAGE - 1) / PAGE * PAGE) < 0) {
			close(fd);
			return fail(err, ENOMEM, pid, "allocate");
		}
		at = hole;
	}
	close(fd);
	return 0;
}

static int vma_segments(pid_t pid, int pmfd, const struct vma *v, struct buf *segs,
			struct dbxcr_error *err)
{
	bool file = v->flags & VMA_FILE;
	int rc;

	segs->len = 0;
	if ((v->flags & (VMA_WHOLE | VMA_SHARED)) == (VMA_WHOLE | VMA_SHARED) &&
	    (rc = data_segments(pid, v, segs, err)) <= 0)
		return rc;
	if (v->flags & VMA_WHOLE)
		return add_seg(segs, v->start, v->end) < 0 ? fail(err, ENOMEM, pid, "allocate") : 0;
	if (scan_works) {
		struct page_region_k vec[512];
		struct pm_scan_arg_k a;
		uint64_t at = v->start;

		while (at < v->end) {
			long n;

			memset(&a, 0, sizeof(a));
			a.size = sizeof(a);
			a.start = at;
			a.end = v->end;
			a.vec = (uint64_t)(uintptr_t)vec;
			a.vec_len = 512;
			a.category_anyof_mask = PAGE_IS_PRESENT | PAGE_IS_SWAPPED;
			a.return_mask = PAGE_IS_PRESENT | PAGE_IS_SWAPPED | PAGE_IS_FILE |
					PAGE_IS_PFNZERO;
			n = ioctl(pmfd, PM_SCAN_IOCTL, &a);
			if (n < 0 && (errno == ENOTTY || errno == EINVAL) && at == v->start) {
				scan_works = false;
				break;
			}
			if (n < 0)
				return fail(err, errno, pid, "PAGEMAP_SCAN %#llx-%#llx",
					    (unsigned long long)at, (unsigned long long)v->end);
			for (long i = 0; i < n; i++) {
				uint64_t c = vec[i].categories;

				if (c & PAGE_IS_PFNZERO)
					continue;	/* the shared zero page: reads as zero */
				if (file && (c & PAGE_IS_FILE))
					continue;	/* page cache: identical to the file */
				if (add_seg(segs, vec[i].start, vec[i].end) < 0)
					return fail(err, ENOMEM, pid, "allocate");
			}
			if (a.walk_end <= at)
				return fail(err, EPROTO, pid, "PAGEMAP_SCAN made no progress at %#llx",
					    (unsigned long long)at);
			at = a.walk_end;
		}
		if (scan_works)
			return 0;
		segs->len = 0;
	}
	/* Fallback: /proc/pid/pagemap entries. */
	for (uint64_t addr = v->start; addr < v->end;) {
		uint64_t pm[512];
		uint64_t n = (v->end - addr) / PAGE;

		if (n > 512)
			n = 512;
		if (full_pread(pmfd, pm, n * 8, (off_t)(addr / PAGE * 8)) < 0)
			return fail(err, errno, pid, "read pagemap at %#llx", (unsigned long long)addr);
		for (uint64_t k = 0; k < n; k++) {
			bool want = file ? (((pm[k] & PM_PRESENT) && !(pm[k] & PM_FILE)) ||
					    (pm[k] & PM_SWAP))
					 : (pm[k] & (PM_PRESENT | PM_SWAP)) != 0;

			if (want && add_seg(segs, addr + k * PAGE, addr + (k + 1) * PAGE) < 0)
				return fail(err, ENOMEM, pid, "allocate");
		}
		addr += n * PAGE;
	}
	return 0;
}

/* Copy into `to` the pages of the private file mapping [start, end) that `from` holds as
 * its own (written since mapped: copy-on-write made them anonymous), at the same
 * addresses.  `to` maps that range afresh from another file (fork_template.c
 * remap_private), whose page cache gives the pages never written.  /proc/PID/mem writes
 * through the mapping's protection (FOLL_FORCE, as ptrace's POKEDATA), so read-only text
 * with relocations comes back too; both are stopped tracees of this thread. */
int copy_private_pages(pid_t from, pid_t to, unsigned long start, unsigned long end,
		       struct dbxcr_error *err)
{
	struct vma v = { .start = start, .end = end, .flags = VMA_FILE };
	struct buf segs = { 0 };
	char path[64], chunk[1 << 16];
	int pmfd = -1, src = -1, dst = -1, rc = -1;

	snprintf(path, sizeof(path), "/proc/%d/pagemap", (int)from);
	pmfd = open(path, O_RDONLY | O_CLOEXEC);
	snprintf(path, sizeof(path), "/proc/%d/mem", (int)from);
	src = open(path, O_RDONLY | O_CLOEXEC);
	snprintf(path, sizeof(path), "/proc/%d/mem", (int)to);
	dst = open(path, O_RDWR | O_CLOEXEC);
	if (pmfd < 0 || src < 0 || dst < 0) {
		fail(err, errno, pmfd < 0 || src < 0 ? from : to, "open pagemap or mem to copy "
		     "the private pages of %#lx-%#lx", start, end);
		goto out;
	}
	if (vma_segments(from, pmfd, &v, &segs, err) < 0)
		goto out;
	for (size_t i = 0; i < segs.len / sizeof(struct seg); i++) {
		const struct seg *g = (const struct seg *)segs.p + i;

		for (uint64_t at = g->s; at < g->e;) {
			size_t n = g->e - at < sizeof(chunk) ? (size_t)(g->e - at) : sizeof(chunk);

			if (full_pread(src, chunk, n, (off_t)at) < 0) {
				fail(err, errno, from, "read private pages at %#llx",
				     (unsigned long long)at);
				goto out;
			}
			ssize_t w = pwrite(dst, chunk, n, (off_t)at);

			if (w != (ssize_t)n) {
				fail(err, w < 0 ? errno : EIO, to, "write private pages at %#llx "
				     "(%zd of %zu)", (unsigned long long)at, w, n);
				goto out;
			}
			at += n;
		}
	}
	rc = 0;
out:
	buf_free(&segs);
	if (pmfd >= 0)
		close(pmfd);
	if (src >= 0)
		close(src);
	if (dst >= 0)
		close(dst);
	return rc;
}

struct dbxcr_dump_job {
	pid_t pid;
	int pdirfd, tmpfd, memfd, pmfd, max_level, fsync;
	bool live;		/* dbxcr_dump_opts.live: index the pages, copy none */
	double t0;
	struct dbxcr_dump_stats st;
	struct core_fixed *core;
	struct vma_list vl;
	struct chain *parent;
	struct parent_idx pi;
	struct dump_out out;
	struct buf corebuf, auxv;
	unsigned char *chunk;
	uint64_t read_at;	/* a page the walk read (0: none yet), for mm_outlived_walk */
	uint8_t id[16];
	char tmpname[PATH_MAX], dirpath[PATH_MAX], base[PATH_MAX], path[PATH_MAX];
};

/* A live image's runs: every candidate page stays where it is, in the template. */
static int index_live(struct dump_out *o, const struct seg *segs, size_t nseg, pid_t pid,
		      struct dbxcr_error *err)
{
	for (size_t i = 0; i < nseg; i++)
		for (uint64_t a = segs[i].s; a < segs[i].e; a += PAGE) {
			if (add_page(o, a, 0, 0, RUN_LIVE) < 0)
				return fail(err, ENOMEM, pid, "allocate page index");
			o->st->pages_total++;
		}
	return 0;
}

/* Dump the candidate pages of one VMA. */
static int dump_vma(struct dbxcr_dump_job *j, const struct vma *v, struct buf *outbuf,
		    struct buf *segbuf, struct dbxcr_error *err)
{
	pid_t pid = j->pid;
	int memfd = j->memfd, pmfd = j->pmfd, max_level = j->max_level;
	struct parent_idx *pi = &j->pi;
	struct dump_out *o = &j->out;
	unsigned char *chunk = j->chunk;
	bool file = v->flags & VMA_FILE;
	const struct seg *segs;
	size_t nseg, si = 0;
	uint64_t at;

	if (v->flags & VMA_SPECIAL)
		return 0;
	if (file && (v->flags & VMA_SHARED))
		return 0;	/* the file is the content */
	if (vma_segments(pid, pmfd, v, segbuf, err) < 0)
		return -1;
	segs = (const struct seg *)segbuf->p;
	nseg = segbuf->len / sizeof(struct seg);
	if (j->live)
		return index_live(o, segs, nseg, pid, err);
	at = nseg ? segs[0].s : 0;
	while (si < nseg) {
		struct iovec riov[CHUNK_PAGES];
		uint64_t addrs[CHUNK_PAGES];
		size_t ni = 0, nsel = 0;

		/* Up to CHUNK_PAGES pages from the segments. */
		while (si < nseg && nsel < CHUNK_PAGES) {
			uint64_t take = (segs[si].e - at) / PAGE;

			if (take > CHUNK_PAGES - nsel)
				take = CHUNK_PAGES - nsel;
			riov[ni].iov_base = (void *)(uintptr_t)at;
			riov[ni].iov_len = take * PAGE;
			ni++;
			for (uint64_t k = 0; k < take; k++)
				addrs[nsel++] = at + k * PAGE;
			at += take * PAGE;
			if (at >= segs[si].e && ++si < nseg)
				at = segs[si].s;
		}
		/* Through /proc/pid/mem (bound to the template's mm since begin), never
		 * process_vm_readv: that pins pages (FOLL_PIN), and pinning an anonymous page
		 * shared copy-on-write with the live process makes the kernel unshare it, so a
		 * dump would copy every page the template shares: measured, a 200 MB template
		 * went from 0 to 205 MB private, and its process too.  mem reads take plain
		 * references (with FOLL_FORCE: PROT_NONE and write-only VMAs too). */
		{
			size_t off = 0;

			for (size_t i = 0; i < ni; i++) {
				if (full_pread(memfd, chunk + off, riov[i].iov_len,
					       (off_t)(uintptr_t)riov[i].iov_base) < 0)
					return fail(err, errno == ENODATA ? ESRCH : errno, pid,
						    "read /proc/%d/mem at %p%s", (int)pid,
						    riov[i].iov_base, errno == ENODATA ?
						    " (the template exited during its dump)" : "");
				off += riov[i].iov_len;
			}
			if (ni && !j->read_at)
				j->read_at = (uint64_t)(uintptr_t)riov[0].iov_base;
		}
		for (size_t s = 0; s < nsel; s++) {
			unsigned char *pg = chunk + s * PAGE;
			uint64_t addr = addrs[s];
			uint64_t h[2], poff = 0;
			const uint64_t *ph;
			int plevel;

			o->st->pages_total++;
			if (page_is_zero(pg)) {
				o->st->pages_zero++;
				if (file && add_page(o, addr, 0, 0, RUN_ZERO) < 0)
					return fail(err, ENOMEM, pid, "allocate page index");
				continue;
			}
			dbxcr_hash128(pg, PAGE, h);
			if (parent_lookup(pi, addr, &plevel, &poff, &ph) && plevel + 1 <= max_level &&
			    ph[0] == h[0] && ph[1] == h[1]) {
				o->st->pages_parent++;
				if (add_page(o, addr, plevel + 1, poff, 0) < 0)
					return fail(err, ENOMEM, pid, "allocate page index");
				continue;
			}
			if (add_page(o, addr, 0, o->data_pages, 0) < 0 ||
			    buf_add(&o->hashes, h, sizeof(h)) < 0 || buf_add(outbuf, pg, PAGE) < 0)
				return fail(err, ENOMEM, pid, "allocate page index");
			o->data_pages++;
			o->st->pages_written++;
		}
		if (outbuf->len >= 4 << 20) {
			if (full_write(o->pages_fd, outbuf->p, outbuf->len) < 0)
				return fail(err, errno, pid, "write pages.img");
			o->st->bytes_written += outbuf->len;
			outbuf->len = 0;
		}
	}
	return 0;
}

/* Ask the parked template for brk, sigactions and sigaltstack with injected calls. */
static int query_template(struct dbxcr_template *tpl, struct core_fixed *core,
			  struct dbxcr_error *err)
{
	struct tracee t;
	struct dbxcr_error ignored;
	long a[6] = { 0 }, r;
	int rc = -1;

	if (template_scratch(tpl, err) < 0 || adopt(&t, tpl->pid, tpl->site, err) < 0)
		return -1;
	t.regs = tpl->park;
	if (!tpl->args_hidden) {	/* else the disguise asked already */
		r = rsys(&t, SYS_brk, a, err, "brk(0) in the template");
		if (r < 0)
			goto out;
		core->mm[MM_BRK] = (uint64_t)r;
	}
	for (int sig = 1; sig <= NSIG_K; sig++) {
		long q[6] = { sig, 0, (long)tpl->scratch, 8, 0, 0 };

		if (rsys(&t, SYS_rt_sigaction, q, err, "rt_sigaction(%d) in the template", sig) < 0)
			goto out;
		if (mem_read(tpl->pid, tpl->scratch, &core->sig[sig - 1],
			     sizeof(struct ksigaction), err) < 0)
			goto out;
	}
	{
		long q[6] = { 0, (long)tpl->scratch, 0, 0, 0, 0 };
		stack_t ss;

		if (rsys(&t, SYS_sigaltstack, q, err, "sigaltstack in the template") < 0)
			goto out;
		if (mem_read(tpl->pid, tpl->scratch, &ss, sizeof(ss), err) < 0)
			goto out;
		core->ss_sp = (uint64_t)(uintptr_t)ss.ss_sp;
		core->ss_flags = ss.ss_flags;
		core->ss_size = ss.ss_size;
	}
	rc = 0;
out:
	if (park(tpl, rc ? &ignored : err) < 0)
		rc = -1;
	return rc;
}

static int rm_tree_at(int dirfd, const char *name)
{
	int fd = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
	DIR *d;
	struct dirent *de;

	if (fd < 0)
		return unlinkat(dirfd, name, 0);
	d = fdopendir(fd);
	if (!d) {
		close(fd);
		return -1;
	}
	while ((de = readdir(d)) != NULL)
		if (strcmp(de->d_name, ".") && strcmp(de->d_name, ".."))
			unlinkat(fd, de->d_name, 0);
	closedir(d);
	return unlinkat(dirfd, name, AT_REMOVEDIR);
}

/* A dump is two steps.  dbxcr_dump_begin reads everything that needs the template's
 * tracer or its live task (injected calls, ptrace requests, /proc files), creates the
 * temporary image directory and opens the template's memory.  dbxcr_dump_finish copies,
 * hashes and writes the pages and the image files: the bulk of the time, on any thread,
 * without the tracer, while the template may be spawned from (spawning only runs injected
 * calls on registers and the scratch page, which is not dumped).  /proc/pid/mem and
 * /proc/pid/pagemap opened in begin stay bound to the template's address space (not to its
 * pid), so a template released meanwhile makes the finish fail, never read another
 * process. */

static void job_free(struct dbxcr_dump_job *j)
{
	if (!j)
		return;
	if (j->out.pages_fd >= 0)
		close(j->out.pages_fd);
	if (j->memfd >= 0)
		close(j->memfd);
	if (j->pmfd >= 0)
		close(j->pmfd);
	if (j->tmpfd >= 0)
		close(j->tmpfd);
	if (j->pdirfd >= 0 && j->tmpname[0])
		rm_tree_at(j->pdirfd, j->tmpname);
	if (j->pdirfd >= 0)
		close(j->pdirfd);
	if (j->parent) {
		chain_free(j->parent);
		free(j->parent);
	}
	vmas_free(&j->vl);
	buf_free(&j->corebuf);
	buf_free(&j->auxv);
	buf_free(&j->out.runs);
	buf_free(&j->out.hashes);
	free(j->core);
	free(j->chunk);
	free(j);
}

void dbxcr_dump_abort(struct dbxcr_dump_job *job)
{
	job_free(job);
}

/* Split path into its directory and last component; pick the temporary sibling's name. */
static int job_paths(struct dbxcr_dump_job *j, const char *path, struct dbxcr_error *err)
{
	const char *slash;
	uint32_t rnd;

	if (strlen(path) >= sizeof(j->path))
		return fail(err, ENAMETOOLONG, j->pid, "image path %s", path);
	snprintf(j->path, sizeof(j->path), "%s", path);
	while (strlen(j->path) > 1 && j->path[strlen(j->path) - 1] == '/')
		j->path[strlen(j->path) - 1] = '\0';
	slash = strrchr(j->path, '/');
	if (slash) {
		snprintf(j->base, sizeof(j->base), "%s", slash + 1);
		snprintf(j->dirpath, sizeof(j->dirpath), "%.*s", (int)(slash - j->path), j->path);
		if (j->dirpath[0] == '\0')
			snprintf(j->dirpath, sizeof(j->dirpath), "/");
	} else {
		snprintf(j->base, sizeof(j->base), "%s", j->path);
		snprintf(j->dirpath, sizeof(j->dirpath), ".");
	}
	if (getrandom(&rnd, sizeof(rnd), 0) != sizeof(rnd))
		rnd = (uint32_t)now_ms();
	snprintf(j->tmpname, sizeof(j->tmpname), ".%.200s.tmp-%d-%08x", j->base, (int)getpid(),
		 rnd);
	return 0;
}

/* The parent image, if any and if the chain may grow by one. */
static int job_parent(struct dbxcr_dump_job *j, const struct dbxcr_dump_opts *o,
		      int max_chain, struct dbxcr_error *err)
{
	int fd;

	if (!o->parent_path || o->live)
		return 0;	/* a live image is always whole: its pages are all in one place */
	fd = open(o->parent_path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (fd < 0)
		return fail(err, errno, j->pid, "open parent image %s", o->parent_path);
	j->parent = calloc(1, sizeof(*j->parent));
	if (!j->parent) {
		close(fd);
		return fail(err, ENOMEM, j->pid, "allocate");
	}
	if (chain_load(fd, j->parent, j->pid, err) < 0) {
		close(fd);
		free(j->parent);
		j->parent = NULL;
		return -1;
	}
	close(fd);
	if ((int)j->parent->im[0].core->depth + 1 < max_chain) {
		j->pi.c = j->parent;
		j->max_level = max_chain - 1;
	}
	return 0;
}

/* The threads section of core.img (struct threads_img). */
static int add_threads(struct buf *b, const struct dbxcr_template *tpl)
{
	const struct thread_set *set = tpl->threads;
	struct threads_img h = { (uint32_t)set->n, 0, tpl->main.clear_tid };

	if (buf_add(b, &h, sizeof(h)) < 0)
		return -1;
	for (int i = 0; i < set->n; i++) {
		const struct thread_state *ts = &set->t[i];
		struct thread_img t;

		memset(&t, 0, sizeof(t));
		t.tid = ts->tid;
		t.nstid = ts->nstid;
		t.regs = ts->regs;
		t.sigmask = ts->sigmask;
		t.clear_tid = ts->clear_tid;
		t.robust_head = ts->robust_head;
		t.robust_len = ts->robust_len;
		t.rseq_ptr = ts->rseq_ptr;
		t.rseq_len = ts->rseq_len;
		t.rseq_sig = ts->rseq_sig;
		t.ss_sp = (uint64_t)(uintptr_t)ts->altstack.ss_sp;
		t.ss_size = ts->altstack.ss_size;
		t.ss_flags = ts->altstack.ss_flags;
		t.affinity_known = ts->affinity_known;
		memcpy(t.affinity, &ts->affinity, sizeof(t.affinity) < sizeof(ts->affinity) ?
		       sizeof(t.affinity) : sizeof(ts->affinity));
		memcpy(t.comm, ts->comm, sizeof(t.comm));
		t.xstate_len = (uint32_t)ts->xstate_len;
		t.npending = (uint32_t)ts->pend.n;
		for (int k = 0; k < ts->pend.n; k++)
			t.pend_shared[k] = ts->pend.shared[k];
		if (buf_add(b, &t, sizeof(t)) < 0 || buf_add(b, ts->xstate, ts->xstate_len) < 0 ||
		    buf_add(b, ts->pend.info, sizeof(siginfo_t) * (size_t)ts->pend.n) < 0)
			return -1;
	}
	return 0;
}

/* The thread_set an image's threads section describes (checked by threads_img_check). */
static struct thread_set *threads_from_image(const unsigned char *p, unsigned long *main_clear_tid)
{
	struct threads_img h;
	struct thread_set *set;
	size_t at = sizeof(h);

	memcpy(&h, p, sizeof(h));
	set = calloc(1, sizeof(*set) + (size_t)h.n * sizeof(set->t[0]));
	if (!set)
		return NULL;
	*main_clear_tid = (unsigned long)h.main_clear_tid;
	for (uint32_t i = 0; i < h.n; i++) {
		struct thread_state *ts = &set->t[i];
		struct thread_img t;

		memcpy(&t, p + at, sizeof(t));
		at += sizeof(t);
		set->n = (int)i + 1;
		ts->tid = t.tid;
		ts->nstid = t.nstid;
		ts->regs = t.regs;
		ts->sigmask = t.sigmask;
		ts->clear_tid = (unsigned long)t.clear_tid;
		ts->robust_head = (unsigned long)t.robust_head;
		ts->robust_len = (size_t)t.robust_len;
		ts->rseq_ptr = t.rseq_ptr;
		ts->rseq_len = t.rseq_len;
		ts->rseq_sig = t.rseq_sig;
		ts->altstack.ss_sp = (void *)(uintptr_t)t.ss_sp;
		ts->altstack.ss_size = (size_t)t.ss_size;
		ts->altstack.ss_flags = t.ss_flags;
		ts->affinity_known = t.affinity_known != 0;
		memcpy(&ts->affinity, t.affinity, sizeof(t.affinity) < sizeof(ts->affinity) ?
		       sizeof(t.affinity) : sizeof(ts->affinity));
		memcpy(ts->comm, t.comm, sizeof(ts->comm));
		ts->comm[sizeof(ts->comm) - 1] = '\0';
		ts->xstate = malloc(t.xstate_len ? t.xstate_len : 1);
		if (!ts->xstate) {
			threads_free(set);
			return NULL;
		}
		memcpy(ts->xstate, p + at, t.xstate_len);
		ts->xstate_len = t.xstate_len;
		at += t.xstate_len;
		ts->pend.n = (int)t.npending;
		for (uint32_t k = 0; k < t.npending; k++) {
			memcpy(&ts->pend.info[k], p + at, sizeof(siginfo_t));
			ts->pend.shared[k] = t.pend_shared[k] != 0;
			at += sizeof(siginfo_t);
		}
	}
	return set;
}

/* core.img's content: registers and signals from the parked template, mm fields, ids,
 * brk and sigactions (injected calls), vdso, rseq, auxv, exe. */
static int job_core(struct dbxcr_dump_job *j, struct dbxcr_template *tpl,
		    const struct dbxcr_dump_opts *o, struct dbxcr_error *err)
{
	struct core_fixed *core = j->core;
	pid_t pid = j->pid;
	char pp[64], exe[PATH_MAX] = "";
	const char *ref;

	core->arch = EM_X86_64;
	core->depth = j->pi.c ? j->parent->im[0].core->depth + 1 : 0;
	if (j->pi.c)
		memcpy(core->parent_id, j->parent->im[0].id, 16);
	core->origin_pid = tpl->origin;
	core->template_pid = tpl->pid;
	core->regs = tpl->regs;
	core->sigmask = tpl->sigmask;
	core->xstate_len = (uint32_t)tpl->xstate_len;
	core->npending = (uint32_t)tpl->pend.n;
	for (int i = 0; i < tpl->pend.n; i++)
		core->pend_shared[i] = tpl->pend.shared[i];
	if (template_scratch(tpl, err) < 0)	/* before listing its mappings: cut out below */
		return -1;
	{
		struct dump_ctx c = { pid, &j->vl, tpl->scratch, o->strip_prefix,
				      o->files_as_of_ns, err };

		if (walk_maps(pid, true, classify_cb, &c, err) < 0)
			return -1;
	}
	/* A disguised template's own bounds hide its command line; the image keeps the
	 * origin's, saved by the disguise (a template never runs: they still hold, brk too). */
	if (tpl->args_hidden)
		memcpy(core->mm, tpl->mm, sizeof(core->mm));
	else if (read_mm_bounds(pid, core->mm, err) < 0)
		return -1;
	if (read_status_bits(pid, core, o->seccomp_ok, err) < 0 ||
	    query_template(tpl, core, err) < 0 ||
	    vdso_hash(pid, core->vdso_hash, &core->vdso_size, err) < 0)
		return -1;
	if (tpl->comm[0]) {	/* the template is named TEMPLATE_COMM; the image keeps the origin's */
		memset(core->comm, 0, sizeof(core->comm));
		memcpy(core->comm, tpl->comm, strnlen(tpl->comm, sizeof(core->comm) - 1));
	}
	{
		struct rseq_conf rc2;
		long n = ptrace(PTRACE_GET_RSEQ_CONFIGURATION, pid, (void *)sizeof(rc2), &rc2);

		if (n > 0 && rc2.rseq_abi_pointer) {
			core->has_rseq = 1;
			core->rseq_ptr = rc2.rseq_abi_pointer;
			core->rseq_len = rc2.rseq_abi_size;
			core->rseq_sig = rc2.signature;
		}
	}
	snprintf(pp, sizeof(pp), "/proc/%d/auxv", (int)pid);
	if (read_whole(pp, &j->auxv) < 0)
		return fail(err, errno, pid, "read %s", pp);
	core->auxv_len = (uint32_t)j->auxv.len;
	snprintf(pp, sizeof(pp), "/proc/%d/exe", (int)pid);
	{
		ssize_t n = readlink(pp, exe, sizeof(exe) - 1);

		exe[n > 0 ? n : 0] = '\0';
		if (n > 10 && strcmp(exe + n - 10, " (deleted)") == 0)
			exe[0] = '\0';
		if (exe[0] && o->strip_prefix) {
			size_t sl = strlen(o->strip_prefix);

			if (sl && strncmp(exe, o->strip_prefix, sl) == 0 && exe[sl] == '/')
				memmove(exe, exe + sl, strlen(exe + sl) + 1);
		}
	}
	core->exe_len = (uint32_t)strlen(exe);
	ref = j->pi.c ? (o->parent_ref ? o->parent_ref : o->parent_path) : "";
	core->parent_ref_len = (uint32_t)strlen(ref);
	core->ndontfork = (uint32_t)tpl->ndontfork;
	if (buf_add(&j->corebuf, core, sizeof(*core)) < 0 ||
	    buf_add(&j->corebuf, tpl->xstate, tpl->xstate_len) < 0 ||
	    buf_add(&j->corebuf, tpl->pend.info, sizeof(siginfo_t) * (size_t)tpl->pend.n) < 0 ||
	    buf_add(&j->corebuf, j->auxv.p, j->auxv.len) < 0 ||
	    buf_add(&j->corebuf, exe, core->exe_len) < 0 ||
	    buf_add(&j->corebuf, ref, core->parent_ref_len) < 0)
		return fail(err, ENOMEM, pid, "allocate core image");
	for (int i = 0; i < tpl->ndontfork; i++) {
		struct dontfork_img d = { tpl->dontfork[i].start, tpl->dontfork[i].end };

		if (buf_add(&j->corebuf, &d, sizeof(d)) < 0)
			return fail(err, ENOMEM, pid, "allocate core image");
	}
	{
		struct robust_img r = { tpl->main.robust_head, tpl->main.robust_len };

		if (buf_add(&j->corebuf, &r, sizeof(r)) < 0)
			return fail(err, ENOMEM, pid, "allocate core image");
	}
	if (tpl->threads && add_threads(&j->corebuf, tpl) < 0)
		return fail(err, ENOMEM, pid, "allocate core image");
	return 0;
}

/* The temporary image directory, pages.img in it, and the template's memory. */
static int job_open(struct dbxcr_dump_job *j, struct dbxcr_error *err)
{
	pid_t pid = j->pid;
	char pp[64];

	j->pdirfd = open(j->dirpath, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (j->pdirfd < 0)
		return fail(err, errno, pid, "open %s", j->dirpath);
	if (faccessat(j->pdirfd, j->base, F_OK, AT_SYMLINK_NOFOLLOW) == 0)
		return fail(err, EEXIST, pid, "image directory %s", j->path);
	if (mkdirat(j->pdirfd, j->tmpname, 0700) < 0) {
		fail(err, errno, pid, "mkdir %s/%s", j->dirpath, j->tmpname);
		j->tmpname[0] = '\0';	/* not ours to remove */
		return -1;
	}
	j->tmpfd = openat(j->pdirfd, j->tmpname, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (j->tmpfd < 0)
		return fail(err, errno, pid, "open %s/%s", j->dirpath, j->tmpname);
	j->out.pages_fd = openat(j->tmpfd, "pages.img", O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC,
				 0600);
	snprintf(pp, sizeof(pp), "/proc/%d/mem", (int)pid);
	j->memfd = open(pp, O_RDONLY | O_CLOEXEC);
	snprintf(pp, sizeof(pp), "/proc/%d/pagemap", (int)pid);
	j->pmfd = open(pp, O_RDONLY | O_CLOEXEC);
	if (j->out.pages_fd < 0 || j->memfd < 0 || j->pmfd < 0)
		return fail(err, errno, pid, "open pages.img, /proc/%d/mem or pagemap", (int)pid);
	return 0;
}

int dbxcr_dump_begin(struct dbxcr_template *tpl, const char *path,
		     const struct dbxcr_dump_opts *opts, struct dbxcr_dump_job **job,
		     struct dbxcr_error *err)
{
	static const struct dbxcr_dump_opts none = { 0 };
	const struct dbxcr_dump_opts *o = opts ? opts : &none;
	struct dbxcr_dump_job *j;
	int max_chain;

	clear_error(err);
	*job = NULL;
	if (check_owner(tpl, err) < 0)
		return -1;
	j = calloc(1, sizeof(*j));
	if (!j)
		return fail(err, ENOMEM, tpl->pid, "allocate dump job");
	j->t0 = now_ms();
	j->pid = tpl->pid;
	j->pdirfd = j->tmpfd = j->memfd = j->pmfd = j->out.pages_fd = -1;
	j->fsync = o->fsync;
	j->live = o->live;
	j->out.st = &j->st;
	max_chain = o->max_chain > 0 ? o->max_chain : DEFAULT_MAX_CHAIN;
	if (max_chain > MAX_DEPTH)
		max_chain = MAX_DEPTH;
	j->core = calloc(1, sizeof(*j->core));
	j->chunk = malloc(CHUNK_PAGES * PAGE);
	if (!j->core || !j->chunk) {
		fail(err, ENOMEM, j->pid, "allocate");
		goto fail;
	}
	if (job_paths(j, path, err) < 0)
		goto fail;
	if (getrandom(j->id, sizeof(j->id), 0) != sizeof(j->id)) {
		fail(err, errno, j->pid, "getrandom for the image id");
		goto fail;
	}
	if (job_parent(j, o, max_chain, err) < 0 || job_core(j, tpl, o, err) < 0 ||
	    job_open(j, err) < 0)
		goto fail;
	*job = j;
	return 0;
fail:
	job_free(j);
	return -1;
}

/* mm.img: every VMA with its name in a string table. */
static int mm_image(const struct vma_list *vl, struct buf *mmbuf, pid_t pid,
		    struct dbxcr_error *err)
{
	struct mm_fixed mf = { .nvma = (uint32_t)vl->n };
	struct buf vmas = { 0 }, strtab = { 0 };
	int rc = -1;

	for (size_t i = 0; i < vl->n; i++) {
		const struct vma *v = &vl->v[i];
		const char *nm = v->path ? v->path : v->special;
		struct vma_img vi = { .start = v->start, .end = v->end, .pgoff = v->pgoff,
				      .prot = v->prot, .flags = v->flags,
				      .name_off = (uint32_t)strtab.len,
				      .name_len = (uint32_t)strlen(nm), .fsize = v->fsize,
				      .mtime_sec = v->mtime_sec, .mtime_nsec = v->mtime_nsec };

		if (buf_add(&strtab, nm, vi.name_len) < 0 || buf_add(&vmas, &vi, sizeof(vi)) < 0)
			goto out;
	}
	mf.strtab_len = strtab.len;
	if (buf_add(mmbuf, &mf, sizeof(mf)) < 0 || buf_add(mmbuf, vmas.p, vmas.len) < 0 ||
	    buf_add(mmbuf, strtab.p, strtab.len) < 0)
		goto out;
	rc = 0;
out:
	buf_free(&vmas);
	buf_free(&strtab);
	return rc < 0 ? fail(err, ENOMEM, pid, "allocate mm image") : 0;
}

/* Whether the template's mm was still alive when the walk ended (so during all of it: an
 * mm never comes back).  Once a template exits, PAGEMAP_SCAN on the pagemap fd opened at
 * begin walks an mm without VMAs and reports no page at all (seen on Linux 6.18.44), so
 * a dump whose template was released meanwhile would otherwise end "successfully" with
 * its pages missing.  /proc/pid/mem reads need a live mm (mmget_not_zero): one byte of a
 * page the walk read, or of the first ordinary VMA, tells. */
static int mm_outlived_walk(struct dbxcr_dump_job *j, struct dbxcr_error *err)
{
	uint64_t at = j->read_at;
	unsigned char byte;
	ssize_t n;

	for (size_t i = 0; !at && i < j->vl.n; i++)
		if (!(j->vl.v[i].flags & VMA_SPECIAL))
			at = j->vl.v[i].start;
	if (!at)
		return 0;	/* nothing but special mappings: nothing was read */
	do
		n = pread(j->memfd, &byte, 1, (off_t)at);
	while (n < 0 && errno == EINTR);
	if (n == 1)
		return 0;
	if (n == 0)
		return fail(err, ESRCH, j->pid, "the template exited during its dump (its "
			    "memory is gone); no image written");
	return fail(err, errno, j->pid, "read /proc/%d/mem at %#llx after the walk", (int)j->pid,
		    (unsigned long long)at);
}

int dbxcr_dump_finish(struct dbxcr_dump_job *j, struct dbxcr_dump_stats *stats,
		      struct dbxcr_error *err)
{
	struct buf mmbuf = { 0 }, pmbuf = { 0 }, outbuf = { 0 }, segbuf = { 0 };
	pid_t pid = j->pid;
	int rc = -1;

	clear_error(err);
	for (size_t i = 0; i < j->vl.n; i++)
		if (dump_vma(j, &j->vl.v[i], &outbuf, &segbuf, err) < 0)
			goto out;
	if (mm_outlived_walk(j, err) < 0)
		goto out;
	if (outbuf.len) {
		if (full_write(j->out.pages_fd, outbuf.p, outbuf.len) < 0) {
			fail(err, errno, pid, "write pages.img");
			goto out;
		}
		j->st.bytes_written += outbuf.len;
	}
	if (j->fsync && fsync(j->out.pages_fd) < 0) {
		fail(err, errno, pid, "fsync pages.img");
		goto out;
	}
	if (mm_image(&j->vl, &mmbuf, pid, err) < 0)
		goto out;
	{
		struct pagemap_fixed pf = { .data_pages = j->out.data_pages,
					    .nruns = j->out.runs.len / sizeof(struct run_img),
					    .npages = j->out.npages };

		if (buf_add(&pmbuf, &pf, sizeof(pf)) < 0 ||
		    buf_add(&pmbuf, j->out.runs.p, j->out.runs.len) < 0 ||
		    buf_add(&pmbuf, j->out.hashes.p, j->out.hashes.len) < 0) {
			fail(err, ENOMEM, pid, "allocate pagemap image");
			goto out;
		}
	}
	if (write_img(j->tmpfd, "pagemap.img", KIND_PAGEMAP, j->id, pmbuf.p, pmbuf.len, j->fsync,
		      &j->st.bytes_written, pid, err) < 0 ||
	    write_img(j->tmpfd, "mm.img", KIND_MM, j->id, mmbuf.p, mmbuf.len, j->fsync,
		      &j->st.bytes_written, pid, err) < 0 ||
	    write_img(j->tmpfd, "core.img", KIND_CORE, j->id, j->corebuf.p, j->corebuf.len,
		      j->fsync, &j->st.bytes_written, pid, err) < 0)
		goto out;
	if (j->fsync && fsync(j->tmpfd) < 0) {
		fail(err, errno, pid, "fsync image directory");
		goto out;
	}
	if (syscall(SYS_renameat2, j->pdirfd, j->tmpname, j->pdirfd, j->base,
		    RENAME_NOREPLACE) < 0) {
		fail(err, errno, pid, "rename image into place as %s", j->path);
		goto out;
	}
	j->tmpname[0] = '\0';
	if (j->fsync && fsync(j->pdirfd) < 0) {
		fail(err, errno, pid, "fsync %s", j->dirpath);
		goto out;
	}
	j->st.vmas = j->vl.n;
	j->st.depth = (int)j->core->depth;
	rc = 0;
out:
	buf_free(&mmbuf);
	buf_free(&pmbuf);
	buf_free(&outbuf);
	buf_free(&segbuf);
	j->st.ms = now_ms() - j->t0;
	if (stats)
		*stats = j->st;
	job_free(j);
	return rc;
}

int dbxcr_dump(struct dbxcr_template *tpl, const char *path, const struct dbxcr_dump_opts *opts,
	       struct dbxcr_dump_stats *stats, struct dbxcr_error *err)
{
	struct dbxcr_dump_job *j;

	if (dbxcr_dump_begin(tpl, path, opts, &j, err) < 0)
		return -1;
	return dbxcr_dump_finish(j, stats, err);
}

int dbxcr_image_info(int image_dirfd, struct dbxcr_image_info *out, struct dbxcr_error *err)
{
	struct image im;

	clear_error(err);
	memset(out, 0, sizeof(*out));
	if (image_load(image_dirfd, NULL, &im, 0, err) < 0)
		return -1;
	out->depth = (int)im.core->depth;
	out->origin_pid = im.core->origin_pid;
	snprintf(out->parent_ref, sizeof(out->parent_ref), "%s", im.parent_ref);
	out->max_tid = im.max_tid;
	image_free(&im);
	return 0;
}

/* Read pages of runs [*ri..] into buf (up to CHUNK_PAGES), checking hashes.  Fills riov
 * with the destination addresses.  Returns pages read. */
struct reader {
	struct chain *c;
	int base;	/* the image whose index is read: c->im[base] (0 for a restore) */
	int live_fd;	/* /proc/SRC/mem of the image's template: pages read there (-1: none) */
	uint64_t run, page_in_run;
};

/* Pages of the current run the reader can take, at most `room`. */
static uint64_t reader_take(const struct reader *rd, uint64_t room)
{
	uint64_t left = rd->c->im[rd->base].runs[rd->run].npages - rd->page_in_run;

	return left < room ? left : room;
}

static void reader_advance(struct reader *rd, uint64_t pages)
{
	rd->page_in_run += pages;
	if (rd->page_in_run == rd->c->im[rd->base].runs[rd->run].npages) {
		rd->run++;
		rd->page_in_run = 0;
	}
}

static long read_chunk(struct reader *rd, unsigned char *buf, struct iovec *liov,
		       struct iovec *riov, size_t *niov, pid_t pid, struct dbxcr_error *err)
{
	const struct image *im = &rd->c->im[rd->base];
	size_t got = 0, ni = 0;

	while (got < CHUNK_PAGES && rd->run < im->pm->nruns) {
		const struct run_img *r = &im->runs[rd->run];
		uint64_t take = reader_take(rd, CHUNK_PAGES - got);
		uint64_t addr = r->vaddr + rd->page_in_run * PAGE;

		if (r->flags & RUN_ZERO) {
			memset(buf + got * PAGE, 0, take * PAGE);
		} else if (rd->live_fd >= 0) {
			/* The template's own copy: no hash to check (it is the source the
			 * image was hashed from), and plain references, never pins (see
			 * dump_vma). */
			if (full_pread(rd->live_fd, buf + got * PAGE, take * PAGE, (off_t)addr) < 0)
				return fail(err, errno == ENODATA ? ESRCH : errno, pid,
					    "read the template's memory at %#llx%s",
					    (unsigned long long)addr, errno == ENODATA ?
					    " (the template is gone: released, or killed, e.g. by "
					    "the sandbox's memory limit)" : "");
		} else {
			off_t off = (off_t)((r->off + rd->page_in_run) * PAGE);

			if (full_pread(rd->c->pages_fd[rd->base + r->level], buf + got * PAGE, take * PAGE, off) < 0) {
				char where[PATH_MAX];

				fd_path(rd->c->pages_fd[rd->base + r->level], where, sizeof(where));
				return fail(err, errno == ENODATA ? EBADMSG : errno, pid,
					    "read %s at page %lld", where, (long long)(off / PAGE));
			}
			for (uint64_t k = 0; k < take; k++) {
				uint64_t h[2];
				const uint64_t *want = rd->c->im[rd->base + r->level].hashes +
						       2 * (r->off + rd->page_in_run + k);

				dbxcr_hash128(buf + (got + k) * PAGE, PAGE, h);
				if (h[0] != want[0] || h[1] != want[1]) {
					char where[PATH_MAX];

					fd_path(rd->c->pages_fd[rd->base + r->level], where, sizeof(where));
					return fail(err, EBADMSG, pid, "%s: page %llu (address %#llx) "
						    "fails its hash check (corrupted)", where,
						    (unsigned long long)(r->off + rd->page_in_run + k),
						    (unsigned long long)(addr + k * PAGE));
				}
			}
		}
		if (ni && (uint64_t)(uintptr_t)riov[ni - 1].iov_base + riov[ni - 1].iov_len == addr) {
			riov[ni - 1].iov_len += take * PAGE;
		} else {
			riov[ni].iov_base = (void *)(uintptr_t)addr;
			riov[ni].iov_len = take * PAGE;
			ni++;
		}
		got += take;
		reader_advance(rd, take);
	}
	liov->iov_base = buf;
	liov->iov_len = got * PAGE;
	*niov = ni;
	return (long)got;
}

int dbxcr_verify_image(int image_dirfd, struct dbxcr_error *err)
{
	struct chain *c = calloc(1, sizeof(*c));
	unsigned char *buf = malloc(CHUNK_PAGES * PAGE);
	int rc = -1;

	clear_error(err);
	if (!c || !buf) {
		fail(err, ENOMEM, 0, "allocate");
		goto out;
	}
	/* Metadata checksums, ids, sizes and references of the whole chain ... */
	if (chain_load(image_dirfd, c, 0, err) < 0)
		goto out;
	/* ... and every page of every pages.img against its hash, in file order: every page
	 * the image (or any level) refers to is some level's own page. */
	rc = 0;
	for (int lv = 0; lv < c->n && rc == 0; lv++) {
		uint64_t n = c->im[lv].pm->data_pages;

		for (uint64_t at = 0; at < n && rc == 0; at += CHUNK_PAGES) {
			uint64_t take = n - at < CHUNK_PAGES ? n - at : CHUNK_PAGES;
			char where[PATH_MAX];

			if (full_pread(c->pages_fd[lv], buf, take * PAGE, (off_t)(at * PAGE)) < 0) {
				fd_path(c->pages_fd[lv], where, sizeof(where));
				rc = fail(err, errno == ENODATA ? EBADMSG : errno, 0, "read %s", where);
				break;
			}
			for (uint64_t k = 0; k < take; k++) {
				uint64_t h[2];
				const uint64_t *want = c->im[lv].hashes + 2 * (at + k);

				dbxcr_hash128(buf + k * PAGE, PAGE, h);
				if (h[0] != want[0] || h[1] != want[1]) {
					fd_path(c->pages_fd[lv], where, sizeof(where));
					rc = fail(err, EBADMSG, 0, "%s: page %llu fails its hash check "
						  "(corrupted)", where, (unsigned long long)(at + k));
					break;
				}
			}
		}
	}
	chain_free(c);
out:
	free(c);
	free(buf);
	return rc;
}

/* ---------- restore ---------- */

struct range {
	uint64_t s, e;
};

static int cmp_range(const void *a, const void *b)
{
	const struct range *x = a, *y = b;

	return x->s < y->s ? -1 : x->s > y->s;
}

/* A free gap of len bytes (with 1 MiB of margin) above 4 GiB, avoiding all ranges. */
static uint64_t find_gap(struct range *rs, size_t n, uint64_t len)
{
	uint64_t margin = 1 << 20, cur = 1ULL << 32;

	qsort(rs, n, sizeof(*rs), cmp_range);
	for (size_t i = 0; i < n; i++) {
		if (rs[i].e <= cur)
			continue;
		if (rs[i].s >= cur + len + 2 * margin)
			return cur + margin;
		if (rs[i].e > cur)
			cur = rs[i].e;
	}
	if (cur + len + 2 * margin < TASK_TOP - (1ULL << 30))
		return cur + margin;
	return 0;
}

struct cur_maps {
	struct range *r;
	char (*name)[24];
	size_t n, cap;
};

static int cur_cb(const struct raw_vma *r, void *arg)
{
	struct cur_maps *m = arg;

	if (r->start >= TASK_TOP)
		return 0;
	if (m->n == m->cap) {
		size_t cap = m->cap ? m->cap * 2 : 64;
		void *a = realloc(m->r, cap * sizeof(*m->r)), *b;

		if (!a)
			return -1;
		m->r = a;
		b = realloc(m->name, cap * sizeof(*m->name));
		if (!b)
			return -1;
		m->name = b;
		m->cap = cap;
	}
	m->r[m->n].s = r->start;
	m->r[m->n].e = r->end;
	memset(m->name[m->n], 0, sizeof(m->name[0]));
	if (is_special_name(r->name))
		memcpy(m->name[m->n], r->name, strlen(r->name));
	m->n++;
	return 0;
}

static void cur_free(struct cur_maps *m)
{
	free(m->r);
	free(m->name);
	memset(m, 0, sizeof(*m));
}

/* Run a syscall in R; on failure the message names the step. */
#define RS(t, nr, err, ...) rsys((t), (nr), a, (err), __VA_ARGS__)
#define BATCH_AT 16	/* the batch loop's offset in the restorer's code page */
/* The call queued in R's batch (batch.c), run with the rest of its step's calls. */
#define BS(R, nr, expect, err, ...) batch_add((R)->b, (nr), a, (expect), (err), __VA_ARGS__)

static pid_t fork_from_host(pid_t host, struct dbxcr_error *err)
{
	struct dbxcr_info info;
	struct tracee h;
	long a[6] = { SIGCHLD, 0, 0, 0, 0, 0 }, ret;
	struct dbxcr_error ignored;
	pid_t child;

	if (dbxcr_describe(host, &info, err) < 0)
		return -1;
	if (info.threads != 1)
		return fail(err, ENOTSUP, host, "host process has %d threads (need 1)", info.threads);
	if (info.tracer_pid)
		return fail(err, EBUSY, host, "host process is traced by %d", info.tracer_pid);
	if (info.state == 'Z' || info.state == 'X' || info.state == 'D')
		return fail(err, EAGAIN, host, "host process is in state %c", info.state);
	if (attach(&h, host, err) < 0)
		return -1;
	h.new_child = 0;
	if (remote_syscall(&h, SYS_clone, a, &ret, err) < 0) {
		kill_traced(h.new_child);
		restore_and_detach(&h, &ignored);
		tracee_free(&h);
		return -1;
	}
	child = h.new_child;
	if (restore_and_detach(&h, err) < 0) {
		kill_traced(child);
		tracee_free(&h);
		return -1;
	}
	tracee_free(&h);
	if (ret < 0)
		return fail(err, (int)-ret, host, "injected clone in the host");
	if (child <= 0)
		return fail(err, EPROTO, host, "clone returned %ld but no fork event", ret);
	if (wait_birth(child, err) < 0) {
		kill_traced(child);
		return -1;
	}
	return child;
}

/* Open a mapped file in the root (no escape through .. or symlinks) and check it is the
 * file that was mapped at dump time. */
/* The open(2) flags a VMA's file is opened with: writable for a writable shared one. */
static int vma_open_flags(const struct vma_img *v)
{
	return ((v->flags & VMA_SHARED) && (v->prot & PROT_WRITE) ? O_RDWR : O_RDONLY) |
	       O_CLOEXEC;
}

static int open_in_root(int root, int flags, const char *path, struct stat *st, pid_t pid,
			struct dbxcr_error *err)
{
	struct open_how how;
	int fd;

	memset(&how, 0, sizeof(how));
	how.flags = (uint64_t)flags;
	how.resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS;
	fd = (int)syscall(SYS_openat2, root, path, &how, sizeof(how));
	if (fd < 0)
		return fail(err, errno, pid, "open mapped file %s in the root", path);
	if (fstat(fd, st) < 0) {
		int e = errno;

		close(fd);
		return fail(err, e, pid, "stat mapped file %s", path);
	}
	return fd;
}

/* The file as the dump saw it (size and mtime), when the dump recorded them. */
static int unchanged(const struct vma_img *v, const struct stat *st, const char *path,
		     pid_t pid, struct dbxcr_error *err)
{
	if (v->fsize >= 0 && (st->st_size != v->fsize || st->st_mtim.tv_sec != v->mtime_sec ||
			      st->st_mtim.tv_nsec != v->mtime_nsec))
		return fail(err, ESTALE, pid, "mapped file %s changed since the dump (size %lld, "
			    "was %lld, or mtime differs)", path, (long long)st->st_size,
			    (long long)v->fsize);
	return 0;
}

static bool same_name(const struct image *im, const struct vma_img *a, const struct vma_img *b)
{
	return a->name_len == b->name_len &&
	       memcmp(im->strtab + a->name_off, im->strtab + b->name_off, a->name_len) == 0;
}

static bool vma_gets_pages(const struct image *im, const struct vma_img *v, uint64_t *run_i)
{
	/* runs are sorted; advance the shared cursor */
	while (*run_i < im->pm->nruns &&
	       im->runs[*run_i].vaddr + (uint64_t)im->runs[*run_i].npages * PAGE <= v->start)
		(*run_i)++;
	return *run_i < im->pm->nruns && im->runs[*run_i].vaddr < v->end;
}

struct restore {
	struct tracee t;
	struct chain *c;
	struct image *im;
	pid_t pid;
	int root;
	int live_fd;			/* reader.live_fd */
	uint64_t code, scratch;		/* C and D */
	struct batch *b;		/* the calls of a step, run by C's loop */
	bool *extra_write;		/* per VMA: mapped with PROT_WRITE added */
	bool *kept;			/* per VMA: the newborn's own kept (r_keep_forked), or
					 * NULL */
	/* Restored in place right after an exec (dbxcr_held_chain): every signal's action is
	 * SIG_DFL, or SIG_IGN for those in `ignored`, with no flags, mask or restorer. */
	bool after_exec;
	uint64_t ignored;
};

/* The index of the image's first VMA starting at or after `start` (nvma: none). */
static uint32_t vma_from(const struct image *im, uint64_t start)
{
	uint32_t lo = 0, hi = im->mm->nvma;

	while (lo < hi) {
		uint32_t mid = lo + (hi - lo) / 2;

		if (im->vmas[mid].start < start)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

/* munmap [s, e) in the tracee, merged with the pending range when they touch (one call
 * for a run of neighbours); e == 0 flushes. */
static int unmap_piece(struct restore *R, uint64_t *ps, uint64_t *pe, uint64_t s, uint64_t e,
		       struct dbxcr_error *err)
{
	long a[6] = { 0 };

	if (e && s == *pe && *pe > *ps) {
		*pe = e;
		return 0;
	}
	if (*pe > *ps) {
		a[0] = (long)*ps;
		a[1] = (long)(*pe - *ps);
		if (BS(R, SYS_munmap, 0, err, "munmap old mapping %#llx-%#llx",
		       (unsigned long long)*ps, (unsigned long long)*pe) < 0)
			return -1;
	}
	*ps = s;
	*pe = e;
	return 0;
}

/* Unmap everything the newborn has but the special mappings, the restorer's pages and
 * the image's VMAs kept in it (r_keep_forked). */
static int r_unmap_old(struct restore *R, struct dbxcr_error *err)
{
	const struct image *im = R->im;
	struct cur_maps m = { 0 };
	uint64_t ps = 0, pe = 0;
	int rc = -1;

	if (walk_maps(R->pid, false, cur_cb, &m, err) < 0) {
		if (!err || !err->code)
			fail(err, ENOMEM, R->pid, "read maps");
		goto out;
	}
	for (size_t i = 0; i < m.n; i++) {
		uint64_t s = m.r[i].s, e = m.r[i].e, cur = s;

		if (m.name[i][0] || s == R->code || s == R->scratch)
			continue;
		for (uint32_t k = R->kept ? vma_from(im, s) : im->mm->nvma;
		     k < im->mm->nvma && im->vmas[k].start < e; k++) {
			if (!R->kept[k] || im->vmas[k].end > e)
				continue;
			if (im->vmas[k].start > cur &&
			    unmap_piece(R, &ps, &pe, cur, im->vmas[k].start, err) < 0)
				goto out;
			cur = im->vmas[k].end;
		}
		if (cur < e && unmap_piece(R, &ps, &pe, cur, e, err) < 0)
			goto out;
	}
	if (unmap_piece(R, &ps, &pe, 0, 0, err) < 0 || batch_run(R->b, err) < 0)
		goto out;
	rc = 0;
out:
	cur_free(&m);
	return rc;
}

/* Move the current vdso/vvar pages to the dumped addresses. */
static int r_move_vdso(struct restore *R, struct dbxcr_error *err)
{
	struct cur_maps m = { 0 };
	const struct image *im = R->im;
	struct range occ[3 + 8];
	size_t nocc = 0, nspec = 0;
	uint64_t lo = UINT64_MAX, hi = 0, tmp;
	long a[6] = { 0 };
	int rc = -1;
	struct {
		uint64_t s, e, to;
	} sp[8];

	if (walk_maps(R->pid, false, cur_cb, &m, err) < 0)
		goto out;
	for (size_t i = 0; i < m.n; i++) {
		bool found = false;

		if (!m.name[i][0])
			continue;
		if (nspec == 8)
			goto layout;
		for (uint32_t j = 0; j < im->mm->nvma; j++) {
			const struct vma_img *v = &im->vmas[j];

			if ((v->flags & VMA_SPECIAL) && v->name_len == strlen(m.name[i]) &&
			    memcmp(im->strtab + v->name_off, m.name[i], v->name_len) == 0) {
				if (v->end - v->start != m.r[i].e - m.r[i].s)
					goto layout;
				sp[nspec].to = v->start;
				found = true;
			}
		}
		if (!found)
			goto layout;
		sp[nspec].s = m.r[i].s;
		sp[nspec].e = m.r[i].e;
		if (sp[nspec].s < lo)
			lo = sp[nspec].s;
		if (sp[nspec].e > hi)
			hi = sp[nspec].e;
		nspec++;
	}
	{
		uint32_t nd = 0;

		for (uint32_t j = 0; j < im->mm->nvma; j++)
			nd += (im->vmas[j].flags & VMA_SPECIAL) != 0;
		if (nd != nspec)
			goto layout;
	}
	if (nspec == 0) {
		rc = 0;
		goto out;
	}
	{
		bool same = true;

		for (size_t i = 0; i < nspec; i++)
			same = same && sp[i].s == sp[i].to;
		if (same) {
			rc = 0;
			goto out;
		}
	}
	/* Through a temporary place that overlaps nothing, current or target. */
	for (size_t i = 0; i < nspec; i++) {
		occ[nocc].s = sp[i].to;
		occ[nocc++].e = sp[i].to + (sp[i].e - sp[i].s);
	}
	occ[nocc].s = lo;
	occ[nocc++].e = hi;
	occ[nocc].s = R->code;
	occ[nocc++].e = R->code + PAGE;
	occ[nocc].s = R->scratch;
	occ[nocc++].e = R->scratch + SCRATCH_LEN;
	{
		struct range all[64];
		size_t na = 0;

		for (size_t i = 0; i < nocc; i++)
			all[na++] = occ[i];
		for (uint32_t j = 0; j < im->mm->nvma && na < 64; j++) {
			all[na].s = im->vmas[j].start;
			all[na++].e = im->vmas[j].end;
		}
		/* (the dump's VMAs are not mapped yet, only the targets matter) */
		tmp = find_gap(all, na < 64 ? na : 64, hi - lo);
	}
	if (!tmp) {
		fail(err, ENOMEM, R->pid, "no room to move the vdso");
		goto out;
	}
	for (int pass = 0; pass < 2; pass++)
		for (size_t i = 0; i < nspec; i++) {
			uint64_t from = pass ? tmp + (sp[i].s - lo) : sp[i].s;
			uint64_t to = pass ? sp[i].to : tmp + (sp[i].s - lo);

			a[0] = (long)from;
			a[1] = a[2] = (long)(sp[i].e - sp[i].s);
			a[3] = MREMAP_MAYMOVE | MREMAP_FIXED;
			a[4] = (long)to;
			if (BS(R, SYS_mremap, 0, err, "mremap vdso/vvar %#llx -> %#llx",
			       (unsigned long long)from, (unsigned long long)to) < 0)
				goto out;
		}
	if (batch_run(R->b, err) < 0)
		goto out;
	rc = 0;
	goto out;
layout:
	fail(err, ENOTSUP, R->pid, "the vdso/vvar layout of this kernel differs from the dump "
	     "(different kernel?)");
out:
	cur_free(&m);
	return rc;
}

/* mmap every dumped VMA; files are opened here and passed in batches, each file once a
 * batch: a library is mapped four or five times (text, data, relro, ...), and opening it
 * (openat2 in the root, fstat, close) is the bulk of a restore of a process mapping many
 * (PostgreSQL's backends: 245 VMAs, ~180 of files, 10 ms each before). */
#define BATCH_FILES 60
#define BATCH_FILE_VMAS 240
static int r_map_vmas(struct restore *R, struct dbxcr_error *err)
{
	const struct image *im = R->im;
	uint32_t nv = im->mm->nvma;
	uint64_t run_i = 0;
	long a[6] = { 0 };

	for (uint32_t i = 0; i < nv;) {
		int local[BATCH_FILES], remote[BATCH_FILES], flags_of[BATCH_FILES];
		uint32_t first[BATCH_FILES];	/* the VMA each file was opened for */
		uint32_t vidx[BATCH_FILE_VMAS];
		size_t vslot[BATCH_FILE_VMAS];
		struct stat st[BATCH_FILES];
		size_t nf = 0, nfv = 0;
		uint32_t j;

		/* Collect the next batch of file VMAs (anonymous ones in between are mapped
		 * in order below). */
		for (j = i; j < nv && nf < BATCH_FILES && nfv < BATCH_FILE_VMAS; j++) {
			const struct vma_img *v = &im->vmas[j];
			char path[PATH_MAX];
			int flags = vma_open_flags(v);
			size_t slot = nf;

			if (!(v->flags & VMA_FILE) || (R->kept && R->kept[j]))
				continue;	/* (a kept one maps its file already) */
			if (v->name_len >= sizeof(path)) {
				fail(err, ENAMETOOLONG, R->pid, "mapped file name");
				goto fail_batch;
			}
			memcpy(path, im->strtab + v->name_off, v->name_len);
			path[v->name_len] = '\0';
			for (size_t q = 0; q < nf; q++)
				if (flags_of[q] == flags && same_name(im, &im->vmas[first[q]], v))
					slot = q;
			if (slot == nf) {
				local[nf] = open_in_root(R->root, flags, path, &st[nf], R->pid, err);
				if (local[nf] < 0)
					goto fail_batch;
				flags_of[nf] = flags;
				first[nf++] = j;
			}
			if (unchanged(v, &st[slot], path, R->pid, err) < 0)
				goto fail_batch;
			vidx[nfv] = j;
			vslot[nfv++] = slot;
		}
		if (nf && transfer_fds(&R->t, R->scratch, local, nf, remote, err) < 0)
			goto fail_batch;
		for (size_t k = 0; k < nf; k++)
			close(local[k]);
		for (uint32_t k = i; k < j; k++) {
			const struct vma_img *v = &im->vmas[k];
			long prot = v->prot, flags = MAP_FIXED_NOREPLACE, fd = -1, off = 0;

			if (v->flags & VMA_SPECIAL)
				continue;
			R->extra_write[k] = vma_gets_pages(im, v, &run_i) && !(prot & PROT_WRITE);
			if (R->kept && R->kept[k]) {	/* there, as the image has it */
				if (!R->extra_write[k])
					continue;
				a[0] = (long)v->start;
				a[1] = (long)(v->end - v->start);
				a[2] = prot | PROT_WRITE;
				if (BS(R, SYS_mprotect, 0, err, "mprotect kept %#llx",
				       (unsigned long long)v->start) < 0)
					return -1;
				continue;
			}
			if (R->extra_write[k])
				prot |= PROT_WRITE;
			flags |= (v->flags & VMA_SHARED) ? MAP_SHARED : MAP_PRIVATE;
			if (v->flags & VMA_GROWSDOWN)
				flags |= MAP_GROWSDOWN;
			if (v->flags & VMA_FILE) {
				for (size_t q = 0; q < nfv; q++)
					if (vidx[q] == k)
						fd = remote[vslot[q]];
				off = (long)(v->pgoff * PAGE);
			} else {
				flags |= MAP_ANONYMOUS;
			}
			a[0] = (long)v->start;
			a[1] = (long)(v->end - v->start);
			a[2] = prot;
			a[3] = flags;
			a[4] = fd;
			a[5] = off;
			if (BS(R, SYS_mmap, v->start, err, "mmap %#llx-%#llx (%.*s)",
			       (unsigned long long)v->start, (unsigned long long)v->end,
			       (int)(v->name_len > 80 ? 80 : v->name_len),
			       v->name_len ? im->strtab + v->name_off : "anon") < 0)
				return -1;
			{
				static const struct { uint32_t f; int adv; } madv[] = {
					{ VMA_HUGE, MADV_HUGEPAGE }, { VMA_NOHUGE, MADV_NOHUGEPAGE },
					{ VMA_WIPEONFORK, MADV_WIPEONFORK },
					{ VMA_DONTDUMP, MADV_DONTDUMP } };

				for (size_t q = 0; q < sizeof(madv) / sizeof(madv[0]); q++) {
					if (!(v->flags & madv[q].f))
						continue;
					a[0] = (long)v->start;
					a[1] = (long)(v->end - v->start);
					a[2] = madv[q].adv;
					if (BS(R, SYS_madvise, 0, err, "madvise(%d) %#llx",
					       madv[q].adv, (unsigned long long)v->start) < 0)
						return -1;
				}
			}
		}
		for (size_t k = 0; k < nf; k++) {
			a[0] = remote[k];
			if (BS(R, SYS_close, 0, err, "close mapped file fd") < 0)
				return -1;
		}
		/* Before the next batch of files reuses these descriptors' numbers. */
		if (batch_run(R->b, err) < 0)
			return -1;
		i = j;
		continue;
fail_batch:
		for (size_t k = 0; k < nf; k++)
			close(local[k]);
		return -1;
	}
	return 0;
}

/* Page data is the bulk of a restore (a 200 MB process: ~30 ms to read and hash, ~75 ms
 * for process_vm_writev, whose cost is faulting in and zeroing the target's pages one by
 * one).  Neither needs the tracer: process_vm_writev only needs ptrace-attach permission,
 * and the kernel faults the target's pages under a shared mmap lock, so writers on
 * disjoint ranges run in parallel.  Up to WRITERS threads take 1 MiB chunks from a shared
 * cursor; the first error stops them all and is the one reported. */
#define WRITERS 4
#define PARALLEL_MIN_PAGES (4 * CHUNK_PAGES)

struct page_writers {
	pthread_mutex_t lock;
	struct reader rd;		/* next chunk to hand out (under lock) */
	pid_t pid;
	bool failed;			/* under lock */
	struct dbxcr_error err;		/* the first failure */
};

/* Advance rd by up to CHUNK_PAGES pages, exactly as read_chunk would; false at the end. */
static bool reader_skip(struct reader *rd)
{
	const struct image *im = &rd->c->im[rd->base];
	uint64_t got = 0;

	if (rd->run >= im->pm->nruns)
		return false;
	while (got < CHUNK_PAGES && rd->run < im->pm->nruns) {
		uint64_t take = reader_take(rd, CHUNK_PAGES - got);

		got += take;
		reader_advance(rd, take);
	}
	return true;
}

/* Hand out the next chunk's start position; false when done or after a failure. */
static bool next_chunk(struct page_writers *W, struct reader *mine)
{
	bool ok;

	pthread_mutex_lock(&W->lock);
	*mine = W->rd;
	ok = !W->failed && reader_skip(&W->rd);
	pthread_mutex_unlock(&W->lock);
	return ok;
}

static void writers_fail(struct page_writers *W, const struct dbxcr_error *e)
{
	pthread_mutex_lock(&W->lock);
	if (!W->failed) {
		W->failed = true;
		W->err = *e;
	}
	pthread_mutex_unlock(&W->lock);
}

static void *page_writer(void *arg)
{
	struct page_writers *W = arg;
	unsigned char *buf = malloc(CHUNK_PAGES * PAGE);
	struct iovec liov, riov[CHUNK_PAGES];
	struct dbxcr_error e = { 0 };
	struct reader mine;
	size_t ni = 0;

	if (!buf) {
		fail(&e, ENOMEM, W->pid, "allocate page buffer");
		writers_fail(W, &e);
		return NULL;
	}
	while (next_chunk(W, &mine)) {
		ssize_t w;

		if (read_chunk(&mine, buf, &liov, riov, &ni, W->pid, &e) < 0) {
			writers_fail(W, &e);
			break;
		}
		w = process_vm_writev(W->pid, &liov, 1, riov, ni, 0);
		if (w < 0 || (size_t)w != liov.iov_len) {
			fail(&e, w < 0 ? errno : EIO, W->pid, "process_vm_writev %zu bytes at %p",
			     liov.iov_len, riov[0].iov_base);
			writers_fail(W, &e);
			break;
		}
	}
	free(buf);
	return NULL;
}

static int r_write_pages(struct restore *R, struct dbxcr_error *err)
{
	struct page_writers W = { .lock = PTHREAD_MUTEX_INITIALIZER,
				  .rd = { .c = R->c, .live_fd = R->live_fd }, .pid = R->pid };
	uint64_t pages = 0;
	long cpus = sysconf(_SC_NPROCESSORS_ONLN);
	int extra = 0, want;
	pthread_t tid[WRITERS];

	for (uint64_t i = 0; i < R->im->pm->nruns; i++)
		pages += R->im->runs[i].npages;
	want = pages < PARALLEL_MIN_PAGES ? 0 : (int)(cpus < WRITERS ? cpus : WRITERS) - 1;
	while (extra < want && pthread_create(&tid[extra], NULL, page_writer, &W) == 0)
		extra++;	/* fewer threads (even none) only makes it slower */
	page_writer(&W);
	for (int i = 0; i < extra; i++)
		pthread_join(tid[i], NULL);
	pthread_mutex_destroy(&W.lock);
	if (W.failed) {
		*err = W.err;
		return -1;
	}
	return 0;
}

/* mm fields and /proc/pid/exe with one prctl(PR_SET_MM, PR_SET_MM_MAP) (the only form that
 * needs no CAP_SYS_RESOURCE).  Done right after the old mappings are gone: the kernel
 * refuses to replace an exe file that is still mapped (EBUSY, e.g. when host runs the same
 * binary), and the map is validated against address limits only, not against VMAs. */
static int r_set_mm(struct restore *R, struct dbxcr_error *err)
{
	const struct image *im = R->im;
	const struct core_fixed *core = im->core;
	long a[6] = { 0 };
	int exe_remote = -1;

	if (im->exe[0]) {
		struct stat st;
		int fd = open_in_root(R->root, O_RDONLY | O_CLOEXEC, im->exe, &st, R->pid, err);

		if (fd < 0)
			return -1;
		if (transfer_fds(&R->t, R->scratch, &fd, 1, &exe_remote, err) < 0) {
			close(fd);
			return -1;
		}
		close(fd);
	}
	{
		struct prctl_mm_map mm;
		unsigned long auxv_at = R->scratch + 512;

		mm_map_of(core->mm, true, &mm);	/* a template: command line hidden */
		mm.auxv = (__u64 *)auxv_at;
		mm.auxv_size = core->auxv_len;
		mm.exe_fd = (uint32_t)exe_remote;
		if (core->auxv_len > SCRATCH_LEN - 1024)
			return fail(err, E2BIG, R->pid, "auxv of %u bytes", core->auxv_len);
		if (mem_write(R->pid, auxv_at, im->auxv, core->auxv_len, err) < 0 ||
		    mem_write(R->pid, R->scratch, &mm, sizeof(mm), err) < 0)
			return -1;
		a[0] = PR_SET_MM;
		a[1] = PR_SET_MM_MAP;
		a[2] = (long)R->scratch;
		a[3] = sizeof(mm);
		if (RS(&R->t, SYS_prctl, err, "prctl(PR_SET_MM_MAP)") < 0)
			return -1;
	}
	if (exe_remote >= 0) {
		a[0] = exe_remote;
		a[1] = a[2] = a[3] = 0;
		if (RS(&R->t, SYS_close, err, "close exe fd") < 0)
			return -1;
	}
	return 0;
}

/* Memory protection keys (x86 PKU; V8 and PartitionAlloc guard Chromium's JIT code with
 * one).  The newborn's mm has the keys its parent allocated (fork copies the allocation
 * map, which /proc does not show) and its VMAs the parent's keys: a zygote restored from
 * an image lost its own key 1, and every renderer it forked after the restore died at
 * its first pkey_mprotect(..., 1) (EINVAL, then a CHECK's SIGTRAP).  pkey_alloc gives the
 * lowest free key, so every key below one a VMA uses is allocated too (one already
 * allocated comes back as a higher key, freed again); then each such VMA gets its key.
 * The access rights (PKRU) are the image's registers'. */
static int r_pkeys(struct restore *R, struct dbxcr_error *err)
{
	const struct image *im = R->im;
	uint32_t used = 0;
	long a[6] = { 0 }, got;

	for (uint32_t k = 0; k < im->mm->nvma; k++)
		used |= 1u << ((im->vmas[k].flags & VMA_PKEY) >> VMA_PKEY_SHIFT);
	for (int key = 1; key <= VMA_PKEY_MAX; key++) {
		if (!(used & (1u << key)))
			continue;
		do {
			a[0] = a[1] = 0;
			if (remote_syscall(&R->t, SYS_pkey_alloc, a, &got, err) < 0)
				return -1;
			if (got == -ENOSPC)
				break;	/* every key allocated, this one too */
			if (got < 0)
				return fail(err, (int)-got, R->pid, "pkey_alloc for protection key "
					    "%d (this machine has no PKU?)", key);
		} while (got < key);
		if (got > key) {
			a[0] = got;
			if (RS(&R->t, SYS_pkey_free, err, "pkey_free(%ld)", got) < 0)
				return -1;
		}
	}
	for (uint32_t k = 0; k < im->mm->nvma; k++) {
		const struct vma_img *v = &im->vmas[k];

		if (!(v->flags & VMA_PKEY) || (v->flags & VMA_SPECIAL) ||
		    (R->kept && R->kept[k]))	/* (kept: with its key already) */
			continue;
		a[0] = (long)v->start;
		a[1] = (long)(v->end - v->start);
		a[2] = v->prot;
		a[3] = (v->flags & VMA_PKEY) >> VMA_PKEY_SHIFT;
		if (BS(R, SYS_pkey_mprotect, 0, err, "pkey_mprotect %#llx key %ld",
		       (unsigned long long)v->start, a[3]) < 0)
			return -1;
	}
	return batch_run(R->b, err);
}

static int r_finish_mm(struct restore *R, struct dbxcr_error *err)
{
	const struct image *im = R->im;
	const struct core_fixed *core = im->core;
	long a[6] = { 0 };

	for (uint32_t k = 0; k < im->mm->nvma; k++) {
		const struct vma_img *v = &im->vmas[k];

		if (!R->extra_write[k])
			continue;
		a[0] = (long)v->start;
		a[1] = (long)(v->end - v->start);
		a[2] = v->prot;
		if (BS(R, SYS_mprotect, 0, err, "mprotect %#llx", (unsigned long long)v->start) < 0)
			return -1;
	}
	if (core->has_rseq) {
		a[0] = (long)core->rseq_ptr;
		a[1] = core->rseq_len;
		a[2] = 0;
		a[3] = core->rseq_sig;
		if (BS(R, SYS_rseq, 0, err, "rseq register %#llx",
		       (unsigned long long)core->rseq_ptr) < 0)
			return -1;
	}
	return batch_run(R->b, err);
}

/* Where r_signals_and_ids puts its calls' arguments in the scratch area (below the batch
 * table): every action, then the alternate stack. */
#define SA_AT 0
#define SS_AT (SA_AT + NSIG_K * sizeof(struct ksigaction))
_Static_assert(SS_AT + sizeof(stack_t) <= BATCH_TABLE_OFF,
	       "r_signals_and_ids' arguments overlap the batch table");

/* The name, then signal actions, alternate stack, umask and personality in one batch. */
static int r_signals_and_ids(struct restore *R, struct dbxcr_error *err)
{
	const struct core_fixed *core = R->im->core;
	long a[6] = { 0 };

	/* The restored process is a template: its children get core->comm back (tpl->comm). */
	if (set_comm(&R->t, R->scratch, TEMPLATE_COMM, err) < 0)
		return -1;

	/* Every action written at once; each set by a call unless it is what the process
	 * has already (after an exec). */
	if (mem_write(R->pid, R->scratch + SA_AT, core->sig, sizeof(core->sig), err) < 0)
		return -1;
	for (int sig = 1; sig <= NSIG_K; sig++) {
		const struct ksigaction *k = &core->sig[sig - 1];
		bool ign = (R->ignored >> (sig - 1)) & 1;

		if (sig == SIGKILL || sig == SIGSTOP)
			continue;
		if (R->after_exec && k->handler == (ign ? (uint64_t)(uintptr_t)SIG_IGN : 0) &&
		    !k->flags && !k->restorer && !k->mask)
			continue;
		a[0] = sig;
		a[1] = (long)(R->scratch + SA_AT + (sig - 1) * sizeof(struct ksigaction));
		a[2] = 0;
		a[3] = 8;
		if (BS(R, SYS_rt_sigaction, 0, err, "rt_sigaction(%d)", sig) < 0)
			return -1;
	}
	{
		stack_t ss;

		memset(&ss, 0, sizeof(ss));
		ss.ss_sp = (void *)(uintptr_t)core->ss_sp;
		ss.ss_size = core->ss_size;
		ss.ss_flags = core->ss_flags & ~SS_ONSTACK;
		if (ss.ss_flags & SS_DISABLE) {
			ss.ss_sp = NULL;
			ss.ss_size = 0;
		}
		if (mem_write(R->pid, R->scratch + SS_AT, &ss, sizeof(ss), err) < 0)
			return -1;
		a[0] = (long)(R->scratch + SS_AT);
		a[1] = 0;
		if (BS(R, SYS_sigaltstack, 0, err, "sigaltstack") < 0)
			return -1;
	}
	a[0] = core->umask;
	if (BS(R, SYS_umask, 0, err, "umask") < 0)
		return -1;
	a[0] = core->personality;
	if (BS(R, SYS_personality, 0, err, "personality(%#x)", core->personality) < 0)
		return -1;
	/* The image's uids, gids and groups are not switched to here: a process of another
	 * user could not do the rest of its restore (nor its spawns: clone3 set_tid, setns).
	 * A process that ran without root's rights has its credentials on its template
	 * (tpl->creds, from src or set by the daemon: deltabox/cr/creds.py), given back last
	 * in every child (creds.c). */
	return batch_run(R->b, err);
}

/* The restore into a fresh process: a child of `host` (fork_from_host), or, given
 * `parent`, the held process's own child with the pid set_tid (held_fork); or, given
 * `inplace`, into that process itself, which has just exec'ed (stopped in our trace: its
 * memory, descriptors and state are all replaced; killed if the restore fails). */
static struct dbxcr_template *restore_template_in(pid_t host, struct dbxcr_held *parent,
						  const pid_t *set_tid, size_t set_tid_size,
						  int image_dirfd, int root_dirfd,
						  const struct dbxcr_template *src, pid_t inplace,
						  const struct dbxcr_spawn_opts *skip,
						  struct dbxcr_error *err);

struct dbxcr_template *dbxcr_restore_template(pid_t host, int image_dirfd, int root_dirfd,
					      struct dbxcr_error *err)
{
	return restore_template_in(host, NULL, NULL, 0, image_dirfd, root_dirfd, NULL, 0, NULL,
				   err);
}

struct dbxcr_template *dbxcr_restore_template_from(pid_t host, int image_dirfd,
						   int root_dirfd,
						   const struct dbxcr_template *src,
						   struct dbxcr_error *err)
{
	return restore_template_in(host, NULL, NULL, 0, image_dirfd, root_dirfd, src, 0, NULL,
				   err);
}

pid_t dbxcr_held_adopt(struct dbxcr_held *parent, int image_dirfd, int root_dirfd,
		       const struct dbxcr_template *src, const struct dbxcr_spawn_opts *opts,
		       struct dbxcr_held **out, struct dbxcr_error *err)
{
	struct dbxcr_template *tpl;

	*out = NULL;
	tpl = restore_template_in(dbxcr_held_pid(parent), parent, opts->set_tid,
				  opts->set_tid_size, image_dirfd, root_dirfd, src, 0, opts, err);
	if (!tpl)
		return -1;
	if (held_become(tpl, opts, true, out, err) < 0)	/* takes tpl */
		return -1;
	return dbxcr_held_pid(*out);
}

/* Step 1 of dbxcr_held_chain for ancestor o: only what the process must have before its
 * own child is born (pid, namespaces, cgroup, process group and session). */
static void chain_birth_opts(const struct dbxcr_spawn_opts *o, struct dbxcr_spawn_opts *out)
{
	memset(out, 0, sizeof(*out));
	out->mntns_fd = o->mntns_fd;
	out->set_tid = o->set_tid;
	out->set_tid_size = o->set_tid_size;
	out->pidns_fd = o->pidns_fd;
	out->ns_pidfd = o->ns_pidfd;
	out->cgroup_fds = o->cgroup_fds;
	out->ncgroup_fds = o->ncgroup_fds;
	out->pgid = o->pgid;
}

int dbxcr_held_chain(struct dbxcr_template *child_tpl, size_t n,
		     const struct dbxcr_spawn_opts *anc_opts, const int *image_dirfds,
		     const struct dbxcr_template *const *srcs, int root_dirfd, int exe_fd,
		     const struct dbxcr_spawn_opts *child_opts, struct dbxcr_held **out,
		     struct dbxcr_error *err)
{
	struct dbxcr_held *x[DBXCR_CHAIN_MAX] = { 0 };
	struct dbxcr_spawn_opts o;
	size_t made = 0, i;

	clear_error(err);
	for (i = 0; i <= n; i++)
		out[i] = NULL;
	if (n == 0 || n > DBXCR_CHAIN_MAX)
		return fail(err, EINVAL, child_tpl->origin, "a chain of %zu ancestors (1 to %d)",
			    n, DBXCR_CHAIN_MAX);
	/* 1. The ancestors' processes, root first, each the previous one's child, all
	 *    sharing the child's template's address space (CLONE_VM: no page table copied). */
	chain_birth_opts(&anc_opts[0], &o);
	if (held_spawn_shared(child_tpl, &o, &x[0], err) < 0)
		return -1;
	for (made = 1; made <= n; made++) {
		/* A pty session's leader takes its terminal before the rest are born of it. */
		if (anc_opts[made - 1].ctty &&
		    held_take_terminal(x[made - 1], &anc_opts[made - 1], err) < 0)
			goto kill;
		if (made == n)
			break;
		chain_birth_opts(&anc_opts[made], &o);
		if (held_spawn_child(x[made - 1], child_tpl, &o, CLONE_VM, &x[made], err) < 0)
			goto kill;
	}
	/* 2. The child: a fork of that memory in its parent (the one page-table copy, as in
	 *    any spawn from the template), re-rooted as the child. */
	if (held_spawn_child(x[n - 1], child_tpl, child_opts, 0, &out[n], err) < 0)
		goto kill;
	/* 3. Each ancestor, deepest first, gets an address space of its own (held_exec),
	 *    then its own image in place (pages from its template), and is re-rooted as
	 *    itself; group and session were set in step 1. */
	for (i = n; i-- > 0;) {
		pid_t pid = dbxcr_held_pid(x[i]);
		struct dbxcr_template *tpl;

		if (held_exec(x[i], exe_fd, err) < 0)
			goto kill;
		tpl = restore_template_in(pid, NULL, NULL, 0, image_dirfds[i], root_dirfd, srcs[i],
					  pid, NULL, err);
		held_forget(x[i]);	/* the process is tpl's now, or killed */
		x[i] = NULL;
		if (!tpl)
			goto kill;
		o = anc_opts[i];
		o.pgid = 0;
		o.pidns_fd = -1;
		o.ns_pidfd = -1;
		o.cgroup_fds = NULL;
		o.ncgroup_fds = 0;
		/* The root's parent is not its restored one (a spawn's: see finish_child). */
		if (held_become(tpl, &o, i > 0, &out[i], err) < 0)	/* takes tpl */
			goto kill;
	}
	return dbxcr_held_pid(out[0]);
kill:	/* children first */
	dbxcr_held_kill(out[n]);
	out[n] = NULL;
	for (i = n; i-- > 0;) {
		dbxcr_held_kill(out[i]);
		out[i] = NULL;
		if (x[i])
			dbxcr_held_kill(x[i]);
	}
	return -1;
}

/* The signals pid ignores (/proc/PID/status SigIgn): after an exec, the only actions
 * that are not SIG_DFL. */
static int sig_ignored(pid_t pid, uint64_t *out, struct dbxcr_error *err)
{
	char path[64], buf[8192];
	const char *at;

	snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
	if (read_small_file(path, buf, sizeof(buf)) < 0)
		return fail(err, errno, pid, "read %s", path);
	at = strstr(buf, "\nSigIgn:");
	if (!at)
		return fail(err, EPROTO, pid, "no SigIgn in /proc/%d/status", (int)pid);
	*out = strtoull(at + 8, NULL, 16);
	return 0;
}

/* The page source of a restore given the image's template (src): its /proc/PID/mem, bound
 * to its address space from here on.  Without src, an image whose pages stayed in its
 * template (RUN_LIVE) cannot be restored. */
static int open_live(struct restore *R, int image_dirfd, const struct dbxcr_template *src,
		     pid_t host, struct dbxcr_error *err)
{
	char path[64], where[PATH_MAX];

	if (src) {
		if (src->origin != R->im->core->origin_pid) {
			fd_path(image_dirfd, where, sizeof(where));
			return fail(err, EINVAL, src->pid, "image %s is of process %d, not of this "
				    "template's (%d)", where, (int)R->im->core->origin_pid,
				    (int)src->origin);
		}
		snprintf(path, sizeof(path), "/proc/%d/mem", (int)src->pid);
		R->live_fd = open(path, O_RDONLY | O_CLOEXEC);
		if (R->live_fd < 0)
			return fail(err, errno, src->pid, "open %s (the image's template)", path);
		return 0;
	}
	for (uint64_t i = 0; i < R->im->pm->nruns; i++)
		if (R->im->runs[i].flags & RUN_LIVE) {
			fd_path(image_dirfd, where, sizeof(where));
			return fail(err, EBADMSG, host, "image %s holds no page contents (its pages "
				    "stayed in the template it was made from): restore it with that "
				    "template", where);
		}
	return 0;
}

/* A kept piece [from, to) of run r, its data offset moved with its start (the hashes are
 * indexed by it). */
static struct run_img run_piece(const struct run_img *r, uint64_t from, uint64_t to)
{
	struct run_img p = *r;

	p.vaddr = from;
	p.npages = (uint32_t)((to - from) / PAGE);
	p.off = r->off + (from - r->vaddr) / PAGE;
	return p;
}

static int push_run(struct run_img **out, size_t *n, size_t *cap, struct run_img r)
{
	if (*n == *cap) {
		size_t c = *cap ? *cap * 2 : 64;
		struct run_img *x = realloc(*out, c * sizeof(*x));

		if (!x)
			return -1;
		*out = x;
		*cap = c;
	}
	(*out)[(*n)++] = r;
	return 0;
}

/* im's runs from now on: `out` (n of them), owned by im. */
static void replace_runs(struct image *im, struct run_img *out, size_t n)
{
	free(im->runs_own);
	im->runs_own = out;
	im->runs = out;
	im->pm->nruns = n;
}

static int by_start(const void *a, const void *b)
{
	const struct dbxcr_remap *x = a, *y = b;

	return x->start < y->start ? -1 : x->start > y->start;
}

/* Drop from image im's runs the pages of the ranges the spawn maps afresh over whatever
 * the restore wrote there: the shared mappings in `remaps` (not private_map), whose object
 * the daemon made again from its copy at the checkpoint (a semaphore, shared memory).  An
 * adopted child sharing memory would otherwise have that memory copied in at every
 * restore, only to be mapped over.  Runs are clipped or split around each range. */
static int skip_remapped(struct image *im, const struct dbxcr_remap *remaps, size_t n,
			 pid_t pid, struct dbxcr_error *err)
{
	struct dbxcr_remap *skip;
	struct run_img *out = NULL;
	size_t ns = 0, kept = 0, cap = 0;

	for (size_t i = 0; i < n; i++)
		ns += !remaps[i].private_map;
	if (!ns || !im->pm->nruns)
		return 0;
	skip = calloc(ns, sizeof(*skip));
	if (!skip)
		goto nomem;
	ns = 0;
	for (size_t i = 0; i < n; i++)
		if (!remaps[i].private_map)
			skip[ns++] = remaps[i];
	qsort(skip, ns, sizeof(*skip), by_start);
	for (uint64_t r = 0; r < im->pm->nruns; r++) {
		const struct run_img *run = &im->runs[r];
		uint64_t cur = run->vaddr, end = run->vaddr + (uint64_t)run->npages * PAGE;

		for (size_t i = 0; i < ns && cur < end; i++) {
			if (skip[i].end <= cur || skip[i].start >= end)
				continue;
			if (skip[i].start > cur &&
			    push_run(&out, &kept, &cap, run_piece(run, cur, skip[i].start)) < 0)
				goto nomem;
			cur = skip[i].end;
		}
		if (cur < end && push_run(&out, &kept, &cap, run_piece(run, cur, end)) < 0)
			goto nomem;
	}
	free(skip);
	replace_runs(im, out, kept);
	return 0;
nomem:
	free(skip);
	free(out);
	return fail(err, ENOMEM, pid, "allocate runs");
}

/* An adopted child is born a fork of its restored parent (held_fork), which holds the
 * parent's pages at the checkpoint copy-on-write; and the child was a fork of that parent,
 * so every page neither wrote since is one physical frame in the parent's template, the
 * child's template (src, where the image's pages are read) and the newborn.  So each
 * private mapping the newborn has exactly as the image has it (range, protection,
 * madvise flags, protection key; of a file, the very file, at the same offset, that the
 * restore would map there: maps_root_file) is kept: only the pages whose frame differs
 * from src's are written, and the newborn's own pages the image does not have are
 * dropped (MADV_DONTNEED: an anonymous page then reads as zero, a file's as the file, as
 * an absent page of the image does).  A pool's worker or a shell's job then costs the
 * pages it wrote, not all of its memory, and its files are not mapped again.  A mapping
 * whose drops (one
 * injected call per range, ~25 us: about what writing KEEP_DROP_PAGES pages costs) would
 * cost more than the writes kept spare is mapped afresh instead.  Frames are read from
 * pagemap (root: PFNs shown); a frame unknown (0, swapped) counts as different. */
#define KEEP_DROP_PAGES 8
#define KEEP_MIN_PAGES 256
#define PM_PRESENT (1ULL << 63)
#define PM_SWAP (1ULL << 62)
#define PM_PFN ((1ULL << 55) - 1)
#define KEPT_SAME 1		/* one frame in the newborn and in src */
#define KEPT_THERE 2		/* the newborn has the page (present or swapped) */
#define KEPT_COVERED 4		/* the image has it: in one of its runs */

/* Private anonymous memory of the image (what a fork of the parent may hold already). */
static bool private_anon(const struct vma_img *v)
{
	return !(v->flags & (VMA_SHARED | VMA_FILE | VMA_SPECIAL | VMA_WHOLE));
}

/* A private mapping of a file of the image (the same, if the newborn maps the same file). */
static bool private_file(const struct vma_img *v)
{
	return (v->flags & (VMA_SHARED | VMA_FILE | VMA_SPECIAL | VMA_WHOLE)) == VMA_FILE;
}

/* The file a restore maps for a VMA of the image: at its path in the root (as the
 * restored parent of a zygote's child does, itself restored from an image), looked up once
 * per name.  Not `ok` if it is not there. */
struct root_file {
	uint32_t k;		/* the image's first VMA of that name */
	bool ok;
	struct stat st;
};

/* A file the newborn maps, as stat shows it: overlayfs gives a file of a lower layer the
 * device of a per-layer pseudo device in stat, the overlay's own in maps, so the two are
 * compared through stat alone (/proc/PID/map_files), once per file the newborn maps. */
struct newborn_file {
	unsigned int major, minor;	/* as maps shows them */
	unsigned long inode;
	bool ok;
	struct stat st;
};

struct keep_ctx {
	struct restore *R;
	struct buf files;	/* struct root_file */
	struct buf mine;	/* struct newborn_file */
};

static const struct root_file *root_file(struct keep_ctx *x, uint32_t k)
{
	const struct image *im = x->R->im;
	const struct vma_img *v = &im->vmas[k];
	struct root_file *f = (struct root_file *)x->files.p, add = { .k = k };
	size_t n = x->files.len / sizeof(*f);
	struct dbxcr_error ignored;
	char path[PATH_MAX];
	int fd;

	for (size_t i = 0; i < n; i++)
		if (same_name(im, &im->vmas[f[i].k], v))
			return &f[i];
	if (v->name_len < sizeof(path)) {
		memcpy(path, im->strtab + v->name_off, v->name_len);
		path[v->name_len] = '\0';
		fd = open_in_root(x->R->root, O_PATH | O_CLOEXEC, path, &add.st, x->R->pid,
				  &ignored);
		add.ok = fd >= 0;
		if (fd >= 0)
			close(fd);
	}
	if (buf_add(&x->files, &add, sizeof(add)) < 0)
		return NULL;
	return (const struct root_file *)x->files.p + n;
}

static const struct newborn_file *newborn_file(struct keep_ctx *x, const struct raw_vma *r)
{
	struct newborn_file *f = (struct newborn_file *)x->mine.p;
	struct newborn_file add = { r->major, r->minor, r->inode, false, { 0 } };
	size_t n = x->mine.len / sizeof(*f);
	char path[96];

	for (size_t i = 0; i < n; i++)
		if (f[i].inode == r->inode && f[i].major == r->major && f[i].minor == r->minor)
			return &f[i];
	snprintf(path, sizeof(path), "/proc/%d/map_files/%llx-%llx", (int)x->R->pid,
		 (unsigned long long)r->start, (unsigned long long)r->end);
	add.ok = stat(path, &add.st) == 0;
	if (buf_add(&x->mine, &add, sizeof(add)) < 0)
		return NULL;
	return (const struct newborn_file *)x->mine.p + n;
}

/* Whether the newborn's r maps the very file (device and inode) the restore would map for
 * v, unchanged since the dump: the mapping is then as the restore would make it. */
static bool maps_root_file(struct keep_ctx *x, const struct raw_vma *r, uint32_t k)
{
	const struct root_file *f = root_file(x, k);
	const struct newborn_file *mine;
	struct dbxcr_error ignored;

	if (!f || !f->ok || !(mine = newborn_file(x, r)) || !mine->ok)
		return false;
	return f->st.st_ino == mine->st.st_ino && f->st.st_dev == mine->st.st_dev &&
	       unchanged(&x->R->im->vmas[k], &f->st, "", x->R->pid, &ignored) == 0;
}

/* A range of pages the newborn has (present or swapped) in a mapping it may keep: only
 * these are looked at, so a renderer's terabytes of reserved address space (V8's cages,
 * PartitionAlloc's pools: PROT_NONE, never touched) cost nothing.  Sorted by address;
 * neighbouring ranges are merged, so the pages between two are ones it does not have. */
struct kept_vma {
	uint32_t k;		/* the image's VMA */
	uint64_t start, end;
	uint8_t *st;		/* per page: KEPT_* */
};

static int keep_cb(const struct raw_vma *r, void *arg)
{
	struct keep_ctx *x = arg;
	struct restore *R = x->R;
	const struct image *im = R->im;
	uint32_t prot = prot_of(r->perms);
	uint32_t flags = vmflags_of(r->vmflags) | ((uint32_t)r->pkey << VMA_PKEY_SHIFT);
	bool file = r->inode != 0;

	if (r->perms[3] != 'p' ||
	    (!file && r->name[0] && strcmp(r->name, "[heap]") && strcmp(r->name, "[stack]")))
		return 0;
	/* Each of the image's VMAs inside this one (the kernel merges neighbouring
	 * mappings, so either side may hold a few as one) */
	for (uint32_t k = vma_from(im, r->start); k < im->mm->nvma &&
	     im->vmas[k].end <= r->end; k++) {
		const struct vma_img *v = &im->vmas[k];

		if (prot != v->prot || flags != (v->flags & (VMA_VMFLAGS | VMA_PKEY)))
			continue;
		if (file ? private_file(v) &&
			   v->pgoff == r->pgoff + (v->start - r->start) / PAGE &&
			   maps_root_file(x, r, k)
			 : private_anon(v))
			R->kept[k] = true;
	}
	return 0;
}

/* Per page of kv (the newborn's own, as vma_segments found them: of a file mapping, the
 * pages copied on write): whether in src's frame. */
static int kept_pages(struct kept_vma *kv, int nfd, int sfd, pid_t pid, pid_t src,
		      struct dbxcr_error *err)
{
	size_t np = (kv->end - kv->start) / PAGE;
	uint64_t *n = malloc(np * 8), *s = malloc(np * 8);
	int rc = -1;

	kv->st = calloc(np, 1);
	if (!n || !s || !kv->st) {
		fail(err, ENOMEM, pid, "allocate %zu pages' entries", np);
		goto out;
	}
	if (full_pread(nfd, n, np * 8, (off_t)(kv->start / PAGE * 8)) < 0 ||
	    full_pread(sfd, s, np * 8, (off_t)(kv->start / PAGE * 8)) < 0) {
		fail(err, errno, pid, "read pagemap at %#llx (newborn %d, source %d)",
		     (unsigned long long)kv->start, (int)pid, (int)src);
		goto out;
	}
	for (size_t i = 0; i < np; i++) {
		kv->st[i] |= KEPT_THERE;
		if ((n[i] & PM_PRESENT) && (s[i] & PM_PRESENT) && (n[i] & PM_PFN) &&
		    (n[i] & PM_PFN) == (s[i] & PM_PFN))
			kv->st[i] |= KEPT_SAME;
	}
	rc = 0;
out:
	free(n);
	free(s);
	return rc;
}

/* Mark each kept page the image's runs hold; unkeep a mapping whose drops would cost more
 * than the writes it spares (KEEP_DROP_PAGES). */
static void kept_cover(struct restore *R, struct kept_vma *kv, size_t nk)
{
	const struct image *im = R->im;
	size_t j = 0;

	for (uint64_t r = 0; r < im->pm->nruns; r++) {
		uint64_t rs = im->runs[r].vaddr, re = rs + (uint64_t)im->runs[r].npages * PAGE;

		while (j < nk && kv[j].end <= rs)
			j++;
		for (size_t t = j; t < nk && kv[t].start < re; t++) {
			uint64_t a = rs > kv[t].start ? rs : kv[t].start;
			uint64_t b = re < kv[t].end ? re : kv[t].end;

			for (uint64_t p = a; p < b; p += PAGE)
				kv[t].st[(p - kv[t].start) / PAGE] |= KEPT_COVERED;
		}
	}
	for (size_t t = 0, ranges = 0, same = 0; t < nk; t++) {
		size_t np = (kv[t].end - kv[t].start) / PAGE;

		for (size_t i = 0; i < np; i++) {
			if ((kv[t].st[i] & (KEPT_THERE | KEPT_COVERED)) == KEPT_THERE &&
			    (i == 0 || (kv[t].st[i - 1] & (KEPT_THERE | KEPT_COVERED)) != KEPT_THERE))
				ranges++;
			same += (kv[t].st[i] & (KEPT_SAME | KEPT_COVERED)) ==
				(KEPT_SAME | KEPT_COVERED);
		}
		if (t + 1 < nk && kv[t + 1].k == kv[t].k)
			continue;	/* the mapping's next range */
		if (ranges * KEEP_DROP_PAGES > same)
			R->kept[kv[t].k] = false;
		ranges = same = 0;
	}
}

/* The image's runs without the pages kept mappings already hold (KEPT_SAME). */
static int kept_runs(struct restore *R, const struct kept_vma *kv, size_t nk,
		     struct dbxcr_error *err)
{
	struct image *im = R->im;
	struct run_img *out = NULL;
	size_t n = 0, cap = 0, j = 0;

	for (uint64_t r = 0; r < im->pm->nruns; r++) {
		const struct run_img *run = &im->runs[r];
		uint64_t end = run->vaddr + (uint64_t)run->npages * PAGE, from = run->vaddr;

		for (uint64_t p = run->vaddr; p < end; p += PAGE) {
			while (j < nk && kv[j].end <= p)
				j++;
			if (j == nk || kv[j].start > p || !R->kept[kv[j].k] ||
			    !(kv[j].st[(p - kv[j].start) / PAGE] & KEPT_SAME))
				continue;
			if (from < p && push_run(&out, &n, &cap, run_piece(run, from, p)) < 0)
				goto nomem;
			from = p + PAGE;
		}
		if (from < end && push_run(&out, &n, &cap, run_piece(run, from, end)) < 0)
			goto nomem;
	}
	replace_runs(im, out, n);
	return 0;
nomem:
	free(out);
	return fail(err, ENOMEM, R->pid, "allocate runs");
}

/* Drop the newborn's pages of kept mappings that the image does not have. */
static int kept_drops(struct restore *R, const struct kept_vma *kv, size_t nk,
		      struct dbxcr_error *err)
{
	long a[6] = { 0 };

	for (size_t t = 0; t < nk; t++) {
		size_t np = (kv[t].end - kv[t].start) / PAGE;

		if (!R->kept[kv[t].k])
			continue;
		for (size_t i = 0; i < np;) {
			size_t e = i;

			if ((kv[t].st[i] & (KEPT_THERE | KEPT_COVERED)) != KEPT_THERE) {
				i++;
				continue;
			}
			while (e < np && (kv[t].st[e] & (KEPT_THERE | KEPT_COVERED)) == KEPT_THERE)
				e++;
			a[0] = (long)(kv[t].start + i * PAGE);
			a[1] = (long)((e - i) * PAGE);
			a[2] = MADV_DONTNEED;
			if (BS(R, SYS_madvise, 0, err, "madvise(DONTNEED) %#llx",
			       (unsigned long long)kv[t].start + i * PAGE) < 0)
				return -1;
			i = e;
		}
	}
	return batch_run(R->b, err);
}

/* What the newborn keeps, before anything is changed: -1 if it could not be looked at (the
 * caller then keeps nothing: a slower restore, the same result). */
static ssize_t keep_plan(struct restore *R, pid_t src, struct kept_vma **out,
			 struct dbxcr_error *err)
{
	uint32_t nv = R->im->mm->nvma;
	struct kept_vma *kv = NULL;
	struct keep_ctx x = { .R = R };
	struct buf segs = { 0 }, kvs = { 0 };
	size_t nk = 0, made = 0;
	char path[64];
	int nfd = -1, sfd = -1;
	ssize_t rc = -1;

	if (walk_maps(R->pid, true, keep_cb, &x, err) < 0)
		goto out;
	for (uint32_t k = 0; k < nv; k++)
		nk += R->kept[k];
	if (!nk) {	/* nothing to look at further */
		rc = 0;
		goto out;
	}
	snprintf(path, sizeof(path), "/proc/%d/pagemap", (int)R->pid);
	nfd = open(path, O_RDONLY | O_CLOEXEC);
	snprintf(path, sizeof(path), "/proc/%d/pagemap", (int)src);
	sfd = open(path, O_RDONLY | O_CLOEXEC);
	if (nfd < 0 || sfd < 0) {
		fail(err, errno, R->pid, "open the pagemaps (source %d)", (int)src);
		goto out;
	}
	for (uint32_t k = 0; k < nv; k++) {
		struct vma v = { .start = R->im->vmas[k].start, .end = R->im->vmas[k].end,
				 .flags = R->im->vmas[k].flags & VMA_FILE };

		if (!R->kept[k])
			continue;
		if (vma_segments(R->pid, nfd, &v, &segs, err) < 0)
			goto out;
		for (size_t g = 0; g < segs.len / sizeof(struct seg); g++) {
			const struct seg *sg = (const struct seg *)segs.p + g;
			struct kept_vma add = { k, sg->s, sg->e, NULL };

			if (buf_add(&kvs, &add, sizeof(add)) < 0) {
				fail(err, ENOMEM, R->pid, "allocate kept ranges");
				goto out;
			}
			kv = (struct kept_vma *)kvs.p;
			if (kept_pages(&kv[made++], nfd, sfd, R->pid, src, err) < 0)
				goto out;
		}
	}
	kept_cover(R, kv, made);
	rc = (ssize_t)made;
out:
	buf_free(&segs);
	buf_free(&x.files);
	buf_free(&x.mine);
	if (rc < 0 && kv) {
		for (size_t t = 0; t < made; t++)
			free(kv[t].st);
		free(kv);
		kv = NULL;
	}
	*out = kv;
	if (nfd >= 0)
		close(nfd);
	if (sfd >= 0)
		close(sfd);
	return rc;
}

/* Pages of the image in private VMAs: what keeping could spare. */
static uint64_t keepable_pages(const struct image *im)
{
	uint64_t n = 0, run_i = 0;

	for (uint32_t k = 0; k < im->mm->nvma; k++) {
		const struct vma_img *v = &im->vmas[k];

		if (!private_anon(v) && !private_file(v))
			continue;
		while (run_i < im->pm->nruns &&
		       im->runs[run_i].vaddr + (uint64_t)im->runs[run_i].npages * PAGE <= v->start)
			run_i++;
		for (uint64_t r = run_i; r < im->pm->nruns && im->runs[r].vaddr < v->end; r++) {
			uint64_t a = im->runs[r].vaddr > v->start ? im->runs[r].vaddr : v->start;
			uint64_t e = im->runs[r].vaddr + (uint64_t)im->runs[r].npages * PAGE;

			n += ((e < v->end ? e : v->end) - a) / PAGE;
		}
	}
	return n;
}

static int r_keep_forked(struct restore *R, pid_t src, struct dbxcr_error *err)
{
	struct kept_vma *kv = NULL;
	struct dbxcr_error ignored;
	ssize_t nk;
	int rc = 0;

	/* Looking costs a walk of the newborn's page tables (smaps) and both pagemaps, about
	 * what writing KEEP_MIN_PAGES pages does: not worth it for a smaller image. */
	if (keepable_pages(R->im) < KEEP_MIN_PAGES)
		return 0;
	R->kept = calloc(R->im->mm->nvma + 1, sizeof(bool));
	if (!R->kept)
		return 0;	/* nothing kept */
	nk = keep_plan(R, src, &kv, &ignored);
	if (nk < 0) {
		free(R->kept);
		R->kept = NULL;
		return 0;
	}
	/* (none: the kept mappings have no pages of their own, a library's code) */
	if (nk > 0 && (kept_runs(R, kv, (size_t)nk, err) < 0 ||
		       kept_drops(R, kv, (size_t)nk, err) < 0))
		rc = -1;
	for (ssize_t t = 0; t < nk; t++)
		free(kv[t].st);
	free(kv);
	return rc;
}

static struct dbxcr_template *restore_template_in(pid_t host, struct dbxcr_held *parent,
						  const pid_t *set_tid, size_t set_tid_size,
						  int image_dirfd, int root_dirfd,
						  const struct dbxcr_template *src, pid_t inplace,
						  const struct dbxcr_spawn_opts *skip,
						  struct dbxcr_error *err)
{
	struct restore R;
	struct chain *c = NULL;
	struct dbxcr_template *tpl = NULL;
	struct dbxcr_error ignored;
	struct pinning pin = { 0 };
	long a[6] = { 0 };
	void *cur_x = NULL;
	size_t cur_xlen = 0;
	pid_t child = -1;

	clear_error(err);
	memset(&R, 0, sizeof(R));
	R.live_fd = -1;
	c = calloc(1, sizeof(*c));
	if (!c) {
		fail(err, ENOMEM, host, "allocate");
		return NULL;
	}
	if (chain_load(image_dirfd, c, host, err) < 0)
		goto out_nochild;
	if (skip && skip_remapped(&c->im[0], skip->remaps, skip->nremaps, host, err) < 0)
		goto out_nochild;
	R.c = c;
	R.im = &c->im[0];
	R.root = root_dirfd;
	if (open_live(&R, image_dirfd, src, host, err) < 0)
		goto out_nochild;
	R.extra_write = calloc(R.im->mm->nvma + 1, sizeof(bool));
	if (!R.extra_write) {
		fail(err, ENOMEM, host, "allocate");
		goto out_nochild;
	}
	if (inplace > 0)
		child = inplace;
	else if (parent)
		child = held_fork(parent, set_tid, set_tid_size, 0, err);
	else
		child = fork_from_host(host, err);
	if (child < 0)
		goto out_nochild;
	R.pid = child;
	/* Some forty calls are injected one by one or in batches: each a plain context switch
	 * with the child on our CPU, an IPI and a VM exit across CPUs (colocate). */
	pin_beside(&pin, child);
	/* The caller exec'ed it: every action is the exec's, SIG_DFL or SIG_IGN. */
	R.after_exec = inplace > 0;
	if (R.after_exec && sig_ignored(child, &R.ignored, err) < 0)
		goto kill;
	if (adopt(&R.t, child, 0, err) < 0 || find_syscall_site(&R.t, err) < 0)
		goto kill;
	if (save_xstate(child, &cur_x, &cur_xlen, err) < 0)
		goto kill;
	if (cur_xlen != R.im->core->xstate_len) {
		fail(err, ENOTSUP, child, "xstate size %zu differs from the dump's %u (another CPU?)",
		     cur_xlen, R.im->core->xstate_len);
		goto kill;
	}
	{
		uint64_t h[2], sz;

		if (vdso_hash(child, h, &sz, err) < 0)
			goto kill;
		if (sz != R.im->core->vdso_size || h[0] != R.im->core->vdso_hash[0] ||
		    h[1] != R.im->core->vdso_hash[1]) {
			fail(err, ENOTSUP, child, "this kernel's vdso (%llu bytes) differs from the "
			     "dumped one (%llu bytes): the image needs the same kernel",
			     (unsigned long long)sz, (unsigned long long)R.im->core->vdso_size);
			goto kill;
		}
	}
	/* 2. descriptors, rseq, code page, scratch, old mappings */
	a[0] = 0;
	a[1] = ~0U;
	a[2] = 0;
	if (RS(&R.t, SYS_close_range, err, "close_range") < 0)
		goto kill;
	{
		struct rseq_conf rc2;

		if (ptrace(PTRACE_GET_RSEQ_CONFIGURATION, child, (void *)sizeof(rc2), &rc2) > 0 &&
		    rc2.rseq_abi_pointer) {
			a[0] = (long)rc2.rseq_abi_pointer;
			a[1] = rc2.rseq_abi_size;
			a[2] = 1;	/* RSEQ_FLAG_UNREGISTER */
			a[3] = rc2.signature;
			if (RS(&R.t, SYS_rseq, err, "rseq unregister") < 0)
				goto kill;
		}
	}
	{
		struct cur_maps m = { 0 };
		struct range *all;
		size_t na = 0;
		long got;
		/* A syscall site, and from BATCH_AT the batch loop (batch.c). */
		unsigned char code[BATCH_AT + BATCH_LOOP_LEN] = { 0x0f, 0x05 };

		memset(code + 2, 0xcc, BATCH_AT - 2);
		memcpy(code + BATCH_AT, batch_loop, BATCH_LOOP_LEN);

		if (walk_maps(child, false, cur_cb, &m, err) < 0)
			goto kill;
		all = calloc(m.n + R.im->mm->nvma + 2, sizeof(*all));
		if (!all) {
			cur_free(&m);
			fail(err, ENOMEM, child, "allocate");
			goto kill;
		}
		for (size_t i = 0; i < m.n; i++)
			all[na++] = m.r[i];
		for (uint32_t j = 0; j < R.im->mm->nvma; j++) {
			all[na].s = R.im->vmas[j].start;
			all[na++].e = R.im->vmas[j].end;
		}
		cur_free(&m);
		R.code = find_gap(all, na, PAGE + SCRATCH_LEN + (4 << 20));
		free(all);
		if (!R.code) {
			fail(err, ENOMEM, child, "no free address range for the restorer");
			goto kill;
		}
		R.scratch = R.code + (2 << 20);
		a[0] = (long)R.code;
		a[1] = PAGE;
		a[2] = PROT_READ | PROT_WRITE;
		a[3] = MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE;
		a[4] = -1;
		a[5] = 0;
		got = RS(&R.t, SYS_mmap, err, "mmap restorer code page");
		if (got < 0)
			goto kill;
		a[0] = (long)R.scratch;
		a[1] = SCRATCH_LEN;
		got = RS(&R.t, SYS_mmap, err, "mmap template scratch");
		if (got < 0)
			goto kill;
		if (mem_write(child, R.code, code, sizeof(code), err) < 0)
			goto kill;
		R.b = malloc(sizeof(*R.b));
		if (!R.b) {
			fail(err, ENOMEM, child, "allocate");
			goto kill;
		}
		batch_init(R.b, &R.t, R.code + BATCH_AT, R.scratch + BATCH_TABLE_OFF);
		a[0] = (long)R.code;
		a[1] = PAGE;
		a[2] = PROT_READ | PROT_EXEC;
		if (RS(&R.t, SYS_mprotect, err, "mprotect restorer code page") < 0)
			goto kill;
		R.t.site = R.code;
	}
	if (parent && src && r_keep_forked(&R, src->pid, err) < 0)
		goto kill;
	if (r_unmap_old(&R, err) < 0 || r_set_mm(&R, err) < 0 || r_move_vdso(&R, err) < 0 ||
	    r_map_vmas(&R, err) < 0)
		goto kill;
	/* The page writers are threads of ours: they would inherit the pin and share a CPU. */
	if (unpin_beside(&pin, err) < 0 || r_write_pages(&R, err) < 0)
		goto kill;
	pin_beside(&pin, child);
	if (r_finish_mm(&R, err) < 0 || r_pkeys(&R, err) < 0)
		goto kill;
	if (r_signals_and_ids(&R, err) < 0)
		goto kill;
	/* 7. syscall site back in the (moved) vdso, code page gone, park. */
	{
		struct tracee probe = R.t;

		if (find_syscall_site(&probe, err) < 0)
			goto kill;
		a[0] = (long)R.code;
		a[1] = PAGE;
		if (RS(&R.t, SYS_munmap, err, "munmap restorer code page") < 0)
			goto kill;
		R.t.site = probe.site;
		(void)R.t;
	}
	tpl = calloc(1, sizeof(*tpl));
	if (!tpl) {
		fail(err, ENOMEM, child, "allocate template");
		goto kill;
	}
	tpl->xstate = malloc(cur_xlen);
	if (!tpl->xstate) {
		free(tpl);
		tpl = NULL;
		fail(err, ENOMEM, child, "allocate template");
		goto kill;
	}
	memcpy(tpl->xstate, R.im->xstate, cur_xlen);
	tpl->xstate_len = cur_xlen;
	if (R.im->core->ndontfork) {
		tpl->dontfork = calloc(R.im->core->ndontfork, sizeof(*tpl->dontfork));
		if (!tpl->dontfork) {
			free(tpl->xstate);
			free(tpl);
			tpl = NULL;
			fail(err, ENOMEM, child, "allocate template");
			goto kill;
		}
		for (uint32_t i = 0; i < R.im->core->ndontfork; i++) {
			struct dontfork_img d;

			memcpy(&d, R.im->dontfork + i * sizeof(d), sizeof(d));
			tpl->dontfork[i].start = (unsigned long)d.start;
			tpl->dontfork[i].end = (unsigned long)d.end;
		}
		tpl->ndontfork = (int)R.im->core->ndontfork;
	}
	tpl->pid = child;
	tpl->origin = R.im->core->origin_pid;
	tpl->tracer_tid = current_tid();
	tpl->regs = R.im->core->regs;
	restart_without_block(&tpl->regs);	/* a new task: no restart_block (threads.c) */
	if (src) {	/* not in the image: the template it was made from has them */
		memcpy(tpl->itimers, src->itimers, sizeof(tpl->itimers));
		tpl->nptimers = src->nptimers;
		tpl->ptimers_ok = src->ptimers_ok;
		memcpy(tpl->ptimers, src->ptimers, sizeof(tpl->ptimers));
		tpl->group_stop = src->group_stop;
		tpl->creds = src->creds;
		tpl->pdeathsig = src->pdeathsig;
		tpl->subreaper = src->subreaper;
	}
	if (R.im->core->has_rseq) {	/* for births from carriers (threads.c: main_restore) */
		tpl->main.rseq_ptr = R.im->core->rseq_ptr;
		tpl->main.rseq_len = R.im->core->rseq_len;
		tpl->main.rseq_sig = R.im->core->rseq_sig;
	}
	if (R.im->robust) {	/* every child registers it again (main_restore) */
		struct robust_img r;

		memcpy(&r, R.im->robust, sizeof(r));
		tpl->main.robust_head = (unsigned long)r.head;
		tpl->main.robust_len = (size_t)r.len;
	}
	if (R.im->threads &&
	    !(tpl->threads = threads_from_image(R.im->threads, &tpl->main.clear_tid))) {
		free(tpl->dontfork);
		free(tpl->xstate);
		free(tpl);
		tpl = NULL;
		fail(err, ENOMEM, child, "allocate the state of the image's threads");
		goto kill;
	}
	tpl->sigmask = R.im->core->sigmask;
	tpl->site = R.t.site;
	tpl->scratch = R.scratch;
	memcpy(tpl->comm, R.im->core->comm, sizeof(tpl->comm));
	tpl->comm[sizeof(tpl->comm) - 1] = '\0';
	tpl->named = true;
	tpl->args_hidden = true;	/* by r_set_mm; children get the image's bounds back */
	memcpy(tpl->mm, R.im->core->mm, sizeof(tpl->mm));
	tpl->pend.n = (int)R.im->core->npending;
	for (int i = 0; i < tpl->pend.n; i++) {
		memcpy(&tpl->pend.info[i], (const char *)R.im->pending + i * sizeof(siginfo_t),
		       sizeof(siginfo_t));
		tpl->pend.shared[i] = R.im->core->pend_shared[i];
	}
	park_regs(tpl, &R.t.regs);
	if (park(tpl, err) < 0) {
		threads_free(tpl->threads);
		free(tpl->xstate);
		free(tpl);
		tpl = NULL;
		goto kill;
	}
	if (unpin_beside(&pin, err) < 0) {	/* its own mask before it ever runs */
		dbxcr_release_template(tpl, &ignored);
		tpl = NULL;
	}
	goto out;
kill:
	kill_traced(child);
	unpin_beside(&pin, &ignored);
out:
	free(cur_x);
out_nochild:
	if (!tpl && inplace > 0 && child < 0)
		kill_traced(inplace);	/* the caller gave it up to us */
	if (R.live_fd >= 0)
		close(R.live_fd);
	free(R.extra_write);
	free(R.kept);
	free(R.b);
	chain_free(c);
	free(c);
	return tpl;
}

/* ---------- memory a template holds (dbxcr_exclusive_bytes) ---------- */

#define PM_PFN_MASK ((1ULL << 55) - 1)	/* pagemap bits 0-54 (with CAP_SYS_ADMIN) */
#define PM_BATCH 512

struct excl_ctx {
	pid_t pid;
	int pagemap, kpagecount, max_maps;
	uint64_t pages;
	struct dbxcr_error *err;
};

static int excl_cb(const struct raw_vma *r, void *ctx)
{
	struct excl_ctx *x = ctx;
	uint64_t ent[PM_BATCH];

	if (strstr(r->name, "[vsyscall]"))
		return 0;
	for (uint64_t a = r->start; a < r->end;) {
		size_t n = (size_t)((r->end - a) / PAGE);
		ssize_t got;

		if (n > PM_BATCH)
			n = PM_BATCH;
		got = pread(x->pagemap, ent, n * sizeof(ent[0]), (off_t)(a / PAGE * sizeof(ent[0])));
		if (got < 0)
			return fail(x->err, errno, x->pid, "read /proc/%d/pagemap at %#llx",
				    (int)x->pid, (unsigned long long)a);
		if (got == 0)
			break;
		n = (size_t)got / sizeof(ent[0]);
		for (size_t i = 0; i < n; i++) {
			uint64_t pfn = ent[i] & PM_PFN_MASK, count = 0;

			if (!(ent[i] & PM_PRESENT) || (ent[i] & PM_SWAP) || pfn == 0)
				continue;
			if (pread(x->kpagecount, &count, sizeof(count), (off_t)(pfn * 8)) !=
			    (ssize_t)sizeof(count))
				return fail(x->err, errno ? errno : EIO, x->pid, "read /proc/kpagecount");
			if (count >= 1 && count <= (uint64_t)x->max_maps)
				x->pages++;
		}
		a += n * PAGE;
	}
	return 0;
}

int dbxcr_exclusive_bytes(pid_t pid, int max_maps, uint64_t *out, struct dbxcr_error *err)
{
	struct excl_ctx x = { pid, -1, -1, max_maps, 0, err };
	char path[64];
	int rc = -1;

	clear_error(err);
	*out = 0;
	snprintf(path, sizeof(path), "/proc/%d/pagemap", (int)pid);
	x.pagemap = open(path, O_RDONLY | O_CLOEXEC);
	if (x.pagemap < 0)
		return fail(err, errno, pid, "open %s", path);
	x.kpagecount = open("/proc/kpagecount", O_RDONLY | O_CLOEXEC);
	if (x.kpagecount < 0) {
		fail(err, errno, pid, "open /proc/kpagecount");
		goto out;
	}
	if (walk_maps(pid, false, excl_cb, &x, err) < 0)
		goto out;
	*out = x.pages * PAGE;
	rc = 0;
out:
	if (x.kpagecount >= 0)
		close(x.kpagecount);
	close(x.pagemap);
	return rc;
}
