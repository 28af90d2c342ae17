"""Request validation: every check raises InvalidRequest with a message that says what to fix.

Limits come from a `RequestLimits` argument (built from the model and the config), never from
globals. These functions see plain Python values, not protos.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Mapping, Sequence

from dsv4.errors import InvalidRequest
from dsv4.ops.limits import MIN_TEMPERATURE, MIN_TOP_P
from dsv4.types import RequestLimits, SamplingParams

_REQUEST_ID_CHARS = re.compile(r"[A-Za-z0-9._:/=+@-]+")


def check_request_id(request_id: str, limits: RequestLimits, *, may_assign: bool) -> str:
    """Return a valid request id; an empty one is replaced by a random id when may_assign."""
    if not request_id:
        if may_assign:
            return uuid.uuid4().hex
        raise InvalidRequest("request_id is empty: the router must forward its request id")
    if len(request_id) > limits.max_request_id_chars:
        raise InvalidRequest(
            f"request_id has {len(request_id)} characters: use at most "
            f"{limits.max_request_id_chars} (a UUID is fine)"
        )
    if not _REQUEST_ID_CHARS.fullmatch(request_id):
        raise InvalidRequest(
            f"request_id {request_id!r} has characters outside [A-Za-z0-9._:/=+@-]: "
            "use letters, digits and those separators only"
        )
    return request_id


def check_prompt_token_ids(ids: Sequence[int], limits: RequestLimits) -> tuple[int, ...]:
    """The prompt must be non-empty, fit the context and use only in-vocabulary ids."""
    if len(ids) == 0:
        raise InvalidRequest("prompt is empty: send non-empty text or at least one token id")
    if len(ids) >= limits.max_model_len:
        raise InvalidRequest(
            f"prompt has {len(ids)} tokens but max_model_len is {limits.max_model_len}: "
            f"shorten the prompt to at most {limits.max_model_len - 1} tokens"
        )
    check_token_ids_in_vocab("prompt_token_ids", ids, limits.vocab_size)
    return tuple(ids)


def check_token_ids_in_vocab(field_name: str, ids: Sequence[int], vocab_size: int) -> None:
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return
    index, value = next((i, v) for i, v in enumerate(ids) if not 0 <= v < vocab_size)
    raise InvalidRequest(
        f"{field_name}[{index}] = {value} is outside the vocabulary: "
        f"token ids must be in [0, {vocab_size})"
    )


def check_sampling(
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    max_new_tokens: int | None,
    seed: int | None,
    stop_token_ids: Sequence[int],
    stop_strings: Sequence[str],
    ignore_eos: bool,
    num_prompt_tokens: int,
    limits: RequestLimits,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    logit_bias: Mapping[int, float] | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """Validate sampling values and fill the default max_new_tokens (clipped to the context)."""
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidRequest(
            f"sampling.temperature = {temperature}: use 0 for greedy decoding or a finite "
            "positive value (1.0 samples from the model's distribution)"
        )
    if 0 < temperature < MIN_TEMPERATURE:
        raise InvalidRequest(
            f"sampling.temperature = {temperature}: a positive temperature must be at least "
            f"{MIN_TEMPERATURE} (smaller ones overflow logits / temperature); use 0 for greedy"
        )
    if not 0.0 < top_p <= 1.0:  # also rejects NaN
        raise InvalidRequest(
            f"sampling.top_p = {top_p}: must be in (0, 1]; use 1.0 to turn nucleus sampling off"
        )
    if top_p < MIN_TOP_P:
        raise InvalidRequest(
            f"sampling.top_p = {top_p}: must be at least {MIN_TOP_P:.4g} (smaller values "
            "underflow in fp32); use top_k = 1 to keep only the most likely token"
        )
    if not 0 <= top_k <= limits.vocab_size:
        raise InvalidRequest(
            f"sampling.top_k = {top_k}: must be 0 (off) or in [1, {limits.vocab_size}] "
            "(the vocabulary size)"
        )
    for name, value in (("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty)):  # fmt: skip
        if not -2.0 <= value <= 2.0:  # also rejects NaN
            raise InvalidRequest(f"sampling.{name} = {value}: must be in [-2, 2]; 0 is off")
    if not 0.0 < repetition_penalty <= 2.0:
        raise InvalidRequest(
            f"sampling.repetition_penalty = {repetition_penalty}: must be in (0, 2]; 1 is off"
        )
    if logprobs is not None and not 0 <= logprobs <= limits.max_logprobs:
        raise InvalidRequest(
            f"sampling.logprobs = {logprobs}: must be in [0, {limits.max_logprobs}] (the most "
            "likely tokens returned beside each generated one's own logprob); unset: none"
        )
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= limits.max_logprobs:
        raise InvalidRequest(
            f"sampling.prompt_logprobs = {prompt_logprobs}: must be in [0, "
            f"{limits.max_logprobs}] (the most likely tokens returned beside each prompt "
            "token's own logprob); unset: none"
        )
    return SamplingParams(
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        max_new_tokens=_check_max_new_tokens(max_new_tokens, num_prompt_tokens, limits),
        seed=seed,
        stop_token_ids=_check_stop_token_ids(stop_token_ids, limits),
        stop_strings=_check_stop_strings(stop_strings, limits),
        ignore_eos=bool(ignore_eos),
        presence_penalty=float(presence_penalty),
        frequency_penalty=float(frequency_penalty),
        repetition_penalty=float(repetition_penalty),
        logit_bias=_check_logit_bias(logit_bias or {}, limits),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def _check_max_new_tokens(
    max_new_tokens: int | None, num_prompt_tokens: int, limits: RequestLimits
) -> int:
    room = limits.max_model_len - num_prompt_tokens
    limit = limits.effective_max_new_tokens
    if max_new_tokens is None:
        return max(1, min(limits.default_max_new_tokens, limit, room))
    if max_new_tokens < 1:
        raise InvalidRequest(
            f"sampling.max_new_tokens = {max_new_tokens}: must be at least 1 "
            "(leave it unset for the server's default)"
        )
    if max_new_tokens > limit:
        raise InvalidRequest(
            f"sampling.max_new_tokens = {max_new_tokens}: this server allows at most {limit}"
        )
    if max_new_tokens > room:
        raise InvalidRequest(
            f"sampling.max_new_tokens = {max_new_tokens} does not fit: the prompt has "
            f"{num_prompt_tokens} tokens and max_model_len is {limits.max_model_len}, so at "
            f"most {room} new tokens fit; lower max_new_tokens or shorten the prompt"
        )
    return max_new_tokens


def _check_stop_token_ids(ids: Sequence[int], limits: RequestLimits) -> tuple[int, ...]:
    if len(ids) > limits.max_stop_token_ids:
        raise InvalidRequest(
            f"sampling.stop_token_ids has {len(ids)} entries: send at most "
            f"{limits.max_stop_token_ids}"
        )
    check_token_ids_in_vocab("sampling.stop_token_ids", ids, limits.vocab_size)
    return tuple(ids)


def _check_logit_bias(
    bias: Mapping[int, float], limits: RequestLimits
) -> tuple[tuple[int, float], ...]:
    """OpenAI's limits: at most 300 entries, each bias in [-100, 100]; token ids in the
    vocabulary. Returned as (token id, bias) pairs by token id."""
    if len(bias) > limits.max_logit_bias:
        raise InvalidRequest(
            f"sampling.logit_bias has {len(bias)} entries: send at most {limits.max_logit_bias}"
        )
    pairs = tuple(sorted((int(t), float(b)) for t, b in bias.items()))
    for token, value in pairs:
        if not 0 <= token < limits.vocab_size:
            raise InvalidRequest(
                f"sampling.logit_bias has token id {token}, outside the vocabulary: token ids "
                f"must be in [0, {limits.vocab_size})"
            )
        if not -100.0 <= value <= 100.0:  # also rejects NaN
            raise InvalidRequest(
                f"sampling.logit_bias[{token}] = {value}: must be in [-100, 100] (-100 bans "
                "the token, 100 makes it the only choice)"
            )
    return pairs


def _check_stop_strings(stop: Sequence[str], limits: RequestLimits) -> tuple[str, ...]:
    if len(stop) > limits.max_stop_strings:
        raise InvalidRequest(
            f"sampling.stop has {len(stop)} strings: send at most {limits.max_stop_strings}"
        )
    for i, s in enumerate(stop):
        if not s:
            raise InvalidRequest(f"sampling.stop[{i}] is empty: remove it or give some text")
        if len(s) > limits.max_stop_string_chars:
            raise InvalidRequest(
                f"sampling.stop[{i}] has {len(s)} characters: use at most "
                f"{limits.max_stop_string_chars}"
            )
    return tuple(stop)
