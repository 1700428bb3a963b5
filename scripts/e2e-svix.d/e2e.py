#!/usr/bin/env python3
"""Helpers for scripts/e2e-svix (Python 3 standard library only).

  e2e.py ports N                      print N free TCP ports on 127.0.0.1
  e2e.py receivers SPEC LOG [--tls CERT KEY]
                                      run the recording receivers until killed
  e2e.py drive ...                    one set-up: create an app and endpoints in Svix,
                                      send a burst, wait, read the attempts, write a JSON row
  e2e.py table ROW.json...            print the rows as the Markdown table

SPEC is "name:port:rate:burst:refuse" joined by ",", refuse being the request numbers
(1-based, "+"-separated, "-" for none) that receiver answers with 429 + Retry-After: 1.
Every receiver logs one JSON line per request: arrival time, receiver, svix-id,
X-Endpoint-Id, status answered. Everything talks to 127.0.0.1 only.
"""

import argparse
import concurrent.futures
import http.server
import json
import socket
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request

RETRY_AFTER = 1  # seconds, in the receivers' 429s


def cmd_ports(args):
    socks = []
    for _ in range(args.n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    print(" ".join(str(s.getsockname()[1]) for s in socks))
    for s in socks:
        s.close()


def parse_spec(spec):
    out = []
    for part in spec.split(","):
        name, port, rate, burst, refuse = part.split(":")
        out.append(
            {
                "name": name,
                "port": int(port),
                "rate": float(rate),
                "burst": float(burst),
                "refuse": [] if refuse == "-" else [int(n) for n in refuse.split("+")],
            }
        )
    return out


def cmd_receivers(args):
    lock = threading.Lock()
    log = open(args.log, "a", buffering=1)

    def make_handler(rx):
        count = [0]

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a real receiver

            def do_POST(self):
                t = time.time()
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                with lock:
                    count[0] += 1
                    n = count[0]
                    status = 429 if n in rx["refuse"] else 200
                    log.write(
                        json.dumps(
                            {
                                "t": t,
                                "recv": rx["name"],
                                "n": n,
                                "svix_id": self.headers.get("svix-id"),
                                "endpoint_hdr": self.headers.get("X-Endpoint-Id"),
                                "status": status,
                            }
                        )
                        + "\n"
                    )
                body = b"ok\n" if status == 200 else b"slow down\n"
                self.send_response(status)
                if status == 429:
                    self.send_header("Retry-After", str(RETRY_AFTER))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_PUT = do_POST

            def log_message(self, *a):
                pass

        return Handler

    servers = []
    for rx in parse_spec(args.spec):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", rx["port"]), make_handler(rx))
        srv.daemon_threads = True
        if args.tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(args.tls[0], args.tls[1])
            srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
        servers.append(srv)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    print("receivers up", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


class Svix:
    def __init__(self, base, token):
        self.base = base.rstrip("/")
        self.token = token

    def call(self, method, path, body=None, tries=5):
        data = None if body is None else json.dumps(body).encode()
        for i in range(tries):
            req = urllib.request.Request(
                self.base + path,
                data=data,
                method=method,
                headers={
                    "Authorization": "Bearer " + self.token,
                    "Content-Type": "application/json",
                    "Accept": "application/json",
                },
            )
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    raw = r.read()
                    return json.loads(raw) if raw else None
            except urllib.error.HTTPError as e:
                if e.code < 500 or i == tries - 1:
                    raise RuntimeError(
                        "%s %s: %s %s" % (method, path, e.code, e.read()[:300].decode("utf-8", "replace"))
                    )
            except (urllib.error.URLError, OSError):
                if i == tries - 1:
                    raise
            time.sleep(0.5 * (i + 1))


def read_log(path):
    rows = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        rows.append(json.loads(line))
                    except ValueError:
                        pass
    except FileNotFoundError:
        pass
    return rows


def busiest(times, window=1.0):
    """Most arrivals in any window [t, t+window) starting at an arrival."""
    times = sorted(times)
    best, j = 0, 0
    for i, t in enumerate(times):
        while j < len(times) and times[j] < t + window:
            j += 1
        best = max(best, j - i)
    return best


def cmd_drive(args):
    rxs = parse_spec(args.receivers)
    svix = Svix(args.svix, args.token)
    scheme = "https" if args.https else "http"
    app = svix.call("POST", "/api/v1/app", {"name": "e2e-" + args.setup})
    app_id = app["id"]
    headers_ok = None
    for rx in rxs:
        ep = svix.call(
            "POST",
            "/api/v1/app/%s/endpoint" % app_id,
            {
                "url": "%s://127.0.0.1:%d/hook/%s" % (scheme, rx["port"], rx["name"]),
                "channels": [rx["name"]],
                "description": "e2e receiver " + rx["name"],
            },
        )
        rx["endpoint_id"] = ep["id"]
        if args.endpoint_header:
            try:
                svix.call(
                    "PUT",
                    "/api/v1/app/%s/endpoint/%s/headers" % (app_id, ep["id"]),
                    {"headers": {args.endpoint_header: rx["name"]}},
                )
                got = svix.call("GET", "/api/v1/app/%s/endpoint/%s/headers" % (app_id, ep["id"]))
                ok = (got or {}).get("headers", {}).get(args.endpoint_header) == rx["name"]
            except RuntimeError as e:
                print("endpoint headers refused: %s" % e, file=sys.stderr)
                ok = False
            headers_ok = ok if headers_ok is None else (headers_ok and ok)

    # Does Svix keep headers given when the endpoint is created? (Its API documents
    # them only on the endpoint-headers routes.) A throwaway endpoint, disabled.
    on_create = None
    if args.endpoint_header:
        try:
            ep = svix.call(
                "POST",
                "/api/v1/app/%s/endpoint" % app_id,
                {
                    "url": "%s://127.0.0.1:9/probe" % scheme,
                    "channels": ["probe-never-sent"],
                    "disabled": True,
                    "headers": {args.endpoint_header: "probe"},
                },
            )
            got = svix.call("GET", "/api/v1/app/%s/endpoint/%s/headers" % (app_id, ep["id"]))
            on_create = (got or {}).get("headers", {}).get(args.endpoint_header) == "probe"
        except RuntimeError as e:
            print("endpoint with headers on create refused: %s" % e, file=sys.stderr)
            on_create = False

    # The burst: every message created as fast as the API takes them, spread evenly.
    plan = [rxs[i % len(rxs)]["name"] for i in range(args.messages)]
    sent = {}
    sent_lock = threading.Lock()

    def send(i):
        name = plan[i]
        msg = svix.call(
            "POST",
            "/api/v1/app/%s/msg" % app_id,
            {
                "eventType": "e2e.burst",
                "channels": [name],
                "payload": {"setup": args.setup, "n": i, "to": name},
            },
        )
        with sent_lock:
            sent[msg["id"]] = {"t": time.time(), "recv": name}

    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.senders) as pool:
        list(pool.map(send, range(args.messages)))
    t_sent = time.time()
    print(
        "[%s] %d messages created in %.1f s; waiting for deliveries (deadline %d s)"
        % (args.setup, len(sent), t_sent - t0, args.deadline),
        file=sys.stderr,
        flush=True,
    )

    def delivered():
        ok = set()
        for a in read_log(args.log):
            if a["svix_id"] in sent and 200 <= a["status"] < 300:
                ok.add(a["svix_id"])
        return ok

    deadline = t0 + args.deadline
    last_report = 0
    while time.time() < deadline:
        n = len(delivered())
        if n >= len(sent):
            break
        if time.time() - last_report >= 30:
            print("[%s] %d of %d delivered" % (args.setup, n, len(sent)), file=sys.stderr, flush=True)
            last_report = time.time()
        time.sleep(0.5)
    # Late duplicates (a Svix timeout and its retry) would arrive now.
    time.sleep(args.settle)

    arrivals = [a for a in read_log(args.log) if a["svix_id"] in sent]
    attempts = {}

    def read_attempts(mid):
        data = svix.call("GET", "/api/v1/app/%s/attempt/msg/%s?limit=50" % (app_id, mid))
        return mid, data.get("data", [])

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        for mid, att in pool.map(read_attempts, list(sent)):
            attempts[mid] = att

    row = summarize(args, rxs, sent, arrivals, attempts, t0, headers_ok)
    row["summary"]["endpoint_headers_kept_on_create"] = on_create
    with open(args.out, "w") as f:
        json.dump(row, f, indent=1)
    print(json.dumps(row["summary"]), file=sys.stderr)


def count_connects(path):
    """CONNECTs sluice logged (its decision log has one line per CONNECT)."""
    if not path:
        return None
    connects, used = {}, set()
    for rec in read_log(path):
        if rec.get("target") != "sluice::decision":
            continue
        peer = rec.get("peer")
        if rec.get("method") == "CONNECT":
            connects[peer] = connects.get(peer, 0) + 1
        else:
            used.add(peer)
    # A tunnel whose CONNECT was admitted (a token spent) but that carried no request
    # sluice saw: a TLS tunnel without interception, or a connection the sender's pool
    # opened and then did not use.
    return {
        "connects": sum(connects.values()),
        "without_request": sum(1 for p in connects if p not in used),
    }


def scrape(admin):
    """sluice's counters that tell what it did: summed over endpoints, by name."""
    if not admin:
        return None
    try:
        with urllib.request.urlopen(admin.rstrip("/") + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError) as e:
        return {"error": str(e)}
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        key = name.split("{", 1)[0]
        if key in (
            "sluice_absorbed_total",
            "sluice_upstream_throttles_total",
            "sluice_tunnels_total",
            "sluice_intercepted_tunnels_total",
        ) or key == "sluice_requests_total":
            if key == "sluice_requests_total":
                outcome = name.split('outcome="', 1)[-1].split('"', 1)[0] if "outcome=" in name else "?"
                key = "requests_" + outcome
            else:
                key = key[len("sluice_"):]
            try:
                out[key] = out.get(key, 0) + float(value)
            except ValueError:
                pass
    return out


def summarize(args, rxs, sent, arrivals, attempts, t0, headers_ok):
    by_msg = {}
    for a in arrivals:
        by_msg.setdefault(a["svix_id"], []).append(a)
    ok_counts = {m: sum(1 for a in v if 200 <= a["status"] < 300) for m, v in by_msg.items()}
    delivered = [m for m in sent if ok_counts.get(m, 0) >= 1]
    duplicates = sum(c - 1 for c in ok_counts.values() if c > 1)
    wrong_receiver = sum(1 for a in arrivals if a["recv"] != sent[a["svix_id"]]["recv"])
    hdr_seen = sum(1 for a in arrivals if a.get("endpoint_hdr"))

    per_rx = []
    for rx in rxs:
        mine = [a for a in arrivals if a["recv"] == rx["name"]]
        times = [a["t"] for a in mine]
        n_msgs = sum(1 for m in sent.values() if m["recv"] == rx["name"])
        refusals = sorted(a["t"] for a in mine if a["status"] == 429)
        after = []
        for t in refusals:
            in_ra = sum(1 for x in times if t < x <= t + RETRY_AFTER)
            in_3 = sum(1 for x in times if t < x <= t + 3)
            after.append({"within_retry_after": in_ra, "within_3s": in_3})
        per_rx.append(
            {
                "name": rx["name"],
                "rate": rx["rate"],
                "burst": rx["burst"],
                "messages": n_msgs,
                "arrivals": len(mine),
                "busiest_1s": busiest(times, 1.0),
                "allowed_1s": rx["rate"] * 1.0 + rx["burst"],
                "busiest_5s": busiest(times, 5.0),
                "allowed_5s": rx["rate"] * 5.0 + rx["burst"],
                "refusals_answered": len(refusals),
                "after_429": after,
            }
        )

    late, multi, first_ok_delay = [], [], []
    attempt_codes = {}
    for m, info in sent.items():
        oks = sorted(a["t"] for a in by_msg.get(m, []) if 200 <= a["status"] < 300)
        if oks:
            first_ok_delay.append(oks[0] - info["t"])
            if oks[0] - info["t"] > 5.0:
                late.append(m)
        att = attempts.get(m, [])
        if len(att) > 1:
            multi.append(m)
        for a in att:
            code = a.get("responseStatusCode")
            attempt_codes[str(code)] = attempt_codes.get(str(code), 0) + 1
    # A message needs a Svix retry when Svix made more than one attempt at it, or when it
    # was never delivered. (Arriving late alone is no sign: sluice holds a message for up
    # to its max_wait, and a slow receiver's last messages arrive seconds after the send.)
    undelivered = [m for m in sent if not any(200 <= a["status"] < 300 for a in by_msg.get(m, []))]
    needing_retry = sorted(set(multi) | set(undelivered))

    ok_times = [a["t"] for a in arrivals if 200 <= a["status"] < 300]
    total = (max(ok_times) - t0) if ok_times else None
    # Svix's own lag from the first message created to the first delivery: not sluice's.
    first = (min(a["t"] for a in arrivals) - t0) if arrivals else None
    ideal = max(max(0.0, (r["messages"] - r["burst"]) / r["rate"]) for r in per_rx)

    summary = {
        "setup": args.setup,
        "label": args.label or args.setup,
        "sent": len(sent),
        "delivered": len(delivered),
        "duplicates": duplicates,
        "wrong_receiver": wrong_receiver,
        "arrivals_with_endpoint_header": hdr_seen,
        "arrivals": len(arrivals),
        "endpoint_headers_accepted": headers_ok,
        "needing_svix_retry": len(needing_retry),
        "with_more_than_one_attempt": len(multi),
        "arrived_over_5s_after_send": len(late),
        "svix_attempt_status_codes": attempt_codes,
        "total_s": None if total is None else round(total, 2),
        "ideal_s": round(ideal, 2),
        "first_arrival_s": None if first is None else round(first, 2),
        "max_delivery_delay_s": round(max(first_ok_delay), 2) if first_ok_delay else None,
        "connects": (count_connects(args.sluice_log) or {}).get("connects"),
        "connects_without_request": (count_connects(args.sluice_log) or {}).get("without_request"),
        "sluice": scrape(args.sluice_admin),
        "receivers": per_rx,
        "notes": args.note or "",
    }
    return {"summary": summary}


def fmt_row(s, connects, extra):
    rx = s["receivers"]
    once = "yes" if s["delivered"] == s["sent"] and s["duplicates"] == 0 else "no"
    deliv = "%s: %d of %d delivered, %d duplicates" % (once, s["delivered"], s["sent"], s["duplicates"])
    busy = ", ".join(
        "%s %d of %g" % (r["name"], r["busiest_1s"], r["allowed_1s"]) for r in rx
    )
    after = []
    for r in rx:
        for a in r["after_429"]:
            after.append("%d in 1 s, %d in 3 s" % (a["within_retry_after"], a["within_3s"]))
    after = "; ".join(after) if after else "no 429 reached the receiver"
    retry = "%d (%d with >1 Svix attempt, %d undelivered); slowest delivery %s after its send" % (
        s["needing_svix_retry"],
        s["with_more_than_one_attempt"],
        s["sent"] - s["delivered"],
        "—" if s["max_delivery_delay_s"] is None else "%.1f s" % s["max_delivery_delay_s"],
    )
    if s["total_s"] is None:
        tm = "— (ideal %.1f s)" % s["ideal_s"]
    else:
        tm = "%.1f s vs %.1f s ideal" % (s["total_s"], s["ideal_s"])
        if s.get("first_arrival_s") is not None:
            tm += " (%.1f s from the first arrival, %.1f s after the first send)" % (
                s["total_s"] - s["first_arrival_s"], s["first_arrival_s"])
    conn = "—" if connects is None else str(connects)
    return "| %s | %s | %s | %s | %s | %s | %s | %s |" % (
        s["label"], deliv, busy, after, retry, tm, conn, extra
    )


def cmd_table(args):
    print("| set-up | exactly once | busiest second (of rate·1 s + burst) | arrivals after a 429 | needing a Svix retry | total time | CONNECTs | notes |")
    print("|---|---|---|---|---|---|---|---|")
    for path in args.rows:
        try:
            with open(path) as f:
                s = json.load(f)["summary"]
        except (OSError, ValueError, KeyError) as e:
            print("| %s | failed: %s | | | | | | |" % (path, e))
            continue
        extra = s.get("notes", "")
        codes = s.get("svix_attempt_status_codes", {})
        bad = {k: v for k, v in codes.items() if not k.startswith("2")}
        if bad:
            extra += ("; " if extra else "") + "Svix attempts answered " + ", ".join(
                "%s×%s" % (v, k) for k, v in sorted(bad.items())
            )
        m = s.get("sluice") or {}
        if m and "error" not in m:
            refused = sum(v for k, v in m.items() if k.startswith("requests_") and k != "requests_forwarded")
            bits = ["sluice absorbed %d of the receivers' 429s" % m.get("absorbed_total", 0)]
            if refused:
                bits.append("refused %d requests" % refused)
            if m.get("tunnels_total"):
                bits.append("paced %d tunnels as one unit each" % m["tunnels_total"])
            extra += ("; " if extra else "") + ", ".join(bits)
        if s.get("endpoint_headers_accepted") is not None:
            extra += ("; " if extra else "") + "X-Endpoint-Id %s, at the receivers on %d of %d arrivals" % (
                "set through Svix's endpoint headers" if s["endpoint_headers_accepted"] else "refused by Svix",
                s.get("arrivals_with_endpoint_header", 0),
                s.get("arrivals", 0),
            )
        connects = s.get("connects")
        if connects is not None and s.get("connects_without_request") is not None:
            connects = "%d (%d carried no request sluice saw)" % (connects, s["connects_without_request"])
        print(fmt_row(s, connects, extra))


def cmd_facts(args):
    """What the runs showed about Svix itself, one line each."""
    rows = []
    for path in args.rows:
        try:
            with open(path) as f:
                rows.append(json.load(f)["summary"])
        except (OSError, ValueError, KeyError):
            pass
    print()
    put = [r["endpoint_headers_accepted"] for r in rows if r.get("endpoint_headers_accepted") is not None]
    made = [r.get("endpoint_headers_kept_on_create") for r in rows if r.get("endpoint_headers_kept_on_create") is not None]
    if put:
        print("- endpoint headers through `PUT /api/v1/app/{app}/endpoint/{ep}/headers`: %s"
              % ("kept" if all(put) else "not kept"))
    if made:
        print("- `headers` in the body that creates an endpoint: %s"
              % ("kept" if all(made) else "ignored"))
    direct = [r for r in rows if r.get("connects") is None]
    for r in direct:
        print("- %s: X-Endpoint-Id reached the receivers on %d of %d arrivals"
              % (r["label"], r.get("arrivals_with_endpoint_header", 0), r.get("arrivals", 0)))
    for r in rows:
        if r.get("connects") is not None:
            print("- %s: %s CONNECTs for %d messages (%d arrivals)"
                  % (r["label"], r["connects"], r["sent"], r.get("arrivals", 0)))


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("ports")
    a.add_argument("n", type=int)
    a.set_defaults(fn=cmd_ports)
    a = sub.add_parser("receivers")
    a.add_argument("spec")
    a.add_argument("log")
    a.add_argument("--tls", nargs=2, metavar=("CERT", "KEY"))
    a.set_defaults(fn=cmd_receivers)
    a = sub.add_parser("drive")
    a.add_argument("--svix", required=True)
    a.add_argument("--token", required=True)
    a.add_argument("--setup", required=True)
    a.add_argument("--label")
    a.add_argument("--note")
    a.add_argument("--receivers", required=True)
    a.add_argument("--log", required=True)
    a.add_argument("--https", action="store_true")
    a.add_argument("--endpoint-header", default="X-Endpoint-Id")
    a.add_argument("--messages", type=int, default=180)
    a.add_argument("--senders", type=int, default=8)
    a.add_argument("--deadline", type=int, default=400)
    a.add_argument("--settle", type=float, default=5.0)
    a.add_argument("--sluice-log", help="sluice's JSON log, for its CONNECTs")
    a.add_argument("--sluice-admin", help="sluice's admin URL, for its metrics")
    a.add_argument("--out", required=True)
    a.set_defaults(fn=cmd_drive)
    a = sub.add_parser("facts")
    a.add_argument("rows", nargs="+")
    a.set_defaults(fn=cmd_facts)
    a = sub.add_parser("table")
    a.add_argument("rows", nargs="+")
    a.set_defaults(fn=cmd_table)
    args = p.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
