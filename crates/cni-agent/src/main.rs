//! `install-cni`: the istio-cni node agent.

fn main() -> std::process::ExitCode {
    cni_agent::cli::main()
}
