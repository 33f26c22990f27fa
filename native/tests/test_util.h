/* Helpers shared by the native test programs. */
#ifndef DBX_TEST_UTIL_H
#define DBX_TEST_UTIL_H

#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

/* /proc/pid/<name> (one read: stat, syscall, fdinfo/N ...) into buf, NUL-terminated; its
 * length, -1 if the process is gone or the file empty. */
static inline ssize_t proc_read(pid_t pid, const char *name, char *buf, size_t len)
{
	char path[96];
	ssize_t n;
	int fd;

	snprintf(path, sizeof(path), "/proc/%d/%s", (int)pid, name);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	n = read(fd, buf, len - 1);
	close(fd);
	if (n <= 0)
		return -1;
	buf[n] = '\0';
	return n;
}

/* /proc/pid/comm without its newline ("" if the process is gone). */
static inline const char *comm_of(pid_t pid, char buf[32])
{
	char path[64];
	FILE *f;

	buf[0] = '\0';
	snprintf(path, sizeof(path), "/proc/%d/comm", (int)pid);
	f = fopen(path, "re");
	if (!f)
		return buf;
	if (!fgets(buf, 32, f))
		buf[0] = '\0';
	fclose(f);
	buf[strcspn(buf, "\n")] = '\0';
	return buf;
}

/* /proc/pid/cmdline into buf (NULs between arguments kept); its length, -1 if unreadable. */
static inline ssize_t cmdline_of(pid_t pid, char *buf, size_t len)
{
	char path[64];
	FILE *f;
	size_t n;

	snprintf(path, sizeof(path), "/proc/%d/cmdline", (int)pid);
	f = fopen(path, "re");
	if (!f)
		return -1;
	n = fread(buf, 1, len, f);
	fclose(f);
	return (ssize_t)n;
}

/* Whether a and b have the same, non-empty command line. */
static inline int same_cmdline(pid_t a, pid_t b)
{
	char x[4096], y[4096];
	ssize_t n = cmdline_of(a, x, sizeof(x)), m = cmdline_of(b, y, sizeof(y));

	return n > 0 && n == m && memcmp(x, y, (size_t)n) == 0;
}

#endif
