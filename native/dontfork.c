/* Mappings fork() does not copy.  A template is a fork of the process, and fork() leaves
 * out every mapping marked MADV_DONTFORK (VM_DONTCOPY): V8 (node) marks its whole heap and
 * code space so, and a child spawned from such a template would fault on its first touch of
 * them (found with a node HTTP server: restored, it died of SIGSEGV at its next timer).
 *
 * A fresh template's mappings are the process's minus those, so comparing the two
 * /proc/PID/maps finds them (a few tens of microseconds; nothing else tells, short of
 * smaps, which walks every page table).  When there are any, the template is made again:
 * MADV_DOFORK on them in the process, the fork, MADV_DONTFORK back.  The template then holds
 * every mapping, and each child it spawns gets MADV_DONTFORK on the same ranges again, so
 * its own forks leave them out as the original's did.
 *
 * The marked mappings are handled as runs: consecutive entries of the process's mapping
 * list that are all marked (V8 reserves its cage as one marked mapping and carves pages out
 * of it, all marked).  madvise over a run that spans unmapped holes applies to every mapping
 * in it and reports ENOMEM for the holes, which is expected here.
 *
 * Not detected: MADV_WIPEONFORK mappings (a template gets them zero-filled, as any fork
 * child does; programs use it for state a fork must not share, such as an RNG's). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>

#include "dbxcr_internal.h"

struct vma_list {
	unsigned long *start, *end;
	int n, cap;
};

static void vmas_free(struct vma_list *v)
{
	free(v->start);
	free(v->end);
	memset(v, 0, sizeof(*v));
}

static int read_vmas(pid_t pid, struct vma_list *v, struct dbxcr_error *err)
{
	char path[64], line[512];
	FILE *f;

	memset(v, 0, sizeof(*v));
	snprintf(path, sizeof(path), "/proc/%d/maps", (int)pid);
	f = fopen(path, "re");
	if (!f)
		return fail(err, errno, pid, "open %s", path);
	while (fgets(line, sizeof(line), f)) {
		unsigned long s, e;
		size_t len = strlen(line);

		/* A long path name: the rest of the line is not another entry. */
		while (len && line[len - 1] != '\n' && fgets(line, sizeof(line), f))
			len = strlen(line);
		if (sscanf(line, "%lx-%lx", &s, &e) != 2)
			continue;
		if (v->n == v->cap) {
			int cap = v->cap ? v->cap * 2 : 256;
			unsigned long *ns = realloc(v->start, (size_t)cap * sizeof(*ns));
			unsigned long *ne = ns ? realloc(v->end, (size_t)cap * sizeof(*ne)) : NULL;

			if (ns)
				v->start = ns;
			if (!ne) {
				fclose(f);
				vmas_free(v);
				return fail(err, ENOMEM, pid, "reading %s", path);
			}
			v->end = ne;
			v->cap = cap;
		}
		v->start[v->n] = s;
		v->end[v->n++] = e;
	}
	fclose(f);
	return 0;
}

/* Whether [s, e) is a mapping of `tpl` (both lists are sorted). */
static bool has_vma(const struct vma_list *tpl, int *at, unsigned long s, unsigned long e)
{
	while (*at < tpl->n && tpl->start[*at] < s)
		(*at)++;
	return *at < tpl->n && tpl->start[*at] == s && tpl->end[*at] == e;
}

static int add_run(struct vma_run **runs, int *n, unsigned long s, unsigned long e)
{
	struct vma_run *r = realloc(*runs, (size_t)(*n + 1) * sizeof(**runs));

	if (!r)
		return -1;
	r[*n].start = s;
	r[*n].end = e;
	*runs = r;
	(*n)++;
	return 0;
}

int dontfork_runs(pid_t orig, pid_t tpl, struct vma_run **runs, int *n, struct dbxcr_error *err)
{
	struct vma_list o, t;
	int at = 0, rc = 0;
	bool open_run = false;
	unsigned long run_start = 0, run_end = 0;

	*runs = NULL;
	*n = 0;
	if (read_vmas(orig, &o, err) < 0)
		return -1;
	if (read_vmas(tpl, &t, err) < 0) {
		vmas_free(&o);
		return -1;
	}
	for (int i = 0; i < o.n && rc == 0; i++) {
		if (!has_vma(&t, &at, o.start[i], o.end[i])) {
			if (!open_run)
				run_start = o.start[i];
			open_run = true;
			run_end = o.end[i];
			continue;
		}
		if (open_run && add_run(runs, n, run_start, run_end) < 0)
			rc = fail(err, ENOMEM, orig, "listing mappings a fork leaves out");
		open_run = false;
	}
	if (rc == 0 && open_run && add_run(runs, n, run_start, run_end) < 0)
		rc = fail(err, ENOMEM, orig, "listing mappings a fork leaves out");
	vmas_free(&o);
	vmas_free(&t);
	if (rc < 0) {
		free(*runs);
		*runs = NULL;
		*n = 0;
	}
	return rc;
}

int madvise_runs(struct tracee *t, const struct vma_run *runs, int n, int advice,
		 struct dbxcr_error *err)
{
	for (int i = 0; i < n; i++) {
		long a[6] = { (long)runs[i].start, (long)(runs[i].end - runs[i].start), advice,
			      0, 0, 0 }, ret;

		if (remote_syscall(t, SYS_madvise, a, &ret, err) < 0)
			return -1;
		if (ret < 0 && ret != -ENOMEM)	/* ENOMEM: holes inside the run */
			return fail(err, (int)-ret, t->pid, "madvise(%#lx-%#lx, %s)", runs[i].start,
				    runs[i].end, advice == MADV_DOFORK ? "MADV_DOFORK" : "MADV_DONTFORK");
	}
	return 0;
}
