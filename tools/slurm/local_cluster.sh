#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for the tests marked `slurm` (and for trying the
# SLURM paths by hand): munge, slurmctld and slurmd with a minimal configuration.
#
#   tools/slurm/local_cluster.sh start    # installs slurm-wlm + munge if missing (root), starts
#   tools/slurm/local_cluster.sh status   # exit 0 if the node answers and is idle or busy
#   tools/slurm/local_cluster.sh stop     # stops the daemons this script started (munged too,
#                                         # if it was not running before `start`)
#   tools/slurm/local_cluster.sh env      # prints `export SLURM_CONF=...` for eval
#
# PYCLS_SLURM_NO_INSTALL=1 never installs (the tests start it that way). Everything lives in
# $PYCLS_SLURM_DIR (default /tmp/pycls-slurm): slurm.conf, state, spool, logs and pid files.
# Client commands find the cluster through SLURM_CONF=$PYCLS_SLURM_DIR/slurm.conf (nothing under
# /etc/slurm is written). Accounting is off, so `sacct` answers nothing: submitit warns and
# knows a job is done from its own result files; `squeue` shows the jobs.
#
# The cluster is its own: its ports are not SLURM's defaults (6817/6818, where a machine's own
# SLURM listens) but a pair derived from $PYCLS_SLURM_DIR (PYCLS_SLURMCTLD_PORT / PYCLS_SLURMD_PORT
# override them), its ClusterName is derived from the directory too, and `status`/`start` count
# the cluster as up only when the controller answering reports this directory's slurm.conf and
# that name. Another cluster on the same ports is reported, never used.
set -euo pipefail

dir=${PYCLS_SLURM_DIR:-/tmp/pycls-slurm}
conf=$dir/slurm.conf
host=$(hostname -s)
log() { echo "local_cluster: $*" >&2; }

# A number from the directory's name: the same directory always gets the same ports and name
sum=$(printf '%s' "$dir" | cksum | cut -d ' ' -f 1)
ctld_port=${PYCLS_SLURMCTLD_PORT:-$((20000 + sum % 4000 * 2))}
slurmd_port=${PYCLS_SLURMD_PORT:-$((ctld_port + 1))}
cluster_name=pycls$((sum % 100000))

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
        && command -v srun >/dev/null && return 0
    if [ -n "${PYCLS_SLURM_NO_INSTALL:-}" ]; then
        log "slurm-wlm and munge are not installed (PYCLS_SLURM_NO_INSTALL is set)"
        return 1
    fi
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
        log "slurm-wlm and munge are not installed, and installing them needs root and apt-get"
        return 1
    fi
    log "installing slurm-wlm and munge (apt-get, about a minute)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null && apt-get install -y -qq slurm-wlm munge >/dev/null
}

start_munge() {
    if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi
    [ -s /etc/munge/munge.key ] || {
        log "creating /etc/munge/munge.key"
        mkdir -p /etc/munge
        dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
    }
    chown munge:munge /etc/munge/munge.key 2>/dev/null || true
    chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /run/munge /var/lib/munge 2>/dev/null || true
    chmod 755 /run/munge
    munged --force
    for _ in $(seq 50); do
        if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
            # started here, so `stop` stops it too (a munged that was running is left alone)
            mkdir -p "$dir"
            if [ -s /run/munge/munged.pid ]; then
                cp /run/munge/munged.pid "$dir/munged.pid"
            elif command -v pgrep >/dev/null; then
                pgrep -n -x munged >"$dir/munged.pid" || rm -f "$dir/munged.pid"
            fi
            return 0
        fi
        sleep 0.1
    done
    log "munged does not answer"
    return 1
}

write_conf() {
    mkdir -p "$dir/state" "$dir/spool"
    # This machine as slurmd sees it (CPUs, sockets, cores, threads, memory)
    local node
    node=$(slurmd -C | head -n 1 | sed "s/^NodeName=[^ ]*/NodeName=$host/")
    cat >"$conf" <<CONF
# Written by tools/slurm/local_cluster.sh: one node, no accounting
ClusterName=$cluster_name
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
AuthType=auth/munge
# Job credentials live 10 s (default 120): a requeued job may start again that much later
AuthInfo=cred_expire=10
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Look at pending jobs every second or two (defaults 60 s and 30 s): a requeued job starts soon
# after its credentials expire
SchedulerParameters=sched_interval=2,bf_interval=1
MpiDefault=none
ReturnToService=2
JobRequeue=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=30
MinJobAge=300
$node State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
}

node_state() {
    SLURM_CONF=$conf sinfo -h -n "$host" -o %T 2>/dev/null | head -n 1
}

answering() {  # "NAME CONF" of the controller that answers at this directory's slurm.conf
    SLURM_CONF=$conf scontrol show config 2>/dev/null | awk -F ' *= *' '
        $1 == "ClusterName" { name = $2 } $1 == "SLURM_CONF" { path = $2 }
        END { print name " " path }'
}

is_ours() {  # the controller answering was started from this directory's slurm.conf
    [ -f "$conf" ] || return 1
    local who
    who=$(answering)
    [ "$who" = "$cluster_name $conf" ] && return 0
    if [ "$who" != " " ]; then
        log "another SLURM controller answers at $conf's port (ClusterName and config: $who);" \
            "not this cluster ($cluster_name)"
    fi
    return 1
}

is_up() {
    is_ours || return 1
    case "$(node_state)" in idle* | mixed* | allocated* | completing*) return 0 ;; esac
    return 1
}

port_taken() {  # something listens on this TCP port of this host
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

start() {
    if is_up; then log "already running ($conf)"; return 0; fi
    install_packages
    start_munge
    stop_daemons
    local port
    for port in "$ctld_port" "$slurmd_port"; do
        if port_taken "$port"; then
            log "port $port is taken by another program; choose free ports with" \
                "PYCLS_SLURMCTLD_PORT and PYCLS_SLURMD_PORT (or another PYCLS_SLURM_DIR)"
            return 1
        fi
    done
    write_conf
    export SLURM_CONF=$conf
    slurmctld -c -f "$conf"   # -c: a fresh state (no jobs left from an earlier start)
    slurmd -f "$conf"
    for _ in $(seq 150); do
        is_ours || { sleep 0.2; continue; }
        case "$(node_state)" in
            idle*) log "node $host is idle; export SLURM_CONF=$conf"; return 0 ;;
            down* | drain* | inval*) SLURM_CONF=$conf scontrol update nodename="$host" state=resume \
                2>/dev/null || true ;;
        esac
        sleep 0.2
    done
    log "the node did not become idle (state: $(node_state)); logs in $dir"
    tail -n 20 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true
    return 1
}

stop_one() {  # pid file: the daemon this script started, by its pid
    [ -f "$1" ] || return 0
    local pid
    pid=$(cat "$1")
    if [ -n "$pid" ] && kill "$pid" 2>/dev/null; then
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$1"
}

stop_daemons() {
    stop_one "$dir/slurmd.pid"
    stop_one "$dir/slurmctld.pid"
}

case "${1:-}" in
    start) start ;;
    stop) stop_daemons; stop_one "$dir/munged.pid"; log "stopped" ;;
    status) if is_up; then echo "up: $(node_state)"; else echo "down"; exit 1; fi ;;
    env) echo "export SLURM_CONF=$conf" ;;
    *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
