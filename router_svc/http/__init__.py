"""The router's OpenAI-compatible HTTP front (aiohttp, no torch), on when router.http_port > 0.

Reading path: `app` (routes, status, SSE) -> `body` (a body read in time and parsed as JSON) ->
`protocol` (request bodies) -> `chat` (chat template) -> `call` (the gRPC Generate path run
in-process) -> `responses` (OpenAI response objects and stream chunks); `errors` holds the
error objects every step raises and how each becomes an HTTP answer; `tokenize` serves vLLM's
/tokenize, /detokenize and /version beside them.
"""

from router_svc.http.app import HttpFront
from router_svc.http.chat import ChatTemplate, load_chat_template

__all__ = ["ChatTemplate", "HttpFront", "load_chat_template"]
