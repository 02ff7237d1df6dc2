#!/usr/bin/env bash
# The microvm runtime on a hardware-virtualisation KVM, on a host that has none: QEMU's TCG
# emulates an AMD CPU with SVM and nested paging, a Debian kernel booted on it (L1) loads kvm-amd,
# and tests/nested/plan.sh runs Cube's Linux-guest microVM tests there against a real SVM
# /dev/kvm, with the project's guest kernel on its stock parameters (no cube_pvm).
#
#   tests/nested/run.sh [--timeout S] [--mem MIB] [--only STEP,...] [--keep]
#
#   --timeout S  stop L1 after S seconds (default 2400); a step that has not reported by then fails
#                (NESTED_STEP_LIMIT, default 450 s, stops one step; a timed-out step, or one a
#                wedged L1 never reported, runs again in a fresh L1, up to NESTED_MAX_BOOTS (8)
#                boots; a failed step gets one more try there; each try's log is printed)
#   --mem MIB    L1 memory (default 10240)
#   --only S,..  run only these steps of tests/nested/steps (debugging; CI runs them all)
#   --keep       keep the results directory (its path is printed)
#
# L1's root is this machine's / shared read-only over 9p under a tmpfs overlay: L1 runs the very
# binaries, virtualenvs and guest kernel this host built (tests/run.sh builds them first), and it
# cannot write to the host. Only the results directory is shared read-write: plan.sh appends
# "PASS|FAIL <step> <seconds>" to results/steps and each step's output to results/<step>.log.
# Exit status 0 only when every step in tests/nested/steps passed. Needs root, qemu-system-x86,
# busybox-static and the package index (the L1 kernel comes from Debian's linux-image-amd64,
# unpacked under /var/cache/cube/nested, never installed on this host).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
timeout_s=2400
mem=10240
keep=0
only=""
die() { echo "nested: FAIL: $*" >&2; exit 1; }
usage() { sed -n '2,23p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2; }
while [[ $# -gt 0 ]]; do
	case "$1" in
	--timeout) [[ $# -ge 2 ]] || usage; timeout_s=$2; shift 2 ;;
	--mem) [[ $# -ge 2 ]] || usage; mem=$2; shift 2 ;;
	--only) [[ $# -ge 2 ]] || usage; only=$2; shift 2 ;;
	--keep) keep=1; shift ;;
	-h | --help) usage ;;
	*) echo "nested: unknown argument: $1" >&2; usage ;;
	esac
done
[[ $timeout_s =~ ^[1-9][0-9]*$ && $mem =~ ^[1-9][0-9]*$ ]] || die "--timeout and --mem want positive integers"
[[ $(id -u) -eq 0 ]] || die "needs root (L1 runs the privileged microVM suites)"
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 missing (deploy/deps.sh --test)"
busybox=/bin/busybox
LC_ALL=C readelf -lW "$busybox" 2>/dev/null | grep -q 'Requesting program interpreter' &&
	die "$busybox is dynamically linked (apt-get install busybox-static)"

steps=$(grep -v '^#' "$here/steps")
if [[ -n $only ]]; then
	for s in ${only//,/ }; do grep -qx "$s" <<<"$steps" || die "--only: no step '$s' in tests/nested/steps"; done
	steps=$(tr ',' '\n' <<<"$only")
fi

# What L1 runs: the inputs tests/run.sh exports, resolved to absolute paths.
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/cache/cube/target}
agent=${CUBE_AGENT_BIN:-$CARGO_TARGET_DIR/x86_64-unknown-linux-gnu/release/cube-agent}
guest=${CUBE_GUEST_KERNEL:-/var/cache/cube/guest-kernel/out/vmlinux}
venvs=${CUBE_VENV_ROOT:-/var/cache/cube/venv}
[[ -x $agent ]] || die "static cube-agent $agent missing (see tests/run.sh)"
[[ -f $guest ]] || die "guest kernel $guest missing (deploy/guest-kernel/build.sh)"
[[ -x $venvs/e2e/bin/python ]] || die "virtualenv $venvs/e2e missing (deploy/deps.sh --test)"

# The L1 kernel: Debian's current linux-image-amd64, unpacked once per version.
pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
[[ -n $pkg ]] || die "linux-image-amd64 is not in the package index (apt-get update)"
l1=/var/cache/cube/nested/$pkg
if [[ ! -f $l1/ready ]]; then
	echo "nested: fetching $pkg"
	rm -rf "$l1" && mkdir -p "$l1/dl"
	chmod 777 "$l1/dl" # apt downloads as _apt where it can
	(cd "$l1/dl" && apt-get download -q "$pkg") || die "apt-get download $pkg failed"
	dpkg-deb -x "$l1"/dl/*.deb "$l1/root" || die "unpacking $pkg failed"
	rm -rf "$l1/dl"
	kver=$(ls "$l1/root/lib/modules")
	"$busybox" depmod -b "$l1/root" "$kver" || die "depmod for $kver failed"
	echo "$kver" >"$l1/ready"
fi
kver=$(cat "$l1/ready")
moddir=$l1/root/lib/modules/$kver

# Test binaries, built by `cargo build --all-targets` (cargo only resolves their names here).
tests=$(cd "$repo" && cargo test --quiet --no-run --message-format=json \
	-p cube-shim --test linux_guest --test linux_xstate -p cubelet --test microvm \
	-p cube-hypervisor --test vm --test snapshot --test devices_snapshot --test virtio_guest --test xstate \
	2>/dev/null |
	python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in m["target"]["kind"]:
        print(m["target"]["name"] + "=" + m["executable"])')
tbin() { awk -F= -v n="$1" '$1 == n {print $2}' <<<"$tests"; }
# cube-hypervisor's own suites (their tiny guests, no Linux): snapshots, pause to disk and resume in a
# new process, devices, xstate, all on SVM.
hv_tests=(vm snapshot devices_snapshot virtio_guest xstate)
for t in linux_guest linux_xstate microvm "${hv_tests[@]}"; do
	[[ -x $(tbin "$t") ]] || die "test binary $t not built"
done

work=$(mktemp -d /var/tmp/cube-nested.XXXXXX)
cleanup() { if ((keep)); then echo "nested: results kept in $work"; else rm -rf "$work"; fi; }
trap cleanup EXIT
# One results directory per boot of L1 (results.1, and results.2 for a retry).
write_env() { # <results dir> <steps>
	{
		printf 'export REPO=%q\n' "$repo"
		printf 'export CARGO_TARGET_DIR=%q CUBE_AGENT_BIN=%q CUBE_GUEST_KERNEL=%q CUBE_VENV_ROOT=%q\n' \
			"$CARGO_TARGET_DIR" "$agent" "$guest" "$venvs"
		printf 'export L1_MODULES=%q\n' "$moddir"
		printf 'export NESTED_STEPS=%q NESTED_STEP_LIMIT=%q\n' "$(echo $2)" "$step_limit"
		printf 'export TEST_LINUX_GUEST=%q TEST_LINUX_XSTATE=%q TEST_CUBELET_MICROVM=%q\n' \
			"$(tbin linux_guest)" "$(tbin linux_xstate)" "$(tbin microvm)"
		printf 'export TEST_HYPERVISOR=%q\n' "$(for t in "${hv_tests[@]}"; do printf '%s ' "$(tbin "$t")"; done)"
	} >"$1/env"
}

# The L1 initramfs: busybox, the modules that reach the 9p root, and init.
stage=$work/initramfs
mkdir -p "$stage"/{bin,dev,proc,sys,newroot,lower,rw}
cp "$busybox" "$stage/bin/busybox"
ln -s busybox "$stage/bin/sh"
need="virtio_pci 9pnet_virtio 9p overlay"
order=()
resolve() { # modules.dep lists a module's dependencies; they load first.
	local m=$1 line path dep
	line=$(grep -E "/${m//_/[-_]}\.ko:" "$moddir/modules.dep" | head -n1) || die "module $m not in $kver"
	path=${line%%:*}
	for dep in ${line#*:}; do resolve "$(basename "$dep" .ko)"; done
	[[ " ${order[*]} " == *" $path "* ]] || order+=("$path")
}
for m in $need; do resolve "$m"; done
mkdir -p "$stage/modules"
for p in "${order[@]}"; do cp "$moddir/$p" "$stage/modules/"; echo "${p##*/}"; done >"$stage/modules/order"
cp "$here/initramfs-init" "$stage/init"
chmod 755 "$stage/init"
mknod -m 600 "$stage/dev/console" c 5 1
(cd "$stage" && find . -mindepth 1 | LC_ALL=C sort | cpio --quiet -o -H newc -R 0:0) | gzip -1 >"$work/initramfs.gz"

# An EPYC with SVM and nested paging, minus what TCG cannot emulate (QEMU would drop those
# with a warning each), so L1's CPUID says what it really has; and without XSAVE (so without
# AVX): QEMU 7.2's TCG does not apply the SVM intercept of XSETBV, so L1's KVM never sees a
# guest's XCR0 change, keeps CPUID 0xD's size for x87 alone ("XSAVE consistency problem" in the
# guest, which then falls back to SSE) and reloads XCR0 = x87 on every entry. Real SVM and VMX
# intercept it; xstate beyond SSE is proven on PVM here and by linux-e2e.sh on hardware.
cpu=EPYC,+svm,+npt
for f in rdseed sha-ni fxsr-opt misalignsse 3dnowprefetch osvw topoext nrip-save \
	xsave xsaveopt xsavec xgetbv1 avx avx2 fma f16c; do cpu+=,-$f; done
# cache=loose: nothing on the host changes while L1 runs. The results share is uncached, so a
# step's report is on the host as soon as it is written.
#
# boot_l1 <n> <steps>: one boot of L1 running those steps, stopped at the overall deadline, when
# L1's heartbeat (plan.sh writes its uptime every 10 s) stops for $wedge_s (L1 wedged: TCG has
# been seen to freeze L1 outright, with no soft-lockup or RCU report on its console), or when no
# step has started or reported for $stall_s (L1's own per-step limit would have fired
# otherwise). Sets l1_rc (qemu's status) and l1_stalled.
boot_l1() {
	local n=$1 res=$work/results.$1 left last_seen seen now qpid hb last_hb="" why="" s
	mkdir -p "$res"
	write_env "$res" "$2"
	for s in $2; do step_boot[$s]=$n; done
	left=$((deadline - $(date +%s)))
	((left > 0)) || { l1_rc=124; l1_stalled=0; return; }
	echo "nested: boot $n of L1 ($pkg, TCG, EPYC+svm+npt, 2 vCPUs, ${mem} MiB): $(echo $2)"
	timeout --kill-after=10 "$left" qemu-system-x86_64 \
		-accel tcg,thread=multi -cpu "$cpu" -smp 2 -m "$mem" \
		-nodefaults -no-user-config -nographic -no-reboot -monitor none \
		-qmp "unix:$work/qmp.$n,server=on,wait=off" \
		-serial "file:$work/console.$n.log" \
		-kernel "$l1/root/boot/vmlinuz-$kver" -initrd "$work/initramfs.gz" \
		-append "console=ttyS0 panic=-1 quiet loglevel=4 rdinit=/init nested.repo=$repo" \
		-virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap" \
		-virtfs "local,path=$res,mount_tag=results,security_model=none,multidevs=remap" \
		>"$work/qemu.$n.log" 2>&1 &
	qpid=$!
	l1_stalled=0
	last_seen=""
	now=$(date +%s)
	local progress=$now beat=$now
	while kill -0 "$qpid" 2>/dev/null; do
		sleep 5
		seen="$(cat "$res/current" 2>/dev/null || true)|$({ wc -l <"$res/steps"; } 2>/dev/null || true)"
		hb=$(cat "$res/heartbeat" 2>/dev/null || true)
		now=$(date +%s)
		[[ $hb != "$last_hb" ]] && { last_hb=$hb; beat=$now; }
		if [[ $seen != "$last_seen" ]]; then
			last_seen=$seen
			progress=$now
		fi
		if [[ -z $hb ]] && ((now - beat > boot_s)); then
			why="L1 did not start the plan within ${boot_s}s"
		elif [[ -n $hb ]] && ((now - beat > wedge_s)); then
			why="L1's heartbeat stopped ${wedge_s}s ago (last: uptime ${hb%% *}s)"
		elif ((now - progress > stall_s)); then
			why="L1 made no progress for ${stall_s}s"
		fi
		if [[ -n $why ]]; then
			echo "nested: $why in step '$(cat "$res/current" 2>/dev/null || true)'; stopping it"
			wedge_report "$qpid" "$work/qmp.$n"
			l1_stalled=1
			kill "$qpid" 2>/dev/null
			break
		fi
	done
	set +e
	wait "$qpid"
	l1_rc=$?
	set -e
	echo "--- L1 console, boot $n (last 30 lines)"
	show_tail 30 "$work/console.$n.log" "  "
	[[ -s $work/qemu.$n.log ]] && { echo "--- qemu"; cat "$work/qemu.$n.log"; }
	return 0
}
# wedge_report <qemu pid> <qmp socket>: what a stopped L1 looked like from outside, so a wedge can
# be told apart (QEMU deadlocked: no CPU used; a vCPU spinning: one core busy) and located (each
# vCPU's instruction pointer and mode). Diagnostics only: never fails.
wedge_report() {
	local t0 t1 q
	q=$(pgrep -P "$1" -f qemu-system | head -n1 || true) # $1 is timeout(1), QEMU its child
	[[ -n $q ]] || return 0
	t0=$(awk '{print $14 + $15}' "/proc/$q/stat" 2>/dev/null || echo 0)
	sleep 5
	t1=$(awk '{print $14 + $15}' "/proc/$q/stat" 2>/dev/null || echo 0)
	echo "--- qemu used $(((t1 - t0) * 100 / $(getconf CLK_TCK) / 5))% of a core over 5 s; its threads:"
	ps -L -o tid,stat,wchan:24,pcpu,comm -p "$q" 2>/dev/null | sed 's/^/  /' || true
	echo "--- vCPU registers (QMP, 10 s limit)"
	timeout 10 python3 - "$2" <<'PY' 2>&1 | sed 's/^/  /' || true
import json, re, socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(8)
s.connect(sys.argv[1])
f = s.makefile("rw")
def call(cmd, **args):
    f.write(json.dumps({"execute": cmd, "arguments": args}) + "\n"); f.flush()
    while True:
        m = json.loads(f.readline())
        if "return" in m or "error" in m:
            return m
f.readline()
call("qmp_capabilities")
out = call("human-monitor-command", **{"command-line": "info registers -a"}).get("return", "")
for line in out.splitlines():
    if re.match(r"^(CPU#|RIP|CS |EFL|CR0|CR3)", line):
        print(line)
PY
}
# show_tail <lines> <file> <indent>: the end of a log, or a note that there is none. Never fails:
# under pipefail a missing log (a step L1 never reached) must not end the script before the retry.
show_tail() {
	if [[ -s $2 ]]; then tail -n "$1" "$2" | sed "s/^/$3/" || true; else echo "$3(no log)"; fi
}
# step_line <n> <step>: that step's report in boot n, if any.
step_line() { awk -v s="$2" '$2 == s' "$work/results.$1/steps" 2>/dev/null | tail -n1 || true; }

step_limit=${NESTED_STEP_LIMIT:-450}
# Longer than the per-step limit inside L1, which reports a timed-out step itself when it can.
stall_s=$((step_limit + 120))
# A living L1 writes its heartbeat every 10 s; L1 reaches the plan in about a minute of wall time.
wedge_s=${NESTED_WEDGE_S:-120}
boot_s=${NESTED_BOOT_S:-180}
max_boots=${NESTED_MAX_BOOTS:-8}
declare -A step_boot # the boot whose report counts for each step (its last try)
start=$(date +%s)
deadline=$((start + timeout_s))
n=1
boot_l1 1 "$steps"
# A step that timed out, or never reported because L1 stopped, runs again in a fresh L1 (after
# l1-kvm, which loads kvm-amd), up to $max_boots boots in all while the deadline allows. A step
# that failed by itself gets one more try there (TCG has been seen to reset a nested guest
# mid-boot and to lose a restored guest's wake-up; a real failure fails both tries). Each
# try's log is printed, and a step that passed only on a retry says so in the summary.
declare -A tries fails
while :; do
	retry=""
	while read -r step; do
		# l1-kvm runs first in every boot anyway.
		[[ -z $step || $step == l1-kvm || ${step_boot[$step]:-0} -ne $n ]] && continue
		line=$(step_line "$n" "$step")
		if [[ -z $line || $line == *" timeout" ]]; then
			retry+=" $step"
		elif [[ $line == FAIL* ]] && ((${fails[$step]:-0} == 0)); then
			fails[$step]=1
			retry+=" $step"
		fi
	done <<<"$steps"
	[[ -n $retry ]] || break
	((l1_rc != 124 && l1_rc != 137 || l1_stalled)) || break
	((n < max_boots)) || { echo "nested: no more boots ($max_boots tried)"; break; }
	(($(date +%s) + 120 < deadline)) || { echo "nested: no time left for another boot"; break; }
	for step in $retry; do
		tries[$step]=$((${tries[$step]:-0} + 1))
		line=$(step_line "$n" "$step")
		why="did not report"
		[[ $line == *" timeout" ]] && why="timed out"
		[[ -n $line && $line != *" timeout" ]] && why="FAILED"
		echo "nested: RETRY $step: $why in boot $n; its log there (last 60 lines):"
		show_tail 60 "$work/results.$n/$step.log" "    "
	done
	n=$((n + 1))
	boot_l1 "$n" "l1-kvm$retry"
done
wall=$(($(date +%s) - start))

echo "--- steps (L1's clock, seconds)"
failures=0
# Each step's outcome also goes to tests/run.sh's suite log (tests/suites.py checks it).
slog() { if [[ -n ${CUBE_SUITE_LOG:-} ]]; then echo "$1" >>"$CUBE_SUITE_LOG"; fi; }
while read -r step; do
	[[ -z $step ]] && continue
	b=${step_boot[$step]:-1}
	line=$(step_line "$b" "$step")
	case "$line" in
	PASS*) echo "  $line$( ((b > 1 && ${tries[$step]:-0} > 0)) && echo " (boot $b, after ${tries[$step]} earlier tr$( ((${tries[$step]} > 1)) && echo ies || echo y)$( ((${fails[$step]:-0})) && echo ", one of them FAILED: its log is above"))")"; slog "RAN     nested nested/$step" ;;
	FAIL*)
		echo "  $line (boot $b)"; failures=$((failures + 1)); slog "FAILED  nested nested/$step: failed in L1"
		echo "  --- $step log (last 60 lines)"; show_tail 60 "$work/results.$b/$step.log" "    " ;;
	*) echo "  MISSING $step (did not report)"; failures=$((failures + 1)) ;;
	esac
done <<<"$steps"
((l1_rc == 124 || l1_rc == 137)) && ((!l1_stalled)) && { echo "nested: L1 did not finish within ${timeout_s}s"; failures=$((failures + 1)); }
echo "nested: L1 wall time ${wall}s in $n boot(s) (last qemu rc $l1_rc)"
((failures == 0)) || die "$failures step(s) failed or missing"
echo "nested: all steps passed"
