//! Compiles `proto/zds.proto` with protox (pure Rust), so no `protoc` is needed to build.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let proto = proto_dir.join("zds.proto");
    println!("cargo:rerun-if-changed={}", proto.display());
    let fds = protox::compile([&proto], [&proto_dir])?;
    prost_build::Config::new().compile_fds(fds)?;
    Ok(())
}
