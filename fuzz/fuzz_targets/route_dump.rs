//! `fuzz_targets::route_dump` (crates/fuzz-targets) driven by libFuzzer: `scripts/fuzz route_dump`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_targets::route_dump::run(data));
