/*
 * escape_probe: run as root inside a sandbox, tries what a hostile program would try to reach
 * the host, each attempt in its own child process. Host interfaces are opened for writing,
 * never written. One line per attempt:
 *
 *   <name> ok              the attempt succeeded (for a read: it returned data)
 *   <name> errno <n> <e>   refused
 *   <name> killed <sig>    the kernel killed the process (seccomp)
 *   <name> empty           opened, but nothing to read (a masked path)
 *
 * and `status <line>` for CapBnd, CapEff, NoNewPrivs and Seccomp of /proc/self/status, and
 * `status prctl-NoNewPrivs: N` from prctl(PR_GET_NO_NEW_PRIVS).
 * It refuses to run where PID 1 is not cube-agent.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef AF_VSOCK
#define AF_VSOCK 40
#endif
#define X32_BIT 0x40000000

/* 0: succeeded; 1: empty; -errno: refused. */
typedef int (*attempt_fn)(void);

static int result(long r) { return r < 0 ? -errno : 0; }

static int open_w(const char *p)
{
	int fd = open(p, O_WRONLY);
	if (fd < 0)
		return -errno;
	close(fd); /* opened: never written */
	return 0;
}

static int read_some(const char *p)
{
	char b[64];
	int fd = open(p, O_RDONLY);
	if (fd < 0)
		return -errno;
	ssize_t n = read(fd, b, sizeof(b));
	int e = errno;
	close(fd);
	return n > 0 ? 0 : n == 0 ? 1 : -e;
}

static int list_dir(const char *p)
{
	DIR *d = opendir(p);
	if (!d)
		return -errno;
	struct dirent *e;
	int n = 0;
	while ((e = readdir(d)))
		if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
			n++;
	closedir(d);
	return n ? 0 : 1;
}

static int node(const char *p, mode_t type, int maj, int min)
{
	unlink(p);
	if (mknod(p, type | 0600, makedev(maj, min)) != 0)
		return -errno;
	int fd = open(p, O_RDWR);
	if (fd < 0)
		return -errno;
	close(fd);
	return 0;
}

static int a_core_pattern(void) { return open_w("/proc/sys/kernel/core_pattern"); }
static int a_modprobe(void) { return open_w("/proc/sys/kernel/modprobe"); }
static int a_panic_on_oom(void) { return open_w("/proc/sys/vm/panic_on_oom"); }
static int a_sysrq(void) { return open_w("/proc/sysrq-trigger"); }
static int a_kcore(void) { return read_some("/proc/kcore"); }
static int a_keys(void) { return read_some("/proc/keys"); }
static int a_timer_list(void) { return read_some("/proc/timer_list"); }
static int a_firmware(void) { return list_dir("/sys/firmware"); }
static int a_sys_write(void) { return open_w("/sys/kernel/uevent_helper"); }
static int a_mknod_loop(void) { return node("/tmp/probe-loop", S_IFBLK, 7, 0); }
static int a_mknod_disk(void) { return node("/tmp/probe-disk", S_IFBLK, 8, 0); }
static int a_mknod_vda(void) { return node("/tmp/probe-vda", S_IFBLK, 254, 0); }
static int a_mknod_kvm(void) { return node("/tmp/probe-kvm", S_IFCHR, 10, 232); }
static int a_mknod_uffd(void) { return node("/tmp/probe-uffd", S_IFCHR, 10, 126); }
static int a_mknod_mem(void) { return node("/tmp/probe-mem", S_IFCHR, 1, 1); }
static int a_unshare(void) { return result(unshare(CLONE_NEWUSER | CLONE_NEWNET)); }
static int a_unshare_ns(void) { return result(unshare(CLONE_NEWNS)); }

static int a_clone3(void)
{
	struct {
		uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls;
	} args = {.flags = CLONE_NEWUSER | CLONE_NEWNET, .exit_signal = SIGCHLD};
	long r = syscall(SYS_clone3, &args, sizeof(args));
	if (r == 0)
		_exit(0);
	if (r > 0) {
		waitpid((pid_t)r, NULL, 0);
		return 0;
	}
	return -errno;
}

static int a_clone_newuser(void)
{
	long r = syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0);
	if (r == 0)
		_exit(0);
	if (r > 0) {
		waitpid((pid_t)r, NULL, 0);
		return 0;
	}
	return -errno;
}

static int a_mount(void) { return result(mount("none", "/tmp", "tmpfs", 0, "")); }
static int a_x32_mount(void)
{
	return result(syscall(X32_BIT | SYS_mount, "none", "/tmp", "tmpfs", 0, ""));
}

static int a_i386_getpid(void)
{
	long r;
	/* int 0x80: the i386 system call table (20 = getpid there). */
	__asm__ volatile("int $0x80" : "=a"(r) : "a"(20L) : "memory");
	return r < 0 ? (int)r : 0;
}

static int a_vsock(void)
{
	int s = socket(AF_VSOCK, SOCK_STREAM, 0);
	if (s < 0)
		return -errno;
	close(s);
	return 0;
}

static int a_io_uring(void)
{
	char params[120] = {0};
	long fd = syscall(SYS_io_uring_setup, 1, params);
	if (fd < 0)
		return -errno;
	close((int)fd);
	return 0;
}

static int a_bpf(void)
{
	char attr[128] = {0}; /* BPF_MAP_CREATE of nothing: refused before validation? */
	long r = syscall(SYS_bpf, 0 /* BPF_MAP_CREATE */, attr, sizeof(attr));
	if (r >= 0) {
		close((int)r);
		return 0;
	}
	/* EINVAL means the kernel looked at the request: the call was allowed. */
	return errno == EINVAL ? 0 : -errno;
}

static int a_perf(void)
{
	char attr[128] = {0};
	*(uint32_t *)(attr + 4) = sizeof(attr); /* size */
	long fd = syscall(SYS_perf_event_open, attr, 0, -1, -1, 0);
	if (fd >= 0) {
		close((int)fd);
		return 0;
	}
	return errno == EINVAL || errno == E2BIG ? 0 : -errno;
}

static int a_keyctl(void)
{
	long r = syscall(SYS_keyctl, 0 /* KEYCTL_GET_KEYRING_ID */, -3 /* session */, 0);
	return r < 0 ? -errno : 0;
}

static int a_userfaultfd(void)
{
	long fd = syscall(SYS_userfaultfd, 0);
	if (fd < 0)
		return -errno;
	close((int)fd);
	return 0;
}

static int a_setns(void)
{
	int fd = open("/proc/self/ns/net", O_RDONLY);
	if (fd < 0)
		return -errno;
	long r = syscall(SYS_setns, fd, 0);
	close(fd);
	return r < 0 ? -errno : 0;
}

static const struct {
	const char *name;
	attempt_fn fn;
} attempts[] = {
	{"open-w /proc/sys/kernel/core_pattern", a_core_pattern},
	{"open-w /proc/sys/kernel/modprobe", a_modprobe},
	{"open-w /proc/sys/vm/panic_on_oom", a_panic_on_oom},
	{"open-w /proc/sysrq-trigger", a_sysrq},
	{"open-w /sys/kernel/uevent_helper", a_sys_write},
	{"read /proc/kcore", a_kcore},
	{"read /proc/keys", a_keys},
	{"read /proc/timer_list", a_timer_list},
	{"list /sys/firmware", a_firmware},
	{"mknod+open block 7:0 (loop)", a_mknod_loop},
	{"mknod+open block 8:0 (disk)", a_mknod_disk},
	{"mknod+open block 254:0 (virtio disk)", a_mknod_vda},
	{"mknod+open char 10:232 (/dev/kvm)", a_mknod_kvm},
	{"mknod+open char 10:126 (/dev/userfaultfd)", a_mknod_uffd},
	{"mknod+open char 1:1 (/dev/mem)", a_mknod_mem},
	{"unshare(CLONE_NEWUSER|CLONE_NEWNET)", a_unshare},
	{"unshare(CLONE_NEWNS)", a_unshare_ns},
	{"clone3(CLONE_NEWUSER|CLONE_NEWNET)", a_clone3},
	{"clone(CLONE_NEWUSER)", a_clone_newuser},
	{"setns(net)", a_setns},
	{"mount", a_mount},
	{"x32 mount", a_x32_mount},
	{"i386 int 0x80", a_i386_getpid},
	{"socket(AF_VSOCK)", a_vsock},
	{"io_uring_setup", a_io_uring},
	{"bpf", a_bpf},
	{"perf_event_open", a_perf},
	{"keyctl", a_keyctl},
	{"userfaultfd", a_userfaultfd},
};

/* Only inside a sandbox: as root on a host these attempts would succeed (mount over /tmp). */
static int in_sandbox(void)
{
	char comm[32] = {0};
	FILE *f = fopen("/proc/1/comm", "r");
	if (!f)
		return 0;
	int ok = fgets(comm, sizeof(comm), f) && !strcmp(comm, "cube-agent\n");
	fclose(f);
	return ok;
}

int main(void)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (!in_sandbox()) {
		fprintf(stderr, "escape_probe: PID 1 is not cube-agent; run it only inside a sandbox\n");
		return 2;
	}
	for (size_t i = 0; i < sizeof(attempts) / sizeof(attempts[0]); i++) {
		int pipefd[2];
		if (pipe(pipefd) != 0)
			return 2;
		pid_t pid = fork();
		if (pid == 0) {
			close(pipefd[0]);
			int r = attempts[i].fn();
			if (write(pipefd[1], &r, sizeof(r)) != sizeof(r))
				_exit(3);
			_exit(0);
		}
		close(pipefd[1]);
		int r = 0, st = 0;
		ssize_t got = read(pipefd[0], &r, sizeof(r));
		close(pipefd[0]);
		waitpid(pid, &st, 0);
		if (WIFSIGNALED(st))
			printf("%s killed %d\n", attempts[i].name, WTERMSIG(st));
		else if (got != sizeof(r))
			printf("%s lost\n", attempts[i].name);
		else if (r == 0)
			printf("%s ok\n", attempts[i].name);
		else if (r == 1)
			printf("%s empty\n", attempts[i].name);
		else
			printf("%s errno %d %s\n", attempts[i].name, -r, strerror(-r));
	}
	FILE *f = fopen("/proc/self/status", "r");
	char line[256];
	while (f && fgets(line, sizeof(line), f))
		if (!strncmp(line, "CapBnd:", 7) || !strncmp(line, "CapEff:", 7) ||
		    !strncmp(line, "NoNewPrivs:", 11) || !strncmp(line, "Seccomp:", 8))
			printf("status %s", line);
	if (f)
		fclose(f);
	/* The kernel's own answer (gVisor's status file has no NoNewPrivs line). */
	printf("status prctl-NoNewPrivs: %d\n", prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0));
	return 0;
}
