"""One frozen `ServeConfig`, parsed once per process: defaults < YAML < DSV4_* env < CLI flags.

Entry points: `add_config_args(parser)`, then `config_from_args(args, os.environ)`; or
`load_config(overrides, yaml_path, env)` directly. `resolve_auto` turns "auto" values into
concrete ones. Validation raises ConfigError naming the field, the value and the fix.
Nothing outside `dsv4.config.load` reads environment variables.

Reading path: `sections` (the tree and its defaults), `fields` (how a field is declared and
checked), `load` (layers and coercion), `cli` (argparse), `resolve` ("auto" values).
"""

from dsv4.config.cli import add_config_args, config_from_args
from dsv4.config.load import config_to_dict, config_to_yaml, load_config
from dsv4.config.resolve import request_limits, resolve_auto
from dsv4.config.sections import (
    CacheSection,
    DiscoverySection,
    FeatureSwitches,
    MetricsSection,
    ModelSection,
    RouterSection,
    SchedulerSection,
    SecuritySection,
    ServeConfig,
    SpeculativeSection,
    TransferSection,
    WorkerSection,
)

__all__ = [
    "CacheSection",
    "DiscoverySection",
    "FeatureSwitches",
    "MetricsSection",
    "ModelSection",
    "RouterSection",
    "SchedulerSection",
    "SecuritySection",
    "ServeConfig",
    "SpeculativeSection",
    "TransferSection",
    "WorkerSection",
    "add_config_args",
    "config_from_args",
    "config_to_dict",
    "config_to_yaml",
    "load_config",
    "request_limits",
    "resolve_auto",
]
