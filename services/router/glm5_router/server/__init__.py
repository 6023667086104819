"""The router process: gRPC service, HTTP API, wiring and shutdown."""
