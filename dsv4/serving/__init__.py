"""Process plumbing every service shares: Prometheus metrics, log lines, the gRPC guard
interceptors and the owner of background tasks."""
