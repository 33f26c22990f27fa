/* System V IPC objects of a sandbox's IPC namespace.
 *
 * Semaphore sets, message queues and shared memory segments belong to an IPC namespace,
 * not to a process: a checkpoint of the sandbox's files and processes does not hold them,
 * a rollback would leave the live ones (their values written after the checkpoint) and a
 * fork's children, in a namespace of their own, would find none.  The daemon counts them
 * at a full checkpoint (which is refused while any exists) and removes those a rollback
 * finds (made after its checkpoint, which had none).
 *
 * The objects a task sees, and the *_INFO and *_STAT_ANY commands, are those of its own
 * IPC namespace (current->nsproxy), so a thread made for the call joins the sandbox's
 * (setns CLONE_NEWIPC acts on the calling thread alone) and ends with the call. */

#include "dbxcr_internal.h"
#include "fork_template.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <sys/ipc.h>
#include <sys/msg.h>
#include <sys/sem.h>
#include <sys/shm.h>

#ifndef SEM_STAT_ANY
#define SEM_STAT_ANY 20
#endif
#ifndef MSG_STAT_ANY
#define MSG_STAT_ANY 13
#endif
#ifndef SHM_STAT_ANY
#define SHM_STAT_ANY 15
#endif

/* glibc declares union semun only for the caller to define. */
union semun_arg {
	int val;
	struct semid_ds *buf;
	unsigned short *array;
	struct seminfo *info;
};

struct ipcns_job {
	int ipcns_fd, clear, code;
	const char *step;
	struct dbxcr_ipc_objects out;
};

/* Remove every object of one kind: *_STAT_ANY on each index up to the highest in use
 * gives the object's id (an index with none fails: skipped); IPC_RMID removes it (a shared
 * memory segment still attached goes once detached). */
static int clear_sems(int top)
{
	for (int i = 0; i <= top; i++) {
		struct semid_ds ds;
		union semun_arg a = { .buf = &ds };
		int id = semctl(i, 0, SEM_STAT_ANY, a);

		if (id >= 0 && semctl(id, 0, IPC_RMID) < 0 && errno != EINVAL && errno != EIDRM)
			return -1;
	}
	return 0;
}

static int clear_msgs(int top)
{
	for (int i = 0; i <= top; i++) {
		struct msqid_ds ds;
		int id = msgctl(i, MSG_STAT_ANY, &ds);

		if (id >= 0 && msgctl(id, IPC_RMID, NULL) < 0 && errno != EINVAL && errno != EIDRM)
			return -1;
	}
	return 0;
}

static int clear_shms(int top)
{
	for (int i = 0; i <= top; i++) {
		struct shmid_ds ds;
		int id = shmctl(i, SHM_STAT_ANY, &ds);

		if (id >= 0 && shmctl(id, IPC_RMID, NULL) < 0 && errno != EINVAL && errno != EIDRM)
			return -1;
	}
	return 0;
}

/* Shared memory segments no process has attached (shm_nattch 0): those no process's
 * mappings show (a checkpoint refuses an attached one by its process). */
static int detached_shms(int top)
{
	int n = 0;

	for (int i = 0; i <= top; i++) {
		struct shmid_ds ds;

		if (shmctl(i, SHM_STAT_ANY, &ds) >= 0 && ds.shm_nattch == 0)
			n++;
	}
	return n;
}

/* How many objects of each kind exist; with clear, remove them first (the count is then
 * what is left: 0).  *_INFO returns the highest index in use (-1 or 0 when none). */
static void *ipcns_thread(void *arg)
{
	struct ipcns_job *j = arg;
	struct seminfo si;
	struct msginfo mi;
	struct shm_info hi;
	union semun_arg a = { .info = &si };
	int top;

	if (setns(j->ipcns_fd, CLONE_NEWIPC) < 0) {
		j->code = errno;
		j->step = "setns into the IPC namespace";
		return NULL;
	}
	for (int pass = j->clear ? 0 : 1; pass < 2; pass++) {
		top = semctl(0, 0, SEM_INFO, a);
		if (top < 0 || (pass == 0 && top >= 0 && si.semusz && clear_sems(top) < 0)) {
			j->code = errno;
			j->step = pass ? "semctl SEM_INFO" : "remove semaphore sets";
			return NULL;
		}
		j->out.sem_sets = si.semusz;
		top = msgctl(0, MSG_INFO, (struct msqid_ds *)&mi);
		if (top < 0 || (pass == 0 && mi.msgpool && clear_msgs(top) < 0)) {
			j->code = errno;
			j->step = pass ? "msgctl MSG_INFO" : "remove message queues";
			return NULL;
		}
		j->out.msg_queues = mi.msgpool;
		top = shmctl(0, SHM_INFO, (struct shmid_ds *)&hi);
		if (top < 0 || (pass == 0 && hi.used_ids && clear_shms(top) < 0)) {
			j->code = errno;
			j->step = pass ? "shmctl SHM_INFO" : "remove shared memory segments";
			return NULL;
		}
		j->out.shm_segments = hi.used_ids;
		j->out.shm_detached = hi.used_ids ? detached_shms(top) : 0;
	}
	return NULL;
}

int dbxcr_ipcns_objects(int ipcns_fd, int clear, struct dbxcr_ipc_objects *out,
			struct dbxcr_error *err)
{
	struct ipcns_job j = { ipcns_fd, clear, 0, NULL, { 0, 0, 0, 0 } };
	pthread_t th;
	int rc;

	clear_error(err);
	rc = pthread_create(&th, NULL, ipcns_thread, &j);
	if (rc != 0)
		return fail(err, rc, current_tid(), "IPC namespace fd %d: pthread_create", ipcns_fd);
	rc = pthread_join(th, NULL);
	if (rc != 0)
		return fail(err, rc, current_tid(), "IPC namespace fd %d: pthread_join", ipcns_fd);
	if (j.code)
		return fail(err, j.code, current_tid(), "IPC namespace fd %d: %s", ipcns_fd,
			    j.step);
	*out = j.out;
	return 0;
}
