/*
 * xstate-probe: do a guest kernel's context switches keep each process's extended vector state?
 *
 * Several processes share one CPU. Each fills the widest registers this CPU lets user mode use
 * (AVX-512: zmm0-31 and k0-7; else AVX: ymm0-15; else SSE: xmm0-15) with a pattern of its own,
 * yields the CPU inside the same asm block (a system call preserves every vector register), and
 * checks the registers; a kernel that saves only part of the state on a context switch lets one
 * process see another's values. Static; runs as a program or as init (then it powers off).
 *
 * Prints "xstate-probe: <level> ok (<n> switches)" and exits 0, or "xstate-probe: <level>
 * CORRUPT ..." and exits 1.
 */
#define _GNU_SOURCE
#include <sched.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/reboot.h>
#include <sys/wait.h>
#include <unistd.h>

#define PROCS 3
#define ROUNDS 400

enum level { SSE, AVX, AVX512 };
static const char *names[] = {"SSE (xmm0-15)", "AVX (ymm0-15)", "AVX-512 (zmm0-31, k0-7)"};

static sigjmp_buf no_xgetbv;

static void on_sigill(int sig)
{
	(void)sig;
	siglongjmp(no_xgetbv, 1);
}

/*
 * What user mode can use is what XCR0 enables, whatever CPUID says: hostile code does not ask
 * first, and on PVM hosts with CPUID faulting a guest program's CPUID is the VMM's table (whose
 * OSXSAVE follows the guest kernel's CR4, off with noxsave) while it runs with the host's XCR0.
 * So XCR0 is read directly (XGETBV faults where XSAVE is really off).
 */
static enum level usable(void)
{
	volatile uint32_t lo = 0;
	uint32_t l, h;
	signal(SIGILL, on_sigill);
	if (sigsetjmp(no_xgetbv, 1) == 0) {
		__asm__ volatile("xgetbv" : "=a"(l), "=d"(h) : "c"(0));
		lo = l;
	}
	signal(SIGILL, SIG_DFL);
	if ((lo & 0x6) != 0x6)
		return SSE;
	/* ZMM state enabled: AVX-512 F and BW (every AVX-512 CPU this runs on has both). */
	if ((lo & 0xe6) == 0xe6)
		return AVX512;
	return AVX;
}

/* 32 registers x 64 bytes, then 8 opmask qwords. */
struct regs {
	uint64_t v[32][8];
	uint64_t k[8];
} __attribute__((aligned(64)));

/* One round: load every register, yield the CPU, store them to `out`. */
static void round_avx512(struct regs *in, struct regs *out)
{
	__asm__ volatile(
#define LZ(n) "vmovdqu64 " #n "*64(%0), %%zmm" #n "\n\t"
		LZ(0) LZ(1) LZ(2) LZ(3) LZ(4) LZ(5) LZ(6) LZ(7) LZ(8) LZ(9) LZ(10) LZ(11) LZ(12)
		LZ(13) LZ(14) LZ(15) LZ(16) LZ(17) LZ(18) LZ(19) LZ(20) LZ(21) LZ(22) LZ(23) LZ(24)
		LZ(25) LZ(26) LZ(27) LZ(28) LZ(29) LZ(30) LZ(31)
#define LK(n) "kmovq 2048+" #n "*8(%0), %%k" #n "\n\t"
		LK(0) LK(1) LK(2) LK(3) LK(4) LK(5) LK(6) LK(7)
		"mov $24, %%eax\n\tsyscall\n\t"
#define SZ(n) "vmovdqu64 %%zmm" #n ", " #n "*64(%1)\n\t"
		SZ(0) SZ(1) SZ(2) SZ(3) SZ(4) SZ(5) SZ(6) SZ(7) SZ(8) SZ(9) SZ(10) SZ(11) SZ(12)
		SZ(13) SZ(14) SZ(15) SZ(16) SZ(17) SZ(18) SZ(19) SZ(20) SZ(21) SZ(22) SZ(23) SZ(24)
		SZ(25) SZ(26) SZ(27) SZ(28) SZ(29) SZ(30) SZ(31)
#define SK(n) "kmovq %%k" #n ", 2048+" #n "*8(%1)\n\t"
		SK(0) SK(1) SK(2) SK(3) SK(4) SK(5) SK(6) SK(7)
		:
		: "r"(in), "r"(out)
		: "rax", "rcx", "r11", "memory");
}

static void round_avx(struct regs *in, struct regs *out)
{
	__asm__ volatile(
#define LY(n) "vmovdqu " #n "*64(%0), %%ymm" #n "\n\t"
		LY(0) LY(1) LY(2) LY(3) LY(4) LY(5) LY(6) LY(7) LY(8) LY(9) LY(10) LY(11) LY(12)
		LY(13) LY(14) LY(15)
		"mov $24, %%eax\n\tsyscall\n\t"
#define SY(n) "vmovdqu %%ymm" #n ", " #n "*64(%1)\n\t"
		SY(0) SY(1) SY(2) SY(3) SY(4) SY(5) SY(6) SY(7) SY(8) SY(9) SY(10) SY(11) SY(12)
		SY(13) SY(14) SY(15)
		:
		: "r"(in), "r"(out)
		: "rax", "rcx", "r11", "memory");
}

static void round_sse(struct regs *in, struct regs *out)
{
	__asm__ volatile(
#define LX(n) "movdqu " #n "*64(%0), %%xmm" #n "\n\t"
		LX(0) LX(1) LX(2) LX(3) LX(4) LX(5) LX(6) LX(7) LX(8) LX(9) LX(10) LX(11) LX(12)
		LX(13) LX(14) LX(15)
		"mov $24, %%eax\n\tsyscall\n\t"
#define SX(n) "movdqu %%xmm" #n ", " #n "*64(%1)\n\t"
		SX(0) SX(1) SX(2) SX(3) SX(4) SX(5) SX(6) SX(7) SX(8) SX(9) SX(10) SX(11) SX(12)
		SX(13) SX(14) SX(15)
		:
		: "r"(in), "r"(out)
		: "rax", "rcx", "r11", "memory");
}

/* Compares what the level covers; returns the first differing (register, qword) or -1. */
static int compare(enum level l, const struct regs *a, const struct regs *b)
{
	int nreg = l == AVX512 ? 32 : 16, nq = l == AVX512 ? 8 : l == AVX ? 4 : 2;
	for (int r = 0; r < nreg; r++)
		for (int q = 0; q < nq; q++)
			if (a->v[r][q] != b->v[r][q])
				return r * 8 + q;
	if (l == AVX512)
		for (int k = 0; k < 8; k++)
			if (a->k[k] != b->k[k])
				return 1000 + k;
	return -1;
}

static int child(int id, enum level l)
{
	static struct regs in, out;
	for (int round = 0; round < ROUNDS; round++) {
		for (int r = 0; r < 32; r++)
			for (int q = 0; q < 8; q++)
				in.v[r][q] = 0x9e3779b97f4a7c15ull * (uint64_t)(id + 1) ^
					     ((uint64_t)round << 32) ^ (uint64_t)(r << 8 | q);
		for (int k = 0; k < 8; k++)
			in.k[k] = 0xa5a5a5a5a5a5a5a5ull ^ ((uint64_t)(id + 1) << 40) ^ (uint64_t)round ^
				  (uint64_t)k;
		memset(&out, 0, sizeof(out));
		if (l == AVX512)
			round_avx512(&in, &out);
		else if (l == AVX)
			round_avx(&in, &out);
		else
			round_sse(&in, &out);
		int at = compare(l, &in, &out);
		if (at >= 0) {
			if (at >= 1000)
				printf("xstate-probe: %s CORRUPT: process %d round %d: k%d %#llx, expected %#llx\n",
				       names[l], id, round, at - 1000, (unsigned long long)out.k[at - 1000],
				       (unsigned long long)in.k[at - 1000]);
			else
				printf("xstate-probe: %s CORRUPT: process %d round %d: register %d qword %d %#llx, expected %#llx\n",
				       names[l], id, round, at / 8, at % 8,
				       (unsigned long long)out.v[at / 8][at % 8],
				       (unsigned long long)in.v[at / 8][at % 8]);
			fflush(stdout);
			return 1;
		}
	}
	return 0;
}

int main(void)
{
	enum level l = usable();
	cpu_set_t one;
	CPU_ZERO(&one);
	CPU_SET(0, &one);
	/* Everyone on CPU 0, so that the processes take turns on one set of registers. */
	if (sched_setaffinity(0, sizeof(one), &one) != 0)
		perror("xstate-probe: sched_setaffinity");
	setvbuf(stdout, NULL, _IOLBF, 0);
	pid_t pids[PROCS];
	for (int i = 0; i < PROCS; i++) {
		pids[i] = fork();
		if (pids[i] == 0)
			_exit(child(i, l));
		if (pids[i] < 0) {
			perror("xstate-probe: fork");
			return 2;
		}
	}
	int bad = 0;
	for (int i = 0; i < PROCS; i++) {
		int st = 0;
		if (waitpid(pids[i], &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
			bad = 1;
	}
	if (!bad)
		printf("xstate-probe: %s ok (%d processes x %d switches)\n", names[l], PROCS, ROUNDS);
	fflush(stdout);
	if (getpid() == 1) {
		sync();
		reboot(RB_POWER_OFF);
	}
	return bad;
}
