/* A process's prctl state that a fork copies and no /proc file shows: whether it may be
 * dumped and traced (PR_SET_DUMPABLE: ssh-agent and gpg-agent clear it), its securebits
 * (keep-capabilities among them), transparent huge pages refused (PR_SET_THP_DISABLE),
 * KSM merging of all its memory (PR_SET_MEMORY_MERGE) and its machine-check kill policy;
 * and no_new_privs (status shows it, but only the process can set it).
 *
 * A child spawned from its template has them (a fork).  One restored from an image is
 * another process's fork given the image's memory (an adopted child, a chain's ancestor,
 * a template rebuilt from a dump: cr/taskattrs.py), so the daemon reads them from the
 * parked template by injected PR_GET_* calls and sets the ones that differ in the copy,
 * held before it runs, by injected PR_SET_* calls: each process's own, as the process
 * itself would.  A securebit some copy has locked and the original has not, or
 * no_new_privs the copy has and the original had not, cannot be cleared: that restore
 * fails, naming it. */
#include <errno.h>
#include <sys/prctl.h>
#include <sys/syscall.h>

#include "dbxcr_internal.h"
#include "fork_template.h"

/* Newer <linux/prctl.h> only. */
#ifndef PR_SET_MEMORY_MERGE
#define PR_SET_MEMORY_MERGE 67
#define PR_GET_MEMORY_MERGE 68
#endif

static int get_one(struct tracee *t, int option, int *out, struct dbxcr_error *err)
{
	long a[6] = { option, 0, 0, 0, 0, 0 };
	long ret;

	if (remote_syscall(t, SYS_prctl, a, &ret, err) < 0)
		return -1;
	/* PR_GET_MEMORY_MERGE on a kernel without KSM: nothing to keep. */
	if (ret == -EINVAL && option == PR_GET_MEMORY_MERGE)
		ret = 0;
	if (ret < 0)
		return fail(err, (int)-ret, t->pid, "prctl(%d) to read its state", option);
	*out = (int)ret;
	return 0;
}

int tracee_prctls(struct tracee *t, struct dbxcr_prctls *out, struct dbxcr_error *err)
{
	if (get_one(t, PR_GET_DUMPABLE, &out->dumpable, err) < 0 ||
	    get_one(t, PR_GET_SECUREBITS, &out->securebits, err) < 0 ||
	    get_one(t, PR_GET_THP_DISABLE, &out->thp_disable, err) < 0 ||
	    get_one(t, PR_GET_MEMORY_MERGE, &out->memory_merge, err) < 0 ||
	    get_one(t, PR_MCE_KILL_GET, &out->mce_kill, err) < 0 ||
	    get_one(t, PR_GET_NO_NEW_PRIVS, &out->no_new_privs, err) < 0)
		return -1;
	return 0;
}

static int set_one(struct tracee *t, long option, long arg2, long arg3, const char *what,
		   struct dbxcr_error *err)
{
	long a[6] = { option, arg2, arg3, 0, 0, 0 };

	return rsys(t, SYS_prctl, a, err, "prctl to restore its %s (%ld)", what,
		    option == PR_MCE_KILL ? arg3 : arg2) < 0 ? -1 : 0;
}

int tracee_set_prctls(struct tracee *t, const struct dbxcr_prctls *want,
		      struct dbxcr_error *err)
{
	struct dbxcr_prctls have;

	if (tracee_prctls(t, &have, err) < 0)
		return -1;
	if (have.no_new_privs && !want->no_new_privs)
		return fail(err, EPERM, t->pid, "no_new_privs is set in the copy and was not in "
			    "the process: it cannot be cleared");
	if (want->no_new_privs && !have.no_new_privs &&
	    set_one(t, PR_SET_NO_NEW_PRIVS, 1, 0, "no_new_privs", err) < 0)
		return -1;
	if (want->securebits != have.securebits &&
	    set_one(t, PR_SET_SECUREBITS, want->securebits, 0, "securebits", err) < 0)
		return -1;
	if (want->thp_disable != have.thp_disable &&
	    set_one(t, PR_SET_THP_DISABLE, want->thp_disable, 0, "THP refusal", err) < 0)
		return -1;
	if (want->memory_merge != have.memory_merge &&
	    set_one(t, PR_SET_MEMORY_MERGE, want->memory_merge, 0, "KSM merging", err) < 0)
		return -1;
	if (want->mce_kill != have.mce_kill &&
	    (want->mce_kill == PR_MCE_KILL_DEFAULT
		     ? set_one(t, PR_MCE_KILL, PR_MCE_KILL_CLEAR, 0, "machine-check policy", err)
		     : set_one(t, PR_MCE_KILL, PR_MCE_KILL_SET, want->mce_kill,
			       "machine-check policy", err)) < 0)
		return -1;
	/* Last: the others are the process's own calls whatever it may be traced by.  2
	 * (SUID_DUMP_ROOT) comes only from an exec, which set it in the copy too. */
	if (want->dumpable != have.dumpable && want->dumpable != 2 &&
	    set_one(t, PR_SET_DUMPABLE, want->dumpable, 0, "dumpable flag", err) < 0)
		return -1;
	return 0;
}

/* Read into `out`, or set `want`, in the parked template, parked again after. */
static int in_template(struct dbxcr_template *tpl, struct dbxcr_prctls *out,
		       const struct dbxcr_prctls *want, struct dbxcr_error *err)
{
	struct dbxcr_error ignored;
	struct tracee t;
	int rc = 0;

	clear_error(err);
	/* Its parked registers (tpl->park) are set once its scratch area is mapped, which a
	 * template gets at its first spawn or dump, not at its making. */
	if (check_owner(tpl, err) < 0 || template_scratch(tpl, err) < 0 ||
	    adopt(&t, tpl->pid, tpl->site, err) < 0)
		return -1;
	t.regs = tpl->park;
	if ((want ? tracee_set_prctls(&t, want, err) : tracee_prctls(&t, out, err)) < 0)
		rc = -1;
	if (park(tpl, rc ? &ignored : err) < 0)
		rc = -1;
	return rc;
}

int dbxcr_template_prctls(struct dbxcr_template *tpl, struct dbxcr_prctls *out,
			  struct dbxcr_error *err)
{
	return in_template(tpl, out, NULL, err);
}

int dbxcr_template_set_prctls(struct dbxcr_template *tpl, const struct dbxcr_prctls *want,
			      struct dbxcr_error *err)
{
	return in_template(tpl, NULL, want, err);
}

/* ---------- what fork drops: the parent-death signal and the child-subreaper flag ----------
 *
 * Neither is copied to a child (copy_process clears pdeath_signal; a new process's signal
 * struct starts with is_child_subreaper 0) and no /proc file shows them, so they are read
 * from the stopped original when its template is made (PR_GET_*: two injected calls, the
 * answers written below its stack's red zone) and given back to each child before it runs.
 *
 * The flag belongs to the process alone: every child gets it.  The signal is tied to the
 * parent: the kernel sends it when the thread that is the process's parent exits.  It is
 * given back only to a child born of its restored parent (an adopted child, a chain's);
 * one spawned from its template is the template's sibling, whose parent is the sandbox's
 * init or, in a fork, a process of the source sandbox, whose death must not signal it.
 * After the credentials (creds_give): the kernel clears the signal when a process's
 * effective or filesystem ids change. */
int tracee_parent_death(struct tracee *t, int *pdeathsig, bool *subreaper,
			struct dbxcr_error *err)
{
	long a[6] = { PR_GET_PDEATHSIG, 0, 0, 0, 0, 0 };
	int v = 0;

	if (query_on_stack(t, SYS_prctl, a, 1, &v, sizeof(v), "prctl(PR_GET_PDEATHSIG)",
			   err) < 0)
		return -1;
	*pdeathsig = v;
	a[0] = PR_GET_CHILD_SUBREAPER;
	v = 0;
	if (query_on_stack(t, SYS_prctl, a, 1, &v, sizeof(v), "prctl(PR_GET_CHILD_SUBREAPER)",
			   err) < 0)
		return -1;
	*subreaper = v != 0;
	return 0;
}

int give_parent_death(struct tracee *c, const struct dbxcr_template *tpl, bool born_of_parent,
		      struct dbxcr_error *err)
{
	if (tpl->subreaper &&
	    set_one(c, PR_SET_CHILD_SUBREAPER, 1, 0, "child-subreaper flag", err) < 0)
		return -1;
	if (born_of_parent && tpl->pdeathsig &&
	    set_one(c, PR_SET_PDEATHSIG, tpl->pdeathsig, 0, "parent-death signal", err) < 0)
		return -1;
	return 0;
}

void dbxcr_template_parent_death(const struct dbxcr_template *tpl, int *pdeathsig,
				 int *subreaper)
{
	*pdeathsig = tpl->pdeathsig;
	*subreaper = tpl->subreaper;
}

int dbxcr_template_set_parent_death(struct dbxcr_template *tpl, int pdeathsig, int subreaper,
				    struct dbxcr_error *err)
{
	clear_error(err);
	if (pdeathsig < 0 || pdeathsig > 64)
		return fail(err, EINVAL, tpl->pid, "parent-death signal %d", pdeathsig);
	tpl->pdeathsig = pdeathsig;
	tpl->subreaper = subreaper != 0;
	return 0;
}
