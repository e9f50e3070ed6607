#!/usr/bin/env bash
# A Slurm cluster on this machine, for trying the sbatch scripts and for the launch tests.
# Needs root and Debian/Ubuntu packages (installed with apt-get when missing).
#
#   bash scripts/slurm/local_cluster.sh up        # one node on the loopback address
#   eval "$(bash scripts/slurm/local_cluster.sh env)"; sbatch scripts/slurm/single_node.sbatch
#   bash scripts/slurm/local_cluster.sh up 2      # two hosts: network namespaces joined by a veth pair
#   bash scripts/slurm/local_cluster.sh run sbatch scripts/slurm/multi_node.sbatch   # any Slurm command
#   bash scripts/slurm/local_cluster.sh on 1 ip -br addr     # any command on host 0 or 1
#   bash scripts/slurm/local_cluster.sh hosts     # only the two hosts, no Slurm
#   bash scripts/slurm/local_cluster.sh down      # stop what `up`/`hosts` started
#   bash scripts/slurm/local_cluster.sh install   # only install the packages if missing
#
# The two hosts are wm-node0 (192.168.77.1) and wm-node1 (192.168.77.2), each in its own network
# namespace with its own loopback and one interface, named wmlink on both (so one
# GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME serves every node, as on a real cluster). Programs run
# "on" a host see its /etc/hosts, which names both. Everything else lives in $SLURM_LOCAL_DIR
# (default /tmp/wm-slurm), including its own slurm.conf, so a system Slurm is never touched.
set -euo pipefail

STATE=${SLURM_LOCAL_DIR:-/tmp/wm-slurm}
CONF=$STATE/slurm.conf
HOSTS=(wm-node0 wm-node1)
ADDRS=(192.168.77.1 192.168.77.2)
LINK=wmlink

die() { echo "local_cluster.sh: $*" >&2; exit 1; }
need_root() { [ "$(id -u)" = 0 ] || die "$1 needs root."; }

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
     && command -v sbatch >/dev/null && command -v munged >/dev/null; then
    return
  fi
  need_root "installing Slurm (apt-get)"
  command -v apt-get >/dev/null || die "no apt-get: install slurmctld, slurmd, slurm-client and munge by hand."
  echo "installing slurmctld slurmd slurm-client munge ..."
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
}

start_munge() {
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    return
  fi
  [ -s /etc/munge/munge.key ] || mungekey --create >/dev/null
  install -d -o munge -g munge -m 0755 /run/munge
  # munged refuses to run as root; the key and its directories belong to the munge user.
  runuser -u munge -- munged
  for _ in $(seq 50); do
    munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return
    sleep 0.1
  done
  die "munged did not start (see /var/log/munge/munged.log)"
}

# on_host I CMD...: run CMD on host I: in its network namespace, with its /etc/hosts. The
# rest of the machine (filesystems, /sys with its cgroups, munge's socket) stays shared.
on_host() {
  local i=$1; shift
  nsenter --net="/run/netns/${HOSTS[$i]}" unshare --mount --propagation private \
    sh -c 'mount --bind "$0" /etc/hosts && exec "$@"' "$STATE/hosts" "$@"
}

make_hosts() {
  need_root "creating network namespaces"
  command -v ip >/dev/null || { apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null; }
  mkdir -p "$STATE"
  printf '127.0.0.1 localhost %s\n%s %s\n%s %s\n' "$(hostname)" \
    "${ADDRS[0]}" "${HOSTS[0]}" "${ADDRS[1]}" "${HOSTS[1]}" >"$STATE/hosts"
  [ -e "/run/netns/${HOSTS[0]}" ] && return
  local i
  for i in 0 1; do
    ip netns add "${HOSTS[$i]}"
    ip -n "${HOSTS[$i]}" link set lo up
  done
  # Created under temporary names, then renamed inside each namespace to the same name.
  ip link add wmlink-a netns "${HOSTS[0]}" type veth peer name wmlink-b netns "${HOSTS[1]}"
  ip -n "${HOSTS[0]}" link set wmlink-a name "$LINK"
  ip -n "${HOSTS[1]}" link set wmlink-b name "$LINK"
  for i in 0 1; do
    ip -n "${HOSTS[$i]}" addr add "${ADDRS[$i]}/24" dev "$LINK"
    ip -n "${HOSTS[$i]}" link set "$LINK" up
  done
}

write_conf() {  # write_conf CONTROLLER_ADDR NODE_LINES
  mkdir -p "$STATE/ctld"
  # proctrack/linuxproc and task/none: no cgroups, so it works in containers and VMs alike.
  # Short timers because this cluster is for tests: a requeued job waits cred_expire
  # seconds (default 120) before it may start, and pending jobs are looked at every
  # sched_interval seconds (default 60).
  cat >"$CONF" <<EOF
ClusterName=wmlocal
SlurmctldHost=$(hostname -s)($1)
SlurmUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
AuthInfo=cred_expire=10
CredType=cred/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool-%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdTimeout=30
KillWait=10
MinJobAge=600
$2
EOF
}

running() {  # running PIDFILE: the daemon recorded there is alive
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

wait_idle() {
  local idle=""
  for _ in $(seq 150); do
    idle=$(client sinfo -h -t idle -o %D 2>/dev/null || true)
    [ "${idle:-0}" = "$NODES" ] && return
    sleep 0.2
  done
  die "$NODES node(s) expected idle, found: $(client sinfo -h -o '%D %t' 2>&1 | tr '\n' ' '); see $STATE/*.log"
}

up() {
  install_packages
  need_root "starting slurmctld and slurmd"
  start_munge
  # -c: start clean, so a stale node or job state from an earlier run never leaks in.
  if [ "$NODES" = 1 ]; then
    local name
    name=$(hostname -s)
    write_conf 127.0.0.1 "NodeName=$name NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=local Nodes=$name Default=YES MaxTime=INFINITE State=UP"
    mkdir -p "$STATE/spool-$name"
    running "$STATE/slurmctld.pid" || slurmctld -c -f "$CONF"
    running "$STATE/slurmd-$name.pid" || slurmd -f "$CONF"
    wait_idle
  else
    make_hosts
    local i
    write_conf "${ADDRS[0]}" "NodeName=${HOSTS[0]} NodeAddr=${ADDRS[0]} CPUs=$(nproc) State=UNKNOWN
NodeName=${HOSTS[1]} NodeAddr=${ADDRS[1]} CPUs=$(nproc) State=UNKNOWN
PartitionName=local Nodes=${HOSTS[0]},${HOSTS[1]} Default=YES MaxTime=INFINITE State=UP"
    running "$STATE/slurmctld.pid" || on_host 0 slurmctld -c -f "$CONF"
    for i in 0 1; do
      mkdir -p "$STATE/spool-${HOSTS[$i]}"
      running "$STATE/slurmd-${HOSTS[$i]}.pid" || on_host "$i" slurmd -N "${HOSTS[$i]}" -f "$CONF"
    done
    wait_idle
  fi
  echo "local Slurm is up: $NODES node(s), SLURM_CONF=$CONF"
}

down() {
  local pidfile pid
  for pidfile in "$STATE"/slurmd-*.pid "$STATE/slurmctld.pid"; do
    running "$pidfile" || continue
    pid=$(cat "$pidfile")
    kill "$pid"
    # Wait for it to exit (and remove its pid file) so that an `up` right after starts afresh.
    for _ in $(seq 50); do
      [ -e "$pidfile" ] && [ -e "/proc/$pid" ] || break
      sleep 0.1
    done
  done
  local host
  for host in "${HOSTS[@]}"; do
    [ -e "/run/netns/$host" ] && ip netns del "$host"
  done
  return 0
}

# client CMD...: run a Slurm command where the controller is reachable (host 0 when there are two).
client() {
  if [ -e "/run/netns/${HOSTS[0]}" ] && [ -e "$STATE/hosts" ]; then
    on_host 0 env SLURM_CONF="$CONF" "$@"
  else
    env SLURM_CONF="$CONF" "$@"
  fi
}

case "${1:-}" in
  install) install_packages ;;
  up)
    NODES=${2:-1}
    [[ "$NODES" =~ ^[12]$ ]] || die "up takes 1 or 2 nodes, not '$NODES'"
    up ;;
  hosts) make_hosts; echo "hosts up: ${HOSTS[*]} (${ADDRS[*]}), interface $LINK" ;;
  run) shift; client "$@" ;;
  on) [[ "${2:-}" =~ ^[01]$ ]] || die "on takes a host index, 0 or 1"; host=$2; shift 2; on_host "$host" "$@" ;;
  down) down ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) die "usage: $0 install | up [1|2] | hosts | run CMD... | on 0|1 CMD... | down | env" ;;
esac
