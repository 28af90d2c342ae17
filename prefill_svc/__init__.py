"""The prefill worker (`dsv4 prefill`): dsv4.v1.PrefillWorker.

Reading path: `servicer` (Prefill -> engine prefill -> export under a lease -> KVHandle; Release,
Info, Drain), then `leases` (the lease table and its one task: transport progress, pull notices,
expiry).
"""
