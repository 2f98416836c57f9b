//! `fuzz_targets::cmdadd_body` (crates/fuzz-targets) driven by libFuzzer: `scripts/fuzz cmdadd_body`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_targets::cmdadd_body::run(data));
