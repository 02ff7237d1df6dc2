#!/usr/bin/env bash
# The Linux-guest path of the microvm runtime, end to end, on this host's /dev/kvm:
#   guest kernel (built, cached) → cube-shim boots it with cube-agent as init and snapshots it
#   once the agent asks for its init over vsock → restore, init, envd over virtio-net, pause to
#   disk, resume (cube-shim/tests/linux_guest.rs) → a cubelet on the microvm runtime behind
#   cube-master and cube-api, driven by the E2B Python SDK: create, commands.run, env vars,
#   two copies with their own RNG, files, pause, connect (tests/e2e/test_microvm.py).
#
#   linux-e2e.sh
#
# Runs on hardware KVM (VMX/SVM) and on PVM hosts (the kernel's cube_pvm patch; guest kernel
# mode is emulated there, so it is slow but real). Both tests are also part of tests/run.sh.
# Needs root, the workspace built (debug), the static cube-agent ($CUBE_AGENT_BIN) and the
# tests/e2e virtualenv (deploy/deps.sh --test).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
die() { echo "linux-e2e.sh: FAIL: $*" >&2; exit 1; }

[[ $# -eq 0 ]] || { sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2; }
[[ -c /dev/kvm ]] || die "no /dev/kvm on this host"
if grep -qwE 'vmx|svm' /proc/cpuinfo; then kind=hardware; else kind=pvm; fi
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/cache/cube/target}
export CUBE_AGENT_BIN=${CUBE_AGENT_BIN:-$CARGO_TARGET_DIR/x86_64-unknown-linux-gnu/release/cube-agent}
[[ -x $CUBE_AGENT_BIN ]] || die "static cube-agent $CUBE_AGENT_BIN missing (see tests/run.sh)"
venv=${CUBE_VENV_ROOT:-/var/cache/cube/venv}/e2e
[[ -x $venv/bin/python ]] || die "virtualenv $venv missing: run deploy/deps.sh --test"

kout=${CUBE_KERNEL_OUT:-/var/cache/cube/guest-kernel/out}
"$here/build.sh" --out "$kout" || die "guest kernel build failed"
"$here/check.sh" "$kout/vmlinux" || die "guest kernel check failed"
export CUBE_GUEST_KERNEL=$kout/vmlinux CUBE_REQUIRE_KVM=1 CUBE_REQUIRE_PRIV=1
echo "linux-e2e: /dev/kvm is $kind; kernel $CUBE_GUEST_KERNEL"

cd "$repo"
cargo build --quiet -p cubelet -p cube-shim -p cube-master -p cube-api -p cubectl
cargo test --quiet -p cube-shim --test linux_guest -- --nocapture || die "cube-shim Linux guest test"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/e2e/test_microvm.py ||
	die "E2B SDK against Linux microVMs"
echo "linux-e2e: OK ($kind KVM)"
