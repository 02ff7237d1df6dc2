#!/usr/bin/env bash
# The test plan inside L1 (tests/nested/run.sh boots it): the microvm runtime on SVM KVM with the
# project's guest kernel on its stock parameters. Each step reports "PASS|FAIL <step> <seconds>"
# to results/steps and its output to results/<step>.log; a failed step does not stop the rest.
set -uo pipefail
R=/run/nested/results
# shellcheck source=/dev/null
. "$R/env"
export CUBE_REQUIRE_KVM=1 CUBE_REQUIRE_PRIV=1 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
console() { echo "nested: $*" >/dev/console; }
# A heartbeat for run.sh: when it stops, L1 itself is wedged (not just a step), and run.sh boots
# a fresh L1 at once instead of waiting out the step limit.
(while :; do cat /proc/uptime >"$R/heartbeat.new" && mv -f "$R/heartbeat.new" "$R/heartbeat"; sleep 10; done) &

# The machine around the tests: what systemd would mount on a Debian host.
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mkdir -p /dev/pts /dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts /dev/pts
ln -sf pts/ptmx /dev/ptmx
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount -t bpf bpf /sys/fs/bpf
kver=$(uname -r)
mkdir -p "/usr/lib/modules/$kver"
mount --bind "$L1_MODULES" "/usr/lib/modules/$kver"
# The kernel loads modules on demand (xfs, tun, veth, nft expressions) through this helper.
mkdir -p /usr/local/sbin
printf '#!/bin/sh\nexec /bin/busybox modprobe "$@"\n' >/usr/local/sbin/modprobe
chmod 755 /usr/local/sbin/modprobe
echo /usr/local/sbin/modprobe >/proc/sys/kernel/modprobe
# Modules whose device nodes the tests open (no udev or kmod static-nodes here to make them).
for m in loop tun; do modprobe "$m" || console "modprobe $m failed"; done
ip link set lo up
# A node has a network interface with an address: the edge's connections to sandboxes take their
# source address from it (L1 has no network of its own, so a dummy one stands in).
ip link add eth0 type dummy && ip addr add 192.0.2.10/24 dev eth0 && ip link set eth0 up ||
	console "no dummy eth0"
hostname nested-l1
W=$(mktemp -d /var/tmp/nested.XXXXXX)

# A step that passes its limit is stopped, with what L1's processes were waiting on and the
# kernel's last words in its log; it reports "FAIL <step> <seconds> timeout" (run.sh retries
# those once in a fresh L1: TCG has been seen to wedge a guest).
STEP_LIMIT=${NESTED_STEP_LIMIT:-450}
step() {
	local name=$1 t0 t1 res rc why=""
	shift
	[[ " $NESTED_STEPS " == *" $name "* ]] || return 0
	console "step $name"
	echo "$name" >"$R/current"
	t0=$(date +%s.%N)
	(cd "$REPO" && timeout -k 10 "$STEP_LIMIT" bash -c '"$@"' "$name" "$@") >"$R/$name.log" 2>&1
	rc=$?
	t1=$(date +%s.%N)
	if ((rc == 0)); then
		res=PASS
	else
		res=FAIL
		# A failing test may print a long guest console after its panic message: repeat the
		# message last, so the tail run.sh shows says why.
		if grep -q "panicked at" "$R/$name.log"; then
			{ echo "--- why (the panic messages above, again)"; grep -A4 "panicked at" "$R/$name.log" | tail -n 20; } >>"$R/$name.log"
		fi
		if ((rc == 124 || rc == 137)); then
			why=" timeout"
			{
				echo "nested: step $name passed its ${STEP_LIMIT}s limit; what L1 was doing:"
				ps -eo pid,ppid,stat,wchan:32,etimes,args
				for p in /proc/[0-9]*; do
					[[ $(awk '{print $3}' "$p/stat" 2>/dev/null) == D ]] || continue
					echo "--- ${p#/proc/} (D) $(tr '\0' ' ' <"$p/cmdline" 2>/dev/null)"
					cat "$p/stack" 2>/dev/null
				done
				echo "--- dmesg (last 40 lines)"
				dmesg | tail -n 40
			} >>"$R/$name.log" 2>&1
		fi
	fi
	printf '%s %s %s%s\n' "$res" "$name" "$(awk "BEGIN {printf \"%.1f\", $t1 - $t0}")" "$why" | tee -a "$R/steps" >/dev/console
}

l1_kvm() {
	modprobe kvm_amd || return 1
	[[ -c /dev/kvm ]] || { echo "no /dev/kvm"; return 1; }
	grep -qw svm /proc/cpuinfo || { echo "no svm flag"; return 1; }
	grep -qw pvm /proc/cpuinfo && { echo "this is PVM, not SVM"; return 1; }
	echo "kvm_amd nested=$(cat /sys/module/kvm_amd/parameters/nested) npt=$(cat /sys/module/kvm_amd/parameters/npt)"
	[[ $(cat /sys/module/kvm_amd/parameters/npt) =~ ^(1|Y)$ ]] || { echo "no nested paging"; return 1; }
	dmesg | grep -iE 'kvm|svm' || true
	grep -m1 '^flags' /proc/cpuinfo
}

# cube-hypervisor boots the guest kernel (stock parameters) with the smoke initramfs; the guest
# stops the way $1 says and cube-hypervisor must notice it by itself (--secs 0: no deadline; the
# step's own timeout is the backstop).
boot() {
	local how=$1 expect=$2
	bash deploy/guest-kernel/mkinitramfs.sh --out "$W/$how.gz" --marker CUBE_NESTED_BOOT --stop "$how" || return 1
	timeout 600 "$CARGO_TARGET_DIR/debug/cube-hypervisor" boot --kernel "$CUBE_GUEST_KERNEL" \
		--initramfs "$W/$how.gz" --vcpus 2 --mem-mib 256 --secs 0 \
		--cmdline "console=ttyS0 reboot=k panic=-1 pci=off nomodule rdinit=/init" >"$W/$how.out" 2>&1
	local rc=$?
	cat "$W/$how.out"
	((rc == 0)) || { echo "cube-hypervisor boot: rc $rc"; return 1; }
	grep -a '^CUBE_NESTED_BOOT ' "$W/$how.out" || { echo "the guest's init did not run"; return 1; }
	grep -a "$expect" "$W/$how.out" || { echo "cube-hypervisor did not report: $expect"; return 1; }
}

export W
export -f l1_kvm boot
step l1-kvm l1_kvm
step boot-reset boot reboot "guest requested a reset"
step boot-halt boot poweroff "guest halted"
# cube-hypervisor's suites, each binary to its end (a failing one does not hide the next).
hypervisor_suites() {
	local t rc=0
	cd cube-hypervisor || return 1
	for t in $TEST_HYPERVISOR; do
		echo "== $(basename "$t")"
		"$t" --test-threads=1 || rc=1
	done
	return $rc
}

export -f hypervisor_suites
step shim-linux-guest bash -c 'cd cube-shim && "$TEST_LINUX_GUEST" --nocapture'
step shim-linux-xstate bash -c 'cd cube-shim && "$TEST_LINUX_XSTATE" --nocapture'
step cubelet-microvm bash -c 'cd cubelet && "$TEST_CUBELET_MICROVM" --test-threads=1'
# runtime = "auto" must pick microvm here, and say why (the fixture checks cubelet's log).
step sdk-microvm env CUBE_E2E_CONFIGURED_RUNTIME=auto "$CUBE_VENV_ROOT/e2e/bin/python" -m pytest -q \
	-p no:cacheprovider tests/e2e/test_microvm.py
# Last: L1 has frozen outright (both vCPUs spinning in its kernel with interrupts off) most
# often as these suites start their guests; the steps before it are then already reported, and
# a retry boot goes straight to it.
step hypervisor-suites hypervisor_suites
console "plan done"
