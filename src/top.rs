//! `sluice top`: the endpoint table of a running sluice, live in a terminal.
//!
//! A thread polls the admin listener's `/endpoints` once a second and hands each answer
//! to the terminal loop, which keeps the state ([`Top`]), draws it ([`draw`]: rendering
//! only, from the state) and reads keys: `s`/`S` sort by the next/previous column
//! (waiting first), `r` reverses, `/` filters by endpoint ID (Enter keeps the filter,
//! Esc clears it), `q` (or Ctrl-C) quits.

use std::collections::HashMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ratatui::Frame;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Row, Table};
use sluice::admin::EndpointView;

/// How often `/endpoints` is asked.
const EVERY: Duration = Duration::from_secs(1);

/// A sortable column: its header, its width and how rows compare on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Column {
    /// Endpoint ID.
    Id,
    /// Current rate.
    Rate,
    /// Configured rate.
    Configured,
    /// Tokens now.
    Tokens,
    /// Requests waiting.
    Waiting,
    /// Requests in flight.
    InFlight,
    /// Longest wait so far.
    Oldest,
    /// Cooldown left.
    Cooldown,
    /// 429s seen.
    Throttles,
    /// Refusals in the last minute.
    Refused,
    /// Requests forwarded per second.
    SentRate,
}

/// The columns in the order shown; `s` walks them from [`Column::Waiting`].
pub const COLUMNS: [Column; 11] = [
    Column::Id,
    Column::Rate,
    Column::Configured,
    Column::Tokens,
    Column::Waiting,
    Column::InFlight,
    Column::Oldest,
    Column::Cooldown,
    Column::Throttles,
    Column::Refused,
    Column::SentRate,
];

impl Column {
    /// The header.
    pub fn title(self) -> &'static str {
        match self {
            Column::Id => "ENDPOINT",
            Column::Rate => "RATE/S",
            Column::Configured => "CONFIGURED",
            Column::Tokens => "TOKENS",
            Column::Waiting => "WAITING",
            Column::InFlight => "IN FLIGHT",
            Column::Oldest => "OLDEST",
            Column::Cooldown => "COOLDOWN",
            Column::Throttles => "429S",
            Column::Refused => "REFUSED/1M",
            Column::SentRate => "SENT/S",
        }
    }

    fn key(self, r: &Shown) -> f64 {
        let v = &r.view;
        match self {
            Column::Id => 0.0,
            Column::Rate => v.rate,
            Column::Configured => v.configured_rate,
            Column::Tokens => v.tokens,
            Column::Waiting => v.waiting as f64,
            Column::InFlight => v.in_flight as f64,
            Column::Oldest => v.oldest_wait_ms as f64,
            Column::Cooldown => v.cooldown_ms as f64,
            Column::Throttles => v.throttles as f64,
            Column::Refused => v.refused_1m as f64,
            Column::SentRate => r.sent_rate.unwrap_or(0.0),
        }
    }
}

/// One endpoint as shown: its view and the sent/s since the poll before.
#[derive(Debug, Clone)]
pub struct Shown {
    /// What `/endpoints` said.
    pub view: EndpointView,
    /// Requests forwarded per second since the poll before (none on the first).
    pub sent_rate: Option<f64>,
}

/// What `sluice top` shows and how.
#[derive(Debug)]
pub struct Top {
    /// The admin listener polled.
    pub admin: String,
    /// The endpoints of the last answer.
    pub lines: Vec<Shown>,
    /// The column sorted by.
    pub sort: Column,
    /// Ascending (else descending).
    pub ascending: bool,
    /// Only endpoints whose ID contains this (case-insensitive).
    pub filter: String,
    /// The filter is being typed.
    pub typing: bool,
    /// The last poll's failure, when it failed.
    pub error: Option<String>,
    /// Polls answered.
    pub polls: u64,
    /// Each endpoint's sent count at the poll before, and when.
    sent: HashMap<String, (u64, Instant)>,
}

/// What a key asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Action {
    /// Keep going.
    Stay,
    /// Leave `top`.
    Quit,
}

impl Top {
    /// A view of `admin`, sorted by waiting, nothing polled yet.
    pub fn new(admin: &str) -> Top {
        Top {
            admin: admin.to_owned(),
            lines: Vec::new(),
            sort: Column::Waiting,
            ascending: false,
            filter: String::new(),
            typing: false,
            error: None,
            polls: 0,
            sent: HashMap::new(),
        }
    }

    /// Takes one poll's answer (`/endpoints` JSON, or why it failed), at `now`.
    pub fn update(&mut self, answer: Result<String, String>, now: Instant) {
        let views: Vec<EndpointView> = match answer.and_then(|body| {
            serde_json::from_str(&body).map_err(|e| format!("not endpoint JSON: {e}"))
        }) {
            Ok(v) => v,
            Err(e) => {
                self.error = Some(e);
                return;
            }
        };
        self.error = None;
        self.polls += 1;
        let mut sent = HashMap::with_capacity(views.len());
        self.lines = views
            .into_iter()
            .map(|view| {
                let sent_rate = self.sent.get(&view.id).and_then(|&(before, at)| {
                    let dt = now.saturating_duration_since(at).as_secs_f64();
                    (dt > 0.0).then(|| view.sent.saturating_sub(before) as f64 / dt)
                });
                sent.insert(view.id.clone(), (view.sent, now));
                Shown { view, sent_rate }
            })
            .collect();
        self.sent = sent;
    }

    /// Acts on a key.
    pub fn key(&mut self, key: KeyEvent) -> Action {
        if key.kind == KeyEventKind::Release {
            return Action::Stay;
        }
        if key.modifiers.contains(KeyModifiers::CONTROL) && key.code == KeyCode::Char('c') {
            return Action::Quit;
        }
        if self.typing {
            match key.code {
                KeyCode::Enter => self.typing = false,
                KeyCode::Esc => {
                    self.typing = false;
                    self.filter.clear();
                }
                KeyCode::Backspace => {
                    self.filter.pop();
                }
                KeyCode::Char(c) => self.filter.push(c),
                _ => {}
            }
            return Action::Stay;
        }
        let at = COLUMNS.iter().position(|c| *c == self.sort).unwrap_or(0);
        match key.code {
            KeyCode::Char('q') => return Action::Quit,
            KeyCode::Char('/') => self.typing = true,
            KeyCode::Esc => self.filter.clear(),
            KeyCode::Char('r') => self.ascending = !self.ascending,
            KeyCode::Char('s') | KeyCode::Right => self.sort_by(COLUMNS[(at + 1) % COLUMNS.len()]),
            KeyCode::Char('S') | KeyCode::Left => {
                self.sort_by(COLUMNS[(at + COLUMNS.len() - 1) % COLUMNS.len()]);
            }
            _ => {}
        }
        Action::Stay
    }

    fn sort_by(&mut self, column: Column) {
        self.sort = column;
        // IDs read A to Z; numbers biggest first.
        self.ascending = column == Column::Id;
    }

    /// The lines shown: filtered, then sorted (ties by ID).
    pub fn shown(&self) -> Vec<&Shown> {
        let filter = self.filter.to_lowercase();
        let mut shown: Vec<&Shown> = self
            .lines
            .iter()
            .filter(|l| l.view.id.to_lowercase().contains(&filter))
            .collect();
        shown.sort_by(|a, b| {
            let by = match self.sort {
                Column::Id => a.view.id.cmp(&b.view.id),
                c => c.key(a).total_cmp(&c.key(b)),
            };
            let by = if self.ascending { by } else { by.reverse() };
            by.then_with(|| a.view.id.cmp(&b.view.id))
        });
        shown
    }
}

fn secs(ms: u64) -> String {
    if ms == 0 {
        "-".into()
    } else {
        format!("{:.1}s", ms as f64 / 1000.0)
    }
}

/// The cells of one line, in [`COLUMNS`] order.
pub fn cells(l: &Shown) -> [String; 11] {
    let v = &l.view;
    let mut id = v.id.clone();
    if v.at_floor {
        id.push_str(" (floor)");
    }
    [
        id,
        format!("{:.2}", v.rate),
        format!("{:.2}", v.configured_rate),
        format!("{:.1}", v.tokens.max(0.0)),
        v.waiting.to_string(),
        v.in_flight.to_string(),
        if v.waiting > 0 {
            secs(v.oldest_wait_ms)
        } else {
            "-".into()
        },
        secs(v.cooldown_ms),
        v.throttles.to_string(),
        v.refused_1m.to_string(),
        l.sent_rate.map_or("-".into(), |r| format!("{r:.1}")),
    ]
}

/// Draws the state: a title line, the table, and a line of keys, filter and status.
pub fn draw(frame: &mut Frame, top: &Top) {
    let [title, table, foot] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Min(1),
        Constraint::Length(1),
    ])
    .areas(frame.area());
    let shown = top.shown();
    let (waiting, in_flight) = top.lines.iter().fold((0, 0), |(w, f), l| {
        (w + l.view.waiting, f + l.view.in_flight)
    });
    let head = Line::from(vec![
        Span::styled("sluice top", Style::new().add_modifier(Modifier::BOLD)),
        Span::raw(format!(
            "  {}  ·  {} endpoints  ·  waiting {waiting}  ·  in flight {in_flight}",
            top.admin,
            top.lines.len()
        )),
    ]);
    frame.render_widget(Paragraph::new(head), title);

    let arrow = if top.ascending { " ▲" } else { " ▼" };
    let header = Row::new(COLUMNS.iter().map(|c| {
        let mut t = c.title().to_owned();
        if *c == top.sort {
            t.push_str(arrow);
        }
        t
    }))
    .style(Style::new().add_modifier(Modifier::BOLD | Modifier::REVERSED));
    let rows = shown.iter().map(|l| {
        let style = if l.view.at_floor {
            Style::new().fg(Color::Red)
        } else if l.view.cooldown_ms > 0 {
            Style::new().fg(Color::Yellow)
        } else {
            Style::new()
        };
        Row::new(cells(l)).style(style)
    });
    let id_width = shown
        .iter()
        .map(|l| cells(l)[0].chars().count())
        .max()
        .unwrap_or(0)
        .clamp(8, 40) as u16;
    let widths = COLUMNS.map(|c| match c {
        Column::Id => Constraint::Length(id_width),
        // Room for the sort arrow and a space.
        c => Constraint::Length(c.title().len() as u16 + 3),
    });
    frame.render_widget(
        Table::new(rows, widths).header(header).column_spacing(1),
        table,
    );

    let mut foot_line = vec![Span::styled(
        " q quit  s/S sort  r reverse  / filter ",
        Style::new().add_modifier(Modifier::REVERSED),
    )];
    if top.typing || !top.filter.is_empty() {
        let cursor = if top.typing { "_" } else { "" };
        foot_line.push(Span::raw(format!("  filter: {}{cursor}", top.filter)));
    }
    match &top.error {
        Some(e) => foot_line.push(Span::styled(
            format!("  {e}"),
            Style::new().fg(Color::Red).add_modifier(Modifier::BOLD),
        )),
        None if top.polls == 0 => foot_line.push(Span::raw("  connecting…")),
        None => foot_line.push(Span::raw(format!(
            "  {} of {} shown · every {}s",
            shown.len(),
            top.lines.len(),
            EVERY.as_secs()
        ))),
    }
    frame.render_widget(Paragraph::new(Line::from(foot_line)), foot);
}

/// Runs `sluice top` against the admin listener `admin` until `q`.
pub fn run(admin: &str, token: Option<String>) -> Result<(), String> {
    let (tx, rx) = mpsc::channel();
    let polled = admin.to_owned();
    // The poller: its own runtime, on its own thread; it ends when the loop below has
    // gone (its next answer has nowhere to go).
    std::thread::Builder::new()
        .name("sluice-top-poll".into())
        .spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                let mut tick = tokio::time::interval(EVERY);
                loop {
                    tick.tick().await;
                    let answer = sluice::admin::fetch_endpoints(&polled, token.as_deref()).await;
                    if tx.send(answer).is_err() {
                        return;
                    }
                }
            });
        })
        .map_err(|e| format!("starting the poller: {e}"))?;
    let mut terminal = ratatui::try_init().map_err(|e| format!("setting up the terminal: {e}"))?;
    let mut top = Top::new(admin);
    let result = (|| -> std::io::Result<()> {
        loop {
            while let Ok(answer) = rx.try_recv() {
                top.update(answer, Instant::now());
            }
            terminal.draw(|f| draw(f, &top))?;
            if event::poll(Duration::from_millis(100))? {
                if let Event::Key(key) = event::read()? {
                    if top.key(key) == Action::Quit {
                        return Ok(());
                    }
                }
            }
        }
    })();
    ratatui::restore();
    result.map_err(|e| format!("terminal: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::Terminal;
    use ratatui::backend::TestBackend;

    fn view(id: &str, waiting: u64, cooldown_ms: u64) -> EndpointView {
        EndpointView {
            id: id.into(),
            configured: true,
            configured_rate: 10.0,
            rate: 10.0,
            burst: 10.0,
            tokens: 3.0,
            mode: "enforce".into(),
            cooldown_ms,
            throttles: 0,
            at_floor: false,
            at_floor_secs: 0.0,
            held_ahead: 0.0,
            windows: Vec::new(),
            waiting,
            waiting_by_priority: Default::default(),
            in_flight: 1,
            oldest_wait_ms: 1500,
            refused_1m: 0,
            sent: 10,
            learned: None,
        }
    }

    fn answer(views: &[EndpointView]) -> Result<String, String> {
        Ok(serde_json::to_string(views).unwrap())
    }

    fn press(top: &mut Top, code: KeyCode) -> Action {
        top.key(KeyEvent::new(code, KeyModifiers::NONE))
    }

    fn ids(top: &Top) -> Vec<&str> {
        top.shown().iter().map(|l| l.view.id.as_str()).collect()
    }

    /// Sorted by waiting, most first; `s` sorts by the next column, `r` reverses, `/`
    /// filters by ID, Esc clears it, `q` quits.
    #[test]
    fn keys_sort_filter_and_quit() {
        let mut top = Top::new("http://x");
        let t0 = Instant::now();
        top.update(
            answer(&[view("a", 1, 0), view("b", 5, 0), view("c", 3, 0)]),
            t0,
        );
        assert_eq!(ids(&top), ["b", "c", "a"]);
        press(&mut top, KeyCode::Char('r'));
        assert_eq!(ids(&top), ["a", "c", "b"]);
        press(&mut top, KeyCode::Char('S'));
        press(&mut top, KeyCode::Char('S'));
        press(&mut top, KeyCode::Char('S'));
        press(&mut top, KeyCode::Char('S'));
        assert_eq!(top.sort, Column::Id);
        assert_eq!(ids(&top), ["a", "b", "c"]);
        press(&mut top, KeyCode::Char('/'));
        for c in "B".chars() {
            assert_eq!(press(&mut top, KeyCode::Char(c)), Action::Stay);
        }
        press(&mut top, KeyCode::Enter);
        assert_eq!(ids(&top), ["b"]);
        assert_eq!(press(&mut top, KeyCode::Char('q')), Action::Quit);
        press(&mut top, KeyCode::Esc);
        assert_eq!(ids(&top).len(), 3);
        // `q` typed into the filter is a letter, not the way out.
        press(&mut top, KeyCode::Char('/'));
        assert_eq!(press(&mut top, KeyCode::Char('q')), Action::Stay);
    }

    /// Sent/s is the sent count's rise over the time between two polls.
    #[test]
    fn sent_per_second_comes_from_two_polls() {
        let mut top = Top::new("http://x");
        let t0 = Instant::now();
        top.update(answer(&[view("a", 0, 0)]), t0);
        assert_eq!(top.lines[0].sent_rate, None);
        let mut later = view("a", 0, 0);
        later.sent = 30;
        top.update(answer(&[later]), t0 + Duration::from_secs(2));
        assert_eq!(top.lines[0].sent_rate, Some(10.0));
        top.update(Err("down".into()), t0 + Duration::from_secs(3));
        assert_eq!(top.error.as_deref(), Some("down"));
        assert_eq!(top.lines.len(), 1, "the last answer stays shown");
    }

    /// The drawn screen: header with the sort arrow, one row per endpoint, the keys.
    #[test]
    fn draws_the_table() {
        let mut top = Top::new("http://127.0.0.1:9090");
        top.update(
            answer(&[view("alpha", 2, 0), view("beta", 0, 4200)]),
            Instant::now(),
        );
        let mut terminal = Terminal::new(TestBackend::new(140, 8)).unwrap();
        terminal.draw(|f| draw(f, &top)).unwrap();
        let screen: Vec<String> = terminal
            .backend()
            .buffer()
            .content()
            .chunks(140)
            .map(|row| row.iter().map(|c| c.symbol()).collect())
            .collect();
        let text = screen.join("\n");
        assert!(screen[1].contains("WAITING ▼"), "{text}");
        assert!(screen[2].starts_with("alpha"), "{text}");
        assert!(
            screen[3].starts_with("beta") && screen[3].contains("4.2s"),
            "{text}"
        );
        assert!(screen[7].contains("q quit"), "{text}");
    }
}
