//! Receiver profiles (`profile = "github"` on an endpoint): every shipped profile loads,
//! an endpoint's own keys override its profile's, `sluice profiles` lists them and
//! `profiles show` prints one as config that `check` accepts and that sets the same
//! policy, and `check` names an unknown profile at its line and key.

mod common;

use std::process::Command;
use std::time::Duration;

use common::process::RunWithin;
use sluice::config::{Config, Policy, QuotaHeaders, RECEIVERS};

const CHILD_DEADLINE: Duration = Duration::from_secs(30);

fn sluice() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
}

fn endpoint_policy(text: &str) -> Policy {
    let c = Config::parse(text).unwrap_or_else(|e| panic!("{text}\n{e:?}"));
    (*c.endpoints[0].policy).clone()
}

/// The policy without the profile's name: what the printed config sets too.
fn unnamed(mut p: Policy) -> Policy {
    p.receiver.profile = None;
    p
}

#[test]
fn every_profile_loads_and_sets_what_it_says() {
    assert!(RECEIVERS.len() >= 8);
    for name in [
        "github", "stripe", "slack", "shopify", "twilio", "discord", "hubspot", "openai",
    ] {
        let p = endpoint_policy(&format!(
            "[[endpoints]]\nid = \"{name}\"\nprofile = \"{name}\"\n"
        ));
        assert_eq!(p.receiver.profile, Some(name));
        assert_ne!(unnamed(p.clone()), Policy::default(), "{name} sets nothing");
    }
    let gh = endpoint_policy("[[endpoints]]\nid = \"gh\"\nprofile = \"github\"\n");
    assert_eq!(gh.rate, 15.0);
    assert_eq!(gh.max_in_flight, Some(100));
    assert_eq!(gh.receiver.quota_headers, QuotaHeaders::XRateLimit);
    let discord = endpoint_policy("[[endpoints]]\nid = \"d\"\nprofile = \"discord\"\n");
    assert_eq!(
        discord.receiver.retry_after_json.as_deref(),
        Some("/retry_after")
    );
}

#[test]
fn an_endpoint_s_own_keys_override_its_profile() {
    let gh = endpoint_policy("[[endpoints]]\nid = \"gh\"\nprofile = \"github\"\n");
    let own = endpoint_policy(
        "[[endpoints]]\nid = \"gh\"\nprofile = \"github\"\nrate = 2.0\nmax_in_flight = 7\n\
         quota_headers = \"auto\"\nretry_after_json = \"/wait\"\n",
    );
    assert_eq!(own.rate, 2.0);
    assert_eq!(own.max_in_flight, Some(7));
    assert_eq!(own.receiver.quota_headers, QuotaHeaders::Auto);
    assert_eq!(own.receiver.retry_after_json.as_deref(), Some("/wait"));
    // What the endpoint does not set stays the profile's.
    assert_eq!(own.burst, gh.burst);
    assert_eq!(own.windows, gh.windows);
    // An endpoint without a profile keeps [defaults]' policy.
    let plain = endpoint_policy("[defaults]\nrate = 3.0\n[[endpoints]]\nid = \"p\"\n");
    assert_eq!(plain.rate, 3.0);
    assert_eq!(plain.receiver.profile, None);
}

#[test]
fn profiles_lists_them_and_show_prints_config_that_sets_the_same_policy() {
    let out = sluice().arg("profiles").run_within(CHILD_DEADLINE);
    assert!(out.status.success());
    let listed = String::from_utf8_lossy(&out.stdout);
    for p in RECEIVERS {
        assert!(
            listed.lines().any(|l| l.starts_with(p.name)),
            "{} not listed:\n{listed}",
            p.name
        );
    }
    let dir = tempfile::tempdir().unwrap();
    for p in RECEIVERS {
        let out = sluice()
            .args(["profiles", "show", p.name])
            .run_within(CHILD_DEADLINE);
        assert!(out.status.success(), "{}", p.name);
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(text.contains("https://"), "{}: no source cited", p.name);
        let printed = endpoint_policy(&text);
        let named = endpoint_policy(&format!(
            "[[endpoints]]\nid = \"x\"\nprofile = \"{}\"\n",
            p.name
        ));
        assert_eq!(printed, unnamed(named), "{}", p.name);
        let file = dir.path().join(format!("{}.toml", p.name));
        std::fs::write(&file, &text).unwrap();
        let check = sluice()
            .args(["check", "--config"])
            .arg(&file)
            .run_within(CHILD_DEADLINE);
        assert!(
            check.status.success(),
            "{}: {}",
            p.name,
            String::from_utf8_lossy(&check.stderr)
        );
    }
    let out = sluice()
        .args(["profiles", "show", "nope"])
        .run_within(CHILD_DEADLINE);
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn check_names_an_unknown_profile_at_its_line_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(
        &file,
        "[[endpoints]]\nid = \"a\"\n\n[[endpoints]]\nid = \"gh\"\nprofile = \"githb\"\n",
    )
    .unwrap();
    let out = sluice()
        .args(["check", "--config"])
        .arg(&file)
        .run_within(CHILD_DEADLINE);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("6:11: endpoints[1].profile: unknown receiver profile \"githb\""),
        "{err}"
    );
    assert!(err.contains("did you mean `github`"), "{err}");
    // A sender profile's name is not a receiver's, and the other way round.
    let issues = Config::parse("[[endpoints]]\nid = \"a\"\nprofile = \"svix\"\n").unwrap_err();
    assert_eq!(issues[0].key, "endpoints[0].profile");
    let issues =
        Config::parse("[[endpoints]]\nid = \"a\"\nsender_profile = \"github\"\n").unwrap_err();
    assert_eq!(issues[0].key, "endpoints[0].sender_profile");
}
