#!/usr/bin/env bash
# Sets up and starts Cube on this host (Debian 12, as root): installs what is needed
# (deploy/deps.sh), builds the workspace (release), installs the binaries to /usr/local/bin and
# the static cube-agent and cube-shim to /usr/lib/cube (plus the microVM guest kernel, built by
# deploy/guest-kernel/build.sh, where the CPU has VMX/SVM or with --runtime microvm), then runs
# `cubectl up`, which starts cubelet,
# cube-master and cube-api, builds the `base` template if missing, creates an API key and prints
# the three E2B_* variables that point the official E2B SDKs at this host.
#
#   deploy/dev-up.sh [--data-dir DIR] [--api-port N] [--runtime auto|namespace|gvisor|microvm] [--foreground]
#   deploy/dev-up.sh --down [--data-dir DIR] [--purge]
#
# Everything after the build is `cubectl up` / `cubectl down`; see `cubectl up --help`.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DOWN=0
RUNTIME=auto
UP_ARGS=()
DOWN_ARGS=()
usage() {
    echo "usage: $0 [--data-dir DIR] [--api-port N] [--runtime auto|namespace|gvisor|microvm] [--foreground]" >&2
    echo "       $0 --down [--data-dir DIR] [--purge]" >&2
    exit 2
}
while [ $# -gt 0 ]; do
    case "$1" in
        --data-dir) [ $# -ge 2 ] || usage; UP_ARGS+=("$1" "$2"); DOWN_ARGS+=("$1" "$2"); shift 2 ;;
        --api-port) [ $# -ge 2 ] || usage; UP_ARGS+=("$1" "$2"); shift 2 ;;
        --runtime) [ $# -ge 2 ] || usage; UP_ARGS+=("$1" "$2"); RUNTIME=$2; shift 2 ;;
        --foreground) UP_ARGS+=("$1"); shift ;;
        --purge) DOWN_ARGS+=("$1"); shift ;;
        --down) DOWN=1; shift ;;
        *) usage ;;
    esac
done

export PATH="$HOME/.cargo/bin:$PATH"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/cache/cube/target}

if [ $DOWN = 1 ]; then
    CUBECTL=$(command -v cubectl || echo "$CARGO_TARGET_DIR/release/cubectl")
    exec "$CUBECTL" down "${DOWN_ARGS[@]}"
fi

bash "$ROOT/deploy/deps.sh"
cd "$ROOT"
echo "==> building (release)" >&2
cargo build --release --quiet -p cubelet -p cube-master -p cube-api -p cubectl -p cube-shim
RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --release --quiet -p cube-agent --target x86_64-unknown-linux-gnu
install -D -m 0755 "$CARGO_TARGET_DIR/x86_64-unknown-linux-gnu/release/cube-agent" /usr/lib/cube/cube-agent
install -D -m 0755 "$CARGO_TARGET_DIR/release/cube-shim" /usr/lib/cube/cube-shim
# The guest kernel is what lets `auto` pick microVMs; it is only worth building where it can be
# picked (VMX/SVM: PVM emulates guest kernel mode, so `auto` stays on namespaces there).
if [ "$RUNTIME" = microvm ] || grep -qwE 'vmx|svm' /proc/cpuinfo; then
    echo "==> guest kernel (deploy/guest-kernel/build.sh, cached)" >&2
    nice bash "$ROOT/deploy/guest-kernel/build.sh" --out /var/cache/cube/guest-kernel/out
    install -D -m 0644 /var/cache/cube/guest-kernel/out/vmlinux /usr/lib/cube/vmlinux
fi
for b in cubelet cube-master cube-api cubectl; do
    install -D -m 0755 "$CARGO_TARGET_DIR/release/$b" "/usr/local/bin/$b"
done

exec /usr/local/bin/cubectl up "${UP_ARGS[@]}"
