/* System V IPC objects and POSIX message queues of a sandbox's IPC namespace.
 *
 * Semaphore sets, message queues and shared memory segments, and POSIX message queues
 * (mq_open), belong to an IPC namespace, not to a process: a checkpoint of the sandbox's
 * files and processes does not hold them, a rollback would leave the live ones (their
 * values written after the checkpoint) and a fork's children, in a namespace of their
 * own, would find none.  The daemon counts them at a full checkpoint, removes those a
 * rollback finds (made after its checkpoint), and captures every kind at the checkpoint
 * and makes it again at each restore (below: segments, System V queues, semaphore sets,
 * POSIX queues).
 *
 * The objects a task sees, and the *_INFO and *_STAT_ANY commands, are those of its own
 * IPC namespace (current->nsproxy), so a thread made for the call joins the sandbox's
 * (setns CLONE_NEWIPC acts on the calling thread alone) and ends with the call.
 *
 * POSIX message queues are the files of the namespace's own mqueue file system, which
 * mq_open uses without any mount.  A new mqueue fs context takes the caller's IPC
 * namespace and the kernel gives it that namespace's superblock (get_tree_keyed), so a
 * detached mount of it (fsopen, fsmount: attached to no mount table, gone with its fd)
 * lists the sandbox's queues and unlinks them, touching no mount namespace. */

#include "dbxcr_internal.h"
#include "fork_template.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/mount.h>
#include <sched.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/sendfile.h>
#include <sys/fsuid.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <sys/ipc.h>
#include <sys/msg.h>
#include <sys/sem.h>
#include <sys/shm.h>
#include <mqueue.h>

#ifndef SEM_STAT_ANY
#define SEM_STAT_ANY 20
#endif
#ifndef MSG_STAT_ANY
#define MSG_STAT_ANY 13
#endif
#ifndef SHM_STAT_ANY
#define SHM_STAT_ANY 15
#endif
#ifndef MSG_COPY
#define MSG_COPY 040000
#endif

/* glibc declares union semun only for the caller to define. */
union semun_arg {
	int val;
	struct semid_ds *buf;
	unsigned short *array;
	struct seminfo *info;
};

/* A call's work, run by a thread of its own once it has joined the namespace. */
struct ipcns_job {
	int ipcns_fd, code;
	void (*work)(struct ipcns_job *j);
	const char *step;
	int id;				/* the object the step was at, or -1 */
	const char *what;		/* its kind, for the message (NULL: a segment) */
	/* count_objects, open_mqueue_dir */
	int clear, mq_dir;
	struct dbxcr_ipc_objects out;
	/* shm_list (segs out), shm_make and shm_modes (segs in, and out: removed) */
	struct dbxcr_shm_segment *segs;
	/* msg_list (queues out), msg_make (make_queues in) */
	struct dbxcr_msg_queue *queues;
	const struct dbxcr_msg_queue *make_queues;
	/* sem_list (sets out), sem_make (make_sets in) */
	struct dbxcr_sem_set *sets;
	const struct dbxcr_sem_set *make_sets;
	/* mq_list (pqueues out), mq_make (make_pqueues in), mq_open (names and open_flags
	 * in, fds out) */
	struct dbxcr_posix_queue *pqueues;
	const struct dbxcr_posix_queue *make_pqueues;
	const char *const *names;
	const int *open_flags;
	int *fds;
	const char *name;		/* the POSIX queue the step was at, or NULL */
	char failed[DBXCR_MQ_NAME];	/* each_posix_queue's: name points here */
	size_t max, n;
};

enum ipc_kind { IPC_SEM, IPC_MSG, IPC_SHM };

/* The id of the object of `kind` at index i (*_STAT_ANY; -1 when the index holds none). */
static int object_at(enum ipc_kind kind, int i)
{
	struct semid_ds sd;
	struct msqid_ds md;
	struct shmid_ds hd;
	union semun_arg a = { .buf = &sd };

	switch (kind) {
	case IPC_SEM:
		return semctl(i, 0, SEM_STAT_ANY, a);
	case IPC_MSG:
		return msgctl(i, MSG_STAT_ANY, &md);
	case IPC_SHM:
		return shmctl(i, SHM_STAT_ANY, &hd);
	}
	return -1;
}

static int remove_object(enum ipc_kind kind, int id)
{
	switch (kind) {
	case IPC_SEM:
		return semctl(id, 0, IPC_RMID);
	case IPC_MSG:
		return msgctl(id, IPC_RMID, NULL);
	case IPC_SHM:
		return shmctl(id, IPC_RMID, NULL);
	}
	return -1;
}

/* Remove every object of one kind, on each index up to the highest in use (a shared
 * memory segment still attached goes once detached; one gone meanwhile is no error). */
static int clear_kind(enum ipc_kind kind, int top)
{
	for (int i = 0; i <= top; i++) {
		int id = object_at(kind, i);

		if (id >= 0 && remove_object(kind, id) < 0 && errno != EINVAL && errno != EIDRM)
			return -1;
	}
	return 0;
}

/* Append a queue's name to the ", "-separated list, cut short (with "...") at its size. */
static void add_name(char *names, size_t size, const char *name)
{
	size_t used = strlen(names);
	int n = snprintf(names + used, size - used, "%s/%s", used ? ", " : "", name);

	if (n < 0 || (size_t)n >= size - used)
		memcpy(names + size - 4, "...", 4);
}

/* A detached mount of the calling thread's IPC namespace's mqueue file system (see the
 * file comment); its fd, or -1 with errno set. */
static int mqueue_mount(void)
{
	int fs = (int)syscall(SYS_fsopen, "mqueue", FSOPEN_CLOEXEC);
	int mnt = -1;

	if (fs < 0)
		return -1;
	if (syscall(SYS_fsconfig, fs, FSCONFIG_CMD_CREATE, NULL, NULL, 0) == 0)
		mnt = (int)syscall(SYS_fsmount, fs, FSMOUNT_CLOEXEC, 0);
	int saved = errno;
	close(fs);
	errno = saved;
	return mnt;
}

/* Call fn(j, dir, name) for each queue of the mqueue file system whose root `root` is
 * (opened again: a listing of its own from the start) until one fails (its name then in
 * j->name).  0, or -1 with errno set. */
static int each_queue_in(struct ipcns_job *j, int root,
			 int (*fn)(struct ipcns_job *j, int dir, const char *name))
{
	int dir = openat(root, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	struct dirent *e;
	DIR *d;

	if (dir < 0 || !(d = fdopendir(dir))) {
		int saved = errno;
		if (dir >= 0)
			close(dir);
		errno = saved;
		return -1;
	}
	errno = 0;
	while ((e = readdir(d))) {
		if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
			continue;
		if (fn(j, dirfd(d), e->d_name) < 0) {
			snprintf(j->failed, sizeof(j->failed), "%s", e->d_name);
			j->name = j->failed;
			break;
		}
		errno = 0;
	}
	int saved = errno;
	closedir(d);
	errno = saved;
	return saved ? -1 : 0;
}

/* Unlink one queue (one unlinked meanwhile is no error: a queue still open lives on for
 * its holders, nameless, as after mq_unlink). */
static int unlink_posix_queue(struct ipcns_job *j, int dir, const char *name)
{
	j->step = "unlink a POSIX message queue";
	return unlinkat(dir, name, 0) == 0 || errno == ENOENT ? 0 : -1;
}

static int count_posix_queue(struct ipcns_job *j, int dir, const char *name)
{
	(void)dir;
	j->out.posix_queues++;
	add_name(j->out.posix_names, sizeof(j->out.posix_names), name);
	return 0;
}

/* Count the namespace's POSIX message queues into j->out (their names too), listed in the
 * caller's directory j->mq_dir; with clear, unlink each instead.  0, or -1 with errno
 * set. */
static int posix_queues(struct ipcns_job *j, bool clear)
{
	j->out.posix_queues = 0;
	j->out.posix_names[0] = '\0';
	return each_queue_in(j, j->mq_dir, clear ? unlink_posix_queue : count_posix_queue);
}

/* The root of the namespace's mqueue file system, opened through a mount made for the
 * call (the directory's open file keeps it), into j->mq_dir. */
static void open_mqueue_dir(struct ipcns_job *j)
{
	int mnt = mqueue_mount();

	if (mnt < 0) {
		j->code = errno;
		j->step = "mount the namespace's mqueue file system (detached)";
		return;
	}
	j->mq_dir = openat(mnt, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (j->mq_dir < 0) {
		j->code = errno;
		j->step = "open the mqueue file system's root";
	}
	close(mnt);
}

/* How many objects of each kind exist; with clear, remove them first (the count is then
 * what is left: 0).  *_INFO returns the highest index in use (-1 or 0 when none). */
static void count_objects(struct ipcns_job *j)
{
	struct seminfo si;
	struct msginfo mi;
	struct shm_info hi;
	union semun_arg a = { .info = &si };
	int top;

	for (int pass = j->clear ? 0 : 1; pass < 2; pass++) {
		top = semctl(0, 0, SEM_INFO, a);
		if (top < 0 || (pass == 0 && top >= 0 && si.semusz && clear_kind(IPC_SEM, top) < 0)) {
			j->code = errno;
			j->step = pass ? "semctl SEM_INFO" : "remove semaphore sets";
			return;
		}
		j->out.sem_sets = si.semusz;
		top = msgctl(0, MSG_INFO, (struct msqid_ds *)&mi);
		if (top < 0 || (pass == 0 && mi.msgpool && clear_kind(IPC_MSG, top) < 0)) {
			j->code = errno;
			j->step = pass ? "msgctl MSG_INFO" : "remove message queues";
			return;
		}
		j->out.msg_queues = mi.msgpool;
		top = shmctl(0, SHM_INFO, (struct shmid_ds *)&hi);
		if (top < 0 || (pass == 0 && hi.used_ids && j->clear != DBXCR_IPC_CLEAR_BUT_SHM &&
				clear_kind(IPC_SHM, top) < 0)) {
			j->code = errno;
			j->step = pass ? "shmctl SHM_INFO" : "remove shared memory segments";
			return;
		}
		j->out.shm_segments = hi.used_ids;
		if (posix_queues(j, pass == 0) < 0) {
			j->code = errno;
			j->step = pass ? "list the POSIX message queues"
				       : "unlink the POSIX message queues";
			return;
		}
	}
}

static void *ipcns_thread(void *arg)
{
	struct ipcns_job *j = arg;

	if (setns(j->ipcns_fd, CLONE_NEWIPC) < 0) {
		j->code = errno;
		j->step = "setns into the IPC namespace";
	} else {
		j->work(j);
	}
	return NULL;
}

/* Run the job on a thread of its own in the namespace. */
static int run_job(struct ipcns_job *j, struct dbxcr_error *err)
{
	clear_error(err);
	if (on_own_thread(ipcns_thread, j, "join an IPC namespace", err) < 0)
		return -1;
	if (j->code && j->name)
		return fail(err, j->code, current_tid(), "IPC namespace fd %d: POSIX message "
			    "queue /%s: %s", j->ipcns_fd, j->name, j->step);
	if (j->code && j->id >= 0)
		return fail(err, j->code, current_tid(), "IPC namespace fd %d: %s %d: %s",
			    j->ipcns_fd, j->what ? j->what : "System V shared memory segment",
			    j->id, j->step);
	if (j->code)
		return fail(err, j->code, current_tid(), "IPC namespace fd %d: %s", j->ipcns_fd,
			    j->step);
	return 0;
}

/* A list call's end: on failure the memfds it had made are closed (each object `size`
 * bytes after the last, its fd `fd_at` bytes in) and nothing is listed. */
static int listed(int rc, const struct ipcns_job *j, void *out, size_t size, size_t fd_at,
		  size_t *n)
{
	for (size_t i = 0; rc < 0 && i < j->n; i++) {
		int fd;

		memcpy(&fd, (char *)out + i * size + fd_at, sizeof(fd));
		if (fd >= 0)
			close(fd);
	}
	*n = rc < 0 ? 0 : j->n;
	return rc;
}

int dbxcr_ipcns_mqueue_dir(int ipcns_fd, struct dbxcr_error *err)
{
	struct ipcns_job j = { .ipcns_fd = ipcns_fd, .work = open_mqueue_dir, .id = -1,
			       .mq_dir = -1 };

	return run_job(&j, err) < 0 ? -1 : j.mq_dir;
}

int dbxcr_ipcns_objects(int ipcns_fd, int clear, int mq_dir, struct dbxcr_ipc_objects *out,
			struct dbxcr_error *err)
{
	struct ipcns_job j = { .ipcns_fd = ipcns_fd, .work = count_objects, .id = -1,
			       .clear = clear, .mq_dir = mq_dir };

	if (run_job(&j, err) < 0)
		return -1;
	*out = j.out;
	return 0;
}

/* System V shared memory segments, captured and made again
 * ---------------------------------------------------------
 * A segment is memory of the namespace: a checkpoint copies it (the daemon, from the
 * descriptor shm_list gives), and a restore makes the namespace's segments those of the
 * checkpoint before any process is born, each with its id, so that every restored
 * process attaches it where the original had it (fork_template.c, attach_segment) and
 * calls naming the id (shmctl, a later shmat) find it.  An id is chosen through the
 * namespace's kernel.shm_next_id (the next segment made takes it; the kernel resets it
 * to -1), which, like every ipc sysctl, is the opener's IPC namespace's: the thread
 * opens it after joining the namespace. */

static unsigned long long page_up(unsigned long long n)
{
	unsigned long long page = (unsigned long long)sysconf(_SC_PAGESIZE);

	return (n + page - 1) / page * page;
}

/* A descriptor of the segment's memory (a file of the kernel's internal shmem mount),
 * through an attachment of our own, *at (the caller detaches it; (void *)-1 if none was
 * made): /proc/self/map_files opens the file a mapping maps.  -1 with errno set. */
static int segment_file(int id, unsigned long long size, int flags, void **at)
{
	char path[80];

	*at = shmat(id, NULL, flags == O_RDONLY ? SHM_RDONLY : 0);
	if (*at == (void *)-1)
		return -1;
	snprintf(path, sizeof(path), "/proc/self/map_files/%lx-%lx", (unsigned long)*at,
		 (unsigned long)*at + (unsigned long)page_up(size));
	return open(path, flags | O_CLOEXEC);
}

/* Detach our attachment, errno kept. */
static void detach(void *at)
{
	int saved = errno;

	if (at != (void *)-1)
		shmdt(at);
	errno = saved;
}

/* A read-only descriptor of the segment's memory. */
static int segment_fd(int id, unsigned long long size)
{
	void *at;
	int fd = segment_file(id, size, O_RDONLY, &at);

	detach(at);
	return fd;
}

/* Call fn for each segment of the namespace (SHM_STAT_ANY on every index up to the
 * highest in use), until one returns -1 having said why (j->code, j->step, j->id). */
static void each_segment(struct ipcns_job *j,
			 int (*fn)(struct ipcns_job *j, int id, const struct shmid_ds *d))
{
	struct shm_info hi;
	int top = shmctl(0, SHM_INFO, (struct shmid_ds *)&hi);

	if (top < 0) {
		j->code = errno;
		j->step = "shmctl SHM_INFO";
		return;
	}
	for (int i = 0; i <= top && hi.used_ids; i++) {
		struct shmid_ds d;
		int id = shmctl(i, SHM_STAT_ANY, &d);

		if (id >= 0 && fn(j, id, &d) < 0)
			return;
	}
}

static int list_segment(struct ipcns_job *j, int id, const struct shmid_ds *d)
{
	struct dbxcr_shm_segment *s;

	if (j->n == j->max) {
		j->code = ENOSPC;
		j->step = "more segments than the daemon captures";
		return -1;
	}
	s = &j->segs[j->n];
	*s = (struct dbxcr_shm_segment){ .id = id, .key = d->shm_perm.__key,
		.mode = d->shm_perm.mode, .uid = d->shm_perm.uid, .gid = d->shm_perm.gid,
		.nattch = (int)d->shm_nattch, .size = d->shm_segsz };
	s->fd = segment_fd(id, d->shm_segsz);
	if (s->fd < 0) {
		j->code = errno;
		j->step = "attach the segment to read it";
		j->id = id;
		return -1;
	}
	j->n++;
	return 0;
}

static void shm_list(struct ipcns_job *j)
{
	each_segment(j, list_segment);
}

/* Make the segment's memory fd's first `size` bytes: every page punched out, then fd's
 * data written, its holes (pages never written: zeros) left holes.  Through the
 * segment's own file (shmem), not an attachment: writing zeros would allocate them. */
static int fill_segment(int shm, unsigned long long size, int fd)
{
	off_t off = 0;

	if (fallocate(shm, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, (off_t)size) < 0)
		return -1;
	while (fd >= 0 && (unsigned long long)off < size) {
		off_t data = lseek(fd, off, SEEK_DATA), hole;

		if (data < 0)
			return errno == ENXIO ? 0 : -1;	/* ENXIO: only holes are left */
		hole = lseek(fd, data, SEEK_HOLE);
		if (hole < 0)
			return -1;
		if ((unsigned long long)hole > size)
			hole = (off_t)size;
		if (lseek(shm, data, SEEK_SET) < 0)
			return -1;
		for (off = data; off < hole;) {
			ssize_t r = sendfile(shm, fd, &off, (size_t)(hole - off));

			if (r <= 0) {
				if (r == 0)
					errno = EIO;	/* shorter than its size */
				return -1;
			}
		}
	}
	return 0;
}

/* Give the segment `id` fd's content, through an attachment of our own. */
static int fill_through_attachment(int id, unsigned long long size, int fd)
{
	void *at;
	int shm = segment_file(id, size, O_RDWR, &at), rc;

	rc = shm < 0 ? -1 : fill_segment(shm, size, fd);
	if (shm >= 0) {
		int saved = errno;

		close(shm);
		errno = saved;
	}
	detach(at);
	return rc;
}

/* A new segment with s's key, size and id (kernel.shm_next_id). */
/* Set the namespace's kernel.KIND_next_id (shm, msg, sem): the next object of that kind
 * made takes that id (the kernel resets it to -1). */
static int next_id(struct ipcns_job *j, const char *kind, int id)
{
	char path[48], text[16];
	int fd, n;

	j->step = "write its kind's kernel.*_next_id";
	snprintf(path, sizeof(path), "/proc/sys/kernel/%s_next_id", kind);
	fd = open(path, O_WRONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	n = snprintf(text, sizeof(text), "%d", id);
	if (full_write(fd, text, (size_t)n) < 0) {
		int saved = errno;

		close(fd);
		errno = saved;
		return -1;
	}
	return close(fd);
}

static int create_segment(struct ipcns_job *j, const struct dbxcr_shm_segment *s)
{
	int got;

	if (next_id(j, "shm", s->id) < 0)
		return -1;
	j->step = "shmget";
	got = shmget(s->key, s->size, IPC_CREAT | IPC_EXCL | (int)(s->mode & 0777));
	if (got >= 0 && got != s->id) {
		/* The id's index is held: an attached segment removed under another sequence
		 * number lives on until detached (the next free index was taken instead). */
		shmctl(got, IPC_RMID, NULL);
		errno = EBUSY;
		j->step = "its id's index is held by a removed segment still attached";
		return -1;
	}
	return got;
}

/* Until every restored process has attached it, a segment is open to all (its mode's
 * bits for others set: shm_modes sets its own back): a restored process attaches it
 * before it gets its own credentials back (creds.c: last), as root without
 * CAP_IPC_OWNER (a sandbox's bounding set lacks it), or as a parent's fork. */
#define RESTORE_MODE 0666

/* Whether the namespace's segment d, holding s's id, can be kept as s: the same key and
 * size, and removed only if s was. */
static bool keepable(const struct shmid_ds *d, const struct dbxcr_shm_segment *s)
{
	return d->shm_perm.__key == s->key && d->shm_segsz == s->size &&
	       (!(d->shm_perm.mode & SHM_DEST) || (s->mode & SHM_DEST));
}

/* Make one segment as s has it, with its id: the namespace's segment of that id if it can
 * be kept as s (the live one in a rollback, the processes that attached it gone), else a
 * new one, the other removed first (with no process attached, its id is free at once;
 * one still attached, by a process no rollback kills, is refilled, and says it was
 * removed); owner, mode (but RESTORE_MODE), lock and content as s's. */
static int make_segment(struct ipcns_job *j, struct dbxcr_shm_segment *s)
{
	struct shmid_ds d;
	bool there = shmctl(s->id, IPC_STAT, &d) == 0;

	if (!there && errno != EINVAL && errno != EIDRM)
		return -1;
	if (there && !keepable(&d, s)) {
		j->step = "remove the segment holding its id";
		if (!(d.shm_perm.mode & SHM_DEST) && shmctl(s->id, IPC_RMID, NULL) < 0)
			return -1;
		there = shmctl(s->id, IPC_STAT, &d) == 0;
		if (there && d.shm_segsz != s->size) {
			errno = EBUSY;
			j->step = "a segment of another size, still attached, holds its id";
			return -1;
		}
	}
	if (!there) {
		if (create_segment(j, s) < 0)
			return -1;
		j->step = "shmctl IPC_STAT";
		if (shmctl(s->id, IPC_STAT, &d) < 0)
			return -1;
	}
	s->removed = (d.shm_perm.mode & SHM_DEST) && !(s->mode & SHM_DEST);
	j->step = "shmctl IPC_SET (owner and mode)";
	d.shm_perm.uid = s->uid;
	d.shm_perm.gid = s->gid;
	d.shm_perm.mode = (s->mode & 0777) | RESTORE_MODE;
	if (shmctl(s->id, IPC_SET, &d) < 0)
		return -1;
	j->step = "shmctl SHM_LOCK / SHM_UNLOCK";
	if (shmctl(s->id, s->mode & SHM_LOCKED ? SHM_LOCK : SHM_UNLOCK, NULL) < 0)
		return -1;
	j->step = "fill the segment from its copy";
	return fill_through_attachment(s->id, s->size, s->fd);
}

/* Whether id is one of the segments to make. */
static bool wanted_id(const struct ipcns_job *j, int id)
{
	for (size_t i = 0; i < j->n; i++)
		if (j->segs[i].id == id)
			return true;
	return false;
}

/* A segment the restore does not make (made since the checkpoint) removed; one removed
 * already, and still attached, goes with its last detach. */
static int remove_unwanted(struct ipcns_job *j, int id, const struct shmid_ds *d)
{
	if (wanted_id(j, id) || (d->shm_perm.mode & SHM_DEST) ||
	    shmctl(id, IPC_RMID, NULL) == 0 || errno == EINVAL || errno == EIDRM)
		return 0;
	j->code = errno;
	j->step = "remove a segment made since";
	j->id = id;
	return -1;
}

/* The namespace's segments made exactly j->segs: others removed, and each made with its
 * id (make_segment).  The kernel frees an attached segment's id only at its last detach,
 * even once removed: the templates detach theirs (dbxcr_template_shmdt), and a rollback
 * makes these once the processes it killed are gone. */
static void shm_make(struct ipcns_job *j)
{
	each_segment(j, remove_unwanted);
	if (j->code)
		return;
	for (size_t i = 0; i < j->n; i++) {
		if (make_segment(j, &j->segs[i]) < 0) {
			j->code = errno;
			j->id = j->segs[i].id;
			return;
		}
	}
}

/* A segment's own mode, once every restored process has attached it; one the checkpoint
 * found removed while attached (SHM_DEST: keyless, gone at its last detach) removed
 * again, now that its processes hold it. */
static int settle_segment(struct ipcns_job *j, const struct dbxcr_shm_segment *s)
{
	struct shmid_ds d;

	j->step = "shmctl IPC_SET (its mode)";
	if (shmctl(s->id, IPC_STAT, &d) < 0)
		return -1;
	bool removed = d.shm_perm.mode & SHM_DEST;

	d.shm_perm.mode = s->mode & 0777;
	if (shmctl(s->id, IPC_SET, &d) < 0)
		return -1;
	j->step = "shmctl IPC_RMID (removed at the checkpoint)";
	if ((s->mode & SHM_DEST) && !removed && shmctl(s->id, IPC_RMID, NULL) < 0)
		return -1;
	return 0;
}

static void shm_modes(struct ipcns_job *j)
{
	for (size_t i = 0; i < j->n; i++) {
		if (settle_segment(j, &j->segs[i]) < 0) {
			j->code = errno;
			j->id = j->segs[i].id;
			return;
		}
	}
}

int dbxcr_ipcns_shm_list(int ipcns_fd, struct dbxcr_shm_segment *out, size_t max,
			 size_t *n, struct dbxcr_error *err)
{
	struct ipcns_job j = { .ipcns_fd = ipcns_fd, .work = shm_list, .id = -1, .segs = out,
			       .max = max };

	return listed(run_job(&j, err), &j, out, sizeof(*out),
		      offsetof(struct dbxcr_shm_segment, fd), n);
}

int dbxcr_ipcns_shm_make(int ipcns_fd, struct dbxcr_shm_segment *segs, size_t n,
			 struct dbxcr_error *err)
{
	struct ipcns_job j = { .ipcns_fd = ipcns_fd, .work = shm_make, .id = -1, .segs = segs,
			       .n = n };

	return run_job(&j, err);
}

int dbxcr_ipcns_shm_modes(int ipcns_fd, struct dbxcr_shm_segment *segs, size_t n,
			  struct dbxcr_error *err)
{
	struct ipcns_job j = { .ipcns_fd = ipcns_fd, .work = shm_modes, .id = -1, .segs = segs,
			       .n = n };

	return run_job(&j, err);
}

/* System V message queues, captured and made again
 * -------------------------------------------------
 * A queue is the namespace's, as a segment is: a checkpoint copies its messages without
 * taking them (msgrcv MSG_COPY reads the message at an index and leaves it queued; the
 * kernel has it with CONFIG_CHECKPOINT_RESTORE, as it has the *_next_id sysctls), and a
 * restore makes the namespace's queues exactly the checkpoint's before any process is
 * born, each with its id (kernel.msg_next_id, as for segments), so that a process that
 * kept a queue's id finds it, and its messages sent again in their order.  Not kept: the
 * creator's ids, the last sender's and receiver's pids, the times. */

/* One message record of a queue's copy: its type and length, then its bytes. */
struct msg_head {
	uint64_t type;
	uint64_t len;
};

/* Copy the queue's d->msg_qnum messages, in order, into a new memfd (q->fd). */
static int copy_messages(struct ipcns_job *j, int id, const struct msqid_ds *d,
			 struct dbxcr_msg_queue *q)
{
	/* No message is longer than all of the queue's bytes together. */
	size_t cap = (size_t)d->__msg_cbytes + 1;
	struct { long type; char text[]; } *buf = malloc(sizeof(long) + cap);
	int rc = 0;

	j->step = "allocate a buffer for its messages";
	if (!buf)
		return -1;
	j->step = "memfd_create for its messages";
	q->fd = memfd_create("dbx-sysv-msg", MFD_CLOEXEC);
	if (q->fd < 0) {
		free(buf);
		return -1;
	}
	for (unsigned long long i = 0; i < (unsigned long long)d->msg_qnum && rc == 0; i++) {
		ssize_t len = msgrcv(id, buf, cap, (long)i, IPC_NOWAIT | MSG_COPY);
		struct msg_head h;

		if (len < 0) {
			j->step = "msgrcv MSG_COPY (read a message, leaving it queued)";
			rc = -1;
			break;
		}
		h = (struct msg_head){ .type = (uint64_t)buf->type, .len = (uint64_t)len };
		j->step = "write a message to its copy";
		rc = full_write(q->fd, &h, sizeof(h));
		if (rc == 0)
			rc = full_write(q->fd, buf->text, (size_t)len);
		q->bytes += (unsigned long long)len;
		q->count++;
	}
	free(buf);
	return rc;
}

static int list_queue(struct ipcns_job *j, int id, const struct msqid_ds *d)
{
	struct dbxcr_msg_queue *q;

	if (j->n == j->max) {
		errno = ENOSPC;
		j->step = "more message queues than the daemon captures";
		return -1;
	}
	q = &j->queues[j->n];
	*q = (struct dbxcr_msg_queue){ .id = id, .key = d->msg_perm.__key,
		.mode = d->msg_perm.mode, .uid = d->msg_perm.uid, .gid = d->msg_perm.gid,
		.qbytes = d->msg_qbytes, .fd = -1 };
	j->n++;  /* its fd is closed by the caller on failure */
	return copy_messages(j, id, d, q);
}

/* Call fn for each message queue of the namespace (MSG_STAT_ANY on every index up to the
 * highest in use) until one fails (-1, errno and j->step set: j->code and j->id here). */
static void each_queue(struct ipcns_job *j,
		       int (*fn)(struct ipcns_job *j, int id, const struct msqid_ds *d))
{
	struct msginfo mi;
	int top = msgctl(0, MSG_INFO, (struct msqid_ds *)&mi);

	if (top < 0) {
		j->code = errno;
		j->step = "msgctl MSG_INFO";
		return;
	}
	for (int i = 0; i <= top && mi.msgpool; i++) {
		struct msqid_ds d;
		int id = msgctl(i, MSG_STAT_ANY, &d);

		if (id >= 0 && fn(j, id, &d) < 0) {
			j->code = errno;
			j->id = id;
			return;
		}
	}
}

static void msg_list(struct ipcns_job *j)
{
	each_queue(j, list_queue);
}

static int remove_queue(struct ipcns_job *j, int id, const struct msqid_ds *d)
{
	(void)d;
	j->step = "remove a message queue";
	return msgctl(id, IPC_RMID, NULL) == 0 || errno == EINVAL || errno == EIDRM ? 0 : -1;
}

/* Call send(j, to, head, text, len) for each message record of the copy `fd` (a
 * struct msg_head then its bytes; head: the type or priority), in order, until one fails.
 * The head's 16 bytes right before text are the caller's to write over. */
static int each_message(struct ipcns_job *j, int fd, int to,
			int (*send)(struct ipcns_job *j, int to, uint64_t head, char *text,
				    size_t len))
{
	struct stat st;
	char *all;
	size_t at = 0;
	int rc = 0;

	if (fd < 0)
		return 0;
	j->step = "read its messages' copy";
	if (fstat(fd, &st) < 0)
		return -1;
	all = malloc((size_t)st.st_size + 1);
	if (!all)
		return -1;
	if (pread(fd, all, (size_t)st.st_size, 0) != st.st_size) {
		if (errno == 0)
			errno = EIO;
		free(all);
		return -1;
	}
	while (at + sizeof(struct msg_head) <= (size_t)st.st_size) {
		struct msg_head h;
		char *rec = all + at;

		memcpy(&h, rec, sizeof(h));
		if (h.len > (size_t)st.st_size - at - sizeof(h)) {
			errno = EIO;
			j->step = "a message of the copy is cut short";
			rc = -1;
			break;
		}
		if (send(j, to, h.type, rec + sizeof(h), (size_t)h.len) < 0) {
			rc = -1;
			break;
		}
		at += sizeof(h) + (size_t)h.len;
	}
	free(all);
	return rc;
}

static int sysv_send(struct ipcns_job *j, int id, uint64_t type, char *text, size_t len)
{
	/* msgsnd takes the type right before the text: over the record's length. */
	long t = (long)type;
	char *msg = text - sizeof(long);

	memcpy(msg, &t, sizeof(long));
	j->step = "msgsnd (a message of the copy)";
	return msgsnd(id, msg, len, IPC_NOWAIT);
}

/* Send the messages of q's copy again, in order.  The queue's limit is raised for it
 * first (a limit lowered below what a queue held stops only later senders), and no
 * message may wait: IPC_NOWAIT. */
static int send_messages(struct ipcns_job *j, const struct dbxcr_msg_queue *q)
{
	return each_message(j, q->fd, q->id, sysv_send);
}

/* A queue as q has it: made with its id and key, filled, then given its owner, mode and
 * limit. */
static int make_queue(struct ipcns_job *j, const struct dbxcr_msg_queue *q)
{
	struct msqid_ds d;
	int got;

	if (next_id(j, "msg", q->id) < 0)
		return -1;
	j->step = "msgget";
	got = msgget(q->key, IPC_CREAT | IPC_EXCL | 0600);
	if (got < 0)
		return -1;
	if (got != q->id) {
		msgctl(got, IPC_RMID, NULL);
		errno = EBUSY;
		j->step = "it was not given its id";
		return -1;
	}
	j->step = "msgctl IPC_STAT";
	if (msgctl(got, IPC_STAT, &d) < 0)
		return -1;
	if (d.msg_qbytes < q->bytes) {
		d.msg_qbytes = q->bytes;
		j->step = "msgctl IPC_SET (room for its messages)";
		if (msgctl(got, IPC_SET, &d) < 0)
			return -1;
	}
	if (send_messages(j, q) < 0)
		return -1;
	d.msg_perm.uid = q->uid;
	d.msg_perm.gid = q->gid;
	d.msg_perm.mode = q->mode & 0777;
	d.msg_qbytes = q->qbytes;
	j->step = "msgctl IPC_SET (owner, mode and limit)";
	return msgctl(got, IPC_SET, &d);
}

/* The namespace's queues made exactly j->make_queues: every queue there removed (in a
 * rollback, made since or changed since; no process that used them is left), then each
 * made with its id and messages. */
static void msg_make(struct ipcns_job *j)
{
	each_queue(j, remove_queue);
	if (j->code)
		return;
	for (size_t i = 0; i < j->n; i++) {
		if (make_queue(j, &j->make_queues[i]) < 0) {
			j->code = errno;
			j->id = j->make_queues[i].id;
			return;
		}
	}
}

int dbxcr_ipcns_msg_list(int ipcns_fd, struct dbxcr_msg_queue *out, size_t max, size_t *n,
			 struct dbxcr_error *err)
{
	struct ipcns_job j = { .ipcns_fd = ipcns_fd, .work = msg_list, .id = -1, .queues = out,
			       .max = max, .what = "System V message queue" };

	return listed(run_job(&j, err), &j, out, sizeof(*out),
		      offsetof(struct dbxcr_msg_queue, fd), n);
}

int dbxcr_ipcns_msg_make(int ipcns_fd, const struct dbxcr_msg_queue *queues, size_t n,
			 struct dbxcr_error *err)
{
	struct ipcns_job j = { .ipcns_fd = ipcns_fd, .work = msg_make, .id = -1,
			       .make_queues = queues, .n = n, .what = "System V message queue" };

	return run_job(&j, err);
}

/* System V semaphore sets, captured and made again
 * -------------------------------------------------
 * As queues: each set's values (GETALL) are copied at the checkpoint into a memfd of ours,
 * and a restore makes the namespace's sets exactly the checkpoint's before any process is
 * born, each with its id (kernel.sem_next_id), key and size, its values (SETALL), owner
 * and mode.  A process's undo adjustments (SEM_UNDO) are its own kernel state, which no
 * call reads: the daemon refuses a process that has them (kcmp KCMP_SYSVSEM, cr/sysv_sem.py).
 * Not kept: the creator's ids, each semaphore's last pid, the times. */

static int list_set(struct ipcns_job *j, int id, const struct semid_ds *d)
{
	struct dbxcr_sem_set *set;
	size_t len = d->sem_nsems * sizeof(unsigned short);
	unsigned short *values;
	union semun_arg a;
	int rc = -1;

	if (j->n == j->max) {
		errno = ENOSPC;
		j->step = "more semaphore sets than the daemon captures";
		return -1;
	}
	set = &j->sets[j->n];
	*set = (struct dbxcr_sem_set){ .id = id, .key = d->sem_perm.__key,
		.mode = d->sem_perm.mode, .uid = d->sem_perm.uid, .gid = d->sem_perm.gid,
		.nsems = (int)d->sem_nsems, .fd = -1 };
	j->n++;  /* its fd is closed by the caller on failure */
	j->step = "allocate a buffer for its values";
	values = malloc(len ? len : 1);
	if (!values)
		return -1;
	a.array = values;
	j->step = "semctl GETALL";
	if (semctl(id, 0, GETALL, a) < 0)
		goto out;
	j->step = "memfd_create for its values";
	set->fd = memfd_create("dbx-sysv-sem", MFD_CLOEXEC);
	if (set->fd < 0)
		goto out;
	j->step = "write its values";
	rc = full_write(set->fd, values, len);
out:
	free(values);
	return rc;
}

/* Call fn for each semaphore set of the namespace (SEM_STAT_ANY on every index up to the
 * highest in use) until one fails (-1, errno and j->step set: j->code and j->id here). */
static void each_set(struct ipcns_job *j,
		     int (*fn)(struct ipcns_job *j, int id, const struct semid_ds *d))
{
	struct seminfo si;
	union semun_arg a = { .info = &si };
	int top = semctl(0, 0, SEM_INFO, a);

	if (top < 0) {
		j->code = errno;
		j->step = "semctl SEM_INFO";
		return;
	}
	for (int i = 0; i <= top && si.semusz; i++) {
		struct semid_ds d;
		union semun_arg b = { .buf = &d };
		int id = semctl(i, 0, SEM_STAT_ANY, b);

		if (id >= 0 && fn(j, id, &d) < 0) {
			j->code = errno;
			j->id = id;
			return;
		}
	}
}

static void sem_list(struct ipcns_job *j)
{
	each_set(j, list_set);
}

static int remove_set(struct ipcns_job *j, int id, const struct semid_ds *d)
{
	(void)d;
	j->step = "remove a semaphore set";
	return semctl(id, 0, IPC_RMID) == 0 || errno == EINVAL || errno == EIDRM ? 0 : -1;
}

/* A set as s has it: made with its id, key and size, given its values, then its owner and
 * mode. */
static int make_set(struct ipcns_job *j, const struct dbxcr_sem_set *s)
{
	size_t len = (size_t)s->nsems * sizeof(unsigned short);
	unsigned short *values;
	struct semid_ds d;
	union semun_arg a = { .buf = &d };
	int got, rc = -1;

	if (next_id(j, "sem", s->id) < 0)
		return -1;
	j->step = "semget";
	got = semget(s->key, s->nsems, IPC_CREAT | IPC_EXCL | 0600);
	if (got < 0)
		return -1;
	if (got != s->id) {
		semctl(got, 0, IPC_RMID);
		errno = EBUSY;
		j->step = "it was not given its id";
		return -1;
	}
	j->step = "read its values' copy";
	values = malloc(len ? len : 1);
	if (!values)
		return -1;
	if (s->fd >= 0 && pread(s->fd, values, len, 0) != (ssize_t)len) {
		if (errno == 0)
			errno = EIO;
		goto out;
	}
	if (s->fd >= 0) {
		union semun_arg all = { .array = values };

		j->step = "semctl SETALL";
		if (semctl(got, 0, SETALL, all) < 0)
			goto out;
	}
	j->step = "semctl IPC_STAT";
	if (semctl(got, 0, IPC_STAT, a) < 0)
		goto out;
	d.sem_perm.uid = s->uid;
	d.sem_perm.gid = s->gid;
	d.sem_perm.mode = s->mode & 0777;
	j->step = "semctl IPC_SET (owner and mode)";
	rc = semctl(got, 0, IPC_SET, a);
out:
	free(values);
	return rc;
}

/* The namespace's sets made exactly j->make_sets: every set there removed (in a rollback,
 * made or changed since; no process that used them is left), then each made with its id and
 * values. */
static void sem_make(struct ipcns_job *j)
{
	each_set(j, remove_set);
	if (j->code)
		return;
	for (size_t i = 0; i < j->n; i++) {
		if (make_set(j, &j->make_sets[i]) < 0) {
			j->code = errno;
			j->id = j->make_sets[i].id;
			return;
		}
	}
}

int dbxcr_ipcns_sem_list(int ipcns_fd, struct dbxcr_sem_set *out, size_t max, size_t *n,
			 struct dbxcr_error *err)
{
	struct ipcns_job j = { .ipcns_fd = ipcns_fd, .work = sem_list, .id = -1, .sets = out,
			       .max = max, .what = "System V semaphore set" };

	return listed(run_job(&j, err), &j, out, sizeof(*out),
		      offsetof(struct dbxcr_sem_set, fd), n);
}

int dbxcr_ipcns_sem_make(int ipcns_fd, const struct dbxcr_sem_set *sets, size_t n,
			 struct dbxcr_error *err)
{
	struct ipcns_job j = { .ipcns_fd = ipcns_fd, .work = sem_make, .id = -1,
			       .make_sets = sets, .n = n, .what = "System V semaphore set" };

	return run_job(&j, err);
}

/* POSIX message queues, captured and made again
 * ----------------------------------------------
 * A queue is a file of the namespace's mqueue file system (see the file comment), and any
 * open file of it is a queue descriptor to the mq_* calls (the kernel checks the file's
 * operations, not how it was opened).  No call reads a message and leaves it queued, so
 * a checkpoint (every process of the sandbox stopped: a stop takes a task out of a wait
 * on the queue, to make the call again once it runs, so none waits to send or receive)
 * receives the queue's messages into a memfd of ours in the order a receiver gets them
 * (highest priority first, oldest first within one) and sends them back in that order,
 * which gives back the same queue.  Not while a process is registered for the queue's
 * notification (mq_notify): a message sent to the emptied queue would fire it; the daemon
 * refuses such a queue (its pid is listed).  A daemon killed between the two calls loses
 * the messages it held from the live queue (that checkpoint is not committed), as for a
 * pty's bytes (cr/ptys.py).  A restore makes the namespace's queues exactly the
 * checkpoint's, each with its name, sizes, owner, mode and messages, before any process
 * is born; a restored process's descriptors are opened on them (dbxcr_ipcns_mq_open) and
 * installed by its spawn.  Not kept: the times. */

static int posix_send(struct ipcns_job *j, int q, uint64_t prio, char *text, size_t len)
{
	j->step = "mq_send (a message of the copy)";
	return mq_send(q, text, len, (unsigned int)prio);
}

/* The pid registered for the queue's notification, from the status line a read of its
 * file gives ("QSIZE:... NOTIFY:... SIGNO:... NOTIFY_PID:n"), into *pid. */
static int notify_pid(struct ipcns_job *j, int q, int *pid)
{
	char line[160];
	ssize_t n = pread(q, line, sizeof(line) - 1, 0);
	const char *at;

	j->step = "read its status";
	if (n < 0)
		return -1;
	line[n] = '\0';
	at = strstr(line, "NOTIFY_PID:");
	if (!at) {
		errno = EPROTO;
		j->step = "read its status (no NOTIFY_PID in it)";
		return -1;
	}
	*pid = (int)strtol(at + strlen("NOTIFY_PID:"), NULL, 10);
	return 0;
}

/* Take the queue's a->mq_curmsgs messages into q->fd, then send them back.  A failure
 * after a message was taken still sends back what was taken (the one in hand last; the
 * copy is then dropped). */
static int copy_posix_messages(struct ipcns_job *j, int q, const struct mq_attr *a,
			       struct dbxcr_posix_queue *pq)
{
	size_t cap = (size_t)a->mq_msgsize;
	char *buf = malloc(cap ? cap : 1);
	ssize_t held = -1;
	unsigned int prio = 0;
	int rc = 0, saved;

	j->step = "allocate a buffer for its messages";
	if (!buf)
		return -1;
	j->step = "memfd_create for its messages";
	pq->fd = memfd_create("dbx-posix-mq", MFD_CLOEXEC);
	if (pq->fd < 0) {
		free(buf);
		return -1;
	}
	for (long i = 0; i < a->mq_curmsgs; i++) {
		struct msg_head h;

		j->step = "mq_receive (take a message, to send it back)";
		held = mq_receive(q, buf, cap, &prio);
		if (held < 0) {
			rc = -1;
			break;
		}
		h = (struct msg_head){ .type = prio, .len = (uint64_t)held };
		j->step = "write a message to its copy";
		if (full_write(pq->fd, &h, sizeof(h)) < 0 ||
		    full_write(pq->fd, buf, (size_t)held) < 0) {
			rc = -1;
			break;
		}
		held = -1;
		pq->bytes += h.len;
		pq->count++;
	}
	saved = errno;
	const char *step = j->step;
	/* A record cut short by the failed write is not sent back. */
	if (rc < 0 && ftruncate(pq->fd, (off_t)(pq->count * sizeof(struct msg_head) +
						pq->bytes)) < 0)
		saved = saved ? saved : errno;
	if (each_message(j, pq->fd, q, posix_send) < 0) {
		rc = -1;
	} else if (rc < 0) {
		if (held >= 0)
			mq_send(q, buf, (size_t)held, prio);
		errno = saved;
		j->step = step;
	}
	free(buf);
	return rc;
}

/* The queue open at q into pq (its name aside): sizes, owner, mode, the process
 * registered for its notification, and (unless one is) a copy of its messages. */
static int capture_queue(struct ipcns_job *j, int q, struct dbxcr_posix_queue *pq)
{
	struct mq_attr a;
	struct stat st;

	j->step = "mq_getattr";
	if (mq_getattr(q, &a) < 0)
		return -1;
	j->step = "fstat";
	if (fstat(q, &st) < 0)
		return -1;
	pq->mode = st.st_mode & 07777;
	pq->uid = st.st_uid;
	pq->gid = st.st_gid;
	pq->maxmsg = a.mq_maxmsg;
	pq->msgsize = a.mq_msgsize;
	if (notify_pid(j, q, &pq->notify_pid) < 0)
		return -1;
	return pq->notify_pid ? 0 : copy_posix_messages(j, q, &a, pq);
}

static int list_posix_queue(struct ipcns_job *j, int dir, const char *name)
{
	struct dbxcr_posix_queue *pq;
	int q, rc;

	if (j->n == j->max) {
		errno = ENOSPC;
		j->step = "more POSIX message queues than the daemon captures";
		return -1;
	}
	pq = &j->pqueues[j->n];
	*pq = (struct dbxcr_posix_queue){ .fd = -1 };
	if (strlen(name) >= sizeof(pq->name)) {
		errno = ENAMETOOLONG;
		j->step = "its name";
		return -1;
	}
	strcpy(pq->name, name);
	j->step = "open it";
	q = openat(dir, name, O_RDWR | O_NONBLOCK | O_CLOEXEC);
	if (q < 0)
		return errno == ENOENT ? 0 : -1;   /* unlinked meanwhile: not listed */
	j->n++;  /* its fd is closed by the caller on failure */
	rc = capture_queue(j, q, pq);
	int saved = errno;
	close(q);
	errno = saved;
	return rc;
}

/* Call fn for each queue of the namespace (through a mount of its mqueue file system made
 * for the call) until one fails (j->code, j->name set). */
static void each_posix_queue(struct ipcns_job *j,
			     int (*fn)(struct ipcns_job *j, int dir, const char *name))
{
	int mnt = mqueue_mount();

	if (mnt < 0) {
		j->code = errno;
		j->step = "mount the namespace's mqueue file system (detached)";
		return;
	}
	j->step = "list the POSIX message queues";
	if (each_queue_in(j, mnt, fn) < 0)
		j->code = errno;
	close(mnt);
}

static void mq_list(struct ipcns_job *j)
{
	each_posix_queue(j, list_posix_queue);
}

/* A queue as pq has it: made with its name and sizes, filled, then given its owner and
 * mode. */
static int make_posix_queue(struct ipcns_job *j, const struct dbxcr_posix_queue *pq)
{
	struct mq_attr a = { .mq_maxmsg = pq->maxmsg, .mq_msgsize = pq->msgsize };
	char path[DBXCR_MQ_NAME + 1];
	int q, rc = -1;

	snprintf(path, sizeof(path), "/%s", pq->name);
	j->step = "mq_open O_CREAT|O_EXCL";
	/* The mqueue file system of a namespace owned by a user namespace makes files only
	 * for fs ids that namespace maps (EOVERFLOW for ours, root's): the queue is made with
	 * its owner's as this thread's (setfsuid acts on the calling thread alone; the file
	 * capabilities it drops come back with fs id 0, for the fchown and fchmod below). */
	setfsgid(pq->gid);
	setfsuid(pq->uid);
	q = mq_open(path, O_CREAT | O_EXCL | O_RDWR | O_NONBLOCK | O_CLOEXEC, 0600, &a);
	int saved = errno;
	setfsuid(0);
	setfsgid(0);
	errno = saved;
	/* The kernel charges a queue's size to its creator's user (the daemon's: root, as
	 * are a sandbox's processes by default), within the creator's RLIMIT_MSGQUEUE. */
	if (q < 0 && errno == EMFILE)
		j->step = "mq_open O_CREAT|O_EXCL (the queues of the daemon's user fill its "
			  "RLIMIT_MSGQUEUE)";
	if (q < 0)
		return -1;
	if (each_message(j, pq->fd, q, posix_send) < 0)
		goto out;
	j->step = "fchown (its owner)";
	if (fchown(q, pq->uid, pq->gid) < 0)
		goto out;
	j->step = "fchmod (its mode)";
	rc = fchmod(q, pq->mode & 07777);
out:
	if (rc < 0) {
		int saved = errno;
		close(q);
		errno = saved;
		return -1;
	}
	return close(q);
}

/* The namespace's queues made exactly j->make_pqueues: every queue there unlinked (in a
 * rollback, made or changed since; a killed process still holding one holds it nameless),
 * then each made with its messages. */
static void mq_make(struct ipcns_job *j)
{
	each_posix_queue(j, unlink_posix_queue);
	if (j->code)
		return;
	for (size_t i = 0; i < j->n; i++) {
		if (make_posix_queue(j, &j->make_pqueues[i]) < 0) {
			j->code = errno;
			j->name = j->make_pqueues[i].name;
			return;
		}
	}
}

/* Each of the j->n descriptors asked for (names, flags) into fds, in one thread; on a
 * failure those opened are closed. */
static void mq_open_job(struct ipcns_job *j)
{
	char path[DBXCR_MQ_NAME + 1];
	size_t i;

	j->step = "mq_open";
	for (i = 0; i < j->n; i++) {
		snprintf(path, sizeof(path), "/%s", j->names[i]);
		j->fds[i] = mq_open(path, (j->open_flags[i] & (O_ACCMODE | O_NONBLOCK)) |
				    O_CLOEXEC);
		if (j->fds[i] < 0) {
			j->code = errno;
			j->name = j->names[i];
			break;
		}
	}
	if (j->code)
		while (i-- > 0)
			close(j->fds[i]);
}

/* Unlink the j->n queues named (those made only for their holders to open). */
static void mq_unlink_job(struct ipcns_job *j)
{
	char path[DBXCR_MQ_NAME + 1];

	j->step = "mq_unlink";
	for (size_t i = 0; i < j->n; i++) {
		snprintf(path, sizeof(path), "/%s", j->names[i]);
		if (mq_unlink(path) < 0 && errno != ENOENT) {
			j->code = errno;
			j->name = j->names[i];
			return;
		}
	}
}

int dbxcr_ipcns_mq_unlink(int ipcns_fd, const char *const *names, size_t n,
			  struct dbxcr_error *err)
{
	struct ipcns_job j = { .ipcns_fd = ipcns_fd, .work = mq_unlink_job, .id = -1,
			       .names = names, .n = n };

	return run_job(&j, err);
}

int dbxcr_mq_capture_fd(int q, struct dbxcr_posix_queue *out, struct dbxcr_error *err)
{
	struct ipcns_job j = { .id = -1 };
	char name[DBXCR_MQ_NAME];

	clear_error(err);
	memcpy(name, out->name, sizeof(name));
	*out = (struct dbxcr_posix_queue){ .fd = -1 };
	memcpy(out->name, name, sizeof(name));
	if (capture_queue(&j, q, out) < 0) {
		int saved = errno;

		if (out->fd >= 0)
			close(out->fd);
		out->fd = -1;
		return fail(err, saved, current_tid(), "POSIX message queue (fd %d, to be /%.*s): "
			    "%s", q, DBXCR_MQ_NAME - 1, name, j.step);
	}
	return 0;
}

int dbxcr_ipcns_mq_list(int ipcns_fd, struct dbxcr_posix_queue *out, size_t max, size_t *n,
			struct dbxcr_error *err)
{
	struct ipcns_job j = { .ipcns_fd = ipcns_fd, .work = mq_list, .id = -1, .pqueues = out,
			       .max = max };

	return listed(run_job(&j, err), &j, out, sizeof(*out),
		      offsetof(struct dbxcr_posix_queue, fd), n);
}

int dbxcr_ipcns_mq_make(int ipcns_fd, const struct dbxcr_posix_queue *queues, size_t n,
			struct dbxcr_error *err)
{
	struct ipcns_job j = { .ipcns_fd = ipcns_fd, .work = mq_make, .id = -1,
			       .make_pqueues = queues, .n = n };

	return run_job(&j, err);
}

int dbxcr_ipcns_mq_open(int ipcns_fd, const char *const *names, const int *flags, int *fds,
			size_t n, struct dbxcr_error *err)
{
	struct ipcns_job j = { .ipcns_fd = ipcns_fd, .work = mq_open_job, .id = -1,
			       .names = names, .open_flags = flags, .fds = fds, .n = n };

	for (size_t i = 0; i < n; i++) {
		if (strlen(names[i]) >= DBXCR_MQ_NAME) {
			clear_error(err);
			return fail(err, ENAMETOOLONG, current_tid(),
				    "POSIX message queue /%s: its name", names[i]);
		}
	}
	return run_job(&j, err);
}
