"""What every worker process shares (prefill_svc and decode_svc build on it).

Reading path: `build` (ServeConfig -> model, engine, KV layout, transport), `server` (the grpc.aio
server: limits, health, reflection, TLS, the x-dsv4-token check), `identity` (Info and the
Redis heartbeat). A worker's life (start, serve, drain on SIGTERM, stop) is assembled in
`dsv4.commands.worker`; its background tasks are owned by `dsv4.serving.tasks`.
"""
