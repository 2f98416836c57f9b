//! `fuzz_targets::nft_dump` (crates/fuzz-targets) driven by libFuzzer: `scripts/fuzz nft_dump`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_targets::nft_dump::run(data));
