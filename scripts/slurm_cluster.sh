#!/usr/bin/env bash
# A one-node SLURM on localhost, from Debian's packages, for CI and for trying the slurm/ templates.
#
#   sudo scripts/slurm_cluster.sh start     # install if missing, configure, start, wait for idle
#   eval "$(scripts/slurm_cluster.sh env)"  # export SLURM_CONF so sbatch/srun/sinfo find it
#   sbatch slurm/...; squeue; sinfo
#   sudo scripts/slurm_cluster.sh stop      # stop exactly the daemons `start` started
#   scripts/slurm_cluster.sh status         # exit 0 iff all three daemons are up
#
# Everything lives in one private directory ($HPCDL_SLURM_DIR, default /tmp/hpcdl-slurm): the
# configuration, a munge key and socket of its own, state, logs and the pid of each daemon. Nothing
# in /etc is changed, and a site SLURM or munged on the same host is left alone (other ports, other
# socket). Runs as root: slurmd must be able to start jobs as any user.
#
# Why it looks like this (facts seen on Debian 12 in a container):
# - no systemd, and policy-rc.d stops apt from starting services, so the daemons start here by hand,
#   in the foreground under nohup, so that $! is the daemon's own pid and `stop` can kill exactly it;
# - `srun --mpi=pmix` needs libpmix2 *and* the unversioned libpmix.so link that only libpmix-dev
#   ships, both present before slurmd starts, or the step hangs;
# - the PyPI Open MPI wheel's PMIx refuses SLURM's munge-based security: mpi.conf sets
#   PMIX_MCA_psec=native in every pmix step (PMIxEnv);
# - no cgroups in a container: process tracking by /proc (proctrack/linuxproc), CPU binding by
#   sched_setaffinity (task/affinity).
# Exit status: 0 done, 1 failed, 3 the packages are missing and cannot be installed (no apt, no
# network): callers such as the tests skip on 3 rather than fail.
set -euo pipefail

DIR=${HPCDL_SLURM_DIR:-/tmp/hpcdl-slurm}
CTLD_PORT=${HPCDL_SLURMCTLD_PORT:-16817}
SLURMD_PORT=${HPCDL_SLURMD_PORT:-16818}
PARTITION=${HPCDL_SLURM_PARTITION:-debug}
PACKAGES=(slurm-wlm munge libpmix2 libpmix-dev)
DAEMONS=(munged slurmctld slurmd)
WAIT_SECONDS=${HPCDL_SLURM_WAIT:-60}

say() { echo "slurm_cluster: $*" >&2; }
die() { say "error: $*"; exit 1; }
cannot_install() { say "error: $*"; exit 3; }

# true if process $1 exists and is not a zombie (a container's pid 1 may never reap it)
alive() {
    local state
    state=$(awk '{print $3}' /proc/"$1"/stat 2>/dev/null) || return 1
    [[ -n $state && $state != Z && $state != X ]]
}

# pid recorded for daemon $1 if that process is alive and is that daemon (pids get reused)
running_pid() {
    local pidfile=$DIR/run/$1.pid pid
    [[ -r $pidfile ]] || return 1
    pid=$(<"$pidfile")
    [[ $pid =~ ^[0-9]+$ ]] && alive "$pid" || return 1
    [[ $(tr '\0' '\n' </proc/"$pid"/cmdline | head -1 | xargs basename 2>/dev/null) == "$1" ]] || return 1
    echo "$pid"
}

install_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    command -v apt-get >/dev/null || cannot_install "missing ${missing[*]} and no apt-get to install them"
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >"$DIR/log/apt.log" 2>&1 || cannot_install "apt-get update failed (see $DIR/log/apt.log)"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >>"$DIR/log/apt.log" 2>&1 \
        || cannot_install "apt-get install ${missing[*]} failed (see $DIR/log/apt.log)"
}

# The unversioned libpmix.so that slurm's mpi_pmix plugin dlopens (from libpmix-dev).
check_pmix() {
    local arch
    arch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -dumpmachine 2>/dev/null || echo x86_64-linux-gnu)
    [[ -e /usr/lib/$arch/libpmix.so ]] || die "/usr/lib/$arch/libpmix.so is missing (install libpmix-dev); srun --mpi=pmix would hang"
}

write_config() {
    local host cpus mem_mb
    host=$(hostname -s)
    cpus=$(getconf _NPROCESSORS_ONLN)  # not nproc: that counts only the CPUs we may run on
    mem_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    mkdir -p "$DIR"/{etc,state,spool,log,run,munge}
    chmod 700 "$DIR/munge"
    [[ -s $DIR/munge/munge.key ]] || { dd if=/dev/urandom bs=1 count=1024 of="$DIR/munge/munge.key" status=none; chmod 400 "$DIR/munge/munge.key"; }
    cat >"$DIR/etc/slurm.conf" <<EOF
# written by scripts/slurm_cluster.sh: one node, $cpus CPUs, all daemons as root
ClusterName=hpcdl
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.own.pid
SlurmdPidFile=$DIR/run/slurmd.own.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# quick turnaround for tests: no minimum job age before purging, fast node checks
MinJobAge=60
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    # Read by the mpi/pmix plugin from the directory of slurm.conf.
    cat >"$DIR/etc/mpi.conf" <<EOF
PMIxEnv=PMIX_MCA_psec=native
EOF
}

# start_daemon NAME COMMAND...: run in the foreground under nohup, record its pid
start_daemon() {
    local name=$1
    shift
    if running_pid "$name" >/dev/null; then
        say "$name already running (pid $(running_pid "$name"))"
        return 0
    fi
    # taskset: all online CPUs, whatever this shell was bound to (started from a rank that mpirun
    # bound to one core, slurmd would see one CPU and the node would never run a job).
    nohup taskset -c "$(</sys/devices/system/cpu/online)" "$@" >>"$DIR/log/$name.out" 2>&1 </dev/null &
    echo $! >"$DIR/run/$name.pid"
    sleep 0.2
    running_pid "$name" >/dev/null || die "$name exited at once; see $DIR/log/$name.out and $DIR/log/$name.log"
}

start() {
    [[ $(id -u) -eq 0 ]] || die "run as root (slurmd starts jobs as their owner)"
    mkdir -p "$DIR/log"
    local t0=$SECONDS
    install_packages
    check_pmix
    write_config
    local conf=$DIR/etc/slurm.conf v
    # Started from inside an MPI job or an allocation (the tests are), the daemons must not pass
    # that job's launcher variables on.
    for v in $(compgen -e); do
        case $v in OMPI_* | PMIX_* | PMI_* | PRTE_* | SLURM_*) unset "$v" ;; esac
    done
    start_daemon munged munged --foreground --force --socket="$DIR/munge/munge.socket" \
        --key-file="$DIR/munge/munge.key" --pid-file="$DIR/run/munged.own.pid" \
        --seed-file="$DIR/munge/munged.seed" --log-file="$DIR/log/munged.log"
    for _ in $(seq 50); do [[ -S $DIR/munge/munge.socket ]] && break; sleep 0.1; done
    start_daemon slurmctld slurmctld -D -c -i -f "$conf"  # -c: a fresh queue, no jobs from an earlier run
    start_daemon slurmd slurmd -D -f "$conf"
    export SLURM_CONF=$conf
    local state=""
    for _ in $(seq $((WAIT_SECONDS * 2))); do
        state=$(sinfo -h -o %T 2>/dev/null | head -1) || true
        [[ $state == idle || $state == mixed || $state == allocated ]] && break
        for d in "${DAEMONS[@]}"; do
            running_pid "$d" >/dev/null || die "$d died; see $DIR/log/$d.out and $DIR/log/$d.log"
        done
        sleep 0.5
    done
    [[ $state == idle || $state == mixed || $state == allocated ]] \
        || die "node not ready after ${WAIT_SECONDS} s (state '${state:-none}'); see $DIR/log/"
    # Idle is not enough (a node whose CPUs differ from slurm.conf shows idle and runs nothing).
    timeout 30 srun -n 1 --time 1 true || die "a one-task srun did not run; see $DIR/log/"
    say "node $(hostname -s) is $state after $((SECONDS - t0)) s; export SLURM_CONF=$conf"
}

stop() {
    local d pid pids=()
    # Reverse order: slurmd, slurmctld, then munged they authenticate through.
    for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
        d=${DAEMONS[i]}
        if pid=$(running_pid "$d"); then
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid")
            say "stopping $d (pid $pid)"
        fi
    done
    for _ in $(seq 50); do
        local left=0
        for pid in "${pids[@]}"; do alive "$pid" && left=1; done
        [[ $left -eq 0 ]] && break
        sleep 0.2
    done
    for pid in "${pids[@]}"; do alive "$pid" && kill -KILL "$pid" 2>/dev/null || true; done
    rm -f "$DIR"/run/*.pid
    return 0
}

status() {
    local d rc=0
    for d in "${DAEMONS[@]}"; do
        if pid=$(running_pid "$d"); then echo "$d running (pid $pid)"; else echo "$d not running"; rc=1; fi
    done
    return $rc
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    env) echo "export SLURM_CONF=$DIR/etc/slurm.conf" ;;
    *) echo "usage: $0 start|stop|status|env   (state in \$HPCDL_SLURM_DIR, default /tmp/hpcdl-slurm)" >&2; exit 2 ;;
esac
