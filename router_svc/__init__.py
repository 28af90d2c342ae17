"""The router: the public `dsv4.v1.Router` gRPC front of a disaggregated deployment (no torch).

Reading path: `server` (process, health, reflection, `dsv4 router`), `servicer` (the API
boundary: auth, admission, validation), `intake` (bounded work before validation), `flow` (one
request: prefill with retries, first token, decode relay, migration, cleanup), `choice` (which
P and D), `pool` + `view` (workers' health and load from discovery and Info probes), `clients`
(channels to workers), `output` (incremental text, stop strings), `admission`, `deadline`,
`live` (abort registry, background-task owner), `text_model` (tokenizer), `fakes` (scripted
workers for tests).
"""

from router_svc.server import RouterServer, main, serve

__all__ = ["RouterServer", "main", "serve"]
