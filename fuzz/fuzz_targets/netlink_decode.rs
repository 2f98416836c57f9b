//! `fuzz_targets::netlink_decode` (crates/fuzz-targets) driven by libFuzzer: `scripts/fuzz netlink_decode`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_targets::netlink_decode::run(data));
