#!/usr/bin/env bash
# curl through sluice: the endpoint as a header, then as the proxy user.
set -euo pipefail
PROXY=${PROXY:-http://127.0.0.1:8080}
TARGET=${TARGET:-http://127.0.0.1:9000/hello}
host=${PROXY#http://}
echo "curl -x (X-Endpoint-Id): $(curl -s -o /dev/null -w '%{http_code}' -x "$PROXY" -H 'X-Endpoint-Id: demo' "$TARGET")"
echo "curl -x demo:x@ (proxy user): $(curl -s -o /dev/null -w '%{http_code}' -x "http://demo:x@$host" "$TARGET")"
echo "curl HTTP_PROXY env: $(http_proxy="$PROXY" curl -s -o /dev/null -w '%{http_code}' -H 'X-Endpoint-Id: demo' "$TARGET")"
