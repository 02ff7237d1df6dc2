#!/usr/bin/env bash
# Runs every Cube test suite: installs what the tests need (idempotent), checks formatting and
# lints, builds, runs the Rust tests, the Python suites against the real E2B SDKs, and the guest
# kernel build check, then checks that every privileged, KVM and nested test in
# tests/must-run.txt ran to its end (tests/suites.py).
#
# Privileged/KVM tests skip with a reason when the host lacks root or /dev/kvm, unless
# CUBE_REQUIRE_PRIV=1 / CUBE_REQUIRE_KVM=1 (CI sets both), in which case they fail.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

bash deploy/deps.sh --test
export PATH="$HOME/.cargo/bin:$PATH"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/cache/cube/target}
export CUBE_VENV_ROOT=${CUBE_VENV_ROOT:-/var/cache/cube/venv}
CUBE_SUITE_LOG=$(mktemp /tmp/cube-suites.XXXXXX)
export CUBE_SUITE_LOG
# The Python suites log each test's outcome there too (tests/cube_suite_log.py).
export PYTHONPATH="$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)
step() { printf '\n==== %s (%ss)\n' "$*" "$(( $(date +%s) - START ))"; }
# The summary is printed however the run ends: a failed step shows what had run until then.
finish() {
    local rc=$?
    if [ "$rc" -ne 0 ]; then
        step "suites that reported before the failure (rc $rc)"
        python3 tests/suites.py summary "$CUBE_SUITE_LOG" || true
    fi
    rm -f "$CUBE_SUITE_LOG"
}
trap finish EXIT

step "format and lints"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings

step "static cube-agent (the binary that goes into templates)"
RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --quiet -p cube-agent --release --target x86_64-unknown-linux-gnu
export CUBE_AGENT_BIN="$CARGO_TARGET_DIR/x86_64-unknown-linux-gnu/release/cube-agent"
file "$CUBE_AGENT_BIN" 2>/dev/null | grep -Eq 'statically linked|static-pie linked' \
    || { echo "cube-agent is not statically linked" >&2; exit 1; }

step "build"
cargo build --quiet --workspace --all-targets

step "guest kernel: build (cached by its inputs) and check"
KOUT=${CUBE_KERNEL_OUT:-/var/cache/cube/guest-kernel/out}
bash deploy/guest-kernel/build.sh --out "$KOUT"
bash deploy/guest-kernel/check.sh "$KOUT/vmlinux"
# The Linux-guest microVM tests boot it (cube-shim/tests/linux_guest.rs).
export CUBE_GUEST_KERNEL="$KOUT/vmlinux"

step "Rust tests"
# cube-master's database tests run on SQLite and on the Debian PostgreSQL cluster.
CUBE_TEST_PG_URL="$(bash deploy/postgres-test.sh)"
export CUBE_TEST_PG_URL
cargo test --workspace --no-fail-fast

step "fuzz: a hostile guest against the virtio-mmio devices (60 s: seed corpus plus new inputs)"
bash cube-hypervisor/fuzz/run.sh --secs 60
echo "RAN     fuzz fuzz/virtio_mmio" >>"$CUBE_SUITE_LOG"

# Python suites: tests/<name>/ runs in the venv made from tests/requirements-<name>.txt.
for req in tests/requirements-*.txt; do
    [ -e "$req" ] || continue
    name=$(basename "$req" .txt); name=${name#requirements-}
    [ -d "tests/$name" ] || continue
    step "Python suite tests/$name"
    "$CUBE_VENV_ROOT/$name/bin/python" -m pytest -q -p no:cacheprovider -p cube_suite_log "tests/$name"
done

# The SDK, interpreter and attacker suites again on the gvisor runtime (runsc; installed by
# deploy/deps.sh). The microVM files are the microvm runtime's own and ran above.
for name in e2e e2e_245 e2e_220 e2e_npm interpreter isolation security; do
    step "Python suite tests/$name on gvisor"
    CUBE_E2E_RUNTIME=gvisor "$CUBE_VENV_ROOT/$name/bin/python" -m pytest -q -p no:cacheprovider -p cube_suite_log \
        "tests/$name" --ignore=tests/e2e/test_microvm.py \
        --ignore=tests/e2e/test_cube_bench_runtimes.py --ignore=tests/e2e/test_soak.py \
        --ignore=tests/e2e/test_master_failover.py \
        --ignore=tests/interpreter/test_microvm_interpreter.py \
        --ignore=tests/isolation/test_microvm_boundary.py
done

step "guest kernel: script self-tests, boot to init under QEMU"
bash deploy/guest-kernel/selftest.sh "$KOUT/vmlinux"
# This host's KVM is PVM (no VMX/SVM), so the boot test uses QEMU's emulator (TCG); on a host
# with hardware KVM it uses KVM.
bash deploy/guest-kernel/boot-test.sh --vmlinux "$KOUT/vmlinux"

step "microvm runtime on SVM KVM: nested under QEMU TCG (tests/nested)"
# This host's /dev/kvm is PVM; an emulated AMD CPU with SVM gives the microvm runtime the
# hardware-virtualisation KVM every production host has.
bash tests/nested/run.sh

step "privileged, KVM, PostgreSQL, nested and Python suites"
if [ "${CUBE_REQUIRE_PRIV:-}" = 1 ] && [ "${CUBE_REQUIRE_KVM:-}" = 1 ]; then
    # On a machine that must run everything, every test in the list ran to its end.
    python3 tests/suites.py check "$CUBE_SUITE_LOG" tests/must-run.txt
else
    python3 tests/suites.py summary "$CUBE_SUITE_LOG"
fi
step "all suites passed"
