"""Validation of combinations: `validate` rejects a typed config that cannot work, naming the keys and
the fix; `validate_flow` is the flow section's own checks, which `policy_from_config` applies to the
flows the simulator and tests build in code.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from common.config.coerce import ENV_PREFIX, ConfigError, _coerce, _hints, parse_value
from common.config.schema import ROLES, Config, DataConfig
from common.config.sections import FlowConfig, PromptSourceConfig, TaskConfig
from common.net import is_loopback
from common.proc import parse_cpus


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _validate_data_sources(d: DataConfig) -> None:
    _require(
        not (d.path and d.sources),
        "trainer.data.path and trainer.data.sources are both set: keep one (a path is a mixture of one source)",
    )
    _require(d.shard_mb > 0, f"trainer.data.shard_mb must be > 0 (MB of input per shard), got {d.shard_mb}")
    _require(d.prep_processes >= 0, f"trainer.data.prep_processes must be >= 0 (0 = one per core): {d.prep_processes}")
    seen: set[str] = set()
    for i, src in enumerate(d.sources):
        key = f"trainer.data.sources[{i}]"
        _require(
            bool(src.name) and all(c.isalnum() or c in "_.-" for c in src.name) and src.name not in (".", ".."),
            f"{key}.name = {src.name!r}: give a name of letters, digits, '_', '.' or '-' (it names a directory)",
        )
        _require(src.name not in seen, f"{key}.name = {src.name!r} is used by an earlier source; names must be unique")
        seen.add(src.name)
        _require(bool(src.path), f"{key} ({src.name!r}) has no path; set it to a .jsonl/.parquet file or directory")
        _require(src.weight > 0, f"{key}.weight = {src.weight} must be > 0 (drop the source to leave it out)")
        _require(src.temperature > 0, f"{key}.temperature = {src.temperature} must be > 0 (1 = weights as given)")


_SOURCE_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


def source_format(src: PromptSourceConfig) -> str:
    """The format a prompt source is read as: its `format`, or for auto the one its path implies ("" if none)."""
    if src.format != "auto":
        return src.format
    if Path(src.path).is_dir():
        return "datasets"
    return _SOURCE_SUFFIXES.get(Path(src.path).suffix.lower(), "")


def _validate_arithmetic(key: str, t: TaskConfig | PromptSourceConfig) -> None:
    """The arithmetic generator's knobs, of the task or of a mixture's arithmetic source at `key`."""
    _require(
        bool(t.operators) and set(t.operators) <= set("+-*"),
        f'{key}.operators {t.operators!r} must be a non-empty subset of "+-*"',
    )
    _require(
        1 <= t.min_operands <= t.max_operands,
        f"{key}.min_operands ({t.min_operands}) must be within [1, max_operands ({t.max_operands})]",
    )


def _validate_task_sources(t: TaskConfig) -> None:
    if t.kind != "mixture":
        _require(
            not t.sources,
            f"rollout.task.sources is read only by kind = 'mixture' (kind is {t.kind!r}): "
            "set rollout.task.kind = 'mixture' or drop the sources",
        )
        return
    _require(
        bool(t.sources),
        "rollout.task.kind = 'mixture' needs [[rollout.task.sources]] tables (name, path, "
        "weight, verifier), or format = 'arithmetic' sources",
    )
    seen: set[str] = set()
    for i, src in enumerate(t.sources):
        key = f"rollout.task.sources[{i}]"
        _require(
            bool(src.name) and all(c.isalnum() or c in "_.-" for c in src.name),
            f"{key}.name = {src.name!r}: give a name of letters, digits, '_', '.' or '-' (it prefixes problem ids)",
        )
        _require(src.name not in seen, f"{key}.name = {src.name!r} is used by an earlier source; names must be unique")
        seen.add(src.name)
        key = f"{key} ({src.name!r})"
        _require(
            math.isfinite(src.weight) and src.weight > 0,
            f"{key}.weight = {src.weight} must be a number > 0 (drop the source to leave it out)",
        )
        _require(
            src.verifier != "import" or ":" in src.verifier_import,
            f"{key}.verifier = 'import' needs verifier_import = 'package.module:factory'",
        )
        if src.format == "arithmetic":
            _require(not src.path, f"{key} is the arithmetic generator and reads no file: drop path = {src.path!r}")
            _require(not src.repeat, f"{key}: an arithmetic source does not repeat; raise its num_problems instead")
            _require(src.num_problems >= 1, f"{key}.num_problems must be >= 1, got {src.num_problems}")
            _validate_arithmetic(key, src)
            continue
        _require(
            bool(src.path),
            f"{key} has no path: give a .jsonl/.parquet file or a datasets directory, or "
            "format = 'arithmetic' for the generator",
        )
        path = Path(src.path)
        _require(path.exists(), f"{key}.path {src.path!r} does not exist (relative paths are from {os.getcwd()})")
        fmt = source_format(src)
        _require(
            bool(fmt),
            f"{key}.path {src.path!r}: cannot tell the format from its name; set format = 'jsonl', "
            "'parquet' or 'datasets'",
        )
        _require(
            (fmt == "datasets") == path.is_dir(),
            f"{key}.path {src.path!r} is {'a directory' if path.is_dir() else 'a file'}, but format {fmt!r} "
            f"reads {'a Dataset.save_to_disk directory' if fmt == 'datasets' else 'a file'}",
        )
    _require(
        not all(src.repeat for src in t.sources),
        "rollout.task.sources: every source repeats, so the mixture would never end; set repeat = false on one "
        "(the mixture ends when it runs out)",
    )


def validate_flow(f: FlowConfig) -> None:
    """The flow section's knobs, as every policy needs them; a FlowConfig built in code (the simulator's,
    tests') skipped the loader's typing, so each field is typed here too."""
    for name, tp in _hints(FlowConfig).items():
        _coerce(getattr(f, name), tp, f"flow.{name}")
    for name in (
        "prompts_per_step",
        "samples_per_prompt",
        "max_concurrent",
        "max_untrained_prompts",
        "max_dynamic_refills_per_step",
    ):
        _require(getattr(f, name) >= 1, f"flow.{name} must be >= 1, got {getattr(f, name)}")
    _require(
        not f.dynamic_sampling or f.samples_per_prompt >= 2,
        "flow.dynamic_sampling drops groups whose rewards are all equal, which a group of one sample always is "
        f"(flow.samples_per_prompt = {f.samples_per_prompt}): set flow.samples_per_prompt >= 2",
    )
    _require(f.max_staleness >= 0, f"flow.max_staleness must be >= 0, got {f.max_staleness}")
    if f.strategy == "fully_async":
        _require(
            f.max_untrained_prompts >= f.prompts_per_step,
            f"flow.max_untrained_prompts ({f.max_untrained_prompts}) is below flow.prompts_per_step "
            f"({f.prompts_per_step}): a batch could never fill; raise max_untrained_prompts",
        )


def validate(cfg: Config) -> None:
    """Reject combinations that cannot work, naming the keys and the fix."""
    rz = cfg.rendezvous
    _require(
        rz.heartbeat_ttl_s >= 2 * rz.heartbeat_period_s > 0,
        f"rendezvous.heartbeat_ttl_s ({rz.heartbeat_ttl_s}) must be at least twice "
        f"rendezvous.heartbeat_period_s ({rz.heartbeat_period_s}) so one late beat is not a death",
    )
    _require(0 <= rz.redis_port < 65536, f"rendezvous.redis_port {rz.redis_port} is not a port (0 = any free)")
    r = cfg.router
    _require(
        is_loopback(r.bind_host) or bool(r.auth_token),
        f"router.bind_host = {r.bind_host!r} is not loopback: set router.auth_token (or bind 127.0.0.1)",
    )
    _require(
        is_loopback(cfg.rollout.bind_host) or bool(cfg.rollout.api_key),
        f"rollout.bind_host = {cfg.rollout.bind_host!r} is not loopback: set rollout.api_key (vLLM then refuses "
        "requests without it), or bind 127.0.0.1",
    )
    _require(r.max_retries >= 0, f"router.max_retries must be >= 0, got {r.max_retries}")
    _require(r.affinity_overload_factor >= 1.0, "router.affinity_overload_factor must be >= 1.0")
    ro = cfg.rollout
    _require(ro.keep_versions >= 1, f"rollout.keep_versions must be >= 1, got {ro.keep_versions}")
    _require(ro.weight_shard_mb >= 1, f"rollout.weight_shard_mb must be >= 1 (MB), got {ro.weight_shard_mb}")
    _require(
        0 < ro.max_tokens < ro.max_model_len,
        f"rollout.max_tokens ({ro.max_tokens}) must be positive and below rollout.max_model_len ({ro.max_model_len})",
    )
    t = ro.task
    _validate_arithmetic("rollout.task", t)
    _require(t.kind != "jsonl_math" or bool(t.path), "rollout.task.kind = 'jsonl_math' needs rollout.task.path")
    _require(
        t.kind != "import" or ":" in t.import_path,
        "rollout.task.kind = 'import' needs rollout.task.import_path = 'package.module:factory'",
    )
    _validate_task_sources(t)
    f = cfg.flow
    validate_flow(f)
    # A policy runs one_step_off at any staleness (`slipstream simulate --strategies all` does, next to fully_async at
    # max_staleness 0), so validate_flow allows it; a config that asks for it contradicts itself.
    if f.strategy == "one_step_off":
        _require(
            f.max_staleness >= 1,
            "flow.strategy = 'one_step_off' trains on samples one version old: set flow.max_staleness >= 1",
        )
    if f.partial_rollout:
        _require(
            ro.pause_mode == "keep",
            f"flow.partial_rollout = true needs rollout.pause_mode = 'keep' (is {ro.pause_mode!r})",
        )
    m = cfg.trainer.model
    _require(0 <= m.first_k_dense <= m.num_layers, "trainer.model.first_k_dense must be within [0, num_layers]")
    _require(
        1 <= m.num_experts_per_tok <= m.n_routed_experts,
        f"trainer.model.num_experts_per_tok ({m.num_experts_per_tok}) must be within [1, n_routed_experts "
        f"({m.n_routed_experts})]",
    )
    _require(
        m.n_routed_experts % m.n_group == 0 and 1 <= m.topk_group <= m.n_group,
        "trainer.model.n_group must divide n_routed_experts and topk_group must be within [1, n_group]",
    )
    if m.arch == "qwen3_moe":
        _require(m.num_heads % m.num_kv_heads == 0, "trainer.model.num_heads must be a multiple of num_kv_heads")
    _require(cfg.trainer.optim.grad_accum >= 1, "trainer.optim.grad_accum must be >= 1")
    _require(len(cfg.trainer.optim.betas) == 2, "trainer.optim.betas must hold two numbers, e.g. [0.9, 0.95]")
    rl = cfg.trainer.rl
    _require(0 <= rl.clip_low < 1 and rl.clip_high >= 0, "trainer.rl.clip_low must be in [0, 1) and clip_high >= 0")
    _require(rl.tis_cap >= 1.0, f"trainer.rl.tis_cap ({rl.tis_cap}) must be >= 1 (1 = weights capped at one)")
    _require(rl.micro_batch_samples >= 1, "trainer.rl.micro_batch_samples must be >= 1")
    _require(
        rl.routing_replay == "none" or cfg.rollout.return_routed_experts,
        'trainer.rl.routing_replay = "rollout" replays the experts the workers return: set '
        "rollout.return_routed_experts = true",
    )
    for name in ("token_mask_band", "seq_mask_band"):
        band = getattr(rl, name)
        _require(
            not band or (len(band) == 2 and 0 <= band[0] < 1 < band[1]),
            f"trainer.rl.{name} = {band}: give [low, high] with 0 <= low < 1 < high (e.g. [0.5, 2.0]), or [] for none",
        )
    _require(
        1 <= rl.mini_batches <= cfg.flow.prompts_per_step,
        f"trainer.rl.mini_batches = {rl.mini_batches}: a mini-batch holds whole prompt groups, so it must be within "
        f"[1, flow.prompts_per_step = {cfg.flow.prompts_per_step}]",
    )
    _require(
        rl.kl_coef == 0,
        f"trainer.rl.kl_coef = {rl.kl_coef}: a KL penalty needs a frozen reference policy, which the trainer does "
        "not keep; set trainer.rl.kl_coef = 0 (the PPO clip against the proximal policy and TIS bound each update)",
    )
    ex = cfg.trainer.experts
    if ex.precision == "fp8":
        _require(
            ex.backend in ("auto", "cutedsl"),
            f"trainer.experts.precision = 'fp8' runs on the cutedsl backend only, not {ex.backend!r}: set "
            "trainer.experts.backend = 'cutedsl' (or 'auto'), or precision = 'bf16'",
        )
        _require(
            cfg.trainer.dtype == "bfloat16",
            f"trainer.experts.precision = 'fp8' quantizes bf16 tokens: set trainer.dtype = 'bfloat16' (is "
            f"{cfg.trainer.dtype!r})",
        )
        _require(
            m.hidden_size % 16 == 0 and m.moe_intermediate_size % 16 == 0,
            f"trainer.experts.precision = 'fp8' needs trainer.model.hidden_size ({m.hidden_size}) and "
            f"moe_intermediate_size ({m.moe_intermediate_size}) divisible by 16 (16-byte e4m3 rows for TMA)",
        )
    par = cfg.trainer.parallel
    _require(par.ep >= 1, f"trainer.parallel.ep must be >= 1, got {par.ep}")
    _require(
        m.n_routed_experts % par.ep == 0,
        f"trainer.parallel.ep = {par.ep} does not divide trainer.model.n_routed_experts = {m.n_routed_experts}; "
        "pick an expert-parallel size that divides the expert count",
    )
    d = cfg.trainer.data
    _require(d.seq_len >= 1 and d.batch_size >= 1, "trainer.data.seq_len and trainer.data.batch_size must be >= 1")
    _require(
        cfg.trainer.mode != "pretrain" or bool(d.path) or bool(d.sources),
        'trainer.mode = "pretrain" needs trainer.data.path (one file) or [[trainer.data.sources]] (a mixture)',
    )
    _validate_data_sources(d)
    _require(cfg.evaluator.every_n_versions >= 1, "evaluator.every_n_versions must be >= 1")
    _require(cfg.evaluator.chunk_cases >= 1, "evaluator.chunk_cases must be >= 1")
    _require(cfg.launch.gpus_per_node >= 1, f"launch.gpus_per_node must be >= 1, got {cfg.launch.gpus_per_node}")
    _require(0 < cfg.launch.master_port < 65536, f"launch.master_port {cfg.launch.master_port} is not a port")
    for name, spec in cfg.launch.roles.items():
        role = spec.role or name
        _require(
            role in ROLES or bool(spec.command),
            f"launch.roles.{name}: unknown role {role!r}; use one of {', '.join(ROLES)} or give a command",
        )
        _require(spec.replicas >= 0, f"launch.roles.{name}.replicas must be >= 0")
        _require(spec.max_restarts >= 0, f"launch.roles.{name}.max_restarts must be >= 0")
        _require(spec.restart_backoff_s >= 0, f"launch.roles.{name}.restart_backoff_s must be >= 0 (seconds)")
        if spec.cpus:
            try:
                parse_cpus(spec.cpus, f"launch.roles.{name}.cpus")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        gpus, key = spec.gpus_per_replica, f"launch.roles.{name}.gpus_per_replica"
        _require(gpus >= 0, f"{key} must be >= 0 (0 = no GPU), got {gpus}")
        _require(
            gpus <= cfg.launch.gpus_per_node,
            f"{key} = {gpus} exceeds launch.gpus_per_node = {cfg.launch.gpus_per_node}: a replica runs on one "
            "node; lower it or raise launch.gpus_per_node",
        )
        _require(
            role != "trainer" or gpus <= 1,
            f"{key} = {gpus}: a trainer rank drives one GPU; set 1 and raise launch.roles.{name}.replicas instead",
        )
        tp_var = ENV_PREFIX + "rollout__tensor_parallel_size"  # an entry may run its workers at another size
        tp_raw = spec.env.get(tp_var)
        tp = cfg.rollout.tensor_parallel_size
        if tp_raw is not None:
            tp = parse_value(tp_raw, int, f"launch.roles.{name}.env.{tp_var}")
        _require(
            role != "vllm" or gpus in (0, tp),
            f"{key} = {gpus} but the workers' rollout.tensor_parallel_size = {tp}: a vLLM worker uses one GPU per "
            f"tensor-parallel rank; set {key} = {tp} (or 0 for a worker without GPUs)",
        )
    if cfg.launch.roles:
        _require(
            any(spec.critical for spec in cfg.launch.roles.values()),
            "launch.roles: no entry is critical, so a launch would never end; set critical = true on one "
            "(usually the trainer)",
        )
