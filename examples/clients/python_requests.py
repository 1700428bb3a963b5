"""Python requests through sluice: explicit proxies, the proxy user, and HTTP_PROXY."""
import os

import requests

PROXY = os.environ.get("PROXY", "http://127.0.0.1:8080")
TARGET = os.environ.get("TARGET", "http://127.0.0.1:9000/hello")
HOST = PROXY.removeprefix("http://")


def status(proxy, **kw):
    r = requests.get(TARGET, proxies={"http": proxy, "https": proxy}, timeout=15, **kw)
    reason = r.headers.get("X-Sluice-Reason", "")
    return f"{r.status_code} {reason}".strip()


print("requests proxies= (X-Endpoint-Id):", status(PROXY, headers={"X-Endpoint-Id": "demo"}))
print("requests proxy user demo:x@:", status(f"http://demo:x@{HOST}"))
# A user without a password is dropped by requests: sluice sees no user, so this
# request falls back to the host rule instead of naming endpoint "nobody" (403).
print("requests proxy user nobody@ (no password):", status(f"http://nobody@{HOST}"))
# HTTP_PROXY from the environment (trust_env, the default).
os.environ["HTTP_PROXY"] = PROXY
r = requests.get(TARGET, headers={"X-Endpoint-Id": "demo"}, timeout=15)
print("requests HTTP_PROXY env:", r.status_code)
