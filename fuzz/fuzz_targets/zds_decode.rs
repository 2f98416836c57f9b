//! `fuzz_targets::zds_decode` (crates/fuzz-targets) driven by libFuzzer: `scripts/fuzz zds_decode`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_targets::zds_decode::run(data));
