#!/usr/bin/env bash
# Installs (or upgrades) Cube on one host as systemd services.
#
#   install.sh --control      [--advertise IP] [--node URL]... [--postgres URL]
#                             [--masters URL,URL...]
#   install.sh --compute      --master URL[,URL...] [--join-token T] [--advertise IP]
#                             [--tls-ca F --tls-cert F --tls-key F]
#   install.sh --single-host
# common options:
#   --bin-dir DIR      where the built binaries are (cubelet cube-master cube-api cubectl, and
#                      cube-agent built static); default: target/release next to this script
#   --agent FILE       the static cube-agent (default: BIN_DIR/cube-agent, then
#                      target/x86_64-unknown-linux-gnu/release/cube-agent)
#   --root DIR         install under DIR instead of / (tests, images); systemd is not touched
#   --data-dir DIR     cubelet data directory (default /var/lib/cube)
#   --loop-size-gib N  size of the loop XFS image when the data dir has no reflink (default 64)
#   --no-tls           plaintext gRPC (--single-host only, where it is the default: the daemons
#                      refuse plaintext on a non-loopback address)
#   --no-start         install and enable, but do not start or restart services
#   --node-id ID       cubelet node id (default: the short host name)
#   --runtime R        cubelet runtime: namespace | gvisor | microvm | auto (default: auto: microvm
#                      with VMX/SVM, else gvisor where runsc works, else namespace)
#   --extra-san LIST   more names in the master's certificate (IP:..,DNS:..), e.g. other addresses
#   --cubelet-extra F  TOML tables appended to a newly written cubelet.toml ([switch], [pools] ...)
#   --masters LIST     (--control) every cube-master of a fleet with standbys, comma-separated:
#                      cube-api fails over between them (needs --postgres: they share it)
#   --check            validate the arguments and stop (nothing is installed)
# PKI helpers (used by --control and by operators issuing node certificates):
#   install.sh --make-ca DIR                          CA in DIR (kept when it already exists)
#   install.sh --issue-cert NAME --pki DIR --san LIST  DIR/NAME.pem + .key, LIST like
#                                                      IP:10.0.0.5,DNS:node5
#
# Idempotent: a second run replaces the binaries, keeps configs, keys, the database and every
# sandbox, and restarts the services that were running (cubelet re-adopts running sandboxes).
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)

die() { echo "install.sh: $*" >&2; exit 1; }
warn() { echo "install.sh: WARNING: $*" >&2; }
say() { echo "==> $*"; }

# ---------------------------------------------------------------------------------------------
# PKI (openssl CLI). ECDSA P-256, v3 extensions rustls/webpki insist on (SAN, key usage).
make_ca() {
    local dir=$1
    mkdir -p "$dir"
    chmod 0750 "$dir"
    if [ -s "$dir/ca.pem" ] && [ -s "$dir/ca.key" ]; then
        return 0
    fi
    (umask 077
     openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -sha256 \
         -keyout "$dir/ca.key" -out "$dir/ca.pem" -days 3650 -subj "/CN=Cube fleet CA" \
         -addext "basicConstraints=critical,CA:TRUE" \
         -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null) \
        || die "openssl could not create the CA in $dir"
    chmod 0644 "$dir/ca.pem"
}

issue_cert() {
    local name=$1 dir=$2 san=$3
    [ -s "$dir/ca.pem" ] && [ -s "$dir/ca.key" ] || die "no CA in $dir (run --make-ca $dir first)"
    [[ $name =~ ^[A-Za-z0-9._-]+$ ]] || die "certificate name $name: use letters, digits, . _ -"
    [ -n "$san" ] || die "--san is required (e.g. IP:10.0.0.5,DNS:node5)"
    if [ -s "$dir/$name.pem" ] && [ -s "$dir/$name.key" ] \
        && openssl x509 -in "$dir/$name.pem" -noout -checkend 2592000 >/dev/null 2>&1; then
        return 0   # valid for 30 more days: keep it
    fi
    local tmp ext
    tmp=$(mktemp -d)
    ext="subjectAltName=$san
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth"
    (umask 077
     openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -sha256 \
         -keyout "$tmp/k" -out "$tmp/csr" -subj "/CN=$name" 2>/dev/null &&
     openssl x509 -req -in "$tmp/csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -sha256 \
         -set_serial "0x$(openssl rand -hex 16)" -days 825 -extfile <(echo "$ext") \
         -out "$tmp/c" 2>/dev/null) || { rm -rf "$tmp"; die "openssl could not issue $name"; }
    mv "$tmp/k" "$dir/$name.key"
    mv "$tmp/c" "$dir/$name.pem"
    chmod 0644 "$dir/$name.pem"
    rm -rf "$tmp"
}

# "a,b" -> "a", "b" (a TOML array's items).
toml_list() {
    local out="" item
    IFS=, read -ra items <<<"$1"
    for item in "${items[@]}"; do
        item=${item// /}
        [ -n "$item" ] && out+="\"$item\", "
    done
    echo "${out%, }"
}

# ---------------------------------------------------------------------------------------------
MODE=""
MASTER=""
JOIN_TOKEN=""
ADVERTISE=""
NODES=()
POSTGRES=""
BIN_DIR=""
AGENT=""
ROOT=""
DATA_DIR=/var/lib/cube
LOOP_GIB=64
TLS=auto
TLS_CA="" TLS_CERT="" TLS_KEY=""
START=1
PKI_DIR="" SAN="" CERT_NAME=""
NODE_ID="" EXTRA_SAN="" CUBELET_EXTRA="" RUNTIME="" MASTERS="" CHECK=0
while [ $# -gt 0 ]; do
    case "$1" in
        --control|--compute|--single-host) MODE=${1#--}; shift ;;
        --make-ca) MODE=make-ca; PKI_DIR=${2:?}; shift 2 ;;
        --issue-cert) MODE=issue-cert; CERT_NAME=${2:?}; shift 2 ;;
        --pki) PKI_DIR=${2:?}; shift 2 ;;
        --san) SAN=${2:?}; shift 2 ;;
        --master) MASTER=${2:?}; shift 2 ;;
        --join-token) JOIN_TOKEN=${2:?}; shift 2 ;;
        --advertise) ADVERTISE=${2:?}; shift 2 ;;
        --node) NODES+=("${2:?}"); shift 2 ;;
        --postgres) POSTGRES=${2:?}; shift 2 ;;
        --bin-dir) BIN_DIR=${2:?}; shift 2 ;;
        --agent) AGENT=${2:?}; shift 2 ;;
        --root) ROOT=${2:?}; shift 2 ;;
        --data-dir) DATA_DIR=${2:?}; shift 2 ;;
        --loop-size-gib) LOOP_GIB=${2:?}; shift 2 ;;
        --no-tls) TLS=off; shift ;;
        --tls-ca) TLS_CA=${2:?}; shift 2 ;;
        --tls-cert) TLS_CERT=${2:?}; shift 2 ;;
        --tls-key) TLS_KEY=${2:?}; shift 2 ;;
        --no-start) START=0; shift ;;
        --node-id) NODE_ID=${2:?}; shift 2 ;;
        --runtime) RUNTIME=${2:?}; shift 2 ;;
        --extra-san) EXTRA_SAN=${2:?}; shift 2 ;;
        --cubelet-extra) CUBELET_EXTRA=${2:?}; shift 2 ;;
        --masters) MASTERS=${2:?}; shift 2 ;;
        --check) CHECK=1; shift ;;
        -h|--help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done

case "$MODE" in
    make-ca)
        [ $CHECK = 0 ] || { echo "install.sh: arguments OK (--$MODE)"; exit 0; }
        make_ca "$PKI_DIR"; echo "$PKI_DIR/ca.pem"; exit 0 ;;
    issue-cert)
        [ -n "$PKI_DIR" ] || die "--issue-cert needs --pki DIR"
        [ -n "$SAN" ] || die "--san is required (e.g. IP:10.0.0.5,DNS:node5)"
        [ $CHECK = 0 ] || { echo "install.sh: arguments OK (--$MODE)"; exit 0; }
        issue_cert "$CERT_NAME" "$PKI_DIR" "$SAN"
        echo "$PKI_DIR/$CERT_NAME.pem"; exit 0 ;;
    control|compute|single-host) ;;
    "") die "give one of --control, --compute --master URL, --single-host (see --help)" ;;
esac
[ $CHECK = 1 ] || [ "$(id -u)" = 0 ] || die "run as root (it installs services, cubelet needs root)"
if [ "$MODE" = compute ] && [ -z "$MASTER" ]; then die "--compute needs --master URL"; fi
[[ $LOOP_GIB =~ ^[0-9]+$ ]] && [ "$LOOP_GIB" -gt 0 ] || die "--loop-size-gib must be a positive integer"
[ -z "$MASTERS" ] || [ "$MODE" = control ] || die "--masters is for --control (a compute host lists them in --master)"
[ -z "$MASTERS" ] || [ -n "$POSTGRES" ] || die "--masters needs --postgres: the masters of a fleet share one PostgreSQL database"
if [ -n "$ROOT" ] && [ $CHECK = 0 ]; then
    mkdir -p "$ROOT"
    ROOT=$(cd "$ROOT" && pwd)
    [ "$ROOT" != / ] || ROOT=""
fi
R=$ROOT
# systemd is driven only for a real install on a host where it is PID 1.
SYSTEMD=0
if [ -z "$R" ] && [ "$(cat /proc/1/comm 2>/dev/null)" = systemd ]; then SYSTEMD=1; fi
[ "$TLS" = auto ] && { [ "$MODE" = single-host ] && TLS=off || TLS=on; }
# cube-master and cubelet refuse plaintext gRPC on a non-loopback address (anyone reaching it
# would control the fleet), and only --single-host binds loopback.
[ "$TLS" = off ] && [ "$MODE" != single-host ] \
    && die "--no-tls is for --single-host only: --control and --compute serve gRPC on the network, which needs mutual TLS"
[ -z "$CUBELET_EXTRA" ] || [ -r "$CUBELET_EXTRA" ] || die "--cubelet-extra $CUBELET_EXTRA is not readable"
case "$RUNTIME" in ""|namespace|gvisor|microvm|auto) ;; *) die "--runtime must be namespace, gvisor, microvm or auto" ;; esac
[ -n "$ADVERTISE" ] || ADVERTISE=$(hostname -I 2>/dev/null | awk '{print $1}')
[ -n "$ADVERTISE" ] || ADVERTISE=127.0.0.1
case $ADVERTISE in *[!0-9.]*) SAN_ADV="DNS:$ADVERTISE" ;; *) SAN_ADV="IP:$ADVERTISE" ;; esac
if [ $CHECK = 1 ]; then echo "install.sh: arguments OK (--$MODE)"; exit 0; fi

WANT_CONTROL=0 WANT_COMPUTE=0
case "$MODE" in
    control) WANT_CONTROL=1 ;;
    compute) WANT_COMPUTE=1 ;;
    single-host) WANT_CONTROL=1; WANT_COMPUTE=1 ;;
esac

# ---------------------------------------------------------------------------------------------
# Host checks.
KVM_KIND=none
if [ $WANT_COMPUTE = 1 ]; then
    if [ -c /dev/kvm ]; then
        if [ -d /sys/module/kvm_pvm ]; then KVM_KIND=PVM
        elif grep -qw vmx /proc/cpuinfo; then KVM_KIND=VMX
        elif grep -qw svm /proc/cpuinfo; then KVM_KIND=SVM
        else KVM_KIND=unknown
        fi
    fi
    say "KVM: $KVM_KIND"
    if [ $KVM_KIND = none ]; then
        warn "no /dev/kvm: sandboxes use the namespace runtime (containers sharing this host's kernel), not microVMs"
    fi
    [ -f /sys/fs/cgroup/cgroup.controllers ] || warn "cgroup v2 is not mounted at /sys/fs/cgroup: cubelet falls back to v1 controllers"
    [ -e /proc/self/ns/user ] || warn "kernel without user namespaces"
    if [ ! -e /sys/kernel/btf/vmlinux ]; then
        warn "no /sys/kernel/btf/vmlinux: the kernel may lack BPF support cube-vs needs (or set network.switch = \"none\", no isolation)"
    fi
    if ! mountpoint -q /sys/fs/bpf 2>/dev/null; then
        say "mounting bpffs at /sys/fs/bpf (systemd mounts it at boot)"
        mkdir -p /sys/fs/bpf && mount -t bpf bpf /sys/fs/bpf || warn "could not mount bpffs"
    fi
    command -v nft >/dev/null || warn "nft (nftables) is missing: sandbox egress masquerade will fail"
    command -v mkfs.xfs >/dev/null || warn "mkfs.xfs (xfsprogs) is missing: template storage needs it"
fi
if [ $TLS = on ] && ! command -v openssl >/dev/null; then die "TLS needs the openssl CLI (apt install openssl)"; fi

RUNTIME=${RUNTIME:-auto}
# gVisor's runsc (Debian bookworm-backports) for runtime gvisor, and for auto without VMX/SVM.
if [ $WANT_COMPUTE = 1 ] && [ "$RUNTIME" != namespace ] && [ "$RUNTIME" != microvm ] && [ -z "$R" ]; then
    bash "$SRC/deploy/deps.sh" --runsc || warn "could not install runsc: runtime auto falls back to namespace"
fi
if [ $KVM_KIND = none ] && [ "$RUNTIME" = microvm ]; then die "--runtime microvm needs /dev/kvm"; fi

# XFS with reflink for the data dir, else a loop XFS image that cubelet creates and mounts.
USE_LOOP=0
if [ $WANT_COMPUTE = 1 ]; then
    mkdir -p "$R$DATA_DIR"
    fstype=$(stat -f -c %T "$R$DATA_DIR")
    if [ "$fstype" = xfs ] && xfs_info "$R$DATA_DIR" 2>/dev/null | grep -q 'reflink=1'; then
        say "data dir $R$DATA_DIR: XFS with reflink"
    elif mountpoint -q "$R$DATA_DIR" && [ "$fstype" = xfs ]; then
        warn "$R$DATA_DIR is XFS without reflink: clones will be full copies (reformat with -m reflink=1)"
    else
        USE_LOOP=1
        say "data dir $R$DATA_DIR is $fstype (no reflink): cubelet will use a ${LOOP_GIB} GiB loop XFS image $R$DATA_DIR.xfs (sparse)"
    fi
fi

# ---------------------------------------------------------------------------------------------
# Binaries. Replaced atomically (copy next to the target, then rename), so a running daemon
# keeps its old inode and the restart picks up the new one.
[ -n "$BIN_DIR" ] || BIN_DIR=$SRC/target/release
BINS=()
[ $WANT_CONTROL = 1 ] && BINS+=(cube-master cube-api)
[ $WANT_COMPUTE = 1 ] && BINS+=(cubelet)
BINS+=(cubectl)
for b in "${BINS[@]}"; do
    [ -x "$BIN_DIR/$b" ] || die "$BIN_DIR/$b missing (cargo build --release -p $b, or --bin-dir)"
done
if [ $WANT_COMPUTE = 1 ]; then
    if [ -z "$AGENT" ]; then
        for a in "$BIN_DIR/cube-agent" "$SRC/target/x86_64-unknown-linux-gnu/release/cube-agent"; do
            [ -x "$a" ] && { AGENT=$a; break; }
        done
    fi
    [ -n "$AGENT" ] && [ -x "$AGENT" ] || die "no static cube-agent (build it with RUSTFLAGS=\"-C target-feature=+crt-static\" cargo build --release -p cube-agent --target x86_64-unknown-linux-gnu, or --agent FILE)"
fi
put() {  # put SRC DST MODE: atomic replace
    mkdir -p "$(dirname "$2")"
    cp "$1" "$2.new.$$"
    chmod "$3" "$2.new.$$"
    mv -f "$2.new.$$" "$2"
}
UPGRADE=0
for b in "${BINS[@]}"; do
    [ -e "$R/usr/local/bin/$b" ] && UPGRADE=1
    put "$BIN_DIR/$b" "$R/usr/local/bin/$b" 0755
done
if [ $WANT_COMPUTE = 1 ]; then
    put "$AGENT" "$R/usr/lib/cube/cube-agent" 0755
    for opt in cube-shim cube-hypervisor; do
        [ -x "$BIN_DIR/$opt" ] && put "$BIN_DIR/$opt" "$R/usr/lib/cube/$opt" 0755
    done
fi
say "binaries installed under $R/usr/local/bin ($([ $UPGRADE = 1 ] && echo upgrade || echo first install))"

# ---------------------------------------------------------------------------------------------
# PKI and configs. Existing configs are never overwritten (operators edit them).
ETC=$R/etc/cube
PKI=$ETC/pki
mkdir -p "$ETC" "$R/var/lib/cube-master" "$R/run/cube" "$R/var/cache/cube/templates"
chmod 0755 "$ETC"
tls_section() {  # tls_section NAME
    [ $TLS = on ] || return 0
    printf '\n# Mutual TLS on the gRPC links (remove the section for plaintext).\n[tls]\nca = "%s"\ncert = "%s"\nkey = "%s"\n' \
        "$PKI/ca.pem" "$PKI/$1.pem" "$PKI/$1.key"
}
write_config() {  # write_config FILE < content
    if [ -e "$1" ]; then
        say "kept $1"
        cat >/dev/null
    else
        cat > "$1.new.$$"
        mv "$1.new.$$" "$1"
        say "wrote $1"
    fi
}
SCHEME=http
if [ $TLS = on ]; then SCHEME=https; fi

if [ $WANT_CONTROL = 1 ]; then
    if [ $TLS = on ]; then
        make_ca "$PKI"
        issue_cert master "$PKI" "$SAN_ADV,IP:127.0.0.1,DNS:localhost${EXTRA_SAN:+,$EXTRA_SAN}"
        issue_cert api "$PKI" "IP:127.0.0.1"
        issue_cert admin "$PKI" "IP:127.0.0.1"
    fi
    DB_URL="sqlite://$R/var/lib/cube-master/master.db?mode=rwc"
    [ -n "$POSTGRES" ] && DB_URL=$POSTGRES
    MASTER_BIND=0.0.0.0
    [ "$MODE" = single-host ] && MASTER_BIND=127.0.0.1
    nodes_toml=""
    for n in "${NODES[@]}"; do nodes_toml+="\"$n\", "; done
    write_config "$ETC/master.toml" <<TOML
# cube-master (see docs/install.md). Generated by deploy/install.sh --$MODE.
grpc_addr = "$MASTER_BIND:9090"
metrics_addr = "127.0.0.1:9092"
database_url = "$DB_URL"
# envd access tokens are derived from this key; the database keeps only their hashes. Every
# master of the fleet needs the same file.
token_key_file = "$R/var/lib/cube-master/token.key"
# Static nodes (polled); nodes installed with --compute register themselves instead.
nodes = [${nodes_toml%, }]
# Nodes join with a one-time token: cubectl node join-token (CreateJoinToken).
require_join_token = $([ "$MODE" = single-host ] && echo false || echo true)
log_format = "json"
$(tls_section master)
TOML
    write_config "$ETC/api.toml" <<TOML
# cube-api (see docs/install.md). Generated by deploy/install.sh --$MODE.
api_addr = "$([ "$MODE" = single-host ] && echo 127.0.0.1 || echo 0.0.0.0):3000"
edge_addr = "$([ "$MODE" = single-host ] && echo 127.0.0.1 || echo 0.0.0.0):3001"
metrics_addr = "127.0.0.1:9094"
$(if [ -n "$MASTERS" ]; then echo "master_urls = [$(toml_list "$MASTERS")]"; else echo "master_url = \"$SCHEME://127.0.0.1:9090\""; fi)
log_format = "json"
$(tls_section api)
TOML
fi

if [ $WANT_COMPUTE = 1 ]; then
    if [ $TLS = on ]; then
        if [ -n "$TLS_CA$TLS_CERT$TLS_KEY" ]; then
            [ -s "$TLS_CA" ] && [ -s "$TLS_CERT" ] && [ -s "$TLS_KEY" ] \
                || die "--tls-ca, --tls-cert and --tls-key must all name readable files"
            mkdir -p "$PKI"; chmod 0750 "$PKI"
            put "$TLS_CA" "$PKI/ca.pem" 0644
            put "$TLS_CERT" "$PKI/node.pem" 0644
            put "$TLS_KEY" "$PKI/node.key" 0600
        elif [ -s "$PKI/ca.key" ]; then
            issue_cert node "$PKI" "$SAN_ADV,IP:127.0.0.1"   # control and compute on one host
        elif [ ! -s "$PKI/node.pem" ]; then
            die "TLS: give --tls-ca/--tls-cert/--tls-key (issue them on the control host: install.sh --issue-cert NODE --pki /etc/cube/pki --san IP:$ADVERTISE)"
        fi
    fi
    [ "$MODE" = single-host ] && MASTER=$SCHEME://127.0.0.1:9090
    NODE_BIND=0.0.0.0
    [ "$MODE" = single-host ] && NODE_BIND=127.0.0.1
    loop=""
    if [ $USE_LOOP = 1 ]; then
        loop="[storage]
# The data dir has no reflink: cubelet creates and mounts this loop XFS image there.
xfs_loop_image = \"$R$DATA_DIR.xfs\"
xfs_loop_size_gib = $LOOP_GIB"
    fi
    write_config "$ETC/cubelet.toml" <<TOML
# cubelet (see docs/install.md). Generated by deploy/install.sh --$MODE. KVM here: $KVM_KIND.
node_id = "${NODE_ID:-$(hostname -s)}"
grpc_addr = "$NODE_BIND:9091"
http_addr = "127.0.0.1:9093"
data_dir = "$R$DATA_DIR"
run_dir = "$R/run/cube"
cache_dir = "$R/var/cache/cube/templates"
agent_binary = "$R/usr/lib/cube/cube-agent"
runtime = "$RUNTIME"
log_format = "json"
$loop

[master]
$(case $MASTER in *,*) echo "addresses = [$(toml_list "$MASTER")]" ;; *) echo "address = \"$MASTER\"" ;; esac)
join_token = "$JOIN_TOKEN"
advertise = "$SCHEME://$([ "$MODE" = single-host ] && echo 127.0.0.1 || echo "$ADVERTISE"):9091"
$(tls_section node)
$([ -n "$CUBELET_EXTRA" ] && cat "$CUBELET_EXTRA")
TOML
    if [ -n "$JOIN_TOKEN" ] && [ -e "$ETC/cubelet.toml" ] && ! grep -q "join_token = \"$JOIN_TOKEN\"" "$ETC/cubelet.toml"; then
        # A new token on re-install (e.g. the node's registration was deleted): take it.
        sed -i "s|^join_token = .*|join_token = \"$JOIN_TOKEN\"|" "$ETC/cubelet.toml"
        say "updated join_token in $ETC/cubelet.toml"
    fi
fi

# ---------------------------------------------------------------------------------------------
# systemd units, with paths moved under --root when given.
UNITS=()
[ $WANT_CONTROL = 1 ] && UNITS+=(cube-master.service cube-api.service cube-control.target)
[ $WANT_COMPUTE = 1 ] && UNITS+=(cubelet.service cube-compute.target)
UDIR=$R/etc/systemd/system
mkdir -p "$UDIR"
for u in "${UNITS[@]}"; do
    sed -e "/^RequiresMountsFor=/s#/var/lib/cube #$R$DATA_DIR #" \
        -e "s#/usr/local/bin/#$R/usr/local/bin/#g" -e "s#/etc/cube/#$R/etc/cube/#g" \
        "$SRC/deploy/systemd/$u" > "$UDIR/$u.new.$$"
    mv "$UDIR/$u.new.$$" "$UDIR/$u"
done
say "units in $UDIR: ${UNITS[*]}"
printf 'mode=%s\nkvm=%s\ntls=%s\ninstalled_at=%s\n' "$MODE" "$KVM_KIND" "$TLS" "$(date -u +%FT%TZ)" > "$ETC/install.state"

if [ $SYSTEMD = 1 ]; then
    systemctl daemon-reload
    TARGETS=()
    [ $WANT_CONTROL = 1 ] && TARGETS+=(cube-control.target)
    [ $WANT_COMPUTE = 1 ] && TARGETS+=(cube-compute.target)
    systemctl enable "${TARGETS[@]}" "${UNITS[@]}" >/dev/null
    if [ $START = 1 ]; then
        # restart: a no-op difference on first install; on upgrade it loads the new binaries.
        # cubelet's stop leaves sandboxes running and its next start re-adopts them.
        for u in "${UNITS[@]}"; do
            case $u in *.service) systemctl restart "$u" ;; esac
        done
        say "services running: $(systemctl is-active "${UNITS[@]}" | tr '\n' ' ')"
    fi
else
    say "systemd is not PID 1 here$([ -n "$R" ] && echo " (or --root was given)"): units installed, nothing started"
    for u in "${UNITS[@]}"; do
        case $u in *.service) echo "    $u: $(sed -n 's/^ExecStart=//p' "$UDIR/$u")" ;; esac
    done
fi
if [ $WANT_CONTROL = 1 ] && [ $TLS = on ]; then
    echo "    cubectl: --tls-ca $PKI/ca.pem --tls-cert $PKI/admin.pem --tls-key $PKI/admin.key"
    echo "    a compute node's certificate: $0 --issue-cert NODE --pki $PKI --san IP:NODE_IP"
fi
