#!/usr/bin/env bash
# Whole-process HTTP benchmark, side by side in one run:
#   direct to a local upstream | HAProxy 2.6 (nbthread 1, forwarding by the request
#   target: set-dst url_ip / url_port; and with a thread per core, its default) | a bare hyper forwarder (examples/bare_forward.rs:
#   the proxy hop alone, no limiting; pooled client, "held": sluice's shape on one
#   thread, and "raw": no HTTP library, the floor of sluice's own lane) | sluice with
#   every connection served by hyper (SLUICE_PLAIN_LANE=0) | sluice (memory store: the
#   default runtime, one worker bound to each core; one worker; workers not bound) | sluice (Redis store, the default config: one replica
#   alone in the store, so store.prefetch = "alone" takes tokens ahead) | sluice (Redis
#   store shared with a second, idle replica: the default then takes none ahead; and
#   with store.prefetch = true) |
#   sluice (memory store, proxy authentication on) | sluice-default: the default config,
#   the decision log on (every other sluice row sets [log] decisions = false)
# The limit is set far above the load so it never binds: this measures forwarding cost.
# Each proxy row also gives its own CPU per request (utime+stime from /proc/PID/stat).
# Usage: bench/http.sh [--write]   (--write also updates docs/BENCHMARKS.md)
#   CONNS=128 (wrk connections, default 32), ROUNDS, DURATION, ROWS (a subset of rows),
#   ROWS may also name sluice-redis-cluster and sluice-redis-cluster-prefetch (a 3-master
#   Redis Cluster of their own, started only then; the second with store.prefetch = true),
#   and sluice-memory-window1, sluice-memory-window3, sluice-redis-window1,
#   sluice-redis-window3 (one or three sliding windows that never bind, started only then),
#   SHOW_ROUNDS=1 (each round's line on stderr), CONNECTION=close|keep-alive (that
#   header on every request), RATE=N (open loop instead of wrk: N req/s offered to
#   every row by examples/paced_load.rs over PACED_CONNS=64 connections, so p99 is
#   compared at the same load; wrk's closed loop gives the faster proxy more),
#   SLUICE_BASE=path/to/another/sluice (rows base-default and base-memory: that binary
#   with the decision log on and off, for an A/B of two builds in one run; name them in ROWS),
#   LOG_TO=pipe (sluice's stderr to a pipe a `cat` drains, as a log collector reads it;
#   default /dev/null)
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-8s}
CONNS=${CONNS:-32}
THREADS=${THREADS:-1}
install() { local s=""; [ "$(id -u)" -eq 0 ] || s=sudo; $s apt-get update -qq && $s apt-get install -y -qq "$@"; }
command -v wrk >/dev/null || install wrk
command -v redis-server >/dev/null || install redis-server
command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || install haproxy
HAPROXY=$(command -v haproxy || echo /usr/sbin/haproxy)
cargo build --release --quiet --bin sluice --example upstream --example bare_forward --example paced_load

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 200); do (exec 3<>/dev/tcp/127.0.0.1/$1) 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 never opened" >&2; exit 1; }
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
TMP=$(mktemp -d)
declare -A PID_OF PORT_OF SCRIPT_OF

UP=$(free_port); target/release/examples/upstream "127.0.0.1:$UP" 2>/dev/null & PIDS+=($!); wait_port "$UP"
PORT_OF[direct]=$UP
BF=$(free_port); target/release/examples/bare_forward "127.0.0.1:$BF" 2>/dev/null & PIDS+=($!); wait_port "$BF"
PORT_OF[bare-hyper-forwarder]=$BF; PID_OF[bare-hyper-forwarder]=$!
BH=$(free_port); target/release/examples/bare_forward "127.0.0.1:$BH" held 2>/dev/null & PIDS+=($!); wait_port "$BH"
PORT_OF[bare-hyper-held]=$BH; PID_OF[bare-hyper-held]=$!
BR=$(free_port); target/release/examples/bare_forward "127.0.0.1:$BR" raw 2>/dev/null & PIDS+=($!); wait_port "$BR"
PORT_OF[bare-raw]=$BR; PID_OF[bare-raw]=$!
RP=$(free_port); redis-server --port "$RP" --bind 127.0.0.1 --save '' --appendonly no --dir "$TMP" >/dev/null & PIDS+=($!); wait_port "$RP"

start_haproxy() { # $1 name, $2 threads
  local hp; hp=$(free_port)
  cat > "$TMP/$1.cfg" <<CFG
global
  nbthread $2
  maxconn 4096
defaults
  mode http
  option http-keep-alive
  timeout connect 5s
  timeout client 30s
  timeout server 30s
frontend proxy
  bind 127.0.0.1:$hp
  default_backend dynamic
backend dynamic
  http-request set-dst url_ip
  http-request set-dst-port url_port
  server dyn 0.0.0.0:0
CFG
  "$HAPROXY" -q -f "$TMP/$1.cfg" & PIDS+=($!); wait_port "$hp"
  PORT_OF[$1]=$hp; PID_OF[$1]=$!
}
start_haproxy haproxy 1
# HAProxy's own default (a thread per core): the like-for-like row for sluice's default.
start_haproxy haproxy-per-core "$(nproc)"

start_sluice() { # $1 name, $2 store section, $3 extra [security] keys, $4 workers, $5 environment, $6 extra [proxy] keys, $7 [log] keys, $8 binary, $9 extra [defaults] keys (no subshell: PIDS and the trap stay here)
  local p a; p=$(free_port); a=$(free_port)
  cat > "$TMP/$1.toml" <<TOML
[proxy]
listen = "127.0.0.1:$p"
admin_listen = "127.0.0.1:$a"
workers = ${4:-0}
${6:-}
$2
[defaults]
rate = 1000000000.0
burst = 1000000000.0
${9:-}
[log]
${7-decisions = false}
[security]
allow_private_destinations = true
${3:-}
TOML
  if [ "${LOG_TO:-null}" = pipe ]; then
    env ${5:-SLUICE_BENCH=1} "${8:-target/release/sluice}" run --config "$TMP/$1.toml" 2> >(cat >/dev/null) & PIDS+=($!)
  else
    env ${5:-SLUICE_BENCH=1} "${8:-target/release/sluice}" run --config "$TMP/$1.toml" 2>/dev/null & PIDS+=($!)
  fi
  wait_port "$p"; PORT_OF[$1]=$p; PID_OF[$1]=$!
}
start_sluice sluice-memory '[store]
backend = "memory"'
# The default config: the decision log on, a line for every request (stderr, here to
# /dev/null).
start_sluice sluice-default '[store]
backend = "memory"' "" 0 SLUICE_BENCH=1 "" ""
if [ -n "${SLUICE_BASE:-}" ]; then
  start_sluice base-default '[store]
backend = "memory"' "" 0 SLUICE_BENCH=1 "" "" "$SLUICE_BASE"
  start_sluice base-memory '[store]
backend = "memory"' "" 0 SLUICE_BENCH=1 "" "decisions = false" "$SLUICE_BASE"
fi
start_sluice sluice-memory-1worker '[store]
backend = "memory"' "" 1
# The default runtime with its workers left where the kernel puts them.
start_sluice sluice-memory-unpinned '[store]
backend = "memory"' "" 0 SLUICE_BENCH=1 "pin_workers = false"
# Every connection served by hyper, as before the plain lane (src/lane.rs).
start_sluice sluice-memory-hyper '[store]
backend = "memory"' "" 0 SLUICE_PLAIN_LANE=0
start_sluice sluice-redis "[store]
backend = \"redis\"
urls = [\"redis://127.0.0.1:$RP/\"]
timeout = \"1s\""
# The same default config on a Redis of its own that a second (idle) replica shares.
RP2=$(free_port); redis-server --port "$RP2" --bind 127.0.0.1 --save '' --appendonly no --dir "$TMP" >/dev/null & PIDS+=($!); wait_port "$RP2"
SHARED="[store]
backend = \"redis\"
urls = [\"redis://127.0.0.1:$RP2/\"]
timeout = \"1s\""
start_sluice sluice-redis-idle-peer "$SHARED"
start_sluice sluice-redis-shared "$SHARED"
# The same shared store with store.prefetch = true, the setting docs/operations.md gives
# for an endpoint whose traffic is heavy and far from its limit on several replicas.
start_sluice sluice-redis-shared-prefetch "$SHARED
prefetch = true"
# Only when ROWS names it (not in the default table): the default config on a 3-master
# Redis Cluster of its own (`backend = "redis-cluster"`, the fallback kept per hash
# slot), one replica alone in it.
if [[ " ${ROWS:-} " == *" sluice-redis-cluster"* ]]; then
  free_bus_port() { python3 -c '
import socket
while True:
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]
    if p + 10000 > 65535: continue
    b = socket.socket()
    try: b.bind(("127.0.0.1", p + 10000)); print(p); break
    except OSError: pass
'; }
  CLUSTER=()
  for n in 1 2 3; do
    cp=$(free_bus_port); mkdir -p "$TMP/cluster$n"
    redis-server --port "$cp" --bind 127.0.0.1 --save '' --appendonly no --dir "$TMP/cluster$n" \
      --cluster-enabled yes --cluster-config-file "$TMP/cluster$n/nodes.conf" >/dev/null & PIDS+=($!)
    wait_port "$cp"; CLUSTER+=("127.0.0.1:$cp")
  done
  redis-cli --cluster create "${CLUSTER[@]}" --cluster-replicas 0 --cluster-yes >/dev/null
  for _ in $(seq 100); do
    redis-cli -p "${CLUSTER[0]#*:}" cluster info | grep -q cluster_state:ok && break; sleep 0.1
  done
  SEEDS=$(printf '"redis://%s/", ' "${CLUSTER[@]}")
  start_sluice sluice-redis-cluster "[store]
backend = \"redis-cluster\"
urls = [${SEEDS%, }]
timeout = \"1s\""
  # The same cluster with store.prefetch = true (tokens taken ahead).
  start_sluice sluice-redis-cluster-prefetch "[store]
backend = \"redis-cluster\"
urls = [${SEEDS%, }]
timeout = \"1s\"
prefetch = true"
fi
# Only when ROWS names them (not in the default table): sliding windows beside the
# bucket (`windows`), one or three, with limits that never bind, so each request pays
# the window math (every log full at 32 entries: a merge per request). On Redis each
# row has a Redis of its own, one replica alone in it; an endpoint with windows takes no
# tokens ahead, so compare with sluice-redis (prefetch "alone") and sluice-redis-shared
# (none taken ahead).
if [[ " ${ROWS:-} " == *"-window"* ]]; then
  BIG=1000000000
  ONE_WINDOW="windows = [{ limit = $BIG, per = \"1h\" }]"
  THREE_WINDOWS="windows = [{ limit = $BIG, per = \"1h\" }, { limit = $BIG, per = \"1m\" }, { limit = $BIG, per = \"1s\" }]"
  start_sluice sluice-memory-window1 '[store]
backend = "memory"' "" 0 SLUICE_BENCH=1 "" "decisions = false" "" "$ONE_WINDOW"
  start_sluice sluice-memory-window3 '[store]
backend = "memory"' "" 0 SLUICE_BENCH=1 "" "decisions = false" "" "$THREE_WINDOWS"
  for n in 1 3; do
    wp=$(free_port); redis-server --port "$wp" --bind 127.0.0.1 --save '' --appendonly no --dir "$TMP" >/dev/null & PIDS+=($!); wait_port "$wp"
    [ "$n" = 1 ] && w="$ONE_WINDOW" || w="$THREE_WINDOWS"
    start_sluice "sluice-redis-window$n" "[store]
backend = \"redis\"
urls = [\"redis://127.0.0.1:$wp/\"]
timeout = \"1s\"" "" 0 SLUICE_BENCH=1 "" "decisions = false" "" "$w"
  done
fi
# Proxy authentication on (bcrypt cost 10, as in production): kept-alive senders pay
# bcrypt once, then hit the credentials cache.
echo "bench-password" | target/release/sluice passwd bench > "$TMP/users.htpasswd"
start_sluice sluice-memory-auth '[store]
backend = "memory"' "auth_users_file = \"$TMP/users.htpasswd\""

# An absolute-form request's Host must match its target, as every HTTP client sends it
# (HAProxy answers 400 otherwise).
cat > "$TMP/proxy.lua" <<LUA
wrk.path = "http://127.0.0.1:$UP/"
wrk.headers["Host"] = "127.0.0.1:$UP"
wrk.headers["X-Endpoint-Id"] = "bench"
LUA
# CONNECTION=close: every request asks for its connection to close (Go's
# DisableKeepAlives, Ruby's one-shot Net::HTTP): the cost of a sender connection per
# request. CONNECTION=keep-alive: the header Python's requests and Node's http send.
[ -z "${CONNECTION:-}" ] || echo "wrk.headers[\"Connection\"] = \"$CONNECTION\"" >> "$TMP/proxy.lua"
cp "$TMP/proxy.lua" "$TMP/auth.lua"
echo "wrk.headers[\"Proxy-Authorization\"] = \"Basic $(printf 'bench:bench-password' | base64)\"" >> "$TMP/auth.lua"
NAMES=(direct haproxy haproxy-per-core bare-hyper-forwarder bare-hyper-held bare-raw sluice-memory sluice-default sluice-memory-1worker sluice-memory-unpinned sluice-memory-hyper sluice-redis sluice-redis-shared sluice-redis-shared-prefetch sluice-memory-auth)
# ROWS="sluice-memory sluice-redis-shared" runs only those rows (a ratio whose reference
# row did not run shows "-"); --write refuses a partial table.
if [ -n "${ROWS:-}" ]; then
  read -r -a NAMES <<<"$ROWS"
  for n in "${NAMES[@]}"; do [ -n "${PORT_OF[$n]:-}" ] || { echo "unknown row: $n" >&2; exit 1; }; done
  [ "${1:-}" != "--write" ] || { echo "--write needs every row (unset ROWS)" >&2; exit 1; }
fi
if [ -n "${RATE:-}" ]; then
  [ "${1:-}" != "--write" ] || { echo "--write is for wrk's table (unset RATE)" >&2; exit 1; }
  # paced_load sends no Proxy-Authorization.
  for n in "${NAMES[@]}"; do [ "$n" != sluice-memory-auth ] || { echo "RATE: drop the sluice-memory-auth row" >&2; exit 1; }; done
fi
for s in "${NAMES[@]}"; do SCRIPT_OF[$s]="-s $TMP/proxy.lua"; done
SCRIPT_OF[sluice-memory-auth]="-s $TMP/auth.lua"
SCRIPT_OF[direct]=""

cpu_ticks() { [ -n "${1:-}" ] && awk '{print $14+$15}' "/proc/$1/stat" || echo 0; }
# Involuntary context switches of all the process's threads: the kernel taking a core
# from the proxy while it had work (what a p99 on shared cores is mostly made of).
preempted() { [ -n "${1:-}" ] && { cat /proc/"$1"/task/*/status 2>/dev/null || true; } | awk '/^nonvoluntary_ctxt_switches/ {n+=$2} END {print n+0}' || echo 0; }
paced() { # $1 scenario, $2 seconds → paced_load's line
  target/release/examples/paced_load "127.0.0.1:${PORT_OF[$1]}" "127.0.0.1:$UP" "$RATE" "$2" "${PACED_CONNS:-64}"
}
run_paced() { # as run(), at RATE req/s offered
  local pid=${PID_OF[$1]:-} before after sw0 sw1 n errors rps p50 p99 rest cpu sw
  paced "$1" 2 >/dev/null 2>&1 # warm-up
  before=$(cpu_ticks "$pid"); sw0=$(preempted "$pid")
  paced "$1" "${DURATION%s}" > "$TMP/$1.txt"
  after=$(cpu_ticks "$pid"); sw1=$(preempted "$pid")
  IFS='|' read -r n errors rps p50 p99 rest < "$TMP/$1.txt"
  # The same refusal as wrk's rows: a row with errors measures errors, not forwarding.
  [ "$errors" = 0 ] || { echo "$1: $errors connections failed" >&2; exit 1; }
  cpu=$(python3 -c "import os; t=os.sysconf('SC_CLK_TCK'); print('-' if not '$pid' else f'{($after-$before)/t*1e6/$n:.1f}')")
  sw=$(python3 -c "print('-' if not '$pid' else f'{($sw1-$sw0)*100/$n:.1f}')")
  echo "$1|$rps|${p50}us|${p99}us|$cpu|$sw"
}
run() { # $1 scenario → "name|req/s|p50|p99|cpu µs per request|preemptions per 100 requests"
  [ -z "${RATE:-}" ] || { run_paced "$1"; return; }
  local port=${PORT_OF[$1]} pid=${PID_OF[$1]:-} args=${SCRIPT_OF[$1]}
  wrk -t"$THREADS" -c"$CONNS" -d2s $args "http://127.0.0.1:$port/" >/dev/null 2>&1 # warm-up
  local before after sw0 sw1; before=$(cpu_ticks "$pid"); sw0=$(preempted "$pid")
  wrk -t"$THREADS" -c"$CONNS" -d"$DURATION" --latency $args "http://127.0.0.1:$port/" > "$TMP/$1.txt"
  after=$(cpu_ticks "$pid"); sw1=$(preempted "$pid")
  local rps p50 p99 n cpu sw
  rps=$(awk '/Requests\/sec/ {print $2}' "$TMP/$1.txt")
  p50=$(awk '$1=="50%" {print $2}' "$TMP/$1.txt")
  p99=$(awk '$1=="99%" {print $2}' "$TMP/$1.txt")
  n=$(awk '/requests in/ {print $1}' "$TMP/$1.txt")
  cpu=$(python3 -c "import os; t=os.sysconf('SC_CLK_TCK'); print('-' if not '$pid' else f'{($after-$before)/t*1e6/$n:.1f}')")
  sw=$(python3 -c "print('-' if not '$pid' else f'{($sw1-$sw0)*100/$n:.1f}')")
  echo "$1|$rps|$p50|$p99|$cpu|$sw"
}
# Interleaved rounds with the order rotated each round: background noise on a shared
# machine hits every scenario alike; each scenario reports its median round.
ROUNDS=${ROUNDS:-3}
declare -A ALL
for r in $(seq 0 $((ROUNDS - 1))); do
  for i in "${!NAMES[@]}"; do
    name=${NAMES[$(((i + r) % ${#NAMES[@]}))]}
    line=$(run "$name")
    ALL[$name]+="$line"$'\n'
    # SHOW_ROUNDS=1: every round's line on stderr (the table keeps the median round).
    [ -z "${SHOW_ROUNDS:-}" ] || echo "round $r: $line" >&2
    # A row whose answers were not all 2xx measures errors, not forwarding: refuse it.
    if [ -z "${RATE:-}" ] && grep -qE "Non-2xx|Socket errors" "$TMP/$name.txt"; then echo "$name: $(grep -E 'Non-2xx|Socket errors' "$TMP/$name.txt")" >&2; exit 1; fi
  done
done
median() { sort -t'|' -k2 -g | awk '{a[NR]=$0} END {print a[int((NR+1)/2)]}'; }
declare -A ROW
for name in "${NAMES[@]}"; do ROW[$name]="$(printf '%s' "${ALL[$name]}" | grep . | median)"; done
field() { echo "${ROW[$1]:-}" | cut -d'|' -f"$2"; }
ratio() { python3 -c "a,b='$1','$2'; print('-' if '-' in (a,b) or '' in (a,b) else f'{float(a)/float(b):.2f}')"; }
ms() { python3 -c "v='$1'; print('' if not v else float(v[:-2])/1000 if v.endswith('us') else float(v[:-2]) if v.endswith('ms') else float(v[:-1])*1000)"; }
TABLE="| scenario | req/s | p50 | p99 | proxy CPU µs/req | preempted /100 req | req/s vs HAProxy | CPU/req vs HAProxy | p99 vs HAProxy | vs sluice-memory |
|---|---|---|---|---|---|---|---|---|---|"
for name in "${NAMES[@]}"; do
  IFS='|' read -r n rps p50 p99 cpu sw <<<"${ROW[$name]}"
  TABLE+=$'\n'"| $n | $rps | $p50 | $p99 | $cpu | $sw | $(ratio "$rps" "$(field haproxy 2)") | $(ratio "$cpu" "$(field haproxy 5)") | $(ratio "$(ms "$p99")" "$(ms "$(field haproxy 4)")") | $(ratio "$rps" "$(field sluice-memory 2)") |"
done
echo "$TABLE"
if [ "${1:-}" = "--write" ]; then
  python3 - "$TABLE" "$(nproc)" "$DURATION" "$CONNS" "$ROUNDS" "$THREADS" <<'PY'
import sys, re, datetime
table, cpus, dur, conns, rounds, threads = sys.argv[1:]
path = "docs/BENCHMARKS.md"
doc = open(path).read()
block = (f"<!-- http:begin -->\nMeasured {datetime.date.today()} on this {cpus}-core machine "
         f"(load generator, upstream, proxy and Redis share the cores): "
         f"`wrk -t{threads} -c{conns} -d{dur} --latency`, 2 s warm-up, {rounds} interleaved rounds "
         f"(order rotated), median round shown. CPU µs/req is the proxy process's own "
         f"utime+stime over the measured run divided by its requests; preempted /100 req counts "
         f"the kernel switching a proxy thread out while it could still run "
         f"(nonvoluntary_ctxt_switches of all its threads) per 100 requests.\n\n{table}\n<!-- http:end -->")
doc = re.sub(r"<!-- http:begin -->.*<!-- http:end -->", lambda m: block, doc, flags=re.S)
open(path, "w").write(doc)
PY
fi
