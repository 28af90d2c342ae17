"""The HTTP front's chat prompts and request checks, without a cluster.

A checkpoint's chat template renders exactly as transformers' `apply_chat_template` renders it
(transformers is the oracle); without one, DeepSeek-V4's chat format, which the tiny tokenizer
turns into BOS + ordinary tokens that decode back to the same text. Request bodies map onto
the Router proto, and refusals name the OpenAI parameter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4.config import ModelSection
from dsv4.errors import CheckpointError, InvalidRequest
from dsv4.text.tokenizer import build_tokenizer
from router_svc.http.chat import load_chat_template
from router_svc.http.errors import ApiError
from router_svc.http.protocol import parse_request
from router_svc.text_model import TINY_VOCAB_SIZE, load_text_model

# Uses what transformers' environment adds to plain jinja2: trim/lstrip of blocks, loop
# controls, its tojson (no HTML escaping), raise_exception, namespace, special tokens.
TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system='') -%}
{%- for m in messages -%}
    {%- if m['role'] == 'system' -%}{%- set ns.system = m['content'] -%}{%- continue -%}{%- endif -%}
    {%- if m['role'] not in ('user', 'assistant') -%}
        {{ raise_exception('role ' + m['role'] + ' is not supported') }}
    {%- endif %}
    {% if loop.index0 == 1 and ns.system %}[sys] {{ ns.system | tojson }}
    {% endif %}
<{{ m['role'] }}> {{ m['content'] }}
    {% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}
{%- endfor -%}
{%- if add_generation_prompt %}<assistant>{% endif %}"""
MESSAGES = [
    {"role": "system", "content": 'Be <brief> & "kind"'},
    {"role": "user", "content": "The quick brown fox"},
    {"role": "assistant", "content": "jumps"},
    {"role": "user", "content": "over the lazy dog?"},
]


def checkpoint(tmp_path: Path, **config: object) -> ModelSection:
    build_tokenizer(TINY_VOCAB_SIZE).save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
              "eos_token": {"__type": "AddedToken", "content": "<eos>", "special": True}, **config}  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return ModelSection(path=str(tmp_path))


def test_checkpoint_template_renders_as_transformers_does(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model = checkpoint(tmp_path, chat_template=TEMPLATE)
    ours = load_chat_template(model, load_text_model(model)).render(MESSAGES)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    assert ours.startswith("<bos>") and '"Be <brief> & \\"kind\\""' in ours


def test_template_refusals_are_bad_requests_and_a_broken_template_is_a_checkpoint_error(
    tmp_path: Path,
) -> None:
    model = checkpoint(tmp_path, chat_template=TEMPLATE)
    template = load_chat_template(model, load_text_model(model))
    with pytest.raises(InvalidRequest, match="role tool is not supported"):
        template.render([{"role": "tool", "content": "42"}])
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")  # wins over the config
    with pytest.raises(CheckpointError, match=r"chat_template\.jinja"):
        load_chat_template(model, load_text_model(model))


def test_without_a_template_deepseek_v4_chat_format(tmp_path: Path) -> None:
    model = checkpoint(tmp_path)
    text = load_text_model(model)
    prompt = load_chat_template(model, text).render(MESSAGES)
    assert prompt == (
        '<bos>Be <brief> & "kind"<｜User｜>The quick brown fox<｜Assistant｜></think>jumps<eos>'
        "<｜User｜>over the lazy dog?<｜Assistant｜></think>"
    )
    ids = text.codec.encode(prompt)
    assert ids[0] == text.bos_token_id and ids.count(text.bos_token_id) == 1
    assert ids.count(text.eos_token_id) == 1 and max(ids) < TINY_VOCAB_SIZE
    assert text.codec.decode(ids) == prompt.replace("<bos>", "").replace("<eos>", "")


def test_request_bodies_become_router_protos() -> None:
    chat = parse_request(
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
         "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0, "top_p": 0.5, "seed": 3,
         "stop": "\n", "stream": True, "stream_options": {"include_usage": True}, "n": 1,
         "ignore_eos": True, "top_k": -1, "user": "ignored"},
        is_chat=True,
    )  # fmt: skip
    assert chat.messages == ({"role": "user", "content": "hi"},) and chat.include_usage
    s = chat.sampling
    assert (s.max_new_tokens, s.temperature, s.top_p, s.seed, list(s.stop)) == (
        7,
        0,
        0.5,
        3,
        ["\n"],
    )
    assert s.ignore_eos and s.top_k == 0 and s.HasField("temperature")
    proto = parse_request({"prompt": [[5, 6, 7]]}, is_chat=False).to_proto((5, 6, 7), "r1")
    assert list(proto.prompt_token_ids.ids) == [5, 6, 7] and proto.request_id == "r1"
    assert not proto.sampling.HasField("max_new_tokens")  # unset: the router's default


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([1], "body"), ({"prompt": "x", "n": 65}, "n"), ({"prompt": "x", "n": 0}, "n"), ({"prompt": ["a", [1]]}, "prompt"), ({"prompt": ["a"] * 33, "n": 2}, "prompt"),
        ({}, "prompt"), ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"), ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "stop": [1]}, "stop"), ({"prompt": "x", "echo": "yes"}, "echo"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": [1, 2**40]}, "prompt"),
        ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "x"}}, "include_usage"),
    ],
)  # fmt: skip
def test_bad_bodies_name_the_parameter(body: object, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_request(body, is_chat=False)
    assert caught.value.status == 400 and caught.value.body()["error"]["param"] == param


def test_router_statuses_map_to_http_with_openai_names() -> None:
    error = ApiError.from_grpc("INVALID_ARGUMENT", "sampling.max_new_tokens = 0: must be >= 1")
    assert error.body() == {"error": {"message": "max_tokens = 0: must be >= 1", "param":
        "max_tokens", "type": "invalid_request_error", "code": "invalid_argument"}}  # fmt: skip
    statuses = {code: ApiError.from_grpc(code, "x").status for code in
                ("UNAUTHENTICATED", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED",
                 "INTERNAL")}  # fmt: skip
    assert statuses == {"UNAUTHENTICATED": 401, "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503,
                        "DEADLINE_EXCEEDED": 504, "INTERNAL": 500}  # fmt: skip


def test_n_choices_are_calls_with_their_own_ids_and_consecutive_seeds() -> None:
    from router_svc.http.choices import choice_protos

    seeded = parse_request({"prompt": "x", "n": 3, "seed": 2**64 - 2, "temperature": 1.0},
                           is_chat=False)  # fmt: skip
    protos = choice_protos(seeded, ["x"], "r")
    assert [m.request_id for m in protos] == ["r-0", "r-1", "r-2"]
    assert [m.sampling.seed for m in protos] == [2**64 - 2, 2**64 - 1, 0]  # uint64 wraps
    assert all(m.prompt == "x" and m.sampling.temperature == 1.0 for m in protos)
    unseeded = choice_protos(
        parse_request({"prompt": [4, 5], "n": 2}, is_chat=False), [(4, 5)], "q"
    )
    assert not any(m.sampling.HasField("seed") for m in unseeded)
    assert parse_request({"prompt": "x"}, is_chat=False).n == 1


def test_a_batch_of_prompts_is_prompt_by_prompt_choices() -> None:
    from router_svc.http.choices import choice_protos

    batch = parse_request({"prompt": ["a", "b"], "n": 2, "seed": 5}, is_chat=False)
    assert batch.batch == ("a", "b") and batch.prompt is None and batch.num_choices == 4
    protos = choice_protos(batch, batch.batch, "r")
    assert [(m.request_id, m.prompt, m.sampling.seed) for m in protos] == [
        ("r-0", "a", 5), ("r-1", "a", 6), ("r-2", "b", 5), ("r-3", "b", 6),
    ]  # fmt: skip
    ids = parse_request({"prompt": [[1, 2], [3]]}, is_chat=False)
    assert ids.batch == ((1, 2), (3,)) and ids.num_choices == 2
    single = parse_request({"prompt": [[1, 2]]}, is_chat=False)  # a batch of one
    assert single.prompt == (1, 2) and single.batch == () and single.num_choices == 1
