//! Replays every input kept for the fuzz targets (`fuzz/corpus/<target>/`, minimised by
//! `scripts/fuzz`, and the hand-written `fuzz/seeds/<target>/`) once through its target's body:
//! a parser change that panics on, or breaks a property for, anything fuzzing once reached fails
//! here, on stable, without libFuzzer.

use std::path::{Path, PathBuf};

use fuzz_targets::TARGETS;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries.map(|e| e.expect("corpus entry").path()).collect();
    out.sort();
    out
}

#[test]
fn every_target_has_a_body_here() {
    let mut declared: Vec<String> = files(&fuzz_dir().join("fuzz_targets"))
        .iter()
        .filter_map(|p| Some(p.file_stem()?.to_str()?.to_string()))
        .collect();
    declared.sort();
    let here: Vec<&str> = TARGETS.iter().map(|(name, _)| *name).collect();
    assert_eq!(
        declared, here,
        "fuzz/fuzz_targets/ and fuzz_targets::TARGETS differ"
    );
}

#[test]
fn every_kept_input_passes_its_target() {
    let mut total = 0;
    for (name, run) in TARGETS {
        let inputs: Vec<PathBuf> = ["corpus", "seeds"]
            .iter()
            .flat_map(|kind| files(&fuzz_dir().join(kind).join(name)))
            .collect();
        assert!(!inputs.is_empty(), "no corpus or seeds kept for {name}");
        for input in &inputs {
            let data = std::fs::read(input).expect("read a kept input");
            if std::panic::catch_unwind(|| run(&data)).is_err() {
                panic!("{name} fails on {}", input.display());
            }
        }
        total += inputs.len();
    }
    println!("{total} kept inputs replayed");
}
