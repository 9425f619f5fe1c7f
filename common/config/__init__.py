"""Configuration: one TOML file becomes a tree of typed dataclasses.

Every section is a dataclass whose fields carry a docstring (the string literal right under the
field; `slipstream show` prints it). Loading is strict: an unknown key is an error with a
"did you mean", a value of the wrong type is an error naming the full key path, and impossible
combinations are rejected by `validate`. Overrides come from `SLIPSTREAM__a__b=v` environment
variables and then `--set a.b=v`, both typed by the schema. Fields made with `identity(...)` define
what a run *is* (model shape, data, seed): a run resumes after runtime changes but refuses a
checkpoint whose identity differs (`identity_diff`).

The schema is dataclasses with their docstrings and each section's own `check()` (as torchtitan keeps
its job_config.py): schema.py (the root `Config`; trainer and evaluator sections), sections.py (run,
rendezvous, router, rollout and flow sections; the `identity` field helper) and launch.py (the launch
section); the machinery apart: coerce.py (reading the schema, typing raw values), load.py (file,
environment and --set overrides, the `--set` argument), validation.py (`validate`: every section's checks, then the few
across sections) and walk.py (leaves, TOML, diff, identity fingerprint). Import from here.
"""

from common.config.coerce import ENV_PREFIX, ConfigError, field_docs, parse_value
from common.config.launch import ROLES, LaunchConfig, RoleSpec
from common.config.load import add_set_argument, apply_override, env_overrides, from_dict, load_config
from common.config.schema import (
    CheckpointConfig,
    Config,
    CriticConfig,
    DataConfig,
    DataSourceConfig,
    EvaluatorConfig,
    ExpertsConfig,
    MetricsConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RLConfig,
    TrainerConfig,
    WarmupConfig,
)
from common.config.sections import (
    EpisodeConfig,
    FlowConfig,
    PromptSourceConfig,
    RendezvousConfig,
    RolloutConfig,
    RouterConfig,
    RunConfig,
    TaskConfig,
    identity,
    source_format,
)
from common.config.validation import validate
from common.config.walk import Leaf, diff, identity_diff, identity_fingerprint, leaves, render, to_toml

__all__ = [
    "ENV_PREFIX",
    "ROLES",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DataSourceConfig",
    "EpisodeConfig",
    "EvaluatorConfig",
    "ExpertsConfig",
    "FlowConfig",
    "LaunchConfig",
    "MetricsConfig",
    "Leaf",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "PromptSourceConfig",
    "CriticConfig",
    "RLConfig",
    "RendezvousConfig",
    "RoleSpec",
    "RolloutConfig",
    "RouterConfig",
    "RunConfig",
    "TaskConfig",
    "TrainerConfig",
    "WarmupConfig",
    "add_set_argument",
    "apply_override",
    "diff",
    "env_overrides",
    "field_docs",
    "from_dict",
    "identity",
    "identity_diff",
    "identity_fingerprint",
    "leaves",
    "load_config",
    "parse_value",
    "render",
    "source_format",
    "to_toml",
    "validate",
]
