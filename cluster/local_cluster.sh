#!/usr/bin/env bash
# A multi-node Ray cluster on this machine: a head plus N workers, each its own
# `ray start --block` node with custom resources and logical GPUs.
#
#   cluster/local_cluster.sh start [N]     # head + N workers (default 2)
#   cluster/local_cluster.sh status
#   cluster/local_cluster.sh stop          # stops only the nodes this script started
#
# Nodes:   head     CPU=$HEAD_CPUS, GPU=0,              resources {"head": 1}
#          worker k CPU=$WORKER_CPUS, GPU=$WORKER_GPUS, resources {"worker_k": 1, "sim_gpu_node": 1}
# The GPUs are logical (Ray counts them; sim-gpu stages reserve them). On a host with
# real GPUs set WORKER_GPUS=0 and give one worker per device CUDA_VISIBLE_DEVICES instead.
#
# Closed to the network: every node listens on 127.0.0.1 only (cluster/ray_node.py
# keeps Ray's CLI from rewriting --node-ip-address=127.0.0.1 into the host's routable
# address), and Ray's token authentication stays on: a token is made in $STATE_DIR
# (mode 0600) and `start` prints the environment drivers and `ray job submit` need.
# RAY_AUTH_MODE=disabled before `start` turns tokens off: then anyone with a shell on
# this host can join the cluster and run code as you. Choose it knowingly.
#
# `stop` never runs `ray stop` (which kills every Ray process on the host, other
# users' included): each node runs under `ray start --block`, whose pid is kept in
# $STATE_DIR, and stopping sends SIGTERM to those pids, which shuts their nodes down.
set -euo pipefail

PORT=${RAY_PORT:-6390}
DASHBOARD_PORT=${DASHBOARD_PORT:-8290}
HEAD_CPUS=${HEAD_CPUS:-1}
WORKER_CPUS=${WORKER_CPUS:-1}
WORKER_GPUS=${WORKER_GPUS:-2}
OBJECT_STORE_BYTES=${OBJECT_STORE_BYTES:-$((512 * 1024 * 1024))}
STATE_DIR=${STATE_DIR:-/tmp/hetero_exec_cluster}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
TOKEN_FILE=${RAY_AUTH_TOKEN_PATH:-$STATE_DIR/auth_token}
BIND=127.0.0.1
# what a driver on this host needs to reach the nodes (loopback resolves to itself)
CLIENT_ENV="RAY_ADDRESS=$BIND:$PORT RAY_AUTH_MODE=$RAY_AUTH_MODE RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0"
if [ "$RAY_AUTH_MODE" = token ]; then
  export RAY_AUTH_TOKEN_PATH=$TOKEN_FILE
  CLIENT_ENV="$CLIENT_ENV RAY_AUTH_TOKEN_PATH=$TOKEN_FILE"
fi

log() { echo "[local_cluster] $*" >&2; }

# Each node needs its own ports on one host; node k uses a block of 100 above the head's.
node_ports() {
  local base=$(( PORT + 100 * ($1 + 1) ))
  echo "--node-manager-port=$base --object-manager-port=$((base + 1)) \
--min-worker-port=$((base + 10)) --max-worker-port=$((base + 99)) \
--dashboard-agent-listen-port=$((base + 2)) --dashboard-agent-grpc-port=$((base + 3)) \
--runtime-env-agent-port=$((base + 4)) --metrics-export-port=$((base + 5))"
}

make_token() {
  [ "$RAY_AUTH_MODE" = token ] || { log "token authentication is OFF (RAY_AUTH_MODE=$RAY_AUTH_MODE)"; return 0; }
  [ -s "$TOKEN_FILE" ] && return 0
  (umask 077 && "$PYTHON" -c 'import secrets; print(secrets.token_hex(32))' >"$TOKEN_FILE")
  log "made an auth token in $TOKEN_FILE"
}

start_node() {  # name, args...
  local name=$1; shift
  nohup "$PYTHON" "$ROOT/cluster/ray_node.py" --block --node-ip-address="$BIND" "$@" \
    >"$STATE_DIR/$name.log" 2>&1 &
  echo $! >"$STATE_DIR/$name.pid"
  log "started $name (pid $(cat "$STATE_DIR/$name.pid"), log $STATE_DIR/$name.log)"
}

wait_for_nodes() {  # expected count
  for _ in $(seq 1 120); do
    local n
    n=$(env $CLIENT_ENV "$PYTHON" - "$1" <<PY 2>/dev/null || echo 0
import ray, sys
ray.init(logging_level="ERROR", log_to_driver=False)
print(sum(1 for n in ray.nodes() if n["Alive"]))
PY
)
    if [ "$n" -ge "$1" ] 2>/dev/null; then log "$n node(s) alive"; return 0; fi
    sleep 1
  done
  log "timed out waiting for $1 node(s)"; return 1
}

cmd_start() {
  local workers=${1:-2}
  if ls "$STATE_DIR"/*.pid >/dev/null 2>&1; then
    log "a cluster from $STATE_DIR is running; stop it first"; exit 1
  fi
  mkdir -p "$STATE_DIR"
  make_token
  # shellcheck disable=SC2046
  start_node head --head --port="$PORT" --num-cpus="$HEAD_CPUS" --num-gpus=0 \
    --resources='{"head": 1}' --include-dashboard=true --dashboard-port="$DASHBOARD_PORT" \
    --ray-client-server-port=$((PORT + 1)) \
    --object-store-memory="$OBJECT_STORE_BYTES" $(node_ports 0)
  wait_for_nodes 1
  for k in $(seq 1 "$workers"); do
    # shellcheck disable=SC2046
    start_node "worker$k" --address="$BIND:$PORT" --num-cpus="$WORKER_CPUS" \
      --num-gpus="$WORKER_GPUS" --resources="{\"worker_$k\": 1, \"sim_gpu_node\": 1}" \
      --object-store-memory="$OBJECT_STORE_BYTES" $(node_ports "$k")
  done
  wait_for_nodes $(( workers + 1 ))
  echo "export $CLIENT_ENV"
  echo "dashboard / job server: http://$BIND:$DASHBOARD_PORT"
}

cmd_status() {
  env $CLIENT_ENV "$PYTHON" - <<PY
import ray
ray.init(logging_level="ERROR", log_to_driver=False)
for n in ray.nodes():
    print(("alive " if n["Alive"] else "dead  "), n["NodeManagerAddress"], n["NodeManagerPort"],
          {k: v for k, v in n["Resources"].items() if not k.startswith("node:")})
PY
}

cmd_stop() {
  shopt -s nullglob
  local pids=("$STATE_DIR"/*.pid)
  if [ ${#pids[@]} -eq 0 ]; then log "nothing to stop in $STATE_DIR"; return 0; fi
  # workers first, the head last
  for f in $(ls -r "$STATE_DIR"/*.pid); do
    local pid; pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid"
      # a node drains for up to 30 s after SIGTERM before its processes exit
      for _ in $(seq 1 90); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      log "stopped $(basename "$f" .pid) (pid $pid)"
    fi
    rm -f "$f"
  done
  # `ray start --head` records its address for later bare ray.init() calls on this host;
  # a stale record would send them to this stopped cluster
  local current=/tmp/ray/ray_current_cluster
  if [ -f "$current" ] && grep -q ":$PORT\$" "$current"; then rm -f "$current"; fi
}

case "${1:-}" in
  start) shift; cmd_start "$@" ;;
  status) cmd_status ;;
  stop) cmd_stop ;;
  *) echo "usage: $0 start [N] | status | stop" >&2; exit 2 ;;
esac
