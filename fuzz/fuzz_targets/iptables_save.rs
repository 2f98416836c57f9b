//! `fuzz_targets::iptables_save` (crates/fuzz-targets) driven by libFuzzer: `scripts/fuzz iptables_save`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz_targets::iptables_save::run(data));
