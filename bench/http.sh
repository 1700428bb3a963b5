#!/usr/bin/env bash
# Whole-process HTTP benchmark, side by side in one run:
#   direct to a local upstream | through a bare hyper forwarder (examples/bare_forward.rs:
#   the proxy hop alone, no limiting) | through sluice (memory store) | through sluice (Redis store)
# The limit is set far above the load so it never binds: this measures sluice's overhead.
# Usage: bench/http.sh [--write]   (--write also updates docs/BENCHMARKS.md)
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-10s}
CONNS=${CONNS:-64}
command -v wrk >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk; }
command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server; }
cargo build --release --quiet --bin sluice --example upstream --example bare_forward

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 200); do (exec 3<>/dev/tcp/127.0.0.1/$1) 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 never opened" >&2; exit 1; }
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
TMP=$(mktemp -d)

UP=$(free_port); target/release/examples/upstream "127.0.0.1:$UP" 2>/dev/null & PIDS+=($!); wait_port "$UP"
BF=$(free_port); target/release/examples/bare_forward "127.0.0.1:$BF" 2>/dev/null & PIDS+=($!); wait_port "$BF"
RP=$(free_port); redis-server --port "$RP" --bind 127.0.0.1 --save '' --appendonly no --dir "$TMP" >/dev/null & PIDS+=($!); wait_port "$RP"

start_sluice() { # $1 = store section, $2 = extra [security] keys; sets SLUICE_PORT (no subshell: PIDS and the trap stay here)
  local p a; p=$(free_port); a=$(free_port)
  cat > "$TMP/s$p.toml" <<TOML
[proxy]
listen = "127.0.0.1:$p"
admin_listen = "127.0.0.1:$a"
$1
[defaults]
rate = 1000000000.0
burst = 1000000000.0
[security]
allow_private_destinations = true
${2:-}
TOML
  RUST_LOG=warn target/release/sluice run --config "$TMP/s$p.toml" & PIDS+=($!)
  wait_port "$p"; SLUICE_PORT=$p
}
start_sluice '[store]
backend = "memory"'
MEM=$SLUICE_PORT
start_sluice "[store]
backend = \"redis\"
urls = [\"redis://127.0.0.1:$RP/\"]
timeout = \"1s\""
RED=$SLUICE_PORT
# Proxy authentication on (bcrypt cost 10, as in production): kept-alive senders pay
# bcrypt once, then hit the credentials cache.
echo "bench-password" | target/release/sluice passwd bench > "$TMP/users.htpasswd"
start_sluice '[store]
backend = "memory"' "auth_users_file = \"$TMP/users.htpasswd\""
AUTH=$SLUICE_PORT

cat > "$TMP/proxy.lua" <<LUA
wrk.path = "http://127.0.0.1:$UP/"
wrk.headers["X-Endpoint-Id"] = "bench"
LUA
cp "$TMP/proxy.lua" "$TMP/auth.lua"
echo "wrk.headers[\"Proxy-Authorization\"] = \"Basic $(printf 'bench:bench-password' | base64)\"" >> "$TMP/auth.lua"
run() { # $1 label, $2 target port, $3 extra args
  wrk -t2 -c"$CONNS" -d2s --latency $3 "http://127.0.0.1:$2/" >/dev/null 2>&1 # warm-up
  wrk -t2 -c"$CONNS" -d"$DURATION" --latency $3 "http://127.0.0.1:$2/" > "$TMP/$1.txt"
  local rps p50 p99
  rps=$(awk '/Requests\/sec/ {print $2}' "$TMP/$1.txt")
  p50=$(awk '$1=="50%" {print $2}' "$TMP/$1.txt")
  p99=$(awk '$1=="99%" {print $2}' "$TMP/$1.txt")
  echo "$1|$rps|$p50|$p99"
}
# Interleaved rounds (A B C D, A B C D, ...): background noise on a shared machine hits
# every scenario alike; each scenario reports its median round.
ROUNDS=${ROUNDS:-3}
declare -A ALL
for _ in $(seq "$ROUNDS"); do
  ALL[direct]+="$(run direct "$UP" "")"$'\n'
  ALL[bare-hyper-forwarder]+="$(run bare-hyper-forwarder "$BF" "-s $TMP/proxy.lua")"$'\n'
  ALL[sluice-memory]+="$(run sluice-memory "$MEM" "-s $TMP/proxy.lua")"$'\n'
  ALL[sluice-redis]+="$(run sluice-redis "$RED" "-s $TMP/proxy.lua")"$'\n'
  ALL[sluice-memory-auth]+="$(run sluice-memory-auth "$AUTH" "-s $TMP/auth.lua")"$'\n'
done
median() { sort -t'|' -k2 -g | awk '{a[NR]=$0} END {print a[int((NR+1)/2)]}'; }
ROWS=()
for name in direct bare-hyper-forwarder sluice-memory sluice-redis sluice-memory-auth; do
  ROWS+=("$(printf '%s' "${ALL[$name]}" | grep . | median)")
done
BASE=$(echo "${ROWS[0]}" | cut -d'|' -f2)
BARE=$(echo "${ROWS[1]}" | cut -d'|' -f2)
MEMRPS=$(echo "${ROWS[2]}" | cut -d'|' -f2)
TABLE="| scenario | req/s | p50 | p99 | req/s vs direct | vs bare forwarder | vs sluice-memory |
|---|---|---|---|---|---|---|"
for r in "${ROWS[@]}"; do
  IFS='|' read -r name rps p50 p99 <<<"$r"
  TABLE+=$'\n'"| $name | $rps | $p50 | $p99 | $(python3 -c "print(f'{$rps/$BASE:.2f}')") | $(python3 -c "print(f'{$rps/$BARE:.2f}')") | $(python3 -c "print(f'{$rps/$MEMRPS:.2f}')") |"
done
echo "$TABLE"
if [ "${1:-}" = "--write" ]; then
  python3 - "$TABLE" "$(nproc)" "$DURATION" "$CONNS" "$ROUNDS" <<'PY'
import sys, re, datetime
table, cpus, dur, conns, rounds = sys.argv[1:]
path = "docs/BENCHMARKS.md"
doc = open(path).read()
block = (f"<!-- http:begin -->\nMeasured {datetime.date.today()} on this {cpus}-core machine "
         f"(load generator, upstream, sluice and Redis share the cores): "
         f"`wrk -t2 -c{conns} -d{dur} --latency`, 2 s warm-up, {rounds} interleaved rounds, median round shown.\n\n{table}\n<!-- http:end -->")
doc = re.sub(r"<!-- http:begin -->.*<!-- http:end -->", lambda m: block, doc, flags=re.S)
open(path, "w").write(doc)
PY
fi
