/* Target process for test_criu_incr.c (built without sanitizers, exec'ed by the test).
 *   criu_target NPAGES : patterned anonymous memory + .data/.bss/heap state; commands on
 *                        stdin, one per line, answers on stdout:
 *                          s      -> "sum <hex> <ncmds> <xmm>"   (checksum of all state)
 *                          m K    -> mutate pages [0, K) and answer "ok"
 *                          a      -> "at <address of the patterned memory>"
 *                          q      -> exit 0
 *   criu_target host   : a restore host: reaps children forever. */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

static uint64_t data_words[512] = { 1, 2, 3 };	/* .data: private file mapping, CoW'd */
static uint64_t bss_words[4096];		/* .bss: anonymous */

static uint64_t mix(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdULL;
	x ^= x >> 33;
	return x;
}

static int readline(char *buf, size_t len)
{
	size_t n = 0;

	while (n + 1 < len) {
		char c;
		ssize_t r = read(0, &c, 1);

		if (r <= 0)
			return -1;
		if (c == '\n')
			break;
		buf[n++] = c;
	}
	buf[n] = '\0';
	return 0;
}

int main(int argc, char **argv)
{
	if (argc > 1 && strcmp(argv[1], "host") == 0) {
		for (;;)
			if (waitpid(-1, NULL, 0) < 0)
				pause();
	}
	long npages = argc > 1 ? atol(argv[1]) : 256;
	uint64_t *mem = mmap(NULL, npages * 4096, PROT_READ | PROT_WRITE,
			     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	uint64_t *heap = malloc(100000 * sizeof(uint64_t));
	volatile double xmm = 1.5;	/* lives on the stack, checked across restores */
	uint64_t ncmds = 0;
	char line[128];

	if (mem == MAP_FAILED || !heap)
		return 2;
	for (long p = 0; p < npages; p++)
		for (int w = 0; w < 512; w++)
			mem[p * 512 + w] = mix((uint64_t)p * 512 + w + 1);
	for (int i = 0; i < 100000; i++)
		heap[i] = mix(i + 7);
	for (int i = 0; i < 512; i++)
		data_words[i] = mix(i + 99);
	for (int i = 0; i < 4096; i++)
		bss_words[i] = mix(i + 1234);
	while (readline(line, sizeof(line)) == 0) {
		ncmds++;
		if (line[0] == 's') {
			uint64_t h = 0;

			for (long i = 0; i < npages * 512; i++)
				h = mix(h ^ mem[i]);
			for (int i = 0; i < 100000; i++)
				h = mix(h ^ heap[i]);
			for (int i = 0; i < 512; i++)
				h = mix(h ^ data_words[i]);
			for (int i = 0; i < 4096; i++)
				h = mix(h ^ bss_words[i]);
			printf("sum %016llx %llu %.3f\n", (unsigned long long)h,
			       (unsigned long long)ncmds, xmm);
			fflush(stdout);
		} else if (line[0] == 'm') {
			long k = atol(line + 2);

			for (long p = 0; p < k && p < npages; p++)
				mem[p * 512 + (p % 512)] += ncmds;
			data_words[ncmds % 512]++;
			xmm += 1.0;
			printf("ok\n");
			fflush(stdout);
		} else if (line[0] == 'a') {
			printf("at %p\n", (void *)mem);
			fflush(stdout);
		} else if (line[0] == 'q') {
			return 0;
		}
	}
	return 1;
}
