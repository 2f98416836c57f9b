# syntax=docker/dockerfile:1
# The istio-cni-rs node image: `install-cni` (the DaemonSet's agent) and `istio-cni` (the CNI
# plugin the agent copies onto the host). Build from the repository root:
#   docker build -t <registry>/istio-cni-rs/install-cni:<tag> .
# (podman/buildah work the same; see docs/install.md for pushing and pointing the chart at it.)

ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=bookworm

FROM docker.io/library/rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS build
ARG TARGETARCH
# The plugin runs on the host, against whatever libc the node has: it is linked statically
# (musl). So is the agent, as `scripts/node-images` builds it: a dynamically linked agent maps
# ~2.4 MiB of glibc, libm, ld.so and libgcc_s into its resident memory (BENCHMARKS.md).
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends musl-tools >/dev/null \
 && rm -rf /var/lib/apt/lists/*
RUN case "${TARGETARCH:-amd64}" in \
      amd64) echo x86_64-unknown-linux-musl ;; \
      arm64) echo aarch64-unknown-linux-musl ;; \
      *) echo "unsupported TARGETARCH ${TARGETARCH}" >&2; exit 1 ;; \
    esac >/musl-target \
 && rustup target add "$(cat /musl-target)"
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY .cargo .cargo
COPY proto proto
COPY crates crates
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p cni-agent -p cni-plugin --bin install-cni --bin istio-cni \
      --target "$(cat /musl-target)" \
 && mkdir -p /out \
 && cp "target/$(cat /musl-target)/release/install-cni" /out/ \
 && cp "target/$(cat /musl-target)/release/istio-cni" /out/

FROM docker.io/library/debian:${DEBIAN_RELEASE}-slim
# iptables backend: iptables/ip6tables -save/-restore in both legacy and nft variants (the agent
# uses whichever the host uses); ipset for the host probe address set. nft is for operators: the
# agent programs nftables over netlink itself.
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends iptables ipset nftables >/dev/null \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /usr/share/doc /usr/share/man
COPY --from=build /out/install-cni /usr/local/bin/install-cni
# The installer copies every regular file of CNI_BIN_SOURCE_DIR (/opt/cni/bin) to the host.
COPY --from=build /out/istio-cni /opt/cni/bin/istio-cni
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/opt/cni/bin
WORKDIR /opt/cni/bin
ENTRYPOINT ["install-cni"]
