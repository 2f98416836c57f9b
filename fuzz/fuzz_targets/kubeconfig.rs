//! `fuzz_targets::kubeconfig` (crates/fuzz-targets) driven by libFuzzer: `scripts/fuzz kubeconfig`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_targets::kubeconfig::run(data));
