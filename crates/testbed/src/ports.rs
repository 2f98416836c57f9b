//! Ports for the servers a test starts (API server, etcd, the agent's health and metrics).
//!
//! A port taken from the kernel (bind to port 0, then close) lies in the ephemeral range, where
//! any outbound connection on the machine may be given it before the server binds it: the agent
//! then waits for a port that never frees. Ports below that range are never handed out by the
//! kernel, so one found free stays free unless another test picks it as well, which a random pick
//! over thousands of ports makes rare.

use std::collections::HashSet;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::net::TcpListener;
use std::sync::Mutex;

/// The lowest port handed out, clear of the well-known and registered ports most daemons use.
const FLOOR: u16 = 10_000;

/// A port that no socket holds now, outside the ephemeral range, not returned before by this
/// process.
pub fn unused() -> u16 {
    static GIVEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    let ceiling = ephemeral_start();
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    let given = given.get_or_insert_with(HashSet::new);
    if ceiling <= FLOOR + 1_000 {
        // An unusual range leaves no room below it: the kernel's pick is the only choice.
        return kernel_pick();
    }
    let random = RandomState::new();
    for attempt in 0u32.. {
        let port = FLOOR + (random.hash_one(attempt) % u64::from(ceiling - FLOOR)) as u16;
        if !given.contains(&port) && TcpListener::bind(("0.0.0.0", port)).is_ok() {
            given.insert(port);
            return port;
        }
    }
    unreachable!("the loop only ends by returning")
}

/// The first port of the kernel's ephemeral range (`ip_local_port_range`).
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

fn kernel_pick() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding a loopback port")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_below_the_ephemeral_range_distinct_and_bindable() {
        let ports: Vec<u16> = (0..50).map(|_| unused()).collect();
        let distinct: HashSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len(), "{ports:?}");
        let ceiling = ephemeral_start();
        for port in ports {
            assert!(
                (FLOOR..ceiling).contains(&port),
                "{port} outside {FLOOR}..{ceiling}"
            );
            TcpListener::bind(("0.0.0.0", port)).expect("still free");
        }
    }
}
