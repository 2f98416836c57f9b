//! `fuzz_targets::annotations` (crates/fuzz-targets) driven by libFuzzer: `scripts/fuzz annotations`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_targets::annotations::run(data));
