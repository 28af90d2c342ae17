"""What every worker process shares (prefill_svc and decode_svc build on it).

Reading path: `build` (ServeConfig -> model, engine, KV layout, transport), `server` (the grpc.aio
server: limits, health, reflection, TLS, the x-dsv4-token check), `identity` (Info and the
Redis heartbeat), `tasks` (owned background tasks), `main` (a worker's life: start, serve,
drain on SIGTERM, stop).
"""
