/* A process's timers, which fork(2) does not pass on: its three interval timers (alarm,
 * setitimer) and its POSIX timers (timer_create: the `timeout` command's, for one).  A
 * template is a fork, so it has none; what the original had at its stop is read into the
 * template, and finish_child arms it again in every child, each timer with the time it had
 * left at the checkpoint counted from the restore (as if the process had been stopped
 * meanwhile with its clocks stopped too).  x86_64 only.
 *
 * Interval timers: no /proc file shows them, so getitimer is injected into the stopped
 * original (its answer on its stack below the red zone: query_on_stack).
 *
 * POSIX timers: /proc/PID/timers lists each one's id, signal and sigev_value, how it
 * notifies (a signal to the process, to one of its threads, or none) and clock; the time
 * left and interval come from an injected timer_gettime.  A program names a timer by its
 * id, so a restored one must have the same: prctl(PR_TIMER_CREATE_RESTORE_IDS) makes the
 * next timer_create calls take the id written at their timer_t pointer (EBUSY if taken).
 * A timer aimed at one thread (SIGEV_THREAD_ID) is aimed at the same tid again: a
 * multi-threaded process comes back only with its threads' tids.  Not restored, and
 * refused by the daemon at the checkpoint (cr/capture.py): a timer aimed at a thread that
 * has exited, one on another process's CPU clock, more than MAX_PTIMERS of them, and any
 * on a kernel without the prctl.  Lost: a timer's
 * overrun count, and the kernel's note that its signal is queued (a pending timer signal
 * is queued again as any other, with its siginfo). */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "dbxcr_internal.h"
#include "fork_template.h"

/* Newer <linux/prctl.h> only: older headers lack it. */
#ifndef PR_TIMER_CREATE_RESTORE_IDS
#define PR_TIMER_CREATE_RESTORE_IDS 77
#define PR_TIMER_CREATE_RESTORE_IDS_OFF 0
#define PR_TIMER_CREATE_RESTORE_IDS_ON 1
#define PR_TIMER_CREATE_RESTORE_IDS_GET 2
#endif

/* ---------- interval timers ---------- */

int capture_itimers(struct tracee *t, struct itimerval out[3], struct dbxcr_error *err)
{
	for (long i = 0; i < 3; i++) {
		long a[6] = { i, 0, 0, 0, 0, 0 };

		if (query_on_stack(t, SYS_getitimer, a, 1, &out[i], sizeof(out[i]),
				   "getitimer", err) < 0)
			return -1;
	}
	return 0;
}

/* A disarmed timer (no time left) is left alone, whatever its interval. */
int arm_itimers(struct tracee *c, const struct dbxcr_template *tpl, struct dbxcr_error *err)
{
	for (int i = 0; i < 3; i++) {
		const struct itimerval *v = &tpl->itimers[i];
		long a[6] = { i, (long)tpl->scratch, 0, 0, 0, 0 };

		if (!v->it_value.tv_sec && !v->it_value.tv_usec)
			continue;
		if (mem_write(c->pid, tpl->scratch, v, sizeof(*v), err) < 0 ||
		    rsys(c, SYS_setitimer, a, err, "setitimer(%d, %ld.%06lds left)", i,
			 (long)v->it_value.tv_sec, (long)v->it_value.tv_usec) < 0)
			return -1;
	}
	return 0;
}

void dbxcr_template_itimers(const struct dbxcr_template *tpl, long out[12])
{
	for (int i = 0; i < 3; i++) {
		const struct itimerval *v = &tpl->itimers[i];

		out[4 * i] = v->it_interval.tv_sec;
		out[4 * i + 1] = v->it_interval.tv_usec;
		out[4 * i + 2] = v->it_value.tv_sec;
		out[4 * i + 3] = v->it_value.tv_usec;
	}
}

int dbxcr_template_set_itimers(struct dbxcr_template *tpl, const long in[12],
			       struct dbxcr_error *err)
{
	clear_error(err);
	for (int i = 0; i < 12; i++)
		if (in[i] < 0 || (i % 2 && in[i] >= 1000000))
			return fail(err, EINVAL, tpl->pid, "interval timer field %d: %ld", i, in[i]);
	for (int i = 0; i < 3; i++) {
		struct itimerval *v = &tpl->itimers[i];

		v->it_interval.tv_sec = in[4 * i];
		v->it_interval.tv_usec = in[4 * i + 1];
		v->it_value.tv_sec = in[4 * i + 2];
		v->it_value.tv_usec = in[4 * i + 3];
	}
	return 0;
}

/* ---------- POSIX timers ---------- */

int dbxcr_ptimers_supported(void)
{
	return prctl(PR_TIMER_CREATE_RESTORE_IDS, PR_TIMER_CREATE_RESTORE_IDS_GET, 0, 0, 0) < 0
		? 0 : MAX_PTIMERS;
}

/* The tid in its pid namespace of the thread of tpl's origin whose host tid is `host`; 0
 * if it has none. */
static pid_t thread_nstid(const struct dbxcr_template *tpl, pid_t host)
{
	const struct thread_set *set = tpl->threads;

	for (int i = 0; set && i < set->n; i++)
		if (set->t[i].tid == host)
			return set->t[i].nstid;
	return 0;
}

/* "notify: signal/pid.N" (or none/..., thread/...; tid.N: SIGEV_THREAD_ID), N a host pid
 * as the daemon's /proc shows it (`pid`: the process's).  A timer aimed at the process,
 * its main thread or one of its other threads can be made again: the threads come back
 * with their tids (a glibc SIGEV_THREAD timer signals a helper thread glibc made for it:
 * vim's).  Not one aimed at a thread that has exited. */
static bool parse_notify(const char *v, const struct dbxcr_template *tpl, pid_t pid,
			 struct ptimer *p)
{
	static const char *const how[] = { "signal", "none", "thread" };	/* SIGEV_* 0-2 */
	char kind[16], whom[8];
	long long who;

	if (sscanf(v, "%15[a-z]/%7[a-z].%lld", kind, whom, &who) != 3)
		return false;
	for (int i = 0; i < 3; i++)
		if (!strcmp(kind, how[i]))
			p->notify = i;
	if (strcmp(kind, how[p->notify]))
		return false;
	if (!strcmp(whom, "tid")) {
		p->notify |= SIGEV_THREAD_ID;
		if (who == pid)
			return true;
		p->thread = who > 0 && who <= INT32_MAX ? thread_nstid(tpl, (pid_t)who) : 0;
		return p->thread > 0;
	}
	return !strcmp(whom, "pid");
}

/* A clock is the same in the restored process unless it is another process's or
 * thread's CPU clock (a negative id encodes the pid, 0: the caller itself). */
static bool own_clock(int clock)
{
	return clock >= 0 || ~(clock >> 3) == 0;
}

/* Parse /proc/PID/timers into tpl->ptimers (supported: false for any we cannot make
 * again, which the daemon refuses by name before a restore is ever asked). */
static int read_ptimers(pid_t pid, struct dbxcr_template *tpl, struct dbxcr_error *err)
{
	char path[64], buf[8192], *line, *save = NULL;
	struct ptimer *p = NULL;

	tpl->nptimers = 0;
	tpl->ptimers_ok = true;
	snprintf(path, sizeof(path), "/proc/%d/timers", (int)pid);
	if (read_small_file(path, buf, sizeof(buf)) < 0)
		return fail(err, errno, pid, "read %s: %s", path, strerror(errno));
	for (line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
		unsigned long long value;
		int id;

		if (sscanf(line, "ID: %d", &id) == 1) {
			if (tpl->nptimers == MAX_PTIMERS) {
				tpl->ptimers_ok = false;
				p = NULL;
				continue;
			}
			p = &tpl->ptimers[tpl->nptimers++];
			*p = (struct ptimer){ .id = id };
		} else if (!p) {
			continue;
		} else if (sscanf(line, "signal: %d/%llx", &p->signo, &value) == 2) {
			p->value = value;
		} else if (!strncmp(line, "notify: ", 8)) {
			if (!parse_notify(line + 8, tpl, pid, p))
				tpl->ptimers_ok = false;
		} else if (sscanf(line, "ClockID: %d", &p->clock) == 1 && !own_clock(p->clock)) {
			tpl->ptimers_ok = false;
		}
	}
	return 0;
}

int capture_ptimers(struct tracee *t, struct dbxcr_template *tpl, struct dbxcr_error *err)
{
	if (read_ptimers(t->pid, tpl, err) < 0)
		return -1;
	for (int i = 0; i < tpl->nptimers; i++) {
		struct ptimer *p = &tpl->ptimers[i];
		long a[6] = { p->id, 0, 0, 0, 0, 0 };

		if (query_on_stack(t, SYS_timer_gettime, a, 1, &p->spec, sizeof(p->spec),
				   "timer_gettime", err) < 0)
			return -1;
	}
	return 0;
}

/* One timer made again with its id (restore mode on), armed if it had time left. */
static int make_ptimer(struct tracee *c, const struct dbxcr_template *tpl,
		       const struct ptimer *p, pid_t tid, struct dbxcr_error *err)
{
	struct sigevent ev;
	int id = p->id;
	unsigned long id_at = tpl->scratch + sizeof(ev);
	long mk[6] = { p->clock, (long)tpl->scratch, (long)id_at, 0, 0, 0 };
	long set[6] = { p->id, 0, (long)tpl->scratch, 0, 0, 0 };

	memset(&ev, 0, sizeof(ev));
	ev.sigev_value.sival_ptr = (void *)(uintptr_t)p->value;
	ev.sigev_signo = p->signo;
	ev.sigev_notify = p->notify;
	/* The kernel looks the thread up in the caller's pid namespace, where every thread
	 * came back with its tid (threads.c), before this runs (finish_child). */
	if (p->notify & SIGEV_THREAD_ID)
		ev._sigev_un._tid = p->thread ? p->thread : tid;
	if (mem_write(c->pid, tpl->scratch, &ev, sizeof(ev), err) < 0 ||
	    mem_write(c->pid, id_at, &id, sizeof(id), err) < 0 ||
	    rsys(c, SYS_timer_create, mk, err, "timer_create(clock %d) with id %d, aimed at "
		 "thread %d", p->clock, p->id, (int)ev._sigev_un._tid) < 0)
		return -1;
	if (!p->spec.it_value.tv_sec && !p->spec.it_value.tv_nsec)
		return 0;
	if (mem_write(c->pid, tpl->scratch, &p->spec, sizeof(p->spec), err) < 0 ||
	    rsys(c, SYS_timer_settime, set, err, "timer_settime(%d, %ld.%09lds left)", p->id,
		 (long)p->spec.it_value.tv_sec, (long)p->spec.it_value.tv_nsec) < 0)
		return -1;
	return 0;
}

int arm_ptimers(struct tracee *c, const struct dbxcr_template *tpl, struct dbxcr_error *err)
{
	long on[6] = { PR_TIMER_CREATE_RESTORE_IDS, PR_TIMER_CREATE_RESTORE_IDS_ON, 0, 0, 0, 0 };
	long off[6] = { PR_TIMER_CREATE_RESTORE_IDS, PR_TIMER_CREATE_RESTORE_IDS_OFF, 0, 0, 0,
			0 };
	long none[6] = { 0 };
	long tid = 0;

	if (!tpl->nptimers)
		return 0;
	if (!tpl->ptimers_ok)	/* never silently without one */
		return fail(err, EOPNOTSUPP, tpl->pid, "a POSIX timer of pid %d cannot be made "
			    "again (see /proc/PID/timers at the checkpoint)", (int)tpl->origin);
	for (int i = 0; i < tpl->nptimers && !tid; i++)
		if ((tpl->ptimers[i].notify & SIGEV_THREAD_ID) && !tpl->ptimers[i].thread)
			tid = rsys(c, SYS_gettid, none, err, "gettid for a thread's timer");
	if (tid < 0 || rsys(c, SYS_prctl, on, err, "prctl(PR_TIMER_CREATE_RESTORE_IDS, on)") < 0)
		return -1;
	for (int i = 0; i < tpl->nptimers; i++)
		if (make_ptimer(c, tpl, &tpl->ptimers[i], (pid_t)tid, err) < 0)
			return -1;
	return rsys(c, SYS_prctl, off, err, "prctl(PR_TIMER_CREATE_RESTORE_IDS, off)") < 0
		? -1 : 0;
}

int dbxcr_template_ptimers(const struct dbxcr_template *tpl, long *out, int max)
{
	int n = tpl->nptimers < max ? tpl->nptimers : max;

	for (int i = 0; i < n; i++) {
		const struct ptimer *p = &tpl->ptimers[i];
		long *o = out + i * DBXCR_PTIMER_FIELDS;

		o[0] = p->id;
		o[1] = p->clock;
		o[2] = p->notify;
		o[3] = p->signo;
		o[4] = (long)p->value;
		o[5] = p->spec.it_interval.tv_sec;
		o[6] = p->spec.it_interval.tv_nsec;
		o[7] = p->spec.it_value.tv_sec;
		o[8] = p->spec.it_value.tv_nsec;
		o[9] = p->thread;
	}
	return tpl->ptimers_ok ? n : -1;
}

int dbxcr_template_set_ptimers(struct dbxcr_template *tpl, const long *in, int n,
			       struct dbxcr_error *err)
{
	clear_error(err);
	if (n < 0 || n > MAX_PTIMERS)
		return fail(err, EINVAL, tpl->pid, "%d POSIX timers (at most %d)", n, MAX_PTIMERS);
	for (int i = 0; i < n; i++) {
		const long *v = in + i * DBXCR_PTIMER_FIELDS;

		if (v[0] < 0 || v[0] > INT32_MAX || !own_clock((int)v[1]) ||
		    (v[2] & ~SIGEV_THREAD_ID) > SIGEV_THREAD || v[3] < 0 || v[3] > SIGRTMAX ||
		    v[5] < 0 || v[6] < 0 || v[6] >= 1000000000 || v[7] < 0 || v[8] < 0 ||
		    v[8] >= 1000000000 || v[9] < 0 || v[9] > INT32_MAX ||
		    (v[9] && !(v[2] & SIGEV_THREAD_ID)))
			return fail(err, EINVAL, tpl->pid, "POSIX timer %d: a field out of range",
				    i);
	}
	tpl->nptimers = n;
	tpl->ptimers_ok = true;
	for (int i = 0; i < n; i++) {
		const long *v = in + i * DBXCR_PTIMER_FIELDS;

		tpl->ptimers[i] = (struct ptimer){
			.id = (int)v[0], .clock = (int)v[1], .notify = (int)v[2],
			.signo = (int)v[3], .value = (uint64_t)v[4],
			.spec = { { v[5], v[6] }, { v[7], v[8] } }, .thread = (pid_t)v[9],
		};
	}
	return 0;
}
