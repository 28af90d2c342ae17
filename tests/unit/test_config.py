"""ServeConfig: layering precedence, coercion, errors that name field/value/fix, resolution."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from dsv4.config import (
    ServeConfig,
    add_config_args,
    config_from_args,
    config_to_dict,
    config_to_yaml,
    load_config,
    request_limits,
    resolve_auto,
)
from dsv4.config.fields import iter_specs
from dsv4.config.load import SPECS
from dsv4.config.model import flash_config, tiny_config
from dsv4.errors import ConfigError


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    return parser.parse_args(argv)


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_are_valid_and_frozen() -> None:
    config = load_config({}, None, {})
    assert config == ServeConfig()
    assert config.scheduler.max_num_batched_tokens == 16384
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache.block_size = 64  # type: ignore[misc]


def test_layers_defaults_yaml_env_cli(tmp_path: Path) -> None:
    path = _yaml(
        tmp_path,
        "cache: {block_size: 512, num_blocks: 10, memory_fraction: 0.5}\nrouter: {port: 6000}\n",
    )
    env = {"DSV4_NUM_BLOCKS": "20", "DSV4_MEMORY_FRACTION": "0.6"}
    config = load_config({"cache.memory_fraction": 0.7}, path, env)
    assert config.cache.block_size == 512  # YAML over default
    assert config.cache.num_blocks == 20  # env over YAML
    assert config.cache.memory_fraction == 0.7  # CLI over env
    assert config.router.port == 6000
    assert config.cache.kv_dtype == "auto"  # default


def test_config_from_args_uses_flags_env_and_forced_values(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "worker: {role: decode}\nfeatures: {skip_topk: false}\n")
    args = _parse(
        ["--config", path, "--role", "decode", "--no-index-cache", "--skip-topk",
         "--prefill", "a:1,b:2", "--prefill", "c:3", "--kernel-override", "router=triton"]
    )  # fmt: skip
    env = {"DSV4_INDEX_CACHE": "true", "DSV4_KERNELS": "ref"}
    config = config_from_args(args, env, forced={"worker.role": "prefill"})
    assert config.worker.role == "prefill"
    assert config.features.index_cache is False and config.features.skip_topk is True
    assert config.discovery.prefill_addresses == ("a:1", "b:2", "c:3")
    assert config.model.backend_for("router") == "triton"
    assert config.model.backend_for("sparse_attn") == "ref"


def test_config_path_from_env(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "metrics: {prometheus_port: 9100}\n")
    config = config_from_args(_parse([]), {"DSV4_CONFIG": path})
    assert config.metrics.prometheus_port == 9100


def test_string_coercion() -> None:
    env = {
        "DSV4_FUSED_MHC": "off",
        "DSV4_MEMORY_BUDGET_BYTES": "1.5GiB",
        "DSV4_MAX_MESSAGE_BYTES": "4MB",
        "DSV4_DECODE": " x:1 , y:2 ",
        "DSV4_LEASE_TTL_S": "45",
    }
    config = load_config({}, None, env)
    assert config.features.fused_mhc is False
    assert config.cache.memory_budget_bytes == 3 << 29
    assert config.router.max_message_bytes == 4_000_000
    assert config.discovery.decode_addresses == ("x:1", "y:2")
    assert config.transfer.lease_ttl_s == 45.0


BAD = {
    "choice": ({"cache.kv_dtype": "fp16"}, "cache.kv_dtype", "use one of auto, fp8, bf16"),
    "range": ({"speculative.num_speculative_tokens": 4}, "num_speculative_tokens", "<= 3"),
    "not an int": ({"scheduler.max_num_seqs": "many"}, "scheduler.max_num_seqs", "an integer"),
    "bool": ({"features.fused_mhc": "maybe"}, "features.fused_mhc", "true/false"),
    "block size": ({"cache.block_size": 384 - 64}, "cache.block_size", "multiple of 128"),
    "device": ({"model.device": "gpu"}, "model.device", "cuda:N"),
    "override": ({"model.kernel_overrides": "router=fast"}, "kernel_overrides", "op=backend"),
    "pattern": ({"features.index_topk_pattern": "SF"}, "index_topk_pattern", "starting with F"),
    "pull vs lease": ({"transfer.pull_timeout_s": 40}, "pull_timeout_s", "below lease_ttl_s"),
    "address": ({"discovery.decode_addresses": "nohost"}, "decode_addresses", "host:port"),
    "redis": ({"discovery.redis_url": "localhost:6379"}, "redis_url", "redis://"),
    "ttl": ({"discovery.ttl_s": 1.0}, "discovery.ttl_s", "2 x heartbeat_s"),
    "port": ({"router.port": 70000}, "router.port", "<= 65535"),
    "tls pair": ({"security.tls_cert_path": "/x.pem"}, "tls_key_path", "together"),
    "tls file": (
        {"security.tls_cert_path": "/no/c.pem", "security.tls_key_path": "/no/k.pem"},
        "security.tls_cert_path",
        "no such file",
    ),
    "unknown key": ({"cache.blocksize": 1}, "cache.blocksize", "did you mean 'cache.block_size'"),
    "expert weights": ({"features.expert_weights": "fp4"}, "expert_weights", "bf16, checkpoint"),
    "fused shared expert, stored experts": (
        {"features.expert_weights": "checkpoint", "features.fuse_shared_expert": True},
        "features.fuse_shared_expert",
        "one format per launch",
    ),
    "linear weights": ({"features.linear_weights": "fp8"}, "linear_weights", "bf16, checkpoint"),
    "staging of one": ({"features.expert_staging": 1}, "expert_staging", "two halves"),
    "fused shared expert, stored linears": (
        {"features.linear_weights": "checkpoint", "features.fuse_shared_expert": True},
        "features.fuse_shared_expert",
        "the shared expert is FP8",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_errors_name_field_value_and_fix(case: str) -> None:
    overrides, field_name, fix = BAD[case]
    with pytest.raises(ConfigError) as info:
        load_config(overrides, None, {})
    assert info.value.field_name.endswith(field_name) or field_name in info.value.field_name
    assert fix in str(info.value)


def test_env_errors() -> None:
    with pytest.raises(ConfigError, match=r"DSV4_BLOCK_SIZ.*did you mean 'DSV4_BLOCK_SIZE'"):
        load_config({}, None, {"DSV4_BLOCK_SIZ": "64"})
    with pytest.raises(ConfigError, match=r"DSV4_BLOCK_SIZE='big'.*'cache.block_size'"):
        load_config({}, None, {"DSV4_BLOCK_SIZE": "big"})
    assert load_config({}, None, {"HOME": "/root", "DSV4_CONFIG": ""}) == ServeConfig()


def test_yaml_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="did you mean 'scheduler'"):
        load_config({}, _yaml(tmp_path, "schedular: {max_num_seqs: 3}\n"), {})
    with pytest.raises(ConfigError, match=r"did you mean 'router\.port'"):
        load_config({}, _yaml(tmp_path, "router: {prot: 1}\n"), {})
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config({}, _yaml(tmp_path, "router: [\n"), {})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config({}, str(tmp_path / "missing.yaml"), {})
    with pytest.raises(ConfigError, match="must be an integer"):
        load_config({}, _yaml(tmp_path, "router: {port: 1.5}\n"), {})
    assert load_config({}, _yaml(tmp_path, "# empty\n"), {}) == ServeConfig()


def test_flags_env_names_and_help_are_unique_and_complete() -> None:
    specs = list(SPECS.values())
    assert len({s.flag for s in specs}) == len(specs)
    assert len({s.env_var for s in specs}) == len(specs)
    assert all(s.help for s in specs)
    assert SPECS["model.kernels"].env_var == "DSV4_KERNELS"  # the name docs/operations.md uses
    for attribute, section_cls, _ in iter_specs(ServeConfig):
        assert attribute == section_cls.SECTION
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    assert "--no-index-cache" in parser.format_help()


def test_secrets_stay_out_of_repr_and_dumps() -> None:
    config = load_config({"router.api_keys": "k1,k2"}, None, {"DSV4_SHARED_SECRET": "s3cret"})
    assert config.router.api_keys == ("k1", "k2")
    assert "s3cret" not in repr(config) and "k1" not in repr(config)
    dumped = config_to_dict(config)
    assert dumped["security"]["shared_secret"] == "<redacted>"
    assert config_to_dict(config, redact_secrets=False)["security"]["shared_secret"] == "s3cret"


def test_a_redis_password_in_the_url_stays_out_of_dumps() -> None:
    """deploy/k8s passes the Redis password inside DSV4_REDIS (redis://:PASSWORD@host)."""
    url = "redis://:hunter2-redis@dsv4-redis:6379/0"
    config = load_config({}, None, {"DSV4_REDIS": url})
    assert config.discovery.redis_url == url
    dumped = config_to_yaml(config)
    assert "hunter2" not in dumped and "redis://:<redacted>@dsv4-redis:6379/0" in dumped
    assert config_to_dict(config, redact_secrets=False)["discovery"]["redis_url"] == url


def test_yaml_dump_round_trips(tmp_path: Path) -> None:
    config = load_config({"discovery.prefill_addresses": "a:1", "cache.num_blocks": 7}, None, {})
    path = _yaml(tmp_path, config_to_yaml(config, redact_secrets=False))
    assert load_config({}, path, {}) == config


def test_expert_weights_switch_round_trips(tmp_path: Path) -> None:
    """Routed experts as stored (MXFP4 / FP8) is one switch: flag, env, YAML; auto by default
    (start-up planning resolves it: `dsv4.worker.fit.resolve_weight_formats`)."""
    assert load_config({}, None, {}).features.expert_weights == "auto"
    config = config_from_args(_parse(["--expert-weights", "checkpoint"]), {})
    assert config.features.expert_weights == "checkpoint"
    assert load_config({}, None, {"DSV4_EXPERT_WEIGHTS": "checkpoint"}) == config
    path = _yaml(tmp_path, config_to_yaml(config, redact_secrets=False))
    assert load_config({}, path, {}) == config


def test_linear_weights_switch_round_trips(tmp_path: Path) -> None:
    """FP8 linears as stored is one switch: flag, env, YAML; auto by default."""
    assert load_config({}, None, {}).features.linear_weights == "auto"
    config = config_from_args(_parse(["--linear-weights", "checkpoint"]), {})
    assert config.features.linear_weights == "checkpoint"
    assert load_config({}, None, {"DSV4_LINEAR_WEIGHTS": "checkpoint"}) == config
    path = _yaml(tmp_path, config_to_yaml(config, redact_secrets=False))
    assert load_config({}, path, {}) == config


def test_auto_weights_allow_fp8_activations_and_the_fuse() -> None:
    """linear_activations fp8 needs linears as stored: allowed with auto (which it then makes
    checkpoint), refused with bf16; the shared-expert fuse is allowed with auto weights (turned
    off at start-up where they resolve to checkpoint)."""
    fp8 = {"features.linear_activations": "fp8"}
    assert load_config(fp8, None, {}).features.linear_weights == "auto"
    with pytest.raises(ConfigError, match="fp8 activations need linear_weights checkpoint"):
        load_config({**fp8, "features.linear_weights": "bf16"}, None, {})
    assert load_config({"features.fuse_shared_expert": True}, None, {}).features.fuse_shared_expert


def test_resolve_auto_on_cpu_and_cuda() -> None:
    config = load_config({}, None, {})
    cpu = resolve_auto(config, has_cuda=False, hostname="h", pid=7, model=tiny_config())
    assert (cpu.model.device, cpu.model.dtype, cpu.model.kernels) == ("cpu", "fp32", "ref")
    assert cpu.cache.kv_dtype == "bf16" and cpu.transfer.transport == "nixl"
    assert cpu.worker.worker_id == "colocated-h-7" and cpu.model.max_model_len == 4096
    assert config.model.device == "auto"  # a new object; the input is unchanged
    gpu = resolve_auto(config, has_cuda=True, hostname="h", pid=7, model=flash_config())
    assert (gpu.model.device, gpu.model.dtype, gpu.model.kernels) == ("cuda", "bf16", "triton")
    assert gpu.cache.kv_dtype == "fp8" and gpu.transfer.transport == "cuda_ipc"
    remote = load_config({"discovery.decode_addresses": "10.0.0.2:1"}, None, {})
    assert resolve_auto(remote, has_cuda=True, hostname="h", pid=1).transfer.transport == "nixl"
    pinned = load_config({"model.device": "cpu", "cache.kv_dtype": "fp8"}, None, {})
    assert resolve_auto(pinned, has_cuda=True, hostname="h", pid=1).cache.kv_dtype == "fp8"
    # The paged forward serves on CUDA, MTP speculation included; CPU keeps the reference.
    mtp = load_config({"speculative.method": "mtp"}, None, {})
    assert gpu.features.forward == "paged" and cpu.features.forward == "reference"
    assert resolve_auto(mtp, has_cuda=True, hostname="h", pid=1).features.forward == "paged"
    assert gpu.features.cuda_graphs and gpu.features.cuda_graph_max_batch == 128


def test_request_limits() -> None:
    config = load_config({"router.max_new_tokens_limit": 300}, None, {})
    with pytest.raises(ConfigError, match="must not exceed max_new_tokens_limit"):
        load_config({"router.max_new_tokens_limit": 100}, None, {})
    limits = request_limits(config, vocab_size=1024, max_model_len=64)
    assert (limits.max_new_tokens_limit, limits.default_max_new_tokens) == (64, 256)
    assert (
        request_limits(ServeConfig(), vocab_size=8, max_model_len=32).effective_max_new_tokens == 32
    )
