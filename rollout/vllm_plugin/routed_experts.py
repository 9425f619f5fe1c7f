"""Routed experts on vLLM 0.32's CPU build: make the V1 CPU model runner drive vLLM's aux-output connector.

With `--enable-return-routed-experts`, vLLM returns per request the top-k expert ids every MoE layer
chose at every position (`CompletionOutput.routed_experts`, [num_tokens - 1, num_layers, top_k]).
The scheduler side, the output processor and the capture/storage worker (`AuxOutputWorkerConnector`)
all exist, but only the V2 model runner drives that worker, and V2 needs Triton, which the CPU build
lacks. So on CPU the flag fails at start: `VllmConfig` rejects it ("AuxOutput Connector requires
Model Runner V2"; forcing V2 with VLLM_USE_V2_MODEL_RUNNER=1 fails with "Model Runner V2 requires
Triton"), and for MLA models (DeepSeek) next with "requires prefix caching", because vLLM's CPU
platform turns prefix caching off for MLA. `install` (vLLM 0.32, CPU platform only) therefore:
1. runs the config check as for a platform that brings its own runner (the check's own exemption
   for out-of-tree platforms) and, where the CPU platform disabled prefix caching, as if it were on:
   the connector needs from prefix caching only the requests' block hashes, which (2) supplies. All
   other checks still run; speculative decoding, which the driver (3) does not handle, is refused.
2. gives requests block hashes when prefix caching is off (the engine core computes them only for
   prefix caching or a KV connector): the connector keys the routing rows of full blocks by them and
   without keys keeps every full block of a running request in a fixed pool, which long requests
   exhaust. Prefix caching itself stays as vLLM set it.
3. wraps the V1 `CPUModelRunner`: once the model and KV cache exist it creates the connector (which
   binds the capture fn to every MoE router); each step begins with the scheduler's connector
   metadata; after the forward the step's rows go to the connector with the batch layout it reads
   (`_StepBatch`); after sampling its per-request output goes into
   `ModelRunnerOutput.aux_output_connector_output`. CPU serving is synchronous (no async
   scheduling), so one step at most is in flight.
Without the flag every wrapper is a no-op.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

_MARK = "_slipstream_routed_experts"


@dataclass
class _StepBatch:
    """What `AuxOutputWorkerConnector.prepare_output` reads of V2's InputBatch, for one V1 step."""

    req_ids: list[str]
    query_start_loc_np: np.ndarray  # [num_reqs + 1] offset of each request's first token in the step
    num_computed_tokens_np: np.ndarray  # [num_reqs] position of each request's first token in the step


def install() -> bool:
    """Patch the config check, the engine core and the V1 CPU runner; True when installed (or already)."""
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not vllm.__version__.startswith("0.32."):
        return False
    from vllm.config import VllmConfig
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(VllmConfig._verify_aux_output_compatibility, _MARK, False):
        return True
    _wrap(VllmConfig, "_verify_aux_output_compatibility", _verify)
    _wrap(EngineCore, "preprocess_add_request", _preprocess_add_request)
    _wrap(CPUModelRunner, "initialize_kv_cache", _initialize_kv_cache)
    _wrap(CPUModelRunner, "execute_model", _execute_model)
    _wrap(CPUModelRunner, "sample_tokens", _sample_tokens)
    return True


def _wrap(cls: type, name: str, wrapper) -> None:
    original = getattr(cls, name)

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        return wrapper(original, self, *args, **kwargs)

    setattr(method, _MARK, True)
    setattr(cls, name, method)


def _verify(original, config) -> None:
    if not config.aux_output_config.enabled or config.use_v2_model_runner:
        return original(config)
    if config.speculative_config is not None:
        raise ValueError(
            "--enable-return-routed-experts on vLLM's CPU build (V1 model runner, driven by Slipstream's plugin) "
            "does not support speculative decoding; drop --speculative-config or set "
            "rollout.return_routed_experts = false"
        )
    from vllm.platforms import current_platform

    cache = config.cache_config
    prefix_caching = cache.enable_prefix_caching
    current_platform.is_out_of_tree = lambda: True  # type: ignore[method-assign]  # an instance attribute shadows the method for this call
    cache.enable_prefix_caching = True
    try:
        original(config)
    finally:
        del current_platform.is_out_of_tree
        cache.enable_prefix_caching = prefix_caching


def _preprocess_add_request(original, core, request):
    if core.request_block_hasher is None and core.vllm_config.aux_output_config.enabled:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes

        hash_fn = get_hash_fn_by_name(core.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        _, hash_block_size = resolve_kv_cache_block_sizes(core.scheduler.kv_cache_config, core.vllm_config)
        core.request_block_hasher = get_request_block_hasher(hash_block_size, hash_fn)
    return original(core, request)


def _initialize_kv_cache(original, runner, kv_cache_config, is_profiling: bool = False, **kwargs) -> None:
    original(runner, kv_cache_config, is_profiling, **kwargs)
    runner._slipstream_aux = None
    runner._slipstream_pending = None
    if runner.vllm_config.aux_output_config.enabled and not is_profiling:
        from vllm.distributed.aux_output_connector.worker import get_aux_output_connector

        # Binds the capture fn to every MoE router; raises for a router type it cannot capture.
        runner._slipstream_aux = get_aux_output_connector(runner.model, runner.vllm_config, kv_cache_config)
        log.info("routed-experts capture on (V1 CPU model runner, driven by Slipstream's plugin)")


def _execute_model(original, runner, scheduler_output, *args, **kwargs):
    aux = getattr(runner, "_slipstream_aux", None)
    if aux is None:
        return original(runner, scheduler_output, *args, **kwargs)
    aux.begin_step(scheduler_output.aux_output_connector_metadata)
    result = original(runner, scheduler_output, *args, **kwargs)
    if result is None:  # the forward ran; sample_tokens follows
        n = runner.input_batch.num_reqs
        batch = _StepBatch(
            list(runner.input_batch.req_ids[:n]),
            runner.query_start_loc.np[: n + 1].copy(),
            runner.input_batch.num_computed_tokens_cpu[:n].copy(),
        )
        runner._slipstream_pending = aux.prepare_output(batch)
    return result


def _sample_tokens(original, runner, *args, **kwargs):
    output = original(runner, *args, **kwargs)
    pending = getattr(runner, "_slipstream_pending", None)
    if pending is None:
        return output
    runner._slipstream_pending = None
    # 1 where this step sampled a token for the request, 0 for a chunk of a prompt still being prefilled.
    sampled = np.array([len(output.sampled_token_ids[output.req_id_to_index[r]]) for r in pending.request_ids])
    pending.enqueue_cpu_copy(sampled, np.zeros_like(sampled))
    output.aux_output_connector_output = pending.process_output()
    return output
