/* DeltaCR images: dump a process template to disk (optionally as a delta against the
 * parent checkpoint's image) and rebuild a template from such an image.  x86_64 only.
 * The on-disk format is described in native/IMAGE_FORMAT.md.
 *
 * Threading: like every call taking a template (fork_template.h), dbxcr_dump and
 * dbxcr_dump_begin must run on the thread that created the template (dbxcr_dump_finish may
 * run anywhere), and dbxcr_restore_template returns a template owned
 * by the calling thread.  dbxcr_verify_image touches no process and may run anywhere.
 *
 * Errors: -1 / NULL with struct dbxcr_error filled ("pid N: step: reason").  A damaged,
 * truncated or mismatched image (bad checksum, wrong image id, missing parent, page hash
 * mismatch) is reported with code EBADMSG and a message naming the file; no other failure
 * uses EBADMSG. */
#ifndef DBX_CRIU_INCR_H
#define DBX_CRIU_INCR_H

#include <stdint.h>
#include "fork_template.h"

struct dbxcr_dump_opts {
	/* Parent image to write a delta against, opened as given (relative to the caller's
	 * cwd), or NULL for a full dump. */
	const char *parent_path;
	/* How the new image names its parent, resolved relative to the new image directory
	 * at restore (e.g. "../ckpt-3/proc-12"); NULL: parent_path is stored as is. */
	const char *parent_ref;
	/* Longest allowed chain: when the parent's depth + 1 reaches this, a full dump is
	 * written instead (depth 0, no parent).  <= 0: default 8. */
	int max_chain;
	int fsync;		/* fsync files and directories before/after the rename */
	/* Strip this prefix from mapped file paths (the sandbox root as the dumping process
	 * sees it), so that paths are relative to the root given at restore; or NULL. */
	const char *strip_prefix;
	/* Dump a process that has a seccomp filter.  The filter is not in the image: the
	 * restored process has the filter of the host it is forked from, so set this only when
	 * that host carries the same filter (deltaboxd: sandbox processes and their init are
	 * confined alike, and the daemon compares filter counts).  0: refuse (ENOTSUP). */
	int seccomp_ok;
	/* Index the pages without copying them (runs marked as staying in the template; no
	 * parent, pages.img empty): a quick image for dbxcr_held_adopt with this template as
	 * its src, useless once the template is released. */
	int live;
	/* When the checkpoint saw the files (CLOCK_REALTIME ns; 0: unknown).  A private
	 * mapping's file is checked at restore to be the size and mtime it was at the dump,
	 * but one written in place since this time (its ctime later) no longer tells what the
	 * checkpoint's was, which the tree given at restore has: it gets no check. */
	long long files_as_of_ns;
};

struct dbxcr_dump_stats {
	uint64_t pages_total;	/* candidate pages examined (present, private) */
	uint64_t pages_written;	/* page contents written to this image's pages.img */
	uint64_t pages_parent;	/* pages referenced in an ancestor image (unchanged) */
	uint64_t pages_zero;	/* all-zero pages (no data stored) */
	uint64_t bytes_written;	/* all files of this image */
	uint64_t vmas;
	int depth;		/* 0: full dump */
	double ms;		/* wall time of the whole dump */
};

/* Write the template's checkpoint state into a new directory `path` (must not exist; it
 * is created atomically by renaming a temporary sibling).  The template stays usable. */
int dbxcr_dump(struct dbxcr_template *tpl, const char *path, const struct dbxcr_dump_opts *opts,
	       struct dbxcr_dump_stats *stats, struct dbxcr_error *err);

/* The same in two steps, so the long part can leave the template's owner thread.
 * dbxcr_dump_begin (owner thread; the template must be parked and must not run) reads the
 * process state that needs the tracer, creates the temporary image directory and opens the
 * template's memory.  dbxcr_dump_finish (any thread, any time while the template is not
 * released; spawning from it meanwhile is fine) copies and hashes the pages, writes the
 * image and renames it into place; it frees the job, as dbxcr_dump_abort does without
 * writing anything.  A template released before the finish makes it fail (ESRCH), never read another process. */
struct dbxcr_dump_job;
int dbxcr_dump_begin(struct dbxcr_template *tpl, const char *path,
		     const struct dbxcr_dump_opts *opts, struct dbxcr_dump_job **job,
		     struct dbxcr_error *err);
int dbxcr_dump_finish(struct dbxcr_dump_job *job, struct dbxcr_dump_stats *stats,
		      struct dbxcr_error *err);
void dbxcr_dump_abort(struct dbxcr_dump_job *job);

/* Check every checksum of the image at image_dirfd and of the ancestors it depends on,
 * including every page hash.  0 if intact; -1 with EBADMSG if damaged. */
int dbxcr_verify_image(int image_dirfd, struct dbxcr_error *err);

/* Rebuild a stopped template from the image at image_dirfd.  The new process is forked
 * from `host` (injected clone: it becomes a child of host, in host's namespaces, cgroup and
 * credentials) and then gets the dumped address space, mm fields, signal handlers and
 * credentials.  Mapped files are opened in root_dirfd (RESOLVE_IN_ROOT).  The returned
 * template works with dbxcr_spawn / dbxcr_release_template; its children are born as
 * children of host (CLONE_PARENT).  It holds no descriptors. */
struct dbxcr_template *dbxcr_restore_template(pid_t host, int image_dirfd, int root_dirfd,
					      struct dbxcr_error *err);
/* The same from a live image (its pages left in `src`, the template it was made from,
 * which also gives the new one what the image does not hold: timers, job-control stop,
 * credentials to give back).  Root's copy of an unprivileged process's template. */
struct dbxcr_template *dbxcr_restore_template_from(pid_t host, int image_dirfd,
						   int root_dirfd,
						   const struct dbxcr_template *src,
						   struct dbxcr_error *err);

/* Restore the image into a new child of the held process `parent` (fork_template.h: a
 * restored parent, stopped) with the pid opts->set_tid, re-rooted as dbxcr_spawn would
 * re-root a child of the image's template (opts), and held in turn: its own children can
 * be adopted the same way; dbxcr_held_release lets it run.  The restored parent can wait
 * for it, as the original parent could for the original child.
 * src (or NULL): the template the image was made from, or one restored from it; its
 * memory holds the image's pages, so they are copied from there (no pages.img read, no
 * hash to check): required for a live image (dbxcr_dump_opts.live).  Any thread: src is
 * only read through /proc/PID/mem. */
pid_t dbxcr_held_adopt(struct dbxcr_held *parent, int image_dirfd, int root_dirfd,
		       const struct dbxcr_template *src, const struct dbxcr_spawn_opts *opts,
		       struct dbxcr_held **out, struct dbxcr_error *err);

/* A held child and its held ancestors when the child's memory is the biggest: the copies
 * dbxcr_held_adopt would make of the child's pages (and of the ancestors' but the root's)
 * are made of the ancestors' instead.  The root's process (anc_opts[0]: pid, namespaces,
 * cgroup, process group) is spawned from child_tpl sharing its address space (CLONE_VM),
 * each next ancestor (anc_opts[1..]) is cloned likewise by the previous one, and the last
 * forks the child (child_opts, pid set_tid): child_tpl's copy-on-write copy, re-rooted
 * like a spawn of it.  Then each ancestor execs the static program exe_fd (it never runs:
 * stopped at its entry, it only gets an address space of its own), gets its own image in
 * place (image_dirfds[i], pages from srcs[i] as for dbxcr_held_adopt) and is re-rooted with
 * anc_opts[i].  Same limits as an adoption for the ancestors (what an image holds), none
 * for the child; all single-threaded.  out[0..n-1]: the ancestors held, out[n] the child.
 * Returns the root's pid.  On the thread that owns child_tpl; on failure nothing is left. */
#define DBXCR_CHAIN_MAX 8
int dbxcr_held_chain(struct dbxcr_template *child_tpl, size_t n,
		     const struct dbxcr_spawn_opts *anc_opts, const int *image_dirfds,
		     const struct dbxcr_template *const *srcs, int root_dirfd, int exe_fd,
		     const struct dbxcr_spawn_opts *child_opts, struct dbxcr_held **out,
		     struct dbxcr_error *err);

struct dbxcr_image_info {
	int depth;		/* 0: full image */
	int origin_pid;		/* the process the template was made from */
	char parent_ref[4096];	/* parent image, relative to this image's directory, or "" */
	int max_tid;		/* the highest tid of its other threads in their innermost pid
				 * namespace (0: one thread): what a restore must leave free */
};

/* Read core.img only (checksum checked, pages not): what the image depends on. */
int dbxcr_image_info(int image_dirfd, struct dbxcr_image_info *out, struct dbxcr_error *err);

/* Bytes of pid's resident pages mapped by at most max_maps page tables (/proc/kpagecount):
 * what a template costs when max_maps - 1 carriers (which never write) share its pages;
 * with max_maps 1, its private memory. */
int dbxcr_exclusive_bytes(pid_t pid, int max_maps, uint64_t *out, struct dbxcr_error *err);

/* The 128-bit content hash used for pages and files (exposed for tests). */
void dbxcr_hash128(const void *data, size_t len, uint64_t out[2]);

#endif
