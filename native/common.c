#include "common.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

int dbx_exit_code(int status)
{
	if (WIFEXITED(status))
		return WEXITSTATUS(status);
	if (WIFSIGNALED(status))
		return 128 + WTERMSIG(status);
	return DBX_EXIT_SETUP;
}
