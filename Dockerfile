# syntax=docker/dockerfile:1
# Build: docker build -t sluice .
# Run:   docker run -v $PWD/sluice.toml:/etc/sluice/sluice.toml -e SLUICE_CONFIG=/etc/sluice/sluice.toml \
#          -p 8080:8080 -p 9090:9090 sluice
# There is no default config: without SLUICE_CONFIG (or --config) the image refuses to
# start. To try it: docker run -p 127.0.0.1:8080:8080 -p 127.0.0.1:9090:9090 sluice run --config /etc/sluice/example.toml
# (the example is an open proxy, allow_anonymous = true: publish it on loopback only).
#
# From a binary built on the host instead of in the build stage (glibc no newer than
# bookworm's): put it at sluice-binary/sluice in the build context (.dockerignore keeps
# target/ out) and pass --build-arg SLUICE_BINARY=host; the build stage is then skipped:
#   cargo build --profile dist --locked --bin sluice && mkdir -p sluice-binary \
#     && cp target/dist/sluice sluice-binary/ && docker build --build-arg SLUICE_BINARY=host -t sluice .
# scripts/check-image builds and runs the image this way with buildah, offline.
ARG SLUICE_BINARY=build

FROM rust:1-slim-bookworm AS build
WORKDIR /src
# The `dist` profile (Cargo.toml): fat LTO, one codegen unit, stripped, no debug info.
# Dependency layer: cached until Cargo.toml / Cargo.lock change.
COPY Cargo.toml Cargo.lock ./
RUN mkdir -p src examples && echo 'fn main() {}' > src/main.rs && echo '' > src/lib.rs \
 && for e in upstream bare_forward store_bench tls_bench; do echo 'fn main() {}' > examples/$e.rs; done \
 && cargo build --profile dist --locked --bin sluice && rm -rf src examples
# build.rs stamps the commit (no .git in the build context: pass
# --build-arg SLUICE_GIT_COMMIT=$(git rev-parse --short HEAD)) and the build date.
ARG SLUICE_GIT_COMMIT=unknown
ARG SOURCE_DATE_EPOCH
COPY build.rs ./
COPY src ./src
COPY lua ./lua
COPY examples ./examples
RUN touch src/main.rs src/lib.rs && cargo build --profile dist --locked --bin sluice \
 && mkdir -p /out && cp /src/target/dist/sluice /out/sluice

# SLUICE_BINARY=host: the binary built on the host (above).
FROM scratch AS host
COPY sluice-binary/sluice /out/sluice

FROM ${SLUICE_BINARY} AS binary

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* && useradd --system --uid 10001 --user-group --no-create-home sluice
COPY --from=binary /out/sluice /usr/local/bin/sluice
# The example config listens on 127.0.0.1; inside a container it must listen on all
# interfaces or the published ports reach nothing. It has no proxy authentication and
# no allowed_hosts, so it says it means to be an open proxy (allow_anonymous = true):
# for trying, behind a port published on loopback; `run` warns of it at start.
COPY config/sluice.example.toml /etc/sluice/example.toml
RUN sed -i -e 's/^listen = "127.0.0.1:/listen = "0.0.0.0:/' \
           -e 's/^admin_listen = "127.0.0.1:/admin_listen = "0.0.0.0:/' \
           -e 's/^allow_anonymous = false /allow_anonymous = true  /' /etc/sluice/example.toml \
 && grep -q '^listen = "0.0.0.0:8080"' /etc/sluice/example.toml \
 && grep -q '^allow_anonymous = true' /etc/sluice/example.toml \
 && sluice check --config /etc/sluice/example.toml
USER 10001:10001
EXPOSE 8080 9090
ENTRYPOINT ["sluice"]
CMD ["run"]
