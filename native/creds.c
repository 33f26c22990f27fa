/* Credentials: a process that runs as another user, or without capabilities (a database's
 * server as its own user, a worker that dropped root), comes back as it ran.
 *
 * A child is spawned from its template, or born of a carrier or a held parent, by calls
 * injected into a process of ours: clone3 with set_tid (CAP_SYS_ADMIN over the target pid
 * namespace), setns into the sandbox's mount namespace (CAP_SYS_ADMIN), reopening files
 * whatever their mode, binding ports below 1024, taking a terminal, prctl(PR_SET_MM).
 * An unprivileged process could do none of that, so such a process is restored from a
 * template of root's (one rebuilt from its image, or its restored parent's fork given its
 * image: deltabox/cr/creds.py) with the credentials it had set on the template
 * (dbxcr_template_set_creds), and finish_child gives them back last, in each of its
 * threads (every credential call is the calling thread's own in the kernel; glibc's
 * setuid() signals every thread to do the same), before any of them runs:
 *
 *   1. the bounding set, the capabilities the process had dropped (PR_CAPBSET_DROP needs
 *      CAP_SETPCAP, which root has here);
 *   2. its supplementary groups (setgroups);
 *   3. PR_SET_KEEPCAPS for the switch, so that the permitted set survives it (the kernel
 *      clears it when every uid leaves 0), then setresgid and setresuid, then setfsgid
 *      and setfsuid (the filesystem ids follow the effective ones unless set apart);
 *   4. capset: the effective, permitted and inheritable sets (each only shrinks from
 *      root's full ones), then the ambient set raised capability by capability;
 *   5. the keep-capabilities flag and whether the process may be dumped as they were
 *      before: a change of uid makes the kernel set the dumpable flag to
 *      fs.suid_dumpable, not to what the process had.
 *
 * Every id is the process's own user namespace's (the daemon maps what it reads in
 * /proc). Each step is checked; the thread's capability sets are then read back from
 * /proc and compared, so a restore never lets a process run with other rights than it
 * had. Not given back: the parent-death signal (a change of credentials clears it, and
 * no restore keeps it), the securebits' locks (set on the template by prctls.c before). */
#include <errno.h>
#include <inttypes.h>
#include <linux/capability.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>

#include "dbxcr_internal.h"
#include "fork_template.h"

/* The highest capability number a bounding set may hold: CAP_LAST_CAP of any kernel
 * this runs on is far below it (PR_CAPBSET_DROP of one it does not know is EINVAL). */
#define CAP_NUMBERS 64

int dbxcr_template_set_creds(struct dbxcr_template *tpl, const struct dbxcr_creds *c,
			     struct dbxcr_error *err)
{
	clear_error(err);
	if (c->ngroups < 0 || c->ngroups > DBXCR_MAX_GROUPS)
		return fail(err, EINVAL, tpl->origin, "%d supplementary groups (at most %d are "
			    "given back)", c->ngroups, DBXCR_MAX_GROUPS);
	tpl->creds = *c;
	tpl->creds.set = 1;
	return 0;
}

/* The thread's /proc/TID/status into buf. */
static int read_status(pid_t tid, char *buf, size_t len, struct dbxcr_error *err)
{
	char path[64];

	snprintf(path, sizeof(path), "/proc/%d/status", (int)tid);
	if (read_small_file(path, buf, len) < 0)
		return fail(err, errno, tid, "reading %s for its capabilities", path);
	return 0;
}

/* A capability set's line of a status text ("CapBnd:\t000001ffffffffff"). */
static int capset_of(pid_t tid, const char *status, const char *name, uint64_t *out,
		     struct dbxcr_error *err)
{
	const char *v = status_field(status, name);

	if (!v)
		return fail(err, EPROTO, tid, "/proc/%d/status has no %s line", (int)tid, name);
	*out = strtoull(v, NULL, 16);
	return 0;
}

/* One capability set of the thread, as /proc shows it now. */
static int read_capset(pid_t tid, const char *name, uint64_t *out, struct dbxcr_error *err)
{
	char buf[4096];

	if (read_status(tid, buf, sizeof(buf), err) < 0)
		return -1;
	return capset_of(tid, buf, name, out, err);
}

static int drop_bounding(struct tracee *t, uint64_t want, struct dbxcr_error *err)
{
	uint64_t have;
	long a[6] = { PR_CAPBSET_DROP, 0, 0, 0, 0, 0 };

	if (read_capset(t->pid, "CapBnd", &have, err) < 0)
		return -1;
	if (want & ~have)
		return fail(err, EPERM, t->pid, "the bounding set it had (%016" PRIx64 ") holds "
			    "capabilities root's here does not (%016" PRIx64 ")", want, have);
	for (int cap = 0; cap < CAP_NUMBERS; cap++) {
		if (!(have >> cap & 1) || want >> cap & 1)
			continue;
		a[1] = cap;
		if (rsys(t, SYS_prctl, a, err, "PR_CAPBSET_DROP of capability %d", cap) < 0)
			return -1;
	}
	return 0;
}

static int capset_at(struct tracee *t, unsigned long scratch, uint64_t eff, uint64_t prm,
		     uint64_t inh, struct dbxcr_error *err)
{
	struct __user_cap_header_struct hdr = { _LINUX_CAPABILITY_VERSION_3, 0 };
	struct __user_cap_data_struct data[2] = {
		{ (uint32_t)eff, (uint32_t)prm, (uint32_t)inh },
		{ (uint32_t)(eff >> 32), (uint32_t)(prm >> 32), (uint32_t)(inh >> 32) },
	};
	long a[6] = { (long)scratch, (long)(scratch + sizeof(hdr)), 0, 0, 0, 0 };

	if (mem_write(t->pid, scratch, &hdr, sizeof(hdr), err) < 0 ||
	    mem_write(t->pid, scratch + sizeof(hdr), data, sizeof(data), err) < 0)
		return -1;
	return rsys(t, SYS_capset, a, err, "capset (effective %016" PRIx64 ", permitted %016"
		    PRIx64 ")", eff, prm) < 0 ? -1 : 0;
}

/* Filesystem ids apart from the effective ones: setfs[ug]id to an id that is none of
 * the thread's others needs CAP_SETUID / CAP_SETGID in its effective set, which the
 * switch to non-zero uids cleared; the permitted set was kept (PR_SET_KEEPCAPS), so the
 * effective set is raised to it for the two calls (set_caps then gives the final sets).
 * setfs[ug]id never fail: an invalid id (-1) reads the current one back. */
static int set_fs_ids(struct tracee *t, unsigned long scratch, const struct dbxcr_creds *c,
		      struct dbxcr_error *err)
{
	long a[6] = { 0 };
	uint64_t prm;

	if (read_capset(t->pid, "CapPrm", &prm, err) < 0 ||
	    capset_at(t, scratch, prm, prm, 0, err) < 0)
		return -1;
	a[0] = c->gid[3];
	if (rsys(t, SYS_setfsgid, a, err, "setfsgid(%u)", c->gid[3]) < 0)
		return -1;
	a[0] = c->uid[3];
	if (rsys(t, SYS_setfsuid, a, err, "setfsuid(%u)", c->uid[3]) < 0)
		return -1;
	a[0] = -1;
	if (rsys(t, SYS_setfsuid, a, err, "setfsuid(-1)") != (long)c->uid[3] ||
	    rsys(t, SYS_setfsgid, a, err, "setfsgid(-1)") != (long)c->gid[3])
		return fail(err, EPERM, t->pid, "its filesystem uid and gid did not become "
			    "%u and %u", c->uid[3], c->gid[3]);
	return 0;
}

static int switch_ids(struct tracee *t, unsigned long scratch, const struct dbxcr_creds *c,
		      struct dbxcr_error *err)
{
	long a[6] = { 0 };

	if (mem_write(t->pid, scratch, c->groups, (size_t)c->ngroups * sizeof(c->groups[0]),
		      err) < 0)
		return -1;
	a[0] = c->ngroups;
	a[1] = (long)scratch;
	if (rsys(t, SYS_setgroups, a, err, "setgroups (%d groups)", c->ngroups) < 0)
		return -1;
	for (int i = 0; i < 3; i++)
		a[i] = c->gid[i];
	if (rsys(t, SYS_setresgid, a, err, "setresgid(%u, %u, %u)", c->gid[0], c->gid[1],
		 c->gid[2]) < 0)
		return -1;
	for (int i = 0; i < 3; i++)
		a[i] = c->uid[i];
	if (rsys(t, SYS_setresuid, a, err, "setresuid(%u, %u, %u)", c->uid[0], c->uid[1],
		 c->uid[2]) < 0)
		return -1;
	if (c->uid[3] == c->uid[1] && c->gid[3] == c->gid[1])
		return 0;	/* the switch set them: they follow the effective ids */
	return set_fs_ids(t, scratch, c, err);
}

static int set_caps(struct tracee *t, unsigned long scratch, const struct dbxcr_creds *c,
		    struct dbxcr_error *err)
{
	long amb[6] = { PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0, 0 };

	if (capset_at(t, scratch, c->cap_eff, c->cap_prm, c->cap_inh, err) < 0)
		return -1;
	if (rsys(t, SYS_prctl, amb, err, "clearing its ambient capabilities") < 0)
		return -1;
	amb[1] = PR_CAP_AMBIENT_RAISE;
	for (int cap = 0; cap < CAP_NUMBERS; cap++) {
		if (!(c->cap_amb >> cap & 1))
			continue;
		amb[2] = cap;
		if (rsys(t, SYS_prctl, amb, err, "raising ambient capability %d", cap) < 0)
			return -1;
	}
	return 0;
}

/* The thread's sets as /proc shows them now (one read): what it will run with. */
static int check_caps(pid_t tid, const struct dbxcr_creds *c, struct dbxcr_error *err)
{
	static const char *const names[] = { "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb" };
	const uint64_t want[] = { c->cap_inh, c->cap_prm, c->cap_eff, c->cap_bnd, c->cap_amb };
	char buf[4096];
	uint64_t got = 0;

	if (read_status(tid, buf, sizeof(buf), err) < 0)
		return -1;
	for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
		if (capset_of(tid, buf, names[i], &got, err) < 0)
			return -1;
		if (got != want[i])
			return fail(err, EPERM, tid, "its %s is %016" PRIx64 " after the restore, "
				    "not %016" PRIx64 " as at the checkpoint", names[i], got,
				    want[i]);
	}
	return 0;
}

int creds_give(struct tracee *t, unsigned long scratch, const struct dbxcr_creds *c,
	       struct dbxcr_error *err)
{
	long a[6] = { 0 };
	long keep, dumpable;

	if (!c->set)
		return 0;
	a[0] = PR_GET_KEEPCAPS;
	if ((keep = rsys(t, SYS_prctl, a, err, "PR_GET_KEEPCAPS")) < 0)
		return -1;
	a[0] = PR_GET_DUMPABLE;
	if ((dumpable = rsys(t, SYS_prctl, a, err, "PR_GET_DUMPABLE")) < 0)
		return -1;
	if (drop_bounding(t, c->cap_bnd, err) < 0)
		return -1;
	a[0] = PR_SET_KEEPCAPS;
	a[1] = 1;
	if (!keep && rsys(t, SYS_prctl, a, err, "PR_SET_KEEPCAPS 1 for the switch") < 0)
		return -1;
	if (switch_ids(t, scratch, c, err) < 0 || set_caps(t, scratch, c, err) < 0)
		return -1;
	a[1] = 0;
	if (!keep && rsys(t, SYS_prctl, a, err, "PR_SET_KEEPCAPS 0 after the switch") < 0)
		return -1;
	a[0] = PR_SET_DUMPABLE;
	a[1] = dumpable;
	if (dumpable <= 1 && rsys(t, SYS_prctl, a, err, "PR_SET_DUMPABLE %ld", dumpable) < 0)
		return -1;
	return check_caps(t->pid, c, err);
}
