# syntax=docker/dockerfile:1
# The istio-cni-rs node image: `install-cni` (the DaemonSet's agent) and `istio-cni` (the CNI
# plugin the agent copies onto the host). Build from the repository root:
#   docker build -t <registry>/istio-cni-rs/install-cni:<tag> .
#   docker buildx build --platform linux/amd64,linux/arm64 -t <registry>/istio-cni-rs/install-cni:<tag> --push .
# (podman/buildah work the same; see docs/install.md.) The final image has the layout of the
# engine-free one `scripts/node-images` builds (crates/testbed/tests/no_root/image_layout.rs compares them).

ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=bookworm

# The build stage runs on the builder's own platform and cross-compiles for the image's
# (TARGETARCH): a multi-arch build compiles natively, never under QEMU.
FROM --platform=$BUILDPLATFORM docker.io/library/rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS build
ARG TARGETARCH
# Both binaries are static (musl): the plugin runs on the host against whatever libc it has, and
# a dynamically linked agent maps ~2.4 MiB of glibc, libm, ld.so and libgcc_s (BENCHMARKS.md).
# For either target, clang compiles the C and assembly of dependencies (ring, psm) and the
# toolchain's own rust-lld links: no cross C toolchain, and one recipe whichever architecture the
# builder has.
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends clang >/dev/null \
 && rm -rf /var/lib/apt/lists/*
# RUSTFLAGS replaces .cargo/config.toml's, which asks a C compiler driver (`-Wl,`) to pack the
# relative relocations: rust-lld takes that flag itself. aarch64's static musl binaries are not
# position-independent, so they have no relative relocations to pack.
RUN case "${TARGETARCH:-amd64}" in \
      amd64) echo x86_64-unknown-linux-musl >/musl-target \
             && echo "-C linker=rust-lld -C link-arg=-zpack-relative-relocs" >/musl-rustflags ;; \
      arm64) echo aarch64-unknown-linux-musl >/musl-target \
             && echo "-C linker=rust-lld" >/musl-rustflags ;; \
      *) echo "unsupported TARGETARCH ${TARGETARCH}" >&2; exit 1 ;; \
    esac \
 && rustup target add "$(cat /musl-target)"
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY .cargo .cargo
COPY proto proto
COPY crates crates
# Workspace members live under tools/ too (cargo reads every member's manifest).
COPY tools tools
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    t="$(cat /musl-target)" \
 && CC_x86_64_unknown_linux_musl=clang CC_aarch64_unknown_linux_musl=clang \
    RUSTFLAGS="$(cat /musl-rustflags)" \
    cargo build --release --locked -p cni-agent -p cni-plugin --bin install-cni --bin istio-cni \
      --target "$t" \
 && mkdir -p /out \
 && cp "target/$t/release/install-cni" "target/$t/release/istio-cni" /out/

FROM docker.io/library/debian:${DEBIAN_RELEASE}-slim
# iptables backend: iptables/ip6tables -save/-restore in both legacy and nft variants (the agent
# uses whichever the host uses); ipset for the host probe address set. nft is for operators: the
# agent programs nftables over netlink itself. The slim image keeps each package's copyright
# file in /usr/share/doc (NOTICE).
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends iptables ipset nftables >/dev/null \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*
COPY --from=build /out/install-cni /usr/local/bin/install-cni
# The installer copies every regular file of CNI_BIN_SOURCE_DIR (/opt/cni/bin) to the host.
COPY --from=build /out/istio-cni /opt/cni/bin/istio-cni
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/opt/cni/bin
WORKDIR /opt/cni/bin
ENTRYPOINT ["install-cni"]
