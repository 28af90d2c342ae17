"""The decode worker (`dsv4 decode`): dsv4.v1.DecodeWorker.

Reading path: `servicer` (Decode, Abort, Info, Drain), then `session` (one Decode: adopt, pull,
Release on P, recompute or fail, colocated, streaming), `text` (detokenized deltas) and
`prefill_client` (Release calls to P).
"""
