/* Many injected system calls in one stop.
 *
 * An injected call (fork_template.c: remote_syscall) is a round trip through the tracee:
 * set its registers, single-step it over a syscall instruction, wait for the trap, read
 * the registers back: about 12 us with the tracee on our CPU, 55 us across CPUs on these
 * VMs (fork_template.c: colocate).  A restore from an image (criu_incr.c) makes a hundred
 * and more of them, a mapping each, an action per signal, all known in advance and none
 * needing another's result.
 * The restorer's own code page carries a loop (batch_loop) that runs a table of calls
 * written into the tracee's scratch area, stores each result beside its call and traps
 * (int3) after the last one or at the first that fails: one round trip for a whole step.
 *
 * The loop is entered with r12 = the table, r13 = the number of calls; it keeps both
 * current, so at the trap r13 counts the calls not done (the failed one included) and rax
 * holds the failed call's result.  Each entry is eight words: nr, six arguments, result.
 * A signal stop in between (SIGSTOP: every other signal is blocked while we work) is taken
 * as remote_syscall takes it, and a call it interrupted is restarted by the kernel as any
 * call is (rip moved back onto the syscall instruction, rax = its number again: the
 * argument registers still hold its arguments).
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/ptrace.h>

#include "dbxcr_internal.h"

/* x86_64, position-independent:
 *	1: test r13, r13;  jz 2f
 *	   mov rax, [r12];  mov rdi, [r12+8];  mov rsi, [r12+16];  mov rdx, [r12+24]
 *	   mov r10, [r12+32];  mov r8, [r12+40];  mov r9, [r12+48]
 *	   syscall
 *	   mov [r12+56], rax
 *	   cmp rax, -4095;  jae 2f		(unsigned: -4095..-1 is an error)
 *	   add r12, 64;  dec r13;  jmp 1b
 *	2: int3 */
const unsigned char batch_loop[BATCH_LOOP_LEN] = {
	0x4d, 0x85, 0xed, 0x74, 0x3a, 0x49, 0x8b, 0x04, 0x24, 0x49, 0x8b, 0x7c, 0x24, 0x08,
	0x49, 0x8b, 0x74, 0x24, 0x10, 0x49, 0x8b, 0x54, 0x24, 0x18, 0x4d, 0x8b, 0x54, 0x24,
	0x20, 0x4d, 0x8b, 0x44, 0x24, 0x28, 0x4d, 0x8b, 0x4c, 0x24, 0x30, 0x0f, 0x05, 0x49,
	0x89, 0x44, 0x24, 0x38, 0x48, 0x3d, 0x01, 0xf0, 0xff, 0xff, 0x73, 0x09, 0x49, 0x83,
	0xc4, 0x40, 0x49, 0xff, 0xcd, 0xeb, 0xc1, 0xcc,
};

/* Run n calls of the table at `table` (already written there) with the loop at `loop`:
 * *done of them succeeded; if *done < n, *last is the next one's error (-errno). */
static int remote_batch(struct tracee *t, unsigned long loop, unsigned long table, size_t n,
			size_t *done, long *last, struct dbxcr_error *err)
{
	struct user_regs_struct r = t->regs;

	r.rip = loop;
	r.r12 = table;
	r.r13 = n;
	r.orig_rax = (unsigned long)-1;
	r.eflags &= ~0x100ULL;	/* TF: left set by the last single-step */
	/* The loop needs no stack; a stack pointer on the current alternate signal stack
	 * would make sigaltstack fail with EPERM (the process stopped in a handler there). */
	r.rsp = 0;
	if (ptrace(PTRACE_SETREGS, t->pid, 0, &r) < 0)
		return fail(err, errno, t->pid, "PTRACE_SETREGS for a batch of %zu calls", n);
	if (ptrace(PTRACE_CONT, t->pid, 0, 0) < 0)
		return fail(err, errno, t->pid, "PTRACE_CONT for a batch of %zu calls", n);
	if (wait_trap(t, PTRACE_CONT, &r, err) < 0)
		return -1;
	if (r.rip != loop + BATCH_LOOP_LEN || r.r13 > n)
		return fail(err, EFAULT, t->pid, "batch of %zu calls: stopped at %#llx, expected %#lx",
			    n, (unsigned long long)r.rip, loop + BATCH_LOOP_LEN);
	*done = n - (size_t)r.r13;
	*last = (long)r.rax;
	return 0;
}

void batch_init(struct batch *b, struct tracee *t, unsigned long loop, unsigned long table)
{
	b->t = t;
	b->loop = loop;
	b->table = table;
	b->n = 0;
}

int batch_add(struct batch *b, long nr, const long a[6], unsigned long expect,
	      struct dbxcr_error *err, const char *fmt, ...)
{
	struct batch_call *c;
	va_list ap;

	if (b->n == BATCH_MAX && batch_run(b, err) < 0)
		return -1;
	c = &b->calls[b->n];
	c->nr = nr;
	memcpy(c->a, a, sizeof(c->a));
	c->ret = 0;
	b->expect[b->n] = expect;
	va_start(ap, fmt);
	vsnprintf(b->step[b->n], sizeof(b->step[0]), fmt, ap);
	va_end(ap);
	b->n++;
	return 0;
}

int batch_run(struct batch *b, struct dbxcr_error *err)
{
	size_t n = b->n, done = 0;
	bool check = false;
	long last = 0;

	if (n == 0)
		return 0;
	b->n = 0;
	if (mem_write(b->t->pid, b->table, b->calls, n * sizeof(b->calls[0]), err) < 0 ||
	    remote_batch(b->t, b->loop, b->table, n, &done, &last, err) < 0)
		return -1;
	if (done < n)
		return fail(err, (int)-last, b->t->pid, "%s", b->step[done]);
	for (size_t i = 0; i < n; i++)
		check = check || b->expect[i];
	if (!check)
		return 0;
	if (mem_read(b->t->pid, b->table, b->calls, n * sizeof(b->calls[0]), err) < 0)
		return -1;
	for (size_t i = 0; i < n; i++)
		if (b->expect[i] && (unsigned long)b->calls[i].ret != b->expect[i])
			return fail(err, EEXIST, b->t->pid, "%s: landed at %#lx", b->step[i],
				    (unsigned long)b->calls[i].ret);
	return 0;
}
