"""`dsv4 generate`: offline generation on the paged engine, checked as the server checks.

    dsv4 generate --model DIR --prompt "Hello" --prompt-ids 5,6,7 --max-new-tokens 16 --json

Every value is checked against the checkpoint's config.json before the weights load, by the
server's own rules (dsv4.wire.validate), and reported with the flag's name. --max-new-tokens is
capped at the model's context with a one-line note. A checkpoint without tokenizer.json runs
token ids in and out (--prompt-ids; vLLM's --skip-tokenizer-init).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from dsv4.config.sections import SEED_LIMIT
from dsv4.errors import InvalidRequest, UsageError


def parse_ints(flag: str, text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise UsageError(f"{flag} {text!r}: give comma-separated {what}") from None


def seed_arg(text: str) -> int:
    """argparse type of --seed: the server's range, a uint64. Outside it the server refuses
    the request and the sampler's generator overflows, so it is refused at parse time."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= seed < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"{seed}: give a seed in [0, 2**64)")
    return seed


# The server's messages name wire fields (`sampling.top_p`, `prompt_token_ids`); a user of
# `dsv4 generate` typed flags.
_WIRE_FIELD = re.compile(r"\bsampling\.(\w+)|\b(prompt_token_ids|max_new_tokens)\b")


def _as_flags(message: str) -> str:
    def flag(match: re.Match[str]) -> str:
        name = match[1] or match[2]
        return "--prompt-ids" if name == "prompt_token_ids" else "--" + name.replace("_", "-")

    return _WIRE_FIELD.sub(flag, message)


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from dsv4.config.model import ModelConfig
    from dsv4.engine.offline import checked_params, generate_batch
    from dsv4.model.weights import load_model
    from dsv4.ops.sampling import SamplingSpec
    from dsv4.text.tokenizer import TextCodec

    # Everything is checked against config.json before the weights load.
    cfg = ModelConfig.from_file(args.model)
    codec = None if args.skip_tokenizer_init else TextCodec.from_dir_if_present(args.model)
    if codec is None and (args.prompt or args.stop):
        flag = "--prompt" if args.prompt else "--stop"
        why = "--skip-tokenizer-init" if args.skip_tokenizer_init else "no tokenizer.json there"
        raise UsageError(
            f"{flag} needs the tokenizer of {args.model} ({why}): "
            "pass token ids with --prompt-ids 1,2,3 (and no --prompt or --stop)"
        )
    prompts = [codec.encode(text) for text in args.prompt or ()] if codec else []
    prompts += [list(parse_ints("--prompt-ids", i, "token ids")) for i in args.prompt_ids or ()]
    if not prompts or any(not p for p in prompts):
        raise UsageError("every prompt must be non-empty: pass --prompt TEXT or --prompt-ids 1,2,3")
    if args.logprobs is not None and not args.json:
        raise UsageError("--logprobs N is printed with --json: pass both")
    spec = SamplingSpec(args.temperature, args.top_p, args.top_k, args.seed,
                        logprobs=args.logprobs)  # fmt: skip
    try:
        params, note = checked_params(
            cfg, prompts, spec, args.max_new_tokens, stop_strings=tuple(args.stop or ())
        )
    except InvalidRequest as exc:
        raise UsageError(_as_flags(exc.message)) from exc
    if note:
        print(f"dsv4 generate: note: {_as_flags(note)}", file=sys.stderr)
    model, cfg = load_model(args.model, dtype=getattr(torch, args.dtype))
    results = generate_batch(
        model,
        prompts,
        [spec] * len(prompts),
        [p.max_new_tokens for p in params],
        stop_token_ids=() if args.ignore_eos else (cfg.eos_token_id,),
        stop_strings=tuple(args.stop or ()),
        codec=codec,
    )
    for result in results:
        ids = list(result.output_token_ids)
        text = codec.decode(ids) if codec else None
        if args.json:
            record = {
                "prompt_token_ids": list(result.prompt_token_ids),
                "output_token_ids": ids,
                "text": text,
                "finish_reason": result.finish_reason,
            }
            if args.logprobs is not None:  # vLLM's raw logprobs: before temperature/top-p
                record["logprobs"] = [
                    {"logprob": lp.logprob, "top": [list(pair) for pair in lp.top]}
                    for lp in result.logprobs
                ]
            print(json.dumps(record))
        else:
            print(text if codec else ",".join(map(str, ids)))
    return 0


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="offline generation on the paged engine (one or many prompts)"
    )
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--prompt", action="append", help="a text prompt (repeat for a batch)")
    p.add_argument(
        "--prompt-ids",
        action="append",
        help="comma-separated token ids (repeatable); needs no tokenizer.json",
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=32, help="capped at the model's context, with a note"
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=seed_arg, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument(
        "--logprobs", type=int, default=None, metavar="N",
        help="with --json: each output token's logprob and the N most likely [id, logprob] "
        "(0-20; from the raw logits, as the server's logprobs)",
    )  # fmt: skip
    p.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="token ids in and out, no tokenizer (as vLLM); implied without tokenizer.json",
    )
    p.set_defaults(handler=run_generate)
