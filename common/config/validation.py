"""Validation of a whole config: every section checks itself (its `check()`, next to its fields), and
`validate` adds the few checks that tie two sections together, naming the keys and the fix.
"""

from __future__ import annotations

from common.config.coerce import ENV_PREFIX, parse_value, require
from common.config.schema import Config


def validate(cfg: Config) -> None:
    """Reject a config that cannot work: each section's own checks, then those across sections."""
    for section in (
        cfg.rendezvous,
        cfg.router,
        cfg.rollout,
        cfg.flow,
        cfg.trainer,
        cfg.evaluator,
        cfg.launch,
        cfg.metrics,
    ):
        section.check()
    f, ro, rl = cfg.flow, cfg.rollout, cfg.trainer.rl
    # A policy runs one_step_off at any staleness (`slipstream simulate --strategies all` does, next to fully_async
    # at max_staleness 0), so FlowConfig.check allows it; a config that asks for it contradicts itself.
    require(
        f.strategy != "one_step_off" or f.max_staleness >= 1,
        "flow.strategy = 'one_step_off' trains on samples one step old: set flow.max_staleness >= 1",
    )
    require(
        not f.partial_rollout or ro.pause_mode == "keep",
        f"flow.partial_rollout = true needs rollout.pause_mode = 'keep' (is {ro.pause_mode!r})",
    )
    require(
        rl.routing_replay == "none" or ro.return_routed_experts,
        'trainer.rl.routing_replay = "rollout" replays the experts the workers return: set '
        "rollout.return_routed_experts = true",
    )
    require(
        1 <= rl.mini_batches <= f.prompts_per_step,
        f"trainer.rl.mini_batches = {rl.mini_batches}: a mini-batch holds whole prompt groups, so it must be within "
        f"[1, flow.prompts_per_step = {f.prompts_per_step}]",
    )
    require(
        cfg.trainer.mode != "rl" or ro.temperature > 0,
        f"rollout.temperature = {ro.temperature}: RL needs sampling (vLLM samples greedily at 0, every sample of "
        "a group is then the same and its log-probs are not of the distribution sampled): set rollout.temperature "
        "> 0 (1 samples the model's own distribution)",
    )
    tp_var = ENV_PREFIX + "rollout__tensor_parallel_size"  # an entry may run its workers at another size
    for name, spec in cfg.launch.roles.items():
        tp_raw = spec.env.get(tp_var)
        tp = (
            ro.tensor_parallel_size if tp_raw is None else parse_value(tp_raw, int, f"launch.roles.{name}.env.{tp_var}")
        )
        key = f"launch.roles.{name}.gpus_per_replica"
        require(
            (spec.role or name) != "vllm" or spec.gpus_per_replica in (0, tp),
            f"{key} = {spec.gpus_per_replica} but the workers' rollout.tensor_parallel_size = {tp}: a vLLM worker "
            f"uses one GPU per tensor-parallel rank; set {key} = {tp} (or 0 for a worker without GPUs)",
        )
