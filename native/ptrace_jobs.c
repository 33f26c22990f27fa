/* The ptrace thread's job queue: native work it runs without the Python interpreter.
 *
 * A tracee answers only to the thread that attached it, so the daemon sends every ptrace
 * request to one thread (deltabox/cr/worker.py).  Handing that thread a Python job costs
 * two hand-overs of the interpreter's lock: the thread must take it from the event loop's
 * thread to start, and the loop must be woken through its own queue to learn the result
 * (0.2-0.4 ms each way on these VMs, as much as a birth).  So the thread waits here, in C,
 * with that lock released: a rollback's births are posted as plain data (dbxcr_births) and
 * run at once, their end written to an eventfd the event loop polls; a Python job is
 * posted as a marker, on which dbxcr_jobs_wait returns so that the interpreter runs it.
 * Both kinds share one FIFO: jobs run in the order they were posted.
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "dbxcr_internal.h"
#include "fork_template.h"

struct job {
	struct dbxcr_births *births;	/* NULL: a Python job */
	struct job *next;
};

struct dbxcr_jobs {
	pthread_mutex_t lock;		/* head and tail: posted from the event loop's thread */
	struct job *head, *tail;
	int post_fd;			/* eventfd (semaphore): one count per job posted */
};

struct dbxcr_jobs *dbxcr_jobs_new(struct dbxcr_error *err)
{
	struct dbxcr_jobs *q;

	clear_error(err);
	q = calloc(1, sizeof(*q));
	if (!q) {
		fail(err, ENOMEM, 0, "jobs: allocate the queue");
		return NULL;
	}
	q->post_fd = eventfd(0, EFD_CLOEXEC | EFD_SEMAPHORE);
	if (q->post_fd < 0) {
		fail(err, errno, 0, "jobs: eventfd: %s", strerror(errno));
		free(q);
		return NULL;
	}
	pthread_mutex_init(&q->lock, NULL);
	return q;
}

void dbxcr_jobs_free(struct dbxcr_jobs *q)
{
	struct job *j, *next;

	if (!q)
		return;
	for (j = q->head; j; j = next) {
		next = j->next;
		free(j);
	}
	close(q->post_fd);
	pthread_mutex_destroy(&q->lock);
	free(q);
}

int dbxcr_jobs_post(struct dbxcr_jobs *q, struct dbxcr_births *births, struct dbxcr_error *err)
{
	struct job *j = calloc(1, sizeof(*j));

	clear_error(err);
	if (!j)
		return fail(err, ENOMEM, 0, "jobs: allocate a job");
	j->births = births;
	pthread_mutex_lock(&q->lock);
	if (q->tail)
		q->tail->next = j;
	else
		q->head = j;
	q->tail = j;
	pthread_mutex_unlock(&q->lock);
	/* The count wakes the thread; the job is queued before it, so a wake-up always finds
	 * one.  An eventfd's counter cannot overflow at one count per job. */
	if (eventfd_write(q->post_fd, 1) < 0)
		return fail(err, errno, 0, "jobs: wake the ptrace thread: %s", strerror(errno));
	return 0;
}

static struct dbxcr_births *pop(struct dbxcr_jobs *q, bool *found)
{
	struct job *j;
	struct dbxcr_births *b = NULL;

	pthread_mutex_lock(&q->lock);
	j = q->head;
	if (j) {
		q->head = j->next;
		if (!q->head)
			q->tail = NULL;
		b = j->births;
	}
	pthread_mutex_unlock(&q->lock);
	*found = j != NULL;
	free(j);
	return b;
}

static long ms_since(const struct timespec *t0)
{
	struct timespec now;

	clock_gettime(CLOCK_MONOTONIC, &now);
	return (now.tv_sec - t0->tv_sec) * 1000 + (now.tv_nsec - t0->tv_nsec) / 1000000;
}

/* Block until every killed process behind the pidfds has exited (a pidfd polls readable
 * then) or timeout_ms passed, reaping those that are our children.  Past the timeout the
 * births find their pids still taken (EEXIST) and the caller retries them. */
static void wait_victims(const int *pidfds, size_t n, int timeout_ms)
{
	struct pollfd pfd[64];
	struct timespec t0;
	size_t i, left = 0;

	if (n > sizeof(pfd) / sizeof(pfd[0]))
		n = sizeof(pfd) / sizeof(pfd[0]);	/* the rest: EEXIST and retried */
	for (i = 0; i < n; i++)
		pfd[left++] = (struct pollfd){ .fd = pidfds[i], .events = POLLIN };
	clock_gettime(CLOCK_MONOTONIC, &t0);
	while (left) {
		long wait = timeout_ms - ms_since(&t0);
		int r;

		if (wait <= 0)
			return;
		r = poll(pfd, left, (int)wait);
		if (r < 0 && errno != EINTR)
			return;
		for (i = 0; r > 0 && i < left;) {
			siginfo_t si;

			if (!pfd[i].revents) {
				i++;
				continue;
			}
			/* ECHILD: not ours (the sandbox's init reaps it). */
			(void)syscall(SYS_waitid, P_PIDFD, pfd[i].fd, &si, WEXITED | WNOHANG, NULL);
			pfd[i] = pfd[--left];
		}
	}
}

/* Each carrier gives birth once, those with a pid to take (leaders first) after the
 * victims have exited; one outcome each, retried by the caller. */
static void run_births(struct dbxcr_births *b)
{
	bool waited = false;
	size_t i;

	for (i = 0; i < b->n; i++) {
		const pid_t *tid = b->set_tid[i] ? &b->set_tid[i] : NULL;

		if (tid && !waited) {
			wait_victims(b->victims, b->n_victims, b->timeout_ms);
			waited = true;
		}
		b->born[i] = dbxcr_carrier_birth(b->carriers[i], tid, tid ? 1 : 0, b->pgid[i],
						 &b->errs[i]);
	}
}

int dbxcr_jobs_wait(struct dbxcr_jobs *q, struct dbxcr_error *err)
{
	clear_error(err);
	for (;;) {
		struct dbxcr_births *b;
		eventfd_t one;
		bool found;

		if (eventfd_read(q->post_fd, &one) < 0) {
			if (errno == EINTR)
				continue;
			return fail(err, errno, 0, "jobs: wait for a job: %s", strerror(errno));
		}
		b = pop(q, &found);
		if (!found)
			return fail(err, EPROTO, 0, "jobs: woken with no job queued");
		if (!b)
			return 1;
		run_births(b);
		/* The poster may read b's results once this lands (and free b): last touch. */
		if (eventfd_write(b->done_fd, 1) < 0)
			return fail(err, errno, 0, "jobs: signal births done on fd %d: %s",
				    b->done_fd, strerror(errno));
	}
}
