//! Compiles `proto/zds.proto` with protox (pure Rust), so no `protoc` is needed to build.
//!
//! The manifest dir is read when the script runs, not baked in when it is compiled: worktrees and
//! clones that share one target dir reuse the compiled script, and a baked-in path would point
//! them all at the first checkout's proto (or at nothing once it is removed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest_dir =
        std::env::var_os("CARGO_MANIFEST_DIR").ok_or("CARGO_MANIFEST_DIR is not set")?;
    let proto_dir = std::path::Path::new(&manifest_dir).join("../../proto");
    let proto = proto_dir.join("zds.proto");
    println!("cargo:rerun-if-changed={}", proto.display());
    let fds = protox::compile([&proto], [&proto_dir])?;
    prost_build::Config::new().compile_fds(fds)?;
    Ok(())
}
