//! Who is sending: proxy users read from an htpasswd file (bcrypt, as Squid, nginx and
//! Traefik read it), a bounded cache of verified credentials so a kept-alive sender pays
//! the bcrypt cost once, and each user's endpoint grants (`[security.user_endpoints]`).
//!
//! A verified value stays cached while it keeps being used (it expires after
//! `CACHE_TTL` without use): the answer cannot change while these users are loaded,
//! since a reload builds new `Users`. Concurrent requests carrying the same value that is
//! not cached yet share one bcrypt run rather than queueing one each.
//!
//! The proxy user name may carry an endpoint after a `+` (`alice+ep_42`): the part
//! before the first `+` is the user whose password is checked; the rest names the
//! endpoint when `proxy.endpoint_from_proxy_user = true`.
//!
//! Credentials are never logged. The cache is keyed by the decoded credential, a SHA-256
//! of the user (before any `+`) and the password, so no password is kept in memory after
//! verification, and every spelling of one credential (the scheme in any case, any
//! whitespace, any endpoint after `+`) is one entry: a sender cannot fill the cache by
//! respelling its header. A full cache of verified credentials evicts the one used least
//! recently. bcrypt's own comparison is constant-time, and a cache hit compares digests
//! of the secret, which tell an attacker nothing about it. A user name that is not listed costs the same bcrypt as
//! one that is (against a decoy hash of a listed user's cost, picked by the name), so the
//! time of a refusal does not tell which names exist. Refused and in-progress values are kept
//! apart from verified ones: a flood of wrong values can fill and flush only its own
//! part, never evict the verified credentials of the senders at work. One sender address
//! has one new value under bcrypt at a time; its others wait their turn, so a flood of
//! wrong passwords from one address holds one of the verifier's places, and the other
//! senders' first checks run beside it instead of queueing behind the whole flood.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use base64::Engine;
use globset::GlobSet;
use http::HeaderMap;
use tokio::sync::{OnceCell, Semaphore};
use tokio::time::Instant;

use crate::config::UserGrant;

/// How long a verified credential stays cached after its last use.
const CACHE_TTL: Duration = Duration::from_secs(60);
/// How long a refused value is remembered (a sender retrying a wrong password costs
/// one bcrypt per this period, not one per request).
const NEGATIVE_TTL: Duration = Duration::from_secs(5);
/// Cached credential digests, at most (verified ones; and apart from them, the others).
const CACHE_CAPACITY: usize = 10_000;

/// An authenticated sender.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The user name (before any `+`).
    pub user: Arc<str>,
    /// The endpoint named after `+`, if any.
    pub endpoint: Option<Arc<str>>,
    /// The user's hash the password was verified against: a tunnel's requests are
    /// refused once the users file no longer has it (the user removed, or the password
    /// changed), see [`Users::still_valid`].
    verified_against: Arc<str>,
}

/// Why a request is not authenticated (both answer 407).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No `Proxy-Authorization: Basic` header.
    #[error("proxy authentication required")]
    Missing,
    /// Unknown user, wrong password, or a malformed header.
    #[error("proxy credentials refused")]
    Refused,
}

/// Why a users file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum UsersFileError {
    /// The file could not be read.
    #[error("cannot read security.auth_users_file {path}: {source}")]
    Read {
        /// The path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Lines that are not `user:bcrypt-hash`.
    #[error("security.auth_users_file {path}:\n{}", lines.join("\n"))]
    Invalid {
        /// The path.
        path: PathBuf,
        /// One message per bad line, each starting with its line number.
        lines: Vec<String>,
    },
}

/// The proxy users, their grants and the verified-credentials cache.
pub struct Users {
    hashes: HashMap<String, String>,
    grants: HashMap<String, GlobSet>,
    cache: Mutex<Cache>,
    /// Each listed user's bcrypt cost, sorted: a name that is not listed is checked
    /// against a decoy of one of these, picked by the name ([`Users::decoy_cost`]).
    costs: Vec<u32>,
    /// A hash of no password at each cost in `costs` (each made on first need).
    decoys: HashMap<u32, OnceCell<Option<String>>>,
    /// bcrypt is CPU-bound: at most this many run at once, off the async workers.
    verifying: Arc<Semaphore>,
    /// bcrypt runs so far (each verifies one header value).
    bcrypt_runs: AtomicU64,
    /// Each sender address's turn at the verifier (one value at a time), while some
    /// value of it is checked or waits.
    turns: Mutex<HashMap<IpAddr, Arc<Semaphore>>>,
}

/// A sender address's turn at the verifier, or its place in the queue for one (until
/// dropped: the address is forgotten with its last).
struct Turn<'a> {
    users: &'a Users,
    peer: IpAddr,
    gate: Arc<Semaphore>,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut turns = self.users.turns.lock().unwrap_or_else(|e| e.into_inner());
        // The map's handle and this one: no other value of the address waits.
        if Arc::strong_count(&self.gate) == 2 {
            turns.remove(&self.peer);
        }
    }
}

/// Credentials by [`credential_key`]: the verified ones, and apart from them the refused
/// ones and those being verified (each part bounded on its own).
#[derive(Default)]
struct Cache {
    verified: HashMap<[u8; 32], Cached>,
    others: HashMap<[u8; 32], Slot>,
}

/// A value not verified (yet): refused until a time, or the verification in progress
/// that every request carrying it waits for.
enum Slot {
    Refused(Instant),
    Verifying(Arc<OnceCell<Option<Identity>>>),
}

/// A verified credential: who it is (without an endpoint: that is each request's own),
/// until when (renewed by use, so the earliest is the least recently used).
struct Cached {
    identity: Identity,
    until: Instant,
}

/// What the cache says about a header value.
enum Lookup {
    /// Verified (`Some`) or refused (`None`) recently.
    Hit(Option<Identity>),
    /// Being verified (possibly by this request, the first to ask): wait for it.
    Verifying(Arc<OnceCell<Option<Identity>>>),
}

impl std::fmt::Debug for Users {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Users")
            .field("users", &self.hashes.len())
            .finish_non_exhaustive()
    }
}

impl Users {
    /// Reads and validates an htpasswd file.
    pub fn load(path: &Path, grants: &[UserGrant]) -> Result<Users, UsersFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| UsersFileError::Read {
            path: path.to_owned(),
            source,
        })?;
        Users::parse(&text, grants).map_err(|lines| UsersFileError::Invalid {
            path: path.to_owned(),
            lines,
        })
    }

    /// Parses htpasswd text: `user:hash` lines, `#` comments and blank lines ignored.
    /// Every bad line is reported with its number.
    pub fn parse(text: &str, grants: &[UserGrant]) -> Result<Users, Vec<String>> {
        let mut hashes = HashMap::new();
        let mut bad = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let n = i + 1;
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((user, hash)) = line.split_once(':') else {
                bad.push(format!("line {n}: expected user:hash"));
                continue;
            };
            if user.is_empty() || user.contains('+') || !user.bytes().all(|b| b.is_ascii_graphic())
            {
                bad.push(format!(
                    "line {n}: user name must be visible ASCII without '+' (it separates the endpoint)"
                ));
                continue;
            }
            if !(hash.starts_with("$2y$") || hash.starts_with("$2b$") || hash.starts_with("$2a$"))
                || bcrypt::HashParts::from_str(hash).is_err()
            {
                bad.push(format!(
                    "line {n}: user {user}: only bcrypt hashes ($2y$/$2b$) are supported; create them with `htpasswd -B`"
                ));
                continue;
            }
            if hashes.insert(user.to_owned(), hash.to_owned()).is_some() {
                bad.push(format!("line {n}: user {user} is listed twice"));
            }
        }
        if !bad.is_empty() {
            return Err(bad);
        }
        let grants = grants
            .iter()
            .map(|g| (g.user.clone(), g.endpoints.clone()))
            .collect();
        let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
        let mut costs: Vec<u32> = hashes
            .values()
            .filter_map(|h| bcrypt::HashParts::from_str(h).ok())
            .map(|p| p.get_cost())
            .collect();
        costs.sort_unstable();
        let decoys = costs.iter().map(|&c| (c, OnceCell::new())).collect();
        Ok(Users {
            hashes,
            costs,
            decoys,
            grants,
            cache: Mutex::new(Cache::default()),
            verifying: Arc::new(Semaphore::new(workers)),
            bcrypt_runs: AtomicU64::new(0),
            turns: Mutex::new(HashMap::new()),
        })
    }

    /// How many users the file lists.
    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    /// True when the file lists no user (every request is refused).
    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }

    /// Whether `user` is (still) listed.
    pub fn contains(&self, user: &str) -> bool {
        self.hashes.contains_key(user)
    }

    /// Whether `id` would still be verified: its user is listed with the hash its
    /// password was checked against (a reload that removed the user or changed the
    /// password ends it, also for a tunnel opened before).
    pub fn still_valid(&self, id: &Identity) -> bool {
        self.hashes
            .get(&*id.user)
            .is_some_and(|h| *h == *id.verified_against)
    }

    /// Users `[security.user_endpoints]` grants endpoints to that the file does not list
    /// (sorted): a misspelt name there leaves the real user free to spend any endpoint.
    pub fn unlisted_grants(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .grants
            .keys()
            .filter(|u| !self.hashes.contains_key(*u))
            .map(String::as_str)
            .collect();
        names.sort_unstable();
        names
    }

    /// Whether `user` may spend `endpoint`'s budget: users without grants may spend any.
    pub fn may_spend(&self, user: &str, endpoint: &str) -> bool {
        self.grants
            .get(user)
            .is_none_or(|globs| globs.is_match(endpoint))
    }

    /// Checks `Proxy-Authorization` from a sender at `peer`. A value verified and used
    /// within the last minute is answered from the cache; otherwise bcrypt runs on a
    /// blocking thread, once for all the requests that carry the value meanwhile, after
    /// the other new values of `peer` (one at a time per address).
    pub async fn authenticate(
        &self,
        headers: &HeaderMap,
        peer: IpAddr,
    ) -> Result<Identity, AuthError> {
        let value = headers
            .get(http::header::PROXY_AUTHORIZATION)
            .ok_or(AuthError::Missing)?;
        let (name, password) = decode_basic(value.as_bytes()).ok_or(AuthError::Refused)?;
        let (user, endpoint) = match name.split_once('+') {
            Some((u, e)) => (u, Some(Arc::from(e)).filter(|e: &Arc<str>| !e.is_empty())),
            None => (name.as_str(), None),
        };
        let key = credential_key(user, &password);
        let cell = match self.lookup(&key, Instant::now()) {
            Lookup::Hit(identity) => return with_endpoint(identity, endpoint),
            Lookup::Verifying(cell) => cell,
        };
        // The first request to get here verifies; the others wait for its verdict (and
        // one of them takes over if that request hangs up meanwhile).
        let identity = cell
            .get_or_init(|| self.verify(user, password, peer))
            .await
            .clone();
        self.remember(key, &cell, identity.clone(), Instant::now());
        with_endpoint(identity, endpoint)
    }

    /// bcrypt runs so far: one per header value verified (not per request).
    pub fn bcrypt_runs(&self) -> u64 {
        self.bcrypt_runs.load(Ordering::Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The cached verdict on `digest` (a verified one now stays another `CACHE_TTL`),
    /// else the verification to wait for, started here when none is under way.
    fn lookup(&self, digest: &[u8; 32], now: Instant) -> Lookup {
        let mut cache = self.lock();
        if let Some(c) = cache.verified.get_mut(digest) {
            if c.until > now {
                c.until = now + CACHE_TTL;
                return Lookup::Hit(Some(c.identity.clone()));
            }
        }
        match cache.others.get(digest) {
            Some(Slot::Refused(until)) if *until > now => return Lookup::Hit(None),
            Some(Slot::Verifying(cell)) => return Lookup::Verifying(Arc::clone(cell)),
            _ => {}
        }
        let others = &mut cache.others;
        if others.len() >= CACHE_CAPACITY {
            others.retain(|_, s| !matches!(s, Slot::Refused(until) if *until <= now));
            if others.len() >= CACHE_CAPACITY {
                // Still full of live entries: start over rather than grow (verified
                // values are kept apart, and stay).
                others.clear();
            }
        }
        let cell = Arc::new(OnceCell::new());
        others.insert(*digest, Slot::Verifying(Arc::clone(&cell)));
        Lookup::Verifying(cell)
    }

    /// Records the verdict `cell` reached on `digest`, unless another verification has
    /// replaced it meanwhile.
    fn remember(
        &self,
        digest: [u8; 32],
        cell: &Arc<OnceCell<Option<Identity>>>,
        identity: Option<Identity>,
        now: Instant,
    ) {
        let mut cache = self.lock();
        if !matches!(cache.others.get(&digest), Some(Slot::Verifying(c)) if Arc::ptr_eq(c, cell)) {
            return;
        }
        let Some(identity) = identity else {
            cache
                .others
                .insert(digest, Slot::Refused(now + NEGATIVE_TTL));
            return;
        };
        cache.others.remove(&digest);
        let verified = &mut cache.verified;
        if verified.len() >= CACHE_CAPACITY && !verified.contains_key(&digest) {
            verified.retain(|_, c| c.until > now);
            // Still full of live entries: the one used least recently makes room (one
            // scan per bcrypt run, which costs far more), so the senders at work stay.
            let oldest = verified
                .iter()
                .min_by_key(|(_, c)| c.until)
                .map(|(k, _)| *k);
            if let (true, Some(oldest)) = (verified.len() >= CACHE_CAPACITY, oldest) {
                verified.remove(&oldest);
            }
        }
        let until = now + CACHE_TTL;
        verified.insert(digest, Cached { identity, until });
    }

    /// The bcrypt cost a name that is not listed is checked at: a listed user's, picked by
    /// a digest of the name. So a name always costs the same, and names not listed cost
    /// what listed names cost, in the same proportions: with costs mixed in the file
    /// (`htpasswd -B` makes cost 5, `sluice passwd` cost 10), the time of a refusal still
    /// does not tell whether a name is listed. `None` without users.
    fn decoy_cost(&self, name: &str) -> Option<u32> {
        if self.costs.is_empty() {
            return None;
        }
        let d = digest(name.as_bytes());
        let pick = u64::from_le_bytes(d[..8].try_into().unwrap_or_default());
        let i = usize::try_from(pick % self.costs.len() as u64).unwrap_or(0);
        self.costs.get(i).copied()
    }

    /// The hash a name that is not listed is checked against: of no password, at
    /// [`Users::decoy_cost`], made once per cost (on a blocking thread).
    async fn decoy(&self, name: &str) -> Option<String> {
        let cost = self.decoy_cost(name)?;
        let made = self.decoys.get(&cost)?.get_or_init(|| async move {
            let hashing = move || bcrypt::hash("sluice: no such user", cost).ok();
            tokio::task::spawn_blocking(hashing).await.ok().flatten()
        });
        made.await.clone()
    }

    /// `peer`'s place in the queue for its turn at the verifier.
    fn turn(&self, peer: IpAddr) -> Turn<'_> {
        let mut turns = self.turns.lock().unwrap_or_else(|e| e.into_inner());
        let gate = turns
            .entry(peer)
            .or_insert_with(|| Arc::new(Semaphore::new(1)));
        Turn {
            users: self,
            peer,
            gate: Arc::clone(gate),
        }
    }

    /// Checks `user`'s password after `peer`'s other new credentials; the identity it
    /// gives names no endpoint (each request adds its own).
    async fn verify(&self, user: &str, password: String, peer: IpAddr) -> Option<Identity> {
        let turn = self.turn(peer);
        let _mine = turn.gate.acquire().await.ok()?;
        // A name not listed costs the same bcrypt as one that is.
        let listed = self.hashes.get(user).cloned();
        let hash = match &listed {
            Some(h) => h.clone(),
            None => self.decoy(user).await?,
        };
        let _permit = self.verifying.acquire().await.ok()?;
        self.bcrypt_runs.fetch_add(1, Ordering::Relaxed);
        let ok =
            tokio::task::spawn_blocking(move || bcrypt::verify(password, &hash).unwrap_or(false))
                .await
                .unwrap_or(false);
        let verified_against = Arc::from(listed?);
        ok.then(|| Identity {
            user: user.into(),
            endpoint: None,
            verified_against,
        })
    }
}

/// A cached verdict on a credential, for a request naming `endpoint`.
fn with_endpoint(
    identity: Option<Identity>,
    endpoint: Option<Arc<str>>,
) -> Result<Identity, AuthError> {
    let identity = identity.ok_or(AuthError::Refused)?;
    Ok(Identity {
        endpoint,
        ..identity
    })
}

/// The cache key of a decoded credential: a digest of the user (before any `+`) and the
/// password. A user name has no `:` (Basic splits at the first), so the pair is
/// unambiguous.
fn credential_key(user: &str, password: &str) -> [u8; 32] {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(user.as_bytes());
    ctx.update(b":");
    ctx.update(password.as_bytes());
    let mut out = [0u8; 32];
    out.copy_from_slice(ctx.finish().as_ref());
    out
}

/// `Basic base64(name:password)` → (name, password): the scheme in any case, then any
/// run of spaces or tabs (RFC 9110 §11.1 allows one or more) before the base64.
fn decode_basic(header: &[u8]) -> Option<(String, String)> {
    let text = std::str::from_utf8(header).ok()?.trim();
    let (scheme, creds) = text.split_once([' ', '\t'])?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let raw = base64::engine::general_purpose::STANDARD
        .decode(creds.trim())
        .ok()?;
    let text = String::from_utf8(raw).ok()?;
    let (name, password) = text.split_once(':')?;
    Some((name.to_owned(), password.to_owned()))
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// Compares two secrets in time that does not depend on where they differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    // Digests first: equal-length inputs, so the length of the secret does not leak either.
    let (a, b) = (digest(a), digest(b));
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(http::header::PROXY_AUTHORIZATION, v.parse().unwrap());
        h
    }

    fn basic(user_pass: &str) -> String {
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(user_pass)
        )
    }

    /// The address the tests' requests come from.
    const PEER: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    fn users() -> Users {
        let hash = bcrypt::hash("s3cret", 4).unwrap();
        Users::parse(&format!("# comment\n\nalice:{hash}\n"), &[]).unwrap()
    }

    #[tokio::test]
    async fn right_wrong_and_missing_credentials() {
        let u = users();
        let id = u
            .authenticate(&header(&basic("alice:s3cret")), PEER)
            .await
            .unwrap();
        assert_eq!(&*id.user, "alice");
        assert_eq!(id.endpoint, None);
        assert_eq!(
            u.authenticate(&header(&basic("alice:nope")), PEER).await,
            Err(AuthError::Refused)
        );
        assert_eq!(
            u.authenticate(&header(&basic("bob:s3cret")), PEER).await,
            Err(AuthError::Refused)
        );
        assert_eq!(
            u.authenticate(&HeaderMap::new(), PEER).await,
            Err(AuthError::Missing)
        );
        assert_eq!(
            u.authenticate(&header("Bearer x"), PEER).await,
            Err(AuthError::Refused)
        );
    }

    #[tokio::test]
    async fn endpoint_after_plus() {
        let u = users();
        let id = u
            .authenticate(&header(&basic("alice+ep_42:s3cret")), PEER)
            .await
            .unwrap();
        assert_eq!(
            (&*id.user, id.endpoint.as_deref()),
            ("alice", Some("ep_42"))
        );
    }

    #[tokio::test]
    async fn verified_credentials_are_cached() {
        let u = users();
        let h = header(&basic("alice:s3cret"));
        u.authenticate(&h, PEER).await.unwrap();
        assert_eq!(u.cache.lock().unwrap().verified.len(), 1);
        // A hit does not need the verifier: hold every permit and ask again.
        let _all = u
            .verifying
            .acquire_many(u.verifying.available_permits() as u32)
            .await
            .unwrap();
        let again = tokio::time::timeout(Duration::from_secs(1), u.authenticate(&h, PEER)).await;
        assert!(matches!(again, Ok(Ok(_))), "{again:?}");
    }

    /// Many connections of one sender whose value is not cached yet (start-up, or
    /// after a minute without use) share one bcrypt run: the others used to queue a
    /// bcrypt each behind the verifier's few permits, stalling for up to a second.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_first_requests_share_one_bcrypt_run() {
        let u = users();
        let h = header(&basic("alice:s3cret"));
        let all = futures_util::future::join_all((0..32).map(|_| u.authenticate(&h, PEER))).await;
        assert!(all.iter().all(Result::is_ok), "{all:?}");
        assert_eq!(u.bcrypt_runs(), 1);
        let wrong = header(&basic("alice:nope"));
        let all =
            futures_util::future::join_all((0..32).map(|_| u.authenticate(&wrong, PEER))).await;
        assert!(all.iter().all(|r| *r == Err(AuthError::Refused)), "{all:?}");
        assert_eq!(u.bcrypt_runs(), 2);
    }

    /// A kept-alive sender pays bcrypt once, however long it keeps sending: each use
    /// keeps its value cached another minute. A minute without use forgets it; a
    /// refused value is forgotten 5 s after it was refused, used or not.
    #[tokio::test(start_paused = true)]
    async fn a_value_in_use_stays_cached() {
        let u = users();
        let h = header(&basic("alice:s3cret"));
        for _ in 0..5 {
            u.authenticate(&h, PEER).await.unwrap();
            tokio::time::advance(Duration::from_secs(50)).await;
        }
        assert_eq!(u.bcrypt_runs(), 1, "used every 50 s for 250 s");
        tokio::time::advance(Duration::from_secs(11)).await;
        u.authenticate(&h, PEER).await.unwrap();
        assert_eq!(u.bcrypt_runs(), 2, "61 s without use");

        let wrong = header(&basic("alice:nope"));
        for _ in 0..4 {
            assert_eq!(u.authenticate(&wrong, PEER).await, Err(AuthError::Refused));
            tokio::time::advance(Duration::from_secs(2)).await;
        }
        assert_eq!(u.bcrypt_runs(), 4, "refused at 0 s and again at 6 s");
    }

    /// A name that is not listed costs the same bcrypt as one that is (before, it was
    /// refused at once, and the time of a refusal told which names exist).
    #[tokio::test]
    async fn a_name_not_listed_costs_a_bcrypt_like_any_other() {
        let u = users();
        for (value, runs) in [("alice:nope", 1), ("mallory:nope", 2), ("mallory:other", 3)] {
            let refused = u.authenticate(&header(&basic(value)), PEER).await;
            assert_eq!(refused, Err(AuthError::Refused), "{value}");
            assert_eq!(u.bcrypt_runs(), runs, "{value}");
        }
        // Even with the decoy's password.
        let decoy = basic("mallory:sluice: no such user");
        assert_eq!(
            u.authenticate(&header(&decoy), PEER).await,
            Err(AuthError::Refused)
        );
    }

    /// With costs mixed in the file, a name that is not listed costs what listed names
    /// cost, in the same proportions, and always the same for one name.
    #[test]
    fn names_not_listed_cost_what_listed_ones_cost() {
        let (low, high) = (bcrypt::hash("a", 4).unwrap(), bcrypt::hash("b", 5).unwrap());
        let file = format!("alice:{low}\nbob:{high}\ncarol:{high}\n");
        let u = Users::parse(&file, &[]).unwrap();
        let names: Vec<String> = (0..3000).map(|i| format!("nobody-{i}")).collect();
        let low_ones = names.iter().filter(|n| u.decoy_cost(n) == Some(4)).count();
        // One listed user in three is at cost 4: so about a third of unknown names.
        let share = low_ones as f64 / names.len() as f64;
        assert!(
            (0.28..0.39).contains(&share),
            "{share} of unknown names at cost 4"
        );
        assert!(names.iter().all(|n| u.decoy_cost(n) == u.decoy_cost(n)));
        assert!(names.iter().all(|n| matches!(u.decoy_cost(n), Some(4 | 5))));
        assert_eq!(Users::parse("", &[]).unwrap().decoy_cost("x"), None);
    }

    /// A flood of refused values (each a new one) never evicts a verified value: the sender
    /// at work is answered from the cache throughout.
    #[tokio::test]
    async fn refused_values_never_evict_verified_ones() {
        let u = users();
        let h = header(&basic("alice:s3cret"));
        u.authenticate(&h, PEER).await.unwrap();
        let now = Instant::now();
        for i in 0..(2 * CACHE_CAPACITY as u32) {
            let d = digest(&i.to_le_bytes());
            let Lookup::Verifying(cell) = u.lookup(&d, now) else {
                panic!("a new value is verified");
            };
            u.remember(d, &cell, None, now);
        }
        assert!(u.cache.lock().unwrap().others.len() <= CACHE_CAPACITY);
        let runs = u.bcrypt_runs();
        u.authenticate(&h, PEER).await.unwrap();
        assert_eq!(u.bcrypt_runs(), runs, "alice's value is still cached");
    }

    /// A flood of new wrong values from one address is checked one at a time, beside the
    /// other senders' checks: while one value of the flood is being checked (here for as
    /// long as the test holds that address's turn), another address's first login is
    /// checked and let in, and the flood's other values wait their turn; then every value
    /// of the flood is still checked (none is refused unchecked: a sender naming several
    /// endpoints after `+` sends several right values at once). The flood's runs are not
    /// counted at the moment the other sender is in: that depends on how soon its task runs
    /// again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_address_cannot_queue_others_behind_its_wrong_passwords() {
        let u = users();
        let flood: Vec<HeaderMap> = (0..50)
            .map(|i| header(&basic(&format!("alice:wrong{i}"))))
            .collect();
        let other: IpAddr = "10.0.0.2".parse().unwrap();
        let good = header(&basic("alice:s3cret"));
        // The flood's address is at the verifier (a slow check of one of its values).
        let held = u.turn(PEER);
        let checking = Arc::clone(&held.gate).acquire_owned().await.unwrap();
        let (refused, (ok, runs)) = tokio::join!(
            futures_util::future::join_all(flood.iter().map(|h| u.authenticate(h, PEER))),
            async {
                let ok =
                    tokio::time::timeout(Duration::from_secs(10), u.authenticate(&good, other))
                        .await;
                let runs = u.bcrypt_runs();
                drop(checking);
                (ok, runs)
            },
        );
        assert!(matches!(ok, Ok(Ok(_))), "{ok:?}");
        assert_eq!(runs, 1, "only the other sender's value ran meanwhile");
        assert!(refused.iter().all(|r| *r == Err(AuthError::Refused)));
        drop(held);
        assert_eq!(u.bcrypt_runs(), 51, "every value was checked");
        // Several right values from one address (`alice+ep0` … `alice+ep5`): all in.
        let eps: Vec<HeaderMap> = (0..6)
            .map(|i| header(&basic(&format!("alice+ep{i}:s3cret"))))
            .collect();
        let all = futures_util::future::join_all(eps.iter().map(|h| u.authenticate(h, PEER))).await;
        assert!(all.iter().all(Result::is_ok), "{all:?}");
        assert!(
            u.turns.lock().unwrap().is_empty(),
            "no address is remembered after"
        );
    }

    /// Spellings of one credential (the scheme in any case, any run of spaces before the
    /// base64) are one cache entry, checked by one bcrypt run, and never evict another
    /// user's entry.
    #[tokio::test]
    async fn spellings_of_one_credential_do_not_evict_another_users_entry() {
        let (a, b) = (
            bcrypt::hash("s3cret", 4).unwrap(),
            bcrypt::hash("hunter2", 4).unwrap(),
        );
        let u = Users::parse(&format!("alice:{a}\nbob:{b}\n"), &[]).unwrap();
        let bob = header(&basic("bob:hunter2"));
        u.authenticate(&bob, PEER).await.unwrap();
        let creds = base64::engine::general_purpose::STANDARD.encode("alice:s3cret");
        for n in 1..=CACHE_CAPACITY + 1 {
            let scheme = ["Basic", "basic", "BASIC"][n % 3];
            let value = format!("{scheme}{}{creds}", " ".repeat(n));
            u.authenticate(&header(&value), PEER).await.unwrap();
        }
        let runs = u.bcrypt_runs();
        u.authenticate(&bob, PEER).await.unwrap();
        assert_eq!(u.bcrypt_runs(), runs, "bob's entry is still cached");
        assert_eq!(
            runs, 2,
            "one run for bob, one for every spelling of alice's"
        );
    }

    /// A full cache of verified values makes room by evicting the one used least recently:
    /// a sender at work keeps its entry.
    #[tokio::test(start_paused = true)]
    async fn a_full_cache_evicts_the_least_recently_used_value() {
        let u = users();
        let alice = header(&basic("alice:s3cret"));
        let identity = u.authenticate(&alice, PEER).await.unwrap();
        let fill = |from: u32, to: u32| {
            for i in from..to {
                let key = digest(&i.to_le_bytes());
                let Lookup::Verifying(cell) = u.lookup(&key, Instant::now()) else {
                    panic!("a new value is verified");
                };
                u.remember(key, &cell, Some(identity.clone()), Instant::now());
            }
        };
        tokio::time::advance(Duration::from_secs(1)).await;
        fill(0, CACHE_CAPACITY as u32 - 1);
        tokio::time::advance(Duration::from_secs(1)).await;
        // alice is used again: the fillers are now the least recently used.
        u.authenticate(&alice, PEER).await.unwrap();
        fill(CACHE_CAPACITY as u32, CACHE_CAPACITY as u32 + 10);
        let runs = u.bcrypt_runs();
        u.authenticate(&alice, PEER).await.unwrap();
        assert_eq!(u.bcrypt_runs(), runs, "alice's value is still cached");
        let cache = u.lock();
        assert_eq!(cache.verified.len(), CACHE_CAPACITY);
        let newest = CACHE_CAPACITY as u32..CACHE_CAPACITY as u32 + 10;
        assert!(
            newest
                .into_iter()
                .all(|i| cache.verified.contains_key(&digest(&i.to_le_bytes())))
        );
    }

    #[test]
    fn bad_lines_are_named() {
        let e = Users::parse("ok:$2y$04$abcdefghijklmnopqrstuuBHuVSm3M1l0K3W2oZ8d7bPl0WJbE7S.\nnocolon\nbob:{SHA}abc\n", &[])
            .unwrap_err();
        assert!(e.iter().any(|l| l.starts_with("line 2:")), "{e:?}");
        assert!(
            e.iter()
                .any(|l| l.starts_with("line 3:") && l.contains("bcrypt")),
            "{e:?}"
        );
    }

    #[test]
    fn constant_time_compare() {
        assert!(constant_time_eq(b"token", b"token"));
        assert!(!constant_time_eq(b"token", b"tokem"));
        assert!(!constant_time_eq(b"token", b"token2"));
    }
}
