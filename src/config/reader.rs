//! The TOML reader: walks the spanned tree, collecting every problem with its
//! `line:column` and dotted key, and reads typed values (strings with `${NAME}`
//! expanded, numbers, durations, globs, addresses) with their defaults. What the keys
//! are and what they mean is in [`super::schema`].

use super::*;

pub(super) type Table<'i> = DeTable<'i>;
pub(super) type Value<'i> = Spanned<DeValue<'i>>;

/// Collects issues while reading the spanned tree.
pub(super) struct Reader<'s> {
    pub(super) src: &'s str,
    pub(super) env: &'s dyn Fn(&str) -> Option<String>,
    pub(super) issues: Vec<ConfigIssue>,
    /// What loads but deserves a word ([`Config::warnings`]).
    pub(super) warnings: Vec<ConfigIssue>,
}

impl Reader<'_> {
    pub(super) fn issue(&mut self, offset: usize, key: &str, message: String) {
        let issue = self.located(offset, key, message);
        self.issues.push(issue);
    }

    /// A warning at `offset`: the config loads, and `check` and `run` say it.
    pub(super) fn warn(&mut self, offset: usize, key: &str, message: String) {
        let warning = self.located(offset, key, message);
        self.warnings.push(warning);
    }

    /// `message` about `key`, at the line and column of byte `offset`.
    fn located(&self, offset: usize, key: &str, message: String) -> ConfigIssue {
        let before = &self.src[..offset.min(self.src.len())];
        let line = before.matches('\n').count() + 1;
        let column = before
            .rfind('\n')
            .map_or(before.len(), |p| before.len() - p - 1)
            + 1;
        ConfigIssue {
            line,
            column,
            key: key.to_owned(),
            message,
        }
    }

    /// Flags keys of `table` that are not in `known`.
    pub(super) fn known_keys(&mut self, table: &Table<'_>, path: &str, known: &[&str]) {
        for (k, _) in table.iter() {
            if !known.contains(&k.get_ref().as_ref()) {
                let key = join(path, k.get_ref());
                let hint = closest(k.get_ref(), known)
                    .map(|c| format!(" (did you mean `{c}`?)"))
                    .unwrap_or_default();
                self.issue(
                    k.span().start,
                    &key,
                    format!("unknown key{hint}; known keys here: {}", known.join(", ")),
                );
            }
        }
    }

    pub(super) fn sub_table<'t, 'i>(
        &mut self,
        table: &'t Table<'i>,
        path: &str,
        name: &str,
    ) -> Option<&'t Table<'i>> {
        let v = table.get(name)?;
        match v.get_ref() {
            DeValue::Table(t) => Some(t),
            other => {
                self.type_issue(v, &join(path, name), "a table", other.type_str());
                None
            }
        }
    }

    pub(super) fn type_issue(&mut self, v: &Value<'_>, key: &str, want: &str, got: &str) {
        self.issue(v.span().start, key, format!("expected {want}, found {got}"));
    }

    /// A string value with `${NAME}` expanded; an expansion error is an issue at `at`.
    pub(super) fn expanded(&mut self, s: &str, at: usize, key: &str) -> Option<(String, usize)> {
        match expand_env(s, self.env) {
            Ok(s) => Some((s, at)),
            Err(e) => {
                self.issue(at, key, e);
                None
            }
        }
    }

    pub(super) fn string(
        &mut self,
        t: &Table<'_>,
        path: &str,
        name: &str,
    ) -> Option<(String, usize)> {
        let v = t.get(name)?;
        match v.get_ref() {
            DeValue::String(s) => self.expanded(s, v.span().start, &join(path, name)),
            other => {
                self.type_issue(v, &join(path, name), "a string", other.type_str());
                None
            }
        }
    }

    pub(super) fn boolean(&mut self, t: &Table<'_>, path: &str, name: &str, default: bool) -> bool {
        let Some(v) = t.get(name) else { return default };
        match v.get_ref() {
            DeValue::Boolean(b) => *b,
            other => {
                self.type_issue(v, &join(path, name), "true or false", other.type_str());
                default
            }
        }
    }

    pub(super) fn number(&mut self, t: &Table<'_>, path: &str, name: &str) -> Option<(f64, usize)> {
        let v = t.get(name)?;
        let at = v.span().start;
        let parsed = match v.get_ref() {
            DeValue::Integer(i) => i64::from_str_radix(&i.as_str().replace('_', ""), i.radix())
                .ok()
                .map(|n| n as f64),
            DeValue::Float(f) => f.as_str().replace('_', "").parse::<f64>().ok(),
            other => {
                self.type_issue(v, &join(path, name), "a number", other.type_str());
                return None;
            }
        };
        match parsed {
            Some(n) if n.is_finite() => Some((n, at)),
            _ => {
                self.issue(at, &join(path, name), "expected a finite number".into());
                None
            }
        }
    }

    /// A number checked by `ok`, or `default` (with an issue) when absent or invalid.
    pub(super) fn checked(
        &mut self,
        t: &Table<'_>,
        path: &str,
        name: &str,
        default: f64,
        rule: &str,
        ok: impl Fn(f64) -> bool,
    ) -> f64 {
        match self.number(t, path, name) {
            Some((n, _)) if ok(n) => n,
            Some((n, at)) => {
                self.issue(
                    at,
                    &join(path, name),
                    format!("{n} is invalid: must be {rule}"),
                );
                default
            }
            None => default,
        }
    }

    pub(super) fn count(&mut self, t: &Table<'_>, path: &str, name: &str, default: usize) -> usize {
        match self.number(t, path, name) {
            Some((n, _)) if n >= 1.0 && n.fract() == 0.0 && n <= 1e9 => n as usize,
            Some((n, at)) => {
                self.issue(
                    at,
                    &join(path, name),
                    format!("{n} is invalid: must be a whole number ≥ 1"),
                );
                default
            }
            None => default,
        }
    }

    /// A whole number in `range` (an integer, not `2.5` or `"2"`), or `default` (with an
    /// issue naming the range) when absent or out of it.
    pub(super) fn whole(
        &mut self,
        t: &Table<'_>,
        path: &str,
        name: &str,
        default: u64,
        range: std::ops::RangeInclusive<u64>,
    ) -> u64 {
        let Some(v) = t.get(name) else {
            return default;
        };
        let DeValue::Integer(i) = v.get_ref() else {
            let want = format!("a whole number from {} to {}", range.start(), range.end());
            self.type_issue(v, &join(path, name), &want, v.get_ref().type_str());
            return default;
        };
        let text = i.as_str().replace('_', "");
        match u64::from_str_radix(&text, i.radix()) {
            Ok(n) if range.contains(&n) => n,
            _ => {
                self.issue(
                    v.span().start,
                    &join(path, name),
                    format!(
                        "{} is invalid: must be a whole number from {} to {}",
                        i.as_str(),
                        range.start(),
                        range.end()
                    ),
                );
                default
            }
        }
    }

    pub(super) fn duration(
        &mut self,
        t: &Table<'_>,
        path: &str,
        name: &str,
        default: Duration,
    ) -> Duration {
        let Some((s, at)) = self.string(t, path, name) else {
            return default;
        };
        match parse_duration(&s) {
            Ok(d) => d,
            Err(e) => {
                self.issue(at, &join(path, name), e);
                default
            }
        }
    }

    pub(super) fn strings(
        &mut self,
        t: &Table<'_>,
        path: &str,
        name: &str,
    ) -> Vec<(String, usize)> {
        let Some(v) = t.get(name) else {
            return Vec::new();
        };
        let key = join(path, name);
        let DeValue::Array(items) = v.get_ref() else {
            self.type_issue(v, &key, "an array of strings", v.get_ref().type_str());
            return Vec::new();
        };
        let mut out = Vec::new();
        for item in items.iter() {
            match item.get_ref() {
                DeValue::String(s) => {
                    if let Some(e) = self.expanded(s, item.span().start, &key) {
                        out.push(e);
                    }
                }
                other => self.type_issue(item, &key, "a string", other.type_str()),
            }
        }
        out
    }

    pub(super) fn enumerated<T: Copy>(
        &mut self,
        t: &Table<'_>,
        path: &str,
        name: &str,
        default: T,
        choices: &[(&str, T)],
    ) -> T {
        let Some((s, at)) = self.string(t, path, name) else {
            return default;
        };
        if let Some((_, v)) = choices.iter().find(|(c, _)| *c == s) {
            return *v;
        }
        let names: Vec<String> = choices.iter().map(|(c, _)| format!("\"{c}\"")).collect();
        self.issue(
            at,
            &join(path, name),
            format!("\"{s}\" is not one of {}", names.join(", ")),
        );
        default
    }

    pub(super) fn addr(
        &mut self,
        t: &Table<'_>,
        path: &str,
        name: &str,
        default: &str,
    ) -> SocketAddr {
        let fallback: SocketAddr = default
            .parse()
            .unwrap_or(SocketAddr::from(([127, 0, 0, 1], 0)));
        let Some((s, at)) = self.string(t, path, name) else {
            return fallback;
        };
        match s.parse() {
            Ok(a) => a,
            Err(_) => {
                self.issue(
                    at,
                    &join(path, name),
                    format!("\"{s}\" is not an address like \"127.0.0.1:8080\""),
                );
                fallback
            }
        }
    }

    pub(super) fn globs(&mut self, t: &Table<'_>, path: &str, name: &str) -> HostGlobs {
        let mut b = GlobSetBuilder::new();
        let mut len = 0;
        let mut patterns = Vec::new();
        for (g, at) in self.strings(t, path, name) {
            // Hosts are matched normalised (no scheme, port or trailing dot): such a
            // glob would never match, and its host be treated as unlisted.
            if g.contains([':', '/']) || g.ends_with('.') {
                self.issue(
                    at,
                    &join(path, name),
                    format!("\"{g}\" can never match: list host names alone, without a scheme, port or trailing dot"),
                );
                continue;
            }
            match Glob::new(&g.to_ascii_lowercase()) {
                Ok(glob) => {
                    b.add(glob);
                    len += 1;
                    patterns.push(g.to_ascii_lowercase());
                }
                Err(e) => self.issue(at, &join(path, name), format!("bad glob \"{g}\": {e}")),
            }
        }
        let set = b.build().unwrap_or_else(|_| GlobSet::empty());
        HostGlobs { set, len, patterns }
    }

    /// An optional path; an empty string means unset.
    pub(super) fn path(&mut self, t: &Table<'_>, path: &str, name: &str) -> Option<PathBuf> {
        self.string(t, path, name)
            .filter(|(s, _)| !s.is_empty())
            .map(|(s, _)| s.into())
    }

    /// A duration that must be greater than zero.
    pub(super) fn positive(
        &mut self,
        t: &Table<'_>,
        path: &str,
        name: &str,
        default: Duration,
    ) -> Duration {
        let d = self.duration(t, path, name, default);
        if d.is_zero() {
            let at = t.get(name).map_or(0, |v| v.span().start);
            self.issue(at, &join(path, name), "must be greater than 0".into());
            return default;
        }
        d
    }
}

pub(super) fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

/// The known key nearest to a typo (by edit distance ≤ 2).
pub(super) fn closest<'a>(typo: &str, known: &[&'a str]) -> Option<&'a str> {
    known
        .iter()
        .map(|k| (edit_distance(typo, k), *k))
        .filter(|(d, _)| *d <= 2)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

pub(super) fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}
