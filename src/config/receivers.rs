//! Receiver profiles: what sluice knows of the APIs it sends to, so an endpoint can say
//! `profile = "github"` instead of working out the receiver's windows, rate, burst,
//! concurrency, quota headers and body hints.
//!
//! Each profile is a data file under `profiles/` in the repository, embedded in the
//! binary: a `[profile]` table saying which receiver it is, the public page its figures
//! come from and the date they were read, and an `[endpoint]` table of ordinary
//! `[[endpoints]]` keys. An endpoint naming a profile is read as if the profile's keys
//! were written in it, its own keys first: whatever the endpoint sets overrides the
//! profile. A profile's keys go through the same reader as the config's own, so every
//! key an endpoint takes (windows, costs, adaptive settings) may appear in a profile.
//!
//! Not to be confused with sender profiles (`[sender] profile`, an endpoint's
//! `sender_profile`, [`super::profiles`]): those describe the platform that *sends*
//! through sluice; these describe the receiver.

use std::sync::Arc;

use super::reader::{Reader, Table, closest, join};
use super::*;

/// One receiver profile: a data file of `profiles/`.
#[derive(Debug, PartialEq, Eq)]
pub struct ReceiverProfile {
    /// The name an endpoint's `profile` takes.
    pub name: &'static str,
    /// The data file's text (TOML).
    pub text: &'static str,
}

/// Every receiver profile sluice ships, by name.
pub const RECEIVERS: &[ReceiverProfile] = &[
    ReceiverProfile {
        name: "discord",
        text: include_str!("../../profiles/discord.toml"),
    },
    ReceiverProfile {
        name: "github",
        text: include_str!("../../profiles/github.toml"),
    },
    ReceiverProfile {
        name: "hubspot",
        text: include_str!("../../profiles/hubspot.toml"),
    },
    ReceiverProfile {
        name: "openai",
        text: include_str!("../../profiles/openai.toml"),
    },
    ReceiverProfile {
        name: "shopify",
        text: include_str!("../../profiles/shopify.toml"),
    },
    ReceiverProfile {
        name: "slack",
        text: include_str!("../../profiles/slack.toml"),
    },
    ReceiverProfile {
        name: "stripe",
        text: include_str!("../../profiles/stripe.toml"),
    },
    ReceiverProfile {
        name: "twilio",
        text: include_str!("../../profiles/twilio.toml"),
    },
];

/// The receiver profile named `name`.
pub fn receiver(name: &str) -> Option<&'static ReceiverProfile> {
    RECEIVERS.iter().find(|p| p.name == name)
}

/// What a profile's `[profile]` table says of it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReceiverMeta {
    /// The receiver, for people.
    pub receiver: String,
    /// The public page the figures come from.
    pub source: String,
    /// When that page was read (YYYY-MM-DD).
    pub read: String,
    /// The receiver's usual hosts (a suggestion for `hosts`; never applied).
    pub hosts: Vec<String>,
    /// What to know before relying on it.
    pub notes: String,
}

impl ReceiverProfile {
    /// The profile's description (`[profile]`).
    pub fn meta(&self) -> ReceiverMeta {
        let Ok(root) = DeTable::parse(self.text) else {
            return ReceiverMeta::default();
        };
        let Some(DeValue::Table(t)) = root.get_ref().get("profile").map(|v| v.get_ref()) else {
            return ReceiverMeta::default();
        };
        let text = |k: &str| match t.get(k).map(|v| v.get_ref()) {
            Some(DeValue::String(s)) => s.to_string(),
            _ => String::new(),
        };
        let hosts = match t.get("hosts").map(|v| v.get_ref()) {
            Some(DeValue::Array(a)) => a
                .iter()
                .filter_map(|v| match v.get_ref() {
                    DeValue::String(s) => Some(s.to_string()),
                    _ => None,
                })
                .collect(),
            _ => Vec::new(),
        };
        ReceiverMeta {
            receiver: text("receiver"),
            source: text("source"),
            read: text("read"),
            hosts,
            notes: text("notes"),
        }
    }

    /// The profile's `[endpoint]` keys, every span moved to `span` (where the config
    /// names the profile: a problem with one of its values is reported there).
    fn endpoint_table(&self, span: std::ops::Range<usize>) -> Table<'static> {
        let Ok(root) = DeTable::parse(self.text) else {
            return Table::default();
        };
        match root.into_inner().remove("endpoint").map(|v| v.into_inner()) {
            Some(DeValue::Table(t)) => respan_table(t, &span),
            _ => Table::default(),
        }
    }

    /// The profile as config: an `[[endpoints]]` entry with every key it sets, under
    /// comments saying where the figures come from (`sluice profiles show NAME`).
    pub fn as_config(&self) -> String {
        let meta = self.meta();
        let mut out = String::new();
        let body = self
            .text
            .split_once("\n[profile]")
            .map_or(self.text, |(head, _)| head);
        out.push_str(body.trim_end());
        out.push_str("\n\n[[endpoints]]\n");
        out.push_str(&format!("id = \"{}\"\n", self.name));
        if !meta.hosts.is_empty() {
            let hosts: Vec<String> = meta.hosts.iter().map(|h| format!("\"{h}\"")).collect();
            out.push_str(&format!("hosts = [{}]\n", hosts.join(", ")));
        }
        let endpoint = self
            .text
            .split_once("\n[endpoint]\n")
            .map_or("", |(_, rest)| rest);
        out.push_str(endpoint.trim_end());
        out.push('\n');
        if !meta.notes.is_empty() {
            out.push_str(&format!("# {}\n", meta.notes));
        }
        out
    }
}

fn respan_table(t: Table<'static>, span: &std::ops::Range<usize>) -> Table<'static> {
    t.into_iter()
        .map(|(k, v)| {
            (
                Spanned::new(span.clone(), k.into_inner()),
                respan(v.into_inner(), span),
            )
        })
        .collect()
}

fn respan(v: DeValue<'static>, span: &std::ops::Range<usize>) -> Spanned<DeValue<'static>> {
    let v = match v {
        DeValue::Table(t) => DeValue::Table(respan_table(t, span)),
        DeValue::Array(a) => DeValue::Array(
            a.into_iter()
                .map(|v| respan(v.into_inner(), span))
                .collect(),
        ),
        other => other,
    };
    Spanned::new(span.clone(), v)
}

/// Which quota headers an endpoint's receiver publishes (`quota_headers`): the ones
/// sluice reads for the remaining quota and its reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QuotaHeaders {
    /// Every dialect sluice knows (the IETF fields, the earlier draft's, `X-RateLimit-*`).
    #[default]
    Auto,
    /// The IETF `RateLimit` and `RateLimit-Policy` structured fields only.
    Ietf,
    /// The earlier draft's `RateLimit-Limit`, `-Remaining`, `-Reset` only.
    Draft,
    /// `X-RateLimit-Limit`, `-Remaining`, `-Reset` only.
    XRateLimit,
    /// None: the receiver's quota headers (if any) are not read.
    None,
}

/// What an endpoint knows of its receiver's answers besides its limits: the receiver
/// profile it names, where a throttling answer's body says when to come back, and which
/// quota headers to read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReceiverHints {
    /// The receiver profile the endpoint names (`profile`).
    pub profile: Option<&'static str>,
    /// `retry_after_json`: a JSON pointer (RFC 6901) into a 429 or 503 body to the wait,
    /// read when the answer has no `Retry-After`.
    pub retry_after_json: Option<Arc<str>>,
    /// `quota_headers`.
    pub quota_headers: QuotaHeaders,
}

/// `quota_headers` values.
const QUOTA_HEADERS: &[(&str, QuotaHeaders)] = &[
    ("auto", QuotaHeaders::Auto),
    ("ietf", QuotaHeaders::Ietf),
    ("draft", QuotaHeaders::Draft),
    ("x-ratelimit", QuotaHeaders::XRateLimit),
    ("none", QuotaHeaders::None),
];

impl Reader<'_> {
    /// An endpoint's table with its receiver profile's keys under its own (`profile`),
    /// or `None` when it names none. An unknown name is an issue at its line.
    pub(super) fn with_receiver_profile<'i>(
        &mut self,
        t: &Table<'i>,
        path: &str,
    ) -> Option<(Table<'i>, &'static str)> {
        let v = t.get("profile")?;
        let key = join(path, "profile");
        let DeValue::String(name) = v.get_ref() else {
            self.type_issue(v, &key, "a string", v.get_ref().type_str());
            return None;
        };
        let Some(p) = receiver(name) else {
            let names: Vec<&str> = RECEIVERS.iter().map(|p| p.name).collect();
            let hint = closest(name, &names)
                .map(|c| format!(" (did you mean `{c}`?)"))
                .unwrap_or_default();
            self.issue(
                v.span().start,
                &key,
                format!(
                    "unknown receiver profile \"{name}\"{hint}; known: {} (`sluice profiles` \
                     lists them; a sending platform is `sender_profile`)",
                    names.join(", ")
                ),
            );
            return None;
        };
        let mut merged: Table<'i> = p.endpoint_table(v.span());
        for (k, v) in t.iter() {
            merged.insert(k.clone(), v.clone());
        }
        Some((merged, p.name))
    }

    /// `retry_after_json` and `quota_headers` of `t`, inheriting from `base`.
    pub(super) fn receiver_hints(
        &mut self,
        t: &Table<'_>,
        path: &str,
        base: &ReceiverHints,
    ) -> ReceiverHints {
        let retry_after_json = match self.string(t, path, "retry_after_json") {
            Some((p, at)) => {
                if p.is_empty() || p.starts_with('/') {
                    Some(Arc::from(p))
                } else {
                    self.issue(
                        at,
                        &join(path, "retry_after_json"),
                        format!(
                            "\"{p}\" is not a JSON pointer: it starts with / (e.g. \
                             \"/error/details/0/retryDelay\")"
                        ),
                    );
                    None
                }
            }
            None => base.retry_after_json.clone(),
        };
        let quota_headers =
            self.enumerated(t, path, "quota_headers", base.quota_headers, QUOTA_HEADERS);
        ReceiverHints {
            profile: base.profile,
            retry_after_json,
            quota_headers,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shipped profile names itself, cites its page and date, sets no key that
    /// belongs to the endpoint rather than the receiver, and loads.
    #[test]
    fn every_profile_is_cited_and_loads() {
        for p in RECEIVERS {
            let meta = p.meta();
            assert!(!meta.receiver.is_empty(), "{}", p.name);
            assert!(meta.source.starts_with("https://"), "{}", p.name);
            assert_eq!(meta.read.len(), 10, "{}: read = YYYY-MM-DD", p.name);
            let t = p.endpoint_table(0..0);
            for k in ["id", "hosts", "path_prefix", "profile", "mode"] {
                assert!(!t.contains_key(k), "{}: sets {k}", p.name);
            }
            let text = format!("[[endpoints]]\nid = \"x\"\nprofile = \"{}\"\n", p.name);
            let c = Config::parse(&text).unwrap_or_else(|e| panic!("{}: {e:?}", p.name));
            assert_eq!(c.endpoints[0].policy.receiver.profile, Some(p.name));
        }
    }
}
