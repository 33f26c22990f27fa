/* Helpers shared by the native test programs. */
#ifndef DBX_TEST_UTIL_H
#define DBX_TEST_UTIL_H

#include <stdio.h>
#include <string.h>
#include <sys/types.h>

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

#endif
