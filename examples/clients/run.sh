#!/usr/bin/env bash
# Runs every client example against a running sluice and demo receiver:
#
#   cargo run --release -- demo-receiver --listen 127.0.0.1:9000     # terminal 1
#   cargo run --release -- run --config config/demo.toml             # terminal 2
#   examples/clients/run.sh                                          # terminal 3
#
# After each client it prints how many requests sluice counted for it (from /metrics),
# so a client that silently skipped the proxy shows "sluice saw 0". Runtimes that are
# not installed are skipped. Env: PROXY, TARGET, ADMIN, PYTHON.
set -uo pipefail
cd "$(dirname "$0")"
export PROXY=${PROXY:-http://127.0.0.1:8080}
export TARGET=${TARGET:-http://127.0.0.1:9000/hello}
ADMIN=${ADMIN:-http://127.0.0.1:9090}
PYTHON=${PYTHON:-python3}
proxy_host=${PROXY#http://}; proxy_host=${proxy_host%:*}
proxy_port=${PROXY##*:}

seen() { curl -s "$ADMIN/metrics" | awk '/^sluice_requests_total\{/ {s += $NF} END {print s + 0}'; }
curl -sf "$ADMIN/healthz" >/dev/null || { echo "no sluice admin at $ADMIN: start sluice with config/demo.toml" >&2; exit 1; }

step() {  # step NAME COMMAND...: runs it, then prints sluice's count for it
  local name=$1; shift
  local before; before=$(seen)
  echo "== $name"
  "$@" 2>&1 | sed 's/^/   /'
  echo "   -> sluice saw $(( $(seen) - before )) request(s)"
}
have() { command -v "$1" >/dev/null; }

step curl ./curl.sh
if $PYTHON -c 'import requests' 2>/dev/null; then step "python requests" $PYTHON python_requests.py; else echo "== python requests: skipped (pip install requests)"; fi
if $PYTHON -c 'import httpx' 2>/dev/null; then step "python httpx" $PYTHON python_httpx.py; else echo "== python httpx: skipped (pip install httpx)"; fi
if have node; then
  if [ ! -d node_modules ] && have npm; then npm install --no-audit --no-fund --silent >/dev/null 2>&1; fi
  step "node $(node --version) built-in fetch, HTTP_PROXY set" env HTTP_PROXY="$PROXY" node node_fetch.mjs builtin
  step "node undici ProxyAgent" node node_fetch.mjs proxyagent
  step "node undici EnvHttpProxyAgent" env HTTP_PROXY="$PROXY" node node_fetch.mjs envagent
  step "node global-agent" node node_global_agent.cjs
else
  echo "== node: skipped"
fi
if have java; then
  step "java, default nonProxyHosts" java -Dhttp.proxyHost="$proxy_host" -Dhttp.proxyPort="$proxy_port" Client.java
  step "java, -Dhttp.nonProxyHosts=" java -Dhttp.proxyHost="$proxy_host" -Dhttp.proxyPort="$proxy_port" -Dhttp.nonProxyHosts= Client.java
else
  echo "== java: skipped"
fi
if have go; then step "go $(go env GOVERSION)" go run client.go; else echo "== go: skipped"; fi
