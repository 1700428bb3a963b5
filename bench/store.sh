#!/usr/bin/env bash
# Store benchmark, side by side in one run on one private Redis:
#   redis-benchmark EVALSHA of the acquire script, lua/bucket.lua + lua/acquire.lua (the raw ceiling) | sluice's RedisStore API
# Both issue "acquire" decisions over 10 000 endpoints with 64 concurrent callers; sluice
# also on one endpoint, where concurrent asks share script calls (src/limiter/batch.rs),
# with and without store.prefetch (tokens taken ahead, src/limiter/credit.rs).
# Usage: bench/store.sh [--write]
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${SECS:-8}
command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server; }
cargo build --release --quiet --example store_bench
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
TMP=$(mktemp -d)
RP=$(free_port)
redis-server --port "$RP" --bind 127.0.0.1 --save '' --appendonly no --dir "$TMP" >/dev/null & RPID=$!
trap 'kill $RPID 2>/dev/null || true' EXIT
for _ in $(seq 200); do redis-cli -p "$RP" ping >/dev/null 2>&1 && break; sleep 0.05; done
SHA=$(cat lua/bucket.lua lua/acquire.lua | redis-cli -p "$RP" -x script load)
ceiling() { # $1 = pipeline depth
  redis-benchmark -p "$RP" -c 64 -n 400000 -r 10000 -P "$1" -q \
    EVALSHA "$SHA" 1 'bench:{ep__rand_int__}' 1000000000 1000000000 0 0 0 '' 0 0 '' \
    | tr '\r' '\n' | awk '/requests per second/ {for(i=1;i<=NF;i++) if ($i ~ /^[0-9.]+$/) v=$i} END {print v}'
}
# Unpipelined (one command in flight per connection) and pipelined 16 deep: sluice's
# multiplexed connection pipelines, so the pipelined figure is the honest ceiling.
CEIL1=$(ceiling 1)
CEIL=$(ceiling 16)
OURS=$(target/release/examples/store_bench "redis://127.0.0.1:$RP/" "$SECS" 64)
ONE=$(target/release/examples/store_bench "redis://127.0.0.1:$RP/" "$SECS" 64 1)
AHEAD=$(target/release/examples/store_bench "redis://127.0.0.1:$RP/" "$SECS" 64 1 prefetch)
RATIO_AHEAD=$(python3 -c "print(f'{$AHEAD/$CEIL:.2f}')")
RATIO=$(python3 -c "print(f'{$OURS/$CEIL:.2f}')")
RATIO_ONE=$(python3 -c "print(f'{$ONE/$CEIL:.2f}')")
RATIO1=$(python3 -c "print(f'{$CEIL1/$CEIL:.2f}')")
TABLE="| path | decisions/s | ratio to ceiling |
|---|---|---|
| redis-benchmark EVALSHA, 64 conns, pipeline 16 (ceiling) | $CEIL | 1.00 |
| redis-benchmark EVALSHA, 64 conns, no pipelining | $CEIL1 | $RATIO1 |
| sluice RedisStore::acquire, 64 concurrent callers, 10 000 endpoints | $OURS | $RATIO |
| sluice RedisStore::acquire, 64 concurrent callers, 1 endpoint (batched calls) | $ONE | $RATIO_ONE |
| sluice RedisStore::acquire, 64 concurrent callers, 1 endpoint, store.prefetch on | $AHEAD | $RATIO_AHEAD |"
echo "$TABLE"
if [ "${1:-}" = "--write" ]; then
  python3 - "$TABLE" "$(nproc)" <<'PY'
import sys, re, datetime
table, cpus = sys.argv[1:]
path = "docs/BENCHMARKS.md"
doc = open(path).read()
block = (f"<!-- store:begin -->\nMeasured {datetime.date.today()} on this {cpus}-core machine "
         f"(Redis, the client and the load share the cores); 64 concurrent callers.\n\n{table}\n<!-- store:end -->")
doc = re.sub(r"<!-- store:begin -->.*<!-- store:end -->", lambda m: block, doc, flags=re.S)
open(path, "w").write(doc)
PY
fi
