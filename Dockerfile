# syntax=docker/dockerfile:1
# Multi-stage build: a static kvroute binary in a distroless, non-root image.
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 GOOS=linux go build -trimpath -ldflags="-s -w" -o /out/kvroute . && \
    CGO_ENABLED=0 GOOS=linux go build -trimpath -ldflags="-s -w" -o /out/kvsim ./bench/cmd/kvsim

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/kvroute /usr/local/bin/kvroute
COPY --from=build /out/kvsim /usr/local/bin/kvsim
USER 65532:65532
EXPOSE 8000 9090
ENTRYPOINT ["/usr/local/bin/kvroute"]
