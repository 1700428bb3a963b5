//! (temporary stub until the real module lands)
#![allow(missing_docs)]
use std::time::{Duration, SystemTime};
use http::{HeaderMap, StatusCode};
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CooldownPolicy { pub default_cooldown: Duration, pub max_cooldown: Duration }
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Feedback { pub pause: Duration, pub throttled: bool }
pub fn feedback(_s: StatusCode, _h: &HeaderMap, _n: SystemTime, _p: &CooldownPolicy) -> Option<Feedback> { None }
