//! The wire's size limits, one place both engines (the lane and hyper) and the error
//! messages read, so a limit is the same on every path.

/// Largest request head accepted; larger heads get 431.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;

/// Most headers a request or response head may have (hyper's own limit); a request with
/// more is answered 431.
pub const MAX_HEADERS: usize = 100;

/// Longest response head read from an upstream: hyper's client limit (its default read
/// buffer), so a receiver's large head (many cookies) is relayed on both engines alike.
pub const MAX_RESPONSE_HEAD_BYTES: usize = 8192 + 4096 * 100;
