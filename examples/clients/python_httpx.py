"""Python httpx through sluice: proxy= and HTTP_PROXY (httpx >= 0.26 spells it proxy=)."""
import os

import httpx

PROXY = os.environ.get("PROXY", "http://127.0.0.1:8080")
TARGET = os.environ.get("TARGET", "http://127.0.0.1:9000/hello")
HOST = PROXY.removeprefix("http://")

with httpx.Client(proxy=PROXY, timeout=15) as c:
    print("httpx proxy= (X-Endpoint-Id):", c.get(TARGET, headers={"X-Endpoint-Id": "demo"}).status_code)
with httpx.Client(proxy=f"http://demo:x@{HOST}", timeout=15) as c:
    print("httpx proxy user demo:x@:", c.get(TARGET).status_code)
with httpx.Client(proxy=f"http://nobody@{HOST}", timeout=15) as c:
    r = c.get(TARGET)
    print("httpx proxy user nobody@ (no password):", r.status_code, r.headers.get("X-Sluice-Reason", ""))
os.environ["HTTP_PROXY"] = PROXY
with httpx.Client(timeout=15) as c:  # trust_env=True by default
    print("httpx HTTP_PROXY env:", c.get(TARGET, headers={"X-Endpoint-Id": "demo"}).status_code)
