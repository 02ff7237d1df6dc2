#!/usr/bin/env bash
# Sets up and starts Cube on this host (Debian 12, as root): installs what is needed
# (deploy/deps.sh), builds the workspace (release), installs the binaries to /usr/local/bin and
# the static cube-agent to /usr/lib/cube, then runs `cubectl up`, which starts cubelet,
# cube-master and cube-api, builds the `base` template if missing, creates an API key and prints
# the three E2B_* variables that point the official E2B SDKs at this host.
#
#   deploy/dev-up.sh [--data-dir DIR] [--api-port N] [--runtime auto|namespace|microvm] [--foreground]
#   deploy/dev-up.sh --down [--data-dir DIR] [--purge]
#
# Everything after the build is `cubectl up` / `cubectl down`; see `cubectl up --help`.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DOWN=0
UP_ARGS=()
DOWN_ARGS=()
usage() {
    echo "usage: $0 [--data-dir DIR] [--api-port N] [--runtime auto|namespace|microvm] [--foreground]" >&2
    echo "       $0 --down [--data-dir DIR] [--purge]" >&2
    exit 2
}
while [ $# -gt 0 ]; do
    case "$1" in
        --data-dir) [ $# -ge 2 ] || usage; UP_ARGS+=("$1" "$2"); DOWN_ARGS+=("$1" "$2"); shift 2 ;;
        --api-port|--runtime) [ $# -ge 2 ] || usage; UP_ARGS+=("$1" "$2"); shift 2 ;;
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
cargo build --release --quiet -p cubelet -p cube-master -p cube-api -p cubectl
RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --release --quiet -p cube-agent --target x86_64-unknown-linux-gnu
install -D -m 0755 "$CARGO_TARGET_DIR/x86_64-unknown-linux-gnu/release/cube-agent" /usr/lib/cube/cube-agent
for b in cubelet cube-master cube-api cubectl; do
    install -D -m 0755 "$CARGO_TARGET_DIR/release/$b" "/usr/local/bin/$b"
done

exec /usr/local/bin/cubectl up "${UP_ARGS[@]}"
