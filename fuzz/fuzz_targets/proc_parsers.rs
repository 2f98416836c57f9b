//! `fuzz_targets::proc_parsers` (crates/fuzz-targets) driven by libFuzzer: `scripts/fuzz proc_parsers`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_targets::proc_parsers::run(data));
