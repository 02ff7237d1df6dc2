#!/usr/bin/env bash
# Sets up and starts Cube on this host (Debian 12, as root): installs what is needed, builds the
# workspace, installs the static cube-agent, builds the `base` template and starts cubelet (the
# node daemon, namespace runtime), cube-master and cube-api in the background, creates an API key
# and prints the three E2B_* variables that point the official E2B SDKs at this host.
#
#   deploy/dev-up.sh [--data-dir DIR] [--foreground]
#   deploy/dev-up.sh --down [--data-dir DIR]
#
# Ports: E2B REST API 127.0.0.1:3000, sandbox edge 127.0.0.1:3001, cube-master gRPC 127.0.0.1:9090,
# cubelet gRPC :9091 and metrics 127.0.0.1:9093.
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
CONF=${CUBE_CONF:-/etc/cube/cubelet.toml}


running() { [ -f "$RUN_DIR/$1.pid" ] && kill -0 "$(cat "$RUN_DIR/$1.pid")" 2>/dev/null; }

if [ $DOWN = 1 ]; then
    for d in cube-api cube-master cubelet; do
        if running "$d"; then
            kill -TERM "$(cat "$RUN_DIR/$d.pid")"
            rm -f "$RUN_DIR/$d.pid"
            echo "$d stopped"
        fi
    done
    echo "(sandboxes keep running; cubelet re-adopts them at the next start)"
    exit 0
fi

bash "$ROOT/deploy/deps.sh"
export PATH="$HOME/.cargo/bin:$PATH"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/cache/cube/target}
cd "$ROOT"

echo "==> building (release)"
cargo build --release --quiet -p cubelet -p cube-master -p cube-api -p cubectl
RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --release --quiet -p cube-agent --target x86_64-unknown-linux-gnu
install -D -m 0755 "$CARGO_TARGET_DIR/x86_64-unknown-linux-gnu/release/cube-agent" /usr/lib/cube/cube-agent
for b in cubelet cube-master cube-api cubectl; do
    install -D -m 0755 "$CARGO_TARGET_DIR/release/$b" "/usr/local/bin/$b"
done

# Sandboxes reach the internet through the host (nftables masquerade behind cube-vs).
sysctl -qw net.ipv4.ip_forward=1
mkdir -p "$DATA_DIR" "$RUN_DIR" "$(dirname "$CONF")" /var/log/cube
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

if [ $FOREGROUND = 1 ]; then
    cubelet --config "$CONF" run &
    cube-master --config /etc/cube/master.toml run &
    exec cube-api --config /etc/cube/api.toml
fi

# start NAME HEALTH-CHECK COMMAND...: start a daemon unless it runs, wait until HEALTH-CHECK passes.
start() {
    local name=$1 check=$2; shift 2
    if running "$name"; then
        echo "==> $name already running (pid $(cat "$RUN_DIR/$name.pid"))"
        return
    fi
    nohup "$@" >"/var/log/cube/$name.log" 2>&1 &
    echo $! > "$RUN_DIR/$name.pid"
    for _ in $(seq 1 200); do
        eval "$check" >/dev/null 2>&1 && { echo "==> $name running (pid $!)"; return; }
        kill -0 "$!" 2>/dev/null || break
        sleep 0.1
    done
    echo "$name did not start; see /var/log/cube/$name.log" >&2
    exit 1
}
start cubelet "curl -fsS http://127.0.0.1:9093/health" cubelet --config "$CONF" run
# The master and API configs are the defaults (one host): no file needed, but show where they go.
touch /etc/cube/master.toml /etc/cube/api.toml
start cube-master "cubectl nodes" cube-master --config /etc/cube/master.toml run
start cube-api "curl -fsS http://127.0.0.1:3000/health" cube-api --config /etc/cube/api.toml

KEYFILE=/etc/cube/dev-api-key
if [ ! -s "$KEYFILE" ]; then
    (umask 077; cubectl apikey create --name dev-up > "$KEYFILE")
fi
# The master learns the node's templates from its first poll.
for _ in $(seq 1 100); do cubectl --json nodes | grep -q '"base"' && break; sleep 0.1; done
cat <<MSG
==> Cube is up (runtime: namespace). Point the E2B SDK at it:
export E2B_API_URL=http://127.0.0.1:3000 E2B_SANDBOX_URL=http://127.0.0.1:3001 E2B_API_KEY=$(cat "$KEYFILE")
    logs: /var/log/cube/   stop: bash deploy/dev-up.sh --down
MSG
