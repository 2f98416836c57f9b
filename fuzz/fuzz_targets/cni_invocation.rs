//! `fuzz_targets::cni_invocation` (crates/fuzz-targets) driven by libFuzzer: `scripts/fuzz cni_invocation`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_targets::cni_invocation::run(data));
