//! Limits reinstalls to one per 5 s (burst 1) while still reacting within a second, and warns when
//! another program keeps rewriting the CNI config (a CNI in "exclusive" mode fighting us).

use std::time::{Duration, Instant};

/// Consecutive throttled passes after which we warn.
const WARN_AFTER: u32 = 5;

/// A one-token bucket refilled every `period` (kept as the time the next token is due, which
/// may run ahead of now while reinstalls keep coming).
#[derive(Debug)]
pub struct Throttle {
    period: Duration,
    next_free: Option<Instant>,
    hits: u32,
}

/// What to do before the next pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub sleep: Duration,
    pub warn: bool,
}

impl Throttle {
    pub fn new(period: Duration) -> Self {
        Throttle {
            period,
            next_free: None,
            hits: 0,
        }
    }

    /// Takes a token at `now`. When none is available the caller sleeps at most 1 s: the debt
    /// keeps growing, so a config fight still shows up as many throttled passes in a row.
    pub fn reserve(&mut self, now: Instant) -> Decision {
        let due = self.next_free.unwrap_or(now);
        if due <= now {
            self.next_free = Some(now + self.period);
            self.hits = 0;
            return Decision {
                sleep: Duration::ZERO,
                warn: false,
            };
        }
        self.next_free = Some(due + self.period);
        self.hits += 1;
        Decision {
            sleep: (due - now).min(Duration::from_secs(1)),
            warn: self.hits > WARN_AFTER,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_pass_is_free_then_throttled_then_warns() {
        let t0 = Instant::now();
        let mut t = Throttle::new(Duration::from_secs(5));
        assert_eq!(t.reserve(t0).sleep, Duration::ZERO);
        let mut now = t0;
        let mut warned_at = None;
        for i in 1..=7 {
            now += Duration::from_millis(100);
            let d = t.reserve(now);
            assert_eq!(d.sleep, Duration::from_secs(1), "pass {i}");
            now += d.sleep;
            if d.warn && warned_at.is_none() {
                warned_at = Some(i);
            }
        }
        assert_eq!(warned_at, Some(6));
    }

    #[test]
    fn quiet_period_resets() {
        let t0 = Instant::now();
        let mut t = Throttle::new(Duration::from_secs(5));
        t.reserve(t0);
        let d = t.reserve(t0 + Duration::from_millis(4500));
        assert_eq!(d.sleep, Duration::from_millis(500));
        // The debt is one period ahead (10 s); after it passes the next pass is free again.
        let d = t.reserve(t0 + Duration::from_secs(11));
        assert_eq!(
            d,
            Decision {
                sleep: Duration::ZERO,
                warn: false
            }
        );
    }
}
