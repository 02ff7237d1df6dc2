#!/usr/bin/env bash
# Sets up and starts Cube on this host (Debian 12, as root): installs what is needed, builds the
# workspace, installs the static cube-agent, builds the `base` template and starts cubelet (the
# node daemon) in the background with the namespace runtime.
#
#   deploy/dev-up.sh [--data-dir DIR] [--foreground]
#   deploy/dev-up.sh --down [--data-dir DIR]
#
# Today this starts the node layer only: cubelet's gRPC Node service on :9091 and /metrics on
# 127.0.0.1:9093. The E2B API (cube-api) and the master come with the control plane.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DATA_DIR=/var/lib/cube
FOREGROUND=0
DOWN=0
while [ $# -gt 0 ]; do
    case "$1" in
        --data-dir) DATA_DIR=$2; shift 2 ;;
        --foreground) FOREGROUND=1; shift ;;
        --down) DOWN=1; shift ;;
        *) echo "usage: $0 [--data-dir DIR] [--foreground] | --down [--data-dir DIR]" >&2; exit 2 ;;
    esac
done
RUN_DIR=/run/cube
PIDFILE="$RUN_DIR/cubelet.pid"
CONF=${CUBE_CONF:-/etc/cube/cubelet.toml}
LOG=/var/log/cube/cubelet.log

if [ $DOWN = 1 ]; then
    if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
        kill -TERM "$(cat "$PIDFILE")"
        echo "cubelet stopped (sandboxes keep running and are re-adopted at the next start)"
    else
        echo "cubelet is not running"
    fi
    exit 0
fi

bash "$ROOT/deploy/deps.sh"
export PATH="$HOME/.cargo/bin:$PATH"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/cache/cube/target}
cd "$ROOT"

echo "==> building (release)"
cargo build --release --quiet -p cubelet
RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --release --quiet -p cube-agent --target x86_64-unknown-linux-gnu
install -D -m 0755 "$CARGO_TARGET_DIR/x86_64-unknown-linux-gnu/release/cube-agent" /usr/lib/cube/cube-agent
install -D -m 0755 "$CARGO_TARGET_DIR/release/cubelet" /usr/local/bin/cubelet

# Sandboxes reach the internet through the host (nftables masquerade behind cube-vs).
sysctl -qw net.ipv4.ip_forward=1
mkdir -p "$DATA_DIR" "$RUN_DIR" "$(dirname "$CONF")" "$(dirname "$LOG")"
if [ ! -f "$CONF" ]; then
    cat > "$CONF" <<TOML
data_dir = "$DATA_DIR"
run_dir = "$RUN_DIR"
agent_binary = "/usr/lib/cube/cube-agent"
runtime = "namespace"

[storage]
# Reflink clones need XFS: without it, cubelet makes a loop-mounted XFS image here.
xfs_loop_image = "$DATA_DIR.xfs"
xfs_loop_size_gib = 32

[pools.started]
base = 4
TOML
    echo "==> wrote $CONF"
fi

echo "==> building the base template (cached after the first build)"
cubelet --config "$CONF" build-template base >/dev/null

if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    echo "==> cubelet already running (pid $(cat "$PIDFILE"))"
    exit 0
fi
if [ $FOREGROUND = 1 ]; then
    exec cubelet --config "$CONF" run
fi
nohup cubelet --config "$CONF" run >"$LOG" 2>&1 &
echo $! > "$PIDFILE"
for _ in $(seq 1 100); do
    curl -fsS http://127.0.0.1:9093/health >/dev/null 2>&1 && break
    sleep 0.1
done
curl -fsS http://127.0.0.1:9093/health >/dev/null || { echo "cubelet did not start; see $LOG" >&2; exit 1; }
echo "==> cubelet running (pid $(cat "$PIDFILE")): gRPC cube.node.v1.Node on :9091, metrics on http://127.0.0.1:9093/metrics"
echo "    log: $LOG   stop: bash deploy/dev-up.sh --down"
