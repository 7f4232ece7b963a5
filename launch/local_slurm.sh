#!/usr/bin/env bash
# A throwaway single-node SLURM cluster on this machine, for tests and for trying Hydra's
# submitit_slurm launcher without a real cluster.
#
#   launch/local_slurm.sh install            # apt-get slurm-wlm + munge (only if missing; root)
#   launch/local_slurm.sh start  [STATE_DIR] # write the config, start munged/slurmctld/slurmd,
#                                            # wait until the node is idle, print the env to use
#   launch/local_slurm.sh status [STATE_DIR] # exit 0 when all three daemons run
#   launch/local_slurm.sh stop   [STATE_DIR] # cancel our jobs, stop the daemons started here
#
# STATE_DIR defaults to $LOCAL_SLURM_DIR or /tmp/replay-rloo-slurm. Everything lives in it:
# slurm.conf, the munge key and socket, spool/state folders, logs and pid files. `start` prints
# one line on stdout (all progress goes to stderr), so a shell can do
#
#   eval "$(launch/local_slurm.sh start)"    # sets SLURM_CONF for sbatch/squeue/sinfo/submitit
#
# It is also written to STATE_DIR/env.sh. Daemons run as root (the test jobs run as root too).
# Nothing system-wide is touched after `install`: no /etc/slurm, no /etc/munge key, no
# /run/munge, no systemd units; a system munged/slurm, if any, is left alone.
#
# Ports default to SLURM's 6817/6818; set LOCAL_SLURM_CTLD_PORT / LOCAL_SLURM_D_PORT to run a
# second cluster beside another one. LOCAL_SLURM_TIMEOUT (seconds, default 60) bounds the wait
# for the node to become idle.
#
# LOCAL_SLURM_NODES=N (default 1) makes N nodes of this one machine, HOST, HOST-2, ... HOST-N, each
# with its own slurmd (slurmd -N NAME, on ports LOCAL_SLURM_D_PORT .. +N-1) and all of this
# machine's CPUs and memory: a job can then ask for N nodes (sbatch -N N) and srun starts a task
# on each, as on a cluster, to test what spans nodes. The nodes share the cores; nothing is faster.
set -euo pipefail

DEFAULT_DIR="${LOCAL_SLURM_DIR:-/tmp/replay-rloo-slurm}"
CTLD_PORT="${LOCAL_SLURM_CTLD_PORT:-6817}"
SLURMD_PORT="${LOCAL_SLURM_D_PORT:-6818}"
START_TIMEOUT="${LOCAL_SLURM_TIMEOUT:-60}"
NODES="${LOCAL_SLURM_NODES:-1}"
[[ "$NODES" =~ ^[1-9][0-9]*$ ]] || { echo "local_slurm: LOCAL_SLURM_NODES=$NODES: give a whole number >= 1 (e.g. 2)" >&2; exit 2; }

log() { echo "local_slurm: $*" >&2; }
die() { log "error: $*"; exit 1; }

# The daemons live in /usr/sbin, which a non-login root shell (or CI) may not have on PATH.
export PATH="$PATH:/usr/sbin:/sbin:/usr/bin:/bin"

usage() {
    awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0" >&2
    exit 2
}

state_dir() {  # absolute path: slurm.conf needs absolute paths, and pid files are compared
    local dir="${1:-$DEFAULT_DIR}"
    realpath -m -- "$dir"
}

# ---------------------------------------------------------------------------------- install

cmd_install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v munged >/dev/null && command -v sbatch >/dev/null; then
        log "slurm and munge already installed ($(slurmctld -V))"
        return 0
    fi
    [[ $(id -u) -eq 0 ]] || die "installing slurm-wlm and munge needs root (apt-get)"
    command -v apt-get >/dev/null || die "apt-get not found: install slurm-wlm and munge by hand"
    log "installing slurm-wlm and munge with apt-get (about 10-60 s)"
    local aptlog
    aptlog=$(mktemp)
    # policy-rc.d (present in Docker-style images) already stops postinst from starting the
    # system munge/slurm services; nothing here depends on them either way.
    if ! { apt-get update -qq \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            slurm-wlm munge; } >"$aptlog" 2>&1; then
        tail -n 30 "$aptlog" >&2
        rm -f "$aptlog"
        die "apt-get install slurm-wlm munge failed (output above)"
    fi
    rm -f "$aptlog"
    log "installed $(slurmctld -V)"
}

# ---------------------------------------------------------------------------------- helpers

# pid of daemon $2 recorded in $1, printed only if that process is still alive *and* still that
# program (pids get reused), so stop/status never touch a process this script did not start.
live_pid() {
    local dir=$1 name=$2 program=${3:-$2} pid comm
    [[ -f "$dir/$name.pid" ]] || return 1
    pid=$(<"$dir/$name.pid")
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
    [[ "$comm" == "$program" ]] || return 1
    # A killed daemon whose parent has not reaped it yet is a zombie: dead, not running.
    [[ "$(proc_state "$pid")" != Z ]] || return 1
    echo "$pid"
}

# What slurmd takes as its NodeName: the hostname up to the first dot (= hostname -s; uname
# because the hostname package may be missing from a minimal image).
short_hostname() {
    local name
    name=$(uname -n)
    echo "${name%%.*}"
}

# The nodes' names: this machine's short hostname, then HOST-2 .. HOST-N (LOCAL_SLURM_NODES).
node_names() {
    local host=$1 i
    echo "$host"
    for (( i = 2; i <= NODES; i++ )); do echo "$host-$i"; done
}

# The daemons by their pid-file names, in start order: munged, slurmctld, then slurmd alone or
# slurmd-NAME for each node. The program of a name is what precedes its first dash.
daemons() {
    local node
    echo munged slurmctld
    if (( NODES == 1 )); then echo slurmd; return; fi
    for node in $(node_names "$1"); do echo "slurmd-$node"; done
}

running() {  # live_pid of a daemon by its pid-file name
    live_pid "$1" "$2" "${2%%-*}"
}

proc_state() {  # R, S, D, Z, ... (field 3 of /proc/PID/stat, after the "(comm)")
    { sed -E 's/^.*\) //' "/proc/$1/stat" | cut -d' ' -f1; } 2>/dev/null || true
}

node_state() {  # "idle", "mixed", "down*", ... or empty when slurmctld does not answer
    SLURM_CONF="$1/slurm.conf" timeout 10 sinfo -h -N -n "$2" -o '%T' 2>/dev/null | head -n 1 || true
}

show_logs() {  # the daemons' log tails, minus the harmless "no PMIx library" noise
    local dir=$1 f
    for f in munged.out slurmctld.log $(cd "$dir" && ls slurmd*.log 2>/dev/null || echo slurmd.log); do
        # slurm*.log only exists once the daemon has read slurm.conf; before that, .out
        [[ -s "$dir/$f" ]] || f=${f%.log}.out
        [[ -s "$dir/$f" ]] || continue
        echo "----- $dir/$f (last lines) -----" >&2
        grep -v -E 'pmix|PMIx|MPI: Cannot create context' "$dir/$f" | tail -n 15 >&2 || true
    done
    if cat "$dir"/slurm*.log 2>/dev/null | grep -q 'Address already in use'; then
        log "hint: port ${CTLD_PORT} or ${SLURMD_PORT} is taken (another cluster running?);" \
            "stop it or set LOCAL_SLURM_CTLD_PORT / LOCAL_SLURM_D_PORT"
    fi
}

write_config() {
    local dir=$1 host=$2 cpus mem_total real_mem def_mem each="" nodes node port i=0
    cpus=$(nproc)
    # slurmd drains a node whose RealMemory is above what it measures (MemTotal), so leave
    # 10% (at least 1 GiB) for the OS and the daemons.
    mem_total=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
    real_mem=$(( mem_total - (mem_total / 10 > 1024 ? mem_total / 10 : 1024) ))
    (( real_mem >= 512 )) || die "only ${mem_total} MiB of memory: too little for a slurm node"
    def_mem=$(( real_mem / cpus ))
    # One node: the daemon's files as they always were. Several: each slurmd's own (%n: its node's name).
    (( NODES == 1 )) || each="-%n"
    # A node a line; several share this machine (NodeHostname) and take a port each.
    nodes="NodeName=${host} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${real_mem} State=UNKNOWN"
    if (( NODES > 1 )); then
        nodes=""
        for node in $(node_names "$host"); do
            port=$(( SLURMD_PORT + i )); i=$(( i + 1 ))
            nodes+="NodeName=${node} NodeHostname=${host} NodeAddr=127.0.0.1 Port=${port} CPUs=${cpus} RealMemory=${real_mem} State=UNKNOWN"$'\n'
        done
        nodes=${nodes%$'\n'}
    fi

    cat >"$dir/slurm.conf" <<EOF
# Written by launch/local_slurm.sh; rewritten on every start.
ClusterName=replay-rloo-local
# The controller is this machine. The explicit address avoids depending on how (or whether)
# the hostname resolves; slurmd finds its NodeName from the short hostname, hence that name.
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=${CTLD_PORT}
SlurmdPort=${SLURMD_PORT}
# Daemons and jobs run as root: no slurm user, spool or key ownership to set up.
SlurmUser=root
SlurmdUser=root
# munge authentication against our own munged (own key, own socket in STATE_DIR), so neither
# /etc/munge/munge.key nor /run/munge nor a system munged is needed or disturbed.
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job (submitit's timeout/preemption requeue) waits
# before it may start again: 120 s by default, 10 s here.
AuthInfo=socket=${dir}/munge/munge.socket,cred_expire=10
# No cgroups in a VM/container without systemd delegation: track job processes by parent pid
# and do no CPU binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# Cores and memory are the consumable resources, so several small jobs share the node.
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Without this, a job that asks for no memory (Hydra's mem_gb=null) is given the whole node
# and jobs run one at a time.
DefMemPerCPU=${def_mem}
# No slurmdbd: submitit then warns "Bypassing sacct error" and reads job state from squeue and
# its own result files; jobs still complete.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# Schedule a submitted batch job at once: the default batch_sched_delay=3 holds every job
# pending for up to 3 s, which would dominate a test's run time. sched_interval: look at
# pending jobs every 2 s rather than 60 s (a requeued job becoming eligible is no event).
SchedulerParameters=batch_sched_delay=0,sched_interval=2
# Reject at sbatch time a job this node can never run (e.g. Hydra's cpus_per_task=8 on a
# 2-CPU machine) instead of leaving it PENDING (PartitionConfig) and the sweep waiting forever.
EnforcePartLimits=ALL
MpiDefault=none
MailProg=/bin/true
# A node that went DOWN (e.g. slurmd killed) comes back as soon as slurmd registers again.
ReturnToService=2
# Without sacct, "scontrol show job" is the only record of a finished job's state and exit
# code: keep it for 5 minutes.
MinJobAge=300
KillWait=5
# Everything stateful in STATE_DIR.
StateSaveLocation=${dir}/state
SlurmdSpoolDir=${dir}/spool${each}
SlurmctldPidFile=${dir}/run/slurmctld.pid
SlurmdPidFile=${dir}/run/slurmd${each}.pid
SlurmctldLogFile=${dir}/slurmctld.log
SlurmdLogFile=${dir}/slurmd${each}.log
SlurmctldDebug=info
SlurmdDebug=info
# Each node with this machine's CPUs (nproc: what this process may use, not the hardware
# count) and most of its memory. slurmd logs "Node reconfigured socket/core boundaries"
# because CPUs= alone gives no topology; that is harmless.
${nodes}
PartitionName=debug Nodes=$(node_names "$host" | paste -sd,) Default=YES MaxTime=INFINITE State=UP
EOF
    log "wrote $dir/slurm.conf (node(s) $(node_names "$host" | paste -sd' ') of this machine:" \
        "CPUs=$cpus RealMemory=${real_mem}M DefMemPerCPU=${def_mem}M each)"
}

# Start "$@" detached (own session, stdio to a file, so callers that capture our output do not
# wait on the daemon) and record its pid. The daemons run in the foreground (-F/-D) so the pid
# recorded is the daemon itself, not a parent that forked and exited.
spawn() {
    local dir=$1 name=$2
    shift 2
    SLURM_CONF="$dir/slurm.conf" setsid "$@" </dev/null >"$dir/$name.out" 2>&1 &
    local pid=$!
    echo "$pid" >"$dir/$name.pid"
    # Until the fork has exec'd the daemon, /proc/$pid/comm still says bash/setsid and
    # live_pid would call it dead: wait for the exec (or for the process to exit).
    for _ in $(seq 1 100); do
        [[ "$(cat "/proc/$pid/comm" 2>/dev/null || echo gone)" =~ ^($name|gone)$ ]] && return 0
        sleep 0.05
    done
}

# ---------------------------------------------------------------------------------- start

cmd_start() {
    local dir host up=() name pid
    dir=$(state_dir "${1:-}")
    host=$(short_hostname)
    [[ -n "$host" ]] || die "this machine has no hostname (uname -n is empty)"
    for name in munged slurmctld slurmd sinfo; do
        command -v "$name" >/dev/null || die "$name not found: run '$0 install' first"
    done
    [[ $(id -u) -eq 0 ]] || die "the local cluster runs its daemons as root; run as root"

    local wanted=($(daemons "$host"))
    for name in "${wanted[@]}"; do
        if pid=$(running "$dir" "$name"); then up+=("$name"); fi
    done
    if (( ${#up[@]} == ${#wanted[@]} )) && grep -q "^NodeName=$(node_names "$host" | tail -n 1) " \
            "$dir/slurm.conf" 2>/dev/null; then
        # idle, mixed or allocated (jobs running) all mean "up"; down/drain means restart.
        local state
        state=$(node_state "$dir" "$host")
        if [[ "$state" =~ ^(idle|mixed|alloc|allocated|completing)$ ]]; then
            log "already running in $dir (node $host: $state)"
            echo "export SLURM_CONF=$dir/slurm.conf"
            return 0
        fi
    fi
    if (( ${#up[@]} > 0 )); then
        log "partly running (${up[*]}) in $dir: restarting"
        cmd_stop "$dir"
    fi

    mkdir -p "$dir"/{state,spool,run,munge}
    for name in $(node_names "$host"); do (( NODES == 1 )) || mkdir -p "$dir/spool-$name"; done
    # munged wants a socket directory only root can write to; the key must be private.
    chmod 755 "$dir/munge"
    write_config "$dir" "$host"

    # A cluster-private munge key, made once per STATE_DIR (1024 random bits).
    if [[ ! -s "$dir/munge/munge.key" ]]; then
        mungekey --create --bits=1024 --keyfile="$dir/munge/munge.key" 2>/dev/null \
            || dd if=/dev/urandom of="$dir/munge/munge.key" bs=128 count=1 status=none
        chmod 400 "$dir/munge/munge.key"
    fi
    rm -f "$dir/munge/munge.socket" "$dir/munge/munge.socket.lock"

    # munged as root with --force: munge prefers its own "munge" user and a world-traversable
    # path to the socket; --force turns those checks into warnings, which lets STATE_DIR sit
    # under a private folder such as pytest's /tmp/pytest-of-root (mode 700). Every client
    # (sbatch, slurmd, slurmstepd) is root here, so nobody else needs to reach the socket.
    spawn "$dir" munged munged --foreground --force \
        --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
        --pid-file="$dir/munge/munged.pid" --seed-file="$dir/munge/munged.seed" \
        --log-file="$dir/munge/munged.log"
    local t0=$SECONDS
    until munge -n -S "$dir/munge/munge.socket" 2>/dev/null \
            | unmunge -S "$dir/munge/munge.socket" >/dev/null 2>&1; do
        if ! live_pid "$dir" munged >/dev/null || (( SECONDS - t0 > 15 )); then
            show_logs "$dir"
            cmd_stop "$dir" >/dev/null 2>&1 || true
            die "munged did not come up (logs above)"
        fi
        sleep 0.2
    done

    # -D: foreground (see spawn). -c: start with no jobs and no saved node state, so jobs
    # left over from a crashed run are not run again. Job ids still count on from the last
    # run in this STATE_DIR, so submitit folders named by job id do not collide.
    # The first job after a start waits ~3 s for slurmctld's first scheduling pass; later
    # ones start within ~1 s.
    spawn "$dir" slurmctld slurmctld -D -c -f "$dir/slurm.conf"
    if (( NODES == 1 )); then
        spawn "$dir" slurmd slurmd -D -f "$dir/slurm.conf"
    else
        for name in $(node_names "$host"); do
            spawn "$dir" "slurmd-$name" slurmd -D -N "$name" -f "$dir/slurm.conf"
        done
    fi

    local state="" node
    t0=$SECONDS
    while :; do
        for node in $(node_names "$host"); do
            state=$(node_state "$dir" "$node")
            [[ "$state" == idle ]] || break  # "idle*" = slurmd not registered yet
        done
        [[ "$state" == idle ]] && break
        for name in "${wanted[@]}"; do
            if ! running "$dir" "$name" >/dev/null; then
                show_logs "$dir"
                cmd_stop "$dir" >/dev/null 2>&1 || true
                die "$name exited during start-up (logs above)"
            fi
        done
        if (( SECONDS - t0 > START_TIMEOUT )); then
            show_logs "$dir"
            cmd_stop "$dir" >/dev/null 2>&1 || true
            die "node $node not idle after ${START_TIMEOUT}s (state: '${state:-no answer}'; logs above)"
        fi
        sleep 0.5
    done

    echo "export SLURM_CONF=$dir/slurm.conf" >"$dir/env.sh"
    log "node(s) $(node_names "$host" | paste -sd' ') idle after $(( SECONDS - t0 ))s; pids in $dir/*.pid"
    echo "export SLURM_CONF=$dir/slurm.conf"
}

# ---------------------------------------------------------------------------------- stop

stop_pid() {  # TERM, wait up to 15 s, then KILL
    local name=$1 pid=$2
    kill -TERM "$pid" 2>/dev/null || return 0
    for _ in $(seq 1 75); do
        [[ -d "/proc/$pid" ]] || { log "stopped $name ($pid)"; return 0; }
        # a zombie is gone for our purposes (its parent, an earlier start, may be this shell)
        [[ "$(proc_state "$pid")" == Z ]] && { log "stopped $name ($pid)"; return 0; }
        sleep 0.2
    done
    log "$name ($pid) ignored SIGTERM: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
}

cmd_stop() {
    local dir name pid n
    dir=$(state_dir "${1:-}")
    if [[ ! -f "$dir/slurm.conf" ]]; then
        log "nothing to stop in $dir"
        return 0
    fi
    # Cancel the jobs of this cluster first, so slurmd takes their slurmstepd/job processes
    # down with them instead of leaving orphans behind.
    if live_pid "$dir" slurmctld >/dev/null; then
        n=$(SLURM_CONF="$dir/slurm.conf" timeout 10 squeue -h -o %i 2>/dev/null | wc -l || true)
        if [[ "$n" =~ ^[0-9]+$ ]] && (( n > 0 )); then
            log "cancelling $n job(s)"
            SLURM_CONF="$dir/slurm.conf" timeout 10 scancel --partition=debug 2>/dev/null || true
            for _ in $(seq 1 50); do
                n=$(SLURM_CONF="$dir/slurm.conf" timeout 10 squeue -h -t R,CG,PD -o %i 2>/dev/null | wc -l || true)
                [[ "$n" == 0 ]] && break
                sleep 0.2
            done
        fi
    fi
    for name in $(cd "$dir" && ls slurmd-*.pid 2>/dev/null | sed 's/\.pid$//') slurmd slurmctld munged; do
        if pid=$(running "$dir" "$name"); then
            stop_pid "$name" "$pid"
        fi
        rm -f "$dir/$name.pid"
    done
    # Job steps whose slurmstepd outlived slurmd: ours if their environment names our config.
    for pid in $(grep -lx slurmstepd /proc/[0-9]*/comm 2>/dev/null | cut -d/ -f3 || true); do
        if { tr '\0' '\n' <"/proc/$pid/environ"; } 2>/dev/null | grep -qx "SLURM_CONF=$dir/slurm.conf"; then
            stop_pid slurmstepd "$pid"
        fi
    done
    rm -f "$dir/munge/munge.socket" "$dir/munge/munge.socket.lock"
}

# ---------------------------------------------------------------------------------- status

cmd_status() {
    local dir name pid up=0 host node
    dir=$(state_dir "${1:-}")
    host=$(short_hostname)
    local wanted=($(daemons "$host"))
    for name in "${wanted[@]}"; do
        if pid=$(running "$dir" "$name"); then
            echo "$name: running (pid $pid)"
            up=$((up + 1))
        else
            echo "$name: not running"
        fi
    done
    if (( up == ${#wanted[@]} )); then
        for node in $(node_names "$host"); do echo "node $node: $(node_state "$dir" "$node")"; done
        echo "export SLURM_CONF=$dir/slurm.conf"
        return 0
    fi
    return 1
}

case "${1:-}" in
    install) cmd_install ;;
    start) cmd_start "${2:-}" ;;
    stop) cmd_stop "${2:-}" ;;
    status) cmd_status "${2:-}" ;;
    *) usage ;;
esac
