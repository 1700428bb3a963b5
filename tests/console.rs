//! Seeing the queue: `/endpoints`' waiting, in-flight and refusal counts (and their
//! metrics and `sluice status` columns), the console page at `/ui` in a real headless
//! Chromium, and `sluice top` in a terminal (tmux).

mod common;

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::process::output_within;
use common::{Reply, Upstream, client};

/// `/endpoints` of the admin listener at `admin`.
async fn endpoints(admin: std::net::SocketAddr) -> Vec<sluice::admin::EndpointView> {
    reqwest::get(format!("http://{admin}/endpoints"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

fn view<'a>(views: &'a [sluice::admin::EndpointView], id: &str) -> &'a sluice::admin::EndpointView {
    views.iter().find(|v| v.id == id).unwrap()
}

/// Sends a GET for `path` through sluice on `endpoint`, in a task of its own.
fn send(
    c: &reqwest::Client,
    up: &Upstream,
    path: &str,
    endpoint: &str,
    priority: Option<&str>,
) -> tokio::task::JoinHandle<u16> {
    let mut req = c.get(up.url(path)).header("x-endpoint-id", endpoint);
    if let Some(p) = priority {
        req = req.header("x-sluice-priority", p);
    }
    tokio::spawn(async move { req.send().await.map_or(0, |r| r.status().as_u16()) })
}

/// With one request at a slow receiver and four waiting for their starts (5 s apart), the
/// endpoint shows 4 waiting, 1 in flight and how long the first has waited; a queued
/// endpoint breaks its waiting down by priority; refusals of the last minute are
/// counted; `sluice_waiting` and `sluice_oldest_wait_seconds` follow, and `sluice
/// status` prints the columns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_show_who_waits_what_is_in_flight_and_what_was_refused() {
    let up = Upstream::with(Arc::new(|a| {
        if a.path == "/slow" {
            Reply::ok().delay(Duration::from_secs(8))
        } else {
            Reply::ok()
        }
    }))
    .await;
    let s = common::sluice(
        "[[endpoints]]\nid = \"w\"\nrate = 0.2\nburst = 1.0\nmax_wait = \"60s\"\n\
         [[endpoints]]\nid = \"p\"\nrate = 0.2\nburst = 1.0\nmax_wait = \"60s\"\n\
         [[endpoints]]\nid = \"r\"\nrate = 1.0\nburst = 1.0\nmax_wait = \"0s\"\n",
    )
    .await;
    let c = client(s.proxy_addr);
    let mut tasks = vec![send(&c, &up, "/slow", "w", None)];
    common::wait_for(
        "the first request in flight",
        Duration::from_secs(5),
        || async { view(&endpoints(s.admin_addr).await, "w").in_flight == 1 },
    )
    .await;
    for _ in 0..4 {
        tasks.push(send(&c, &up, "/", "w", None));
    }
    // A priority named once queues the endpoint: the first (`low`) leaves at once, the
    // next holds the head until its start, the two after it wait in the queue.
    assert_eq!(send(&c, &up, "/", "p", Some("low")).await.unwrap(), 200);
    for _ in 0..3 {
        tasks.push(send(&c, &up, "/", "p", Some("high")));
    }
    for _ in 0..3 {
        let r = c.get(up.url("/")).header("x-endpoint-id", "r").send().await;
        r.unwrap();
    }
    common::wait_for("4 waiting on w, 3 on p", Duration::from_secs(5), || async {
        let views = endpoints(s.admin_addr).await;
        view(&views, "w").waiting == 4 && view(&views, "p").waiting == 3
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let views = endpoints(s.admin_addr).await;
    let (w, p, r) = (view(&views, "w"), view(&views, "p"), view(&views, "r"));
    assert_eq!(w.in_flight, 1, "{w:?}");
    assert!(w.oldest_wait_ms >= 100, "{w:?}");
    assert_eq!(w.waiting_by_priority, sluice::admin::ByPriority::default());
    assert_eq!(p.waiting_by_priority.high, 2, "{p:?}");
    assert_eq!(r.refused_1m, 2, "{r:?}");
    assert_eq!(r.sent, 1, "{r:?}");
    common::wait_for_metric(s.admin_addr, "sluice_waiting{endpoint=\"w\"} 4").await;
    let text = common::metrics(s.admin_addr).await;
    assert!(
        text.contains("# TYPE sluice_waiting gauge")
            && text.contains("# TYPE sluice_oldest_wait_seconds gauge")
            && text.contains("sluice_oldest_wait_seconds{endpoint=\"w\"}"),
        "{text}"
    );
    let admin = format!("http://{}", s.admin_addr);
    let out = tokio::task::spawn_blocking(move || {
        output_within(
            Command::new(env!("CARGO_BIN_EXE_sluice")).args(["status", "--admin", &admin]),
            Duration::from_secs(10),
        )
    })
    .await
    .unwrap();
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{table}");
    let header = table.lines().next().unwrap();
    for col in ["WAITING", "IN FLIGHT", "OLDEST", "REFUSED/1M"] {
        assert!(header.contains(col), "no {col}:\n{table}");
    }
    let row: Vec<&str> = table
        .lines()
        .find(|l| l.starts_with("w "))
        .unwrap()
        .split_whitespace()
        .collect();
    let at = |name: &str| {
        let i = header
            .split("  ")
            .filter(|c| !c.trim().is_empty())
            .position(|c| c.trim() == name)
            .unwrap();
        row[i]
    };
    assert_eq!(at("WAITING"), "4", "{table}");
    assert_eq!(at("IN FLIGHT"), "1", "{table}");
    // Senders that give up leave nothing counted behind.
    for t in &tasks[1..] {
        t.abort();
    }
    assert_eq!(
        tasks.remove(0).await.unwrap(),
        200,
        "the slow one is answered"
    );
    common::wait_for("nothing left waiting", Duration::from_secs(5), || async {
        let views = endpoints(s.admin_addr).await;
        let (w, p) = (view(&views, "w"), view(&views, "p"));
        w.waiting + w.in_flight + p.waiting + p.in_flight == 0
    })
    .await;
    s.stop().await;
}

/// Debian's Chromium (`scripts/test` installs it), or `None` when it is not there.
fn chromium() -> Option<&'static str> {
    ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|b| {
            Command::new(b)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
}

/// The DOM of `url` after `budget_ms` of the page's (virtual) time in headless Chromium.
fn dump_dom(browser: &str, url: &str, budget_ms: u64) -> String {
    let profile = tempfile::tempdir().unwrap();
    let out = output_within(
        Command::new(browser)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg(format!("--virtual-time-budget={budget_ms}"))
            .args(["--dump-dom", url]),
        Duration::from_secs(90),
    );
    let dom = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && dom.contains("</html>"),
        "{browser} failed: {}\n{dom}",
        String::from_utf8_lossy(&out.stderr)
    );
    dom
}

/// The `<tr>` of endpoint `id` in a dumped console DOM.
fn row<'a>(dom: &'a str, id: &str) -> &'a str {
    let start = dom
        .find(&format!("<tr data-id=\"{id}\""))
        .unwrap_or_else(|| panic!("no row for {id}:\n{dom}"));
    let len = dom[start..].find("</tr>").unwrap();
    &dom[start..start + len]
}

/// A number the DOM shows in the element that follows `marker`.
fn number_after(html: &str, marker: &str) -> u64 {
    let at = html
        .find(marker)
        .unwrap_or_else(|| panic!("no {marker:?} in\n{html}"));
    let digits: String = html[at + marker.len()..]
        .chars()
        .skip_while(|c| *c != '>')
        .skip(1)
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("no number after {marker:?}"))
}

/// The console at `/ui`, in a real headless Chromium: it lists the running sluice's
/// endpoints, marks the one whose receiver answered 429 as cooling down (with its 429
/// and the cooldown left), shows what waits, and keeps polling without a reload: a
/// longer run of the same page has polled more and drawn more points in its sparklines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_shows_endpoints_cooldowns_and_updates_in_a_browser() {
    let Some(browser) = chromium() else {
        eprintln!(
            "SKIPPED the_console_shows_endpoints_cooldowns_and_updates_in_a_browser: no \
             chromium on PATH (scripts/test installs Debian's chromium package)"
        );
        return;
    };
    let up = Upstream::with(Arc::new(|a| match a.path.as_str() {
        "/throttle" => Reply::status(429).header("retry-after", "120"),
        _ => Reply::ok(),
    }))
    .await;
    let s = common::sluice(
        "[defaults]\nmax_wait = \"60s\"\n[defaults.adaptive]\nabsorb = \"off\"\n\
         [[endpoints]]\nid = \"alpha\"\nrate = 5.0\n\
         [[endpoints]]\nid = \"beta\"\nrate = 5.0\n\
         [[endpoints]]\nid = \"gamma\"\nrate = 0.05\nburst = 1.0\n",
    )
    .await;
    let c = client(s.proxy_addr);
    assert_eq!(send(&c, &up, "/", "alpha", None).await.unwrap(), 200);
    assert_eq!(send(&c, &up, "/throttle", "beta", None).await.unwrap(), 429);
    let mut waiting = vec![send(&c, &up, "/", "gamma", None)];
    common::wait_for("gamma's first sent", Duration::from_secs(5), || async {
        view(&endpoints(s.admin_addr).await, "gamma").sent == 1
    })
    .await;
    for _ in 0..2 {
        waiting.push(send(&c, &up, "/", "gamma", None));
    }
    common::wait_for("2 waiting on gamma", Duration::from_secs(5), || async {
        view(&endpoints(s.admin_addr).await, "gamma").waiting == 2
    })
    .await;
    let url = format!("http://{}/ui", s.admin_addr);
    let (short, long) = tokio::task::spawn_blocking(move || {
        (dump_dom(browser, &url, 2500), dump_dom(browser, &url, 6500))
    })
    .await
    .unwrap();
    for id in ["alpha", "beta", "gamma"] {
        row(&short, id);
    }
    let beta = row(&short, "beta");
    assert!(
        beta.starts_with("<tr data-id=\"beta\" class=\"cooldown"),
        "{beta}"
    );
    assert!(beta.contains("<td class=\"throttles\">1</td>"), "{beta}");
    let left = number_after(beta, "<td class=\"cooldown\"");
    assert!(
        (100..=120).contains(&left),
        "{left}s of cooldown left: {beta}"
    );
    let alpha = row(&short, "alpha");
    assert!(
        alpha.starts_with("<tr data-id=\"alpha\" class=\"\">"),
        "{alpha}"
    );
    assert_eq!(
        number_after(row(&short, "gamma"), "<td class=\"waiting\""),
        2
    );
    // Polled again and again in one page load: more polls, longer sparklines.
    let (polls_short, polls_long) = (
        number_after(&short, "id=\"polls\""),
        number_after(&long, "id=\"polls\""),
    );
    assert!(polls_short >= 2, "{polls_short} polls in 2.5 s");
    assert!(polls_long > polls_short, "{polls_long} polls after 6.5 s");
    let gamma = row(&long, "gamma");
    let at = gamma.find("data-samples=\"").unwrap() + "data-samples=\"".len();
    let samples: String = gamma[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    assert_eq!(
        samples,
        polls_long.to_string(),
        "a sparkline point per poll"
    );
    for w in waiting {
        w.abort();
    }
    s.stop().await;
}

/// With `proxy.admin_token_file`, `/ui` wants the token as `/endpoints` does: a browser
/// is asked for a Basic password (the token; any user name), and the page's polls go
/// with it. The page may load nothing from elsewhere (its Content-Security-Policy).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_wants_the_admin_token() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cret-token\n").unwrap();
    let s = common::sluice(&format!(
        "[proxy]\nadmin_token_file = \"{}\"\n[[endpoints]]\nid = \"alpha\"\n",
        token_file.display()
    ))
    .await;
    let base = format!("http://{}", s.admin_addr);
    let http = reqwest::Client::new();
    let r = http.get(format!("{base}/ui")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert!(
        r.headers()["www-authenticate"]
            .to_str()
            .unwrap()
            .starts_with("Basic realm=\"sluice-admin\""),
        "{:?}",
        r.headers()
    );
    for (user, password, want) in [("anyone", "s3cret-token", 200), ("anyone", "wrong", 401)] {
        for path in ["/ui", "/endpoints", "/metrics"] {
            let r = http
                .get(format!("{base}{path}"))
                .basic_auth(user, Some(password))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), want, "{path} with password {password}");
        }
    }
    let r = http
        .get(format!("{base}/ui"))
        .bearer_auth("s3cret-token")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/html; charset=utf-8");
    let csp = r.headers()["content-security-policy"].to_str().unwrap();
    assert!(csp.starts_with("default-src 'none'"), "{csp}");
    let page = r.text().await.unwrap();
    assert!(
        !page.contains("src=\"http") && !page.contains("href=\"http"),
        "the page loads nothing from elsewhere"
    );
    if let Some(browser) = chromium() {
        let url = format!("http://anyone:s3cret-token@{}/ui", s.admin_addr);
        let dom = tokio::task::spawn_blocking(move || dump_dom(browser, &url, 2500))
            .await
            .unwrap();
        row(&dom, "alpha");
        assert!(number_after(&dom, "id=\"polls\"") >= 2, "{dom}");
    }
    s.stop().await;
}

/// A tmux server of the test's own (`tmux -L`), killed when dropped.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn new() -> Option<Tmux> {
        let found = Command::new("tmux")
            .arg("-V")
            .output()
            .is_ok_and(|o| o.status.success());
        found.then(|| Tmux {
            socket: format!("sluice-top-test-{}", std::process::id()),
        })
    }

    fn run(&self, args: &[&str]) -> std::process::Output {
        output_within(
            Command::new("tmux").args(["-L", &self.socket]).args(args),
            Duration::from_secs(10),
        )
    }

    /// The pane's screen, as text.
    fn screen(&self) -> String {
        String::from_utf8_lossy(&self.run(&["capture-pane", "-p", "-t", "top"]).stdout).into_owned()
    }

    /// Waits (at most `limit`) until the screen satisfies `ok`; fails showing it.
    async fn until(&self, what: &str, limit: Duration, ok: impl Fn(&str) -> bool) -> String {
        let end = tokio::time::Instant::now() + limit;
        loop {
            let screen = self.screen();
            if ok(&screen) {
                return screen;
            }
            assert!(
                tokio::time::Instant::now() < end,
                "timed out after {limit:?} waiting for {what}; the screen:\n{screen}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["-L", &self.socket, "kill-server"])
            .output();
    }
}

/// The line of the screen that starts with endpoint `id`, and where.
fn line_of(screen: &str, id: &str) -> Option<usize> {
    screen
        .lines()
        .position(|l| l.starts_with(&format!("{id} ")))
}

/// `sluice top` in a terminal (tmux): it shows the running sluice's endpoints, the one
/// with requests waiting first, with its waiting count; `/` filters by ID; `q` quits,
/// with status 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_shows_the_table_live_filters_and_quits_in_a_terminal() {
    let Some(tmux) = Tmux::new() else {
        eprintln!(
            "SKIPPED top_shows_the_table_live_filters_and_quits_in_a_terminal: no tmux on \
             PATH (scripts/test installs it)"
        );
        return;
    };
    let up = Upstream::start().await;
    let s = common::sluice(
        "[defaults]\nmax_wait = \"60s\"\n\
         [[endpoints]]\nid = \"alpha\"\nrate = 5.0\n\
         [[endpoints]]\nid = \"beta\"\nrate = 0.05\nburst = 1.0\n",
    )
    .await;
    let c = client(s.proxy_addr);
    assert_eq!(send(&c, &up, "/", "beta", None).await.unwrap(), 200);
    let waiting: Vec<_> = (0..2).map(|_| send(&c, &up, "/", "beta", None)).collect();
    common::wait_for("2 waiting on beta", Duration::from_secs(5), || async {
        view(&endpoints(s.admin_addr).await, "beta").waiting == 2
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let status = dir.path().join("status");
    let command = format!(
        "{} top --admin http://{}; echo exit=$? > {}",
        env!("CARGO_BIN_EXE_sluice"),
        s.admin_addr,
        status.display()
    );
    let out = tmux.run(&[
        "new-session",
        "-d",
        "-s",
        "top",
        "-x",
        "150",
        "-y",
        "20",
        &command,
    ]);
    assert!(out.status.success(), "tmux: {out:?}");
    let screen = tmux
        .until("both endpoints", Duration::from_secs(20), |s| {
            line_of(s, "alpha").is_some() && line_of(s, "beta").is_some()
        })
        .await;
    let (alpha, beta) = (
        line_of(&screen, "alpha").unwrap(),
        line_of(&screen, "beta").unwrap(),
    );
    assert!(beta < alpha, "sorted by waiting, beta first:\n{screen}");
    assert!(screen.contains("WAITING ▼"), "{screen}");
    // Beta's WAITING cell (under its header) says 2.
    let header = screen.lines().find(|l| l.starts_with("ENDPOINT")).unwrap();
    let col = header.find("WAITING").unwrap();
    let row = screen.lines().nth(beta).unwrap();
    let cell: String = row
        .chars()
        .skip(header[..col].chars().count())
        .take(7)
        .collect();
    assert_eq!(cell.trim(), "2", "{screen}");
    // Filter by ID.
    tmux.run(&["send-keys", "-t", "top", "/", "alp", "Enter"]);
    tmux.until("only alpha", Duration::from_secs(10), |s| {
        line_of(s, "alpha").is_some() && line_of(s, "beta").is_none() && s.contains("filter: alp")
    })
    .await;
    tmux.run(&["send-keys", "-t", "top", "q"]);
    common::wait_for("top to exit", Duration::from_secs(10), || async {
        std::fs::read_to_string(&status).is_ok_and(|s| s.contains("exit="))
    })
    .await;
    assert_eq!(std::fs::read_to_string(&status).unwrap().trim(), "exit=0");
    for w in waiting {
        w.abort();
    }
    s.stop().await;
}
