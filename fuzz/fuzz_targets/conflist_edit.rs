//! `fuzz_targets::conflist_edit` (crates/fuzz-targets) driven by libFuzzer: `scripts/fuzz conflist_edit`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_targets::conflist_edit::run(data));
