# syntax=docker/dockerfile:1
# Multi-stage build: a static kvroute binary in a distroless, non-root image.
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# Stamped into kvroute --version, its first log line and kvroute_build_info:
#   docker build --build-arg VERSION=$(git describe --tags --always) --build-arg REVISION=$(git rev-parse HEAD) .
ARG VERSION=dev
ARG REVISION=unknown
RUN CGO_ENABLED=0 GOOS=linux go build -trimpath -ldflags="-s -w -X main.version=${VERSION} -X main.revision=${REVISION}" -o /out/kvroute . && \
    CGO_ENABLED=0 GOOS=linux go build -trimpath -ldflags="-s -w" -o /out/kvsim ./bench/cmd/kvsim

FROM gcr.io/distroless/static-debian12:nonroot
ARG VERSION=dev
ARG REVISION=unknown
LABEL org.opencontainers.image.title="kvroute" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"
COPY --from=build /out/kvroute /usr/local/bin/kvroute
COPY --from=build /out/kvsim /usr/local/bin/kvsim
USER 65532:65532
EXPOSE 8000 9090
ENTRYPOINT ["/usr/local/bin/kvroute"]
