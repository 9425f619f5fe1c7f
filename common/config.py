"""Configuration: one TOML file becomes a tree of typed dataclasses.

Every section is a dataclass whose fields carry a docstring (the string literal right under the
field; `slipstream show` prints it). Loading is strict: an unknown key is an error with a
"did you mean", a value of the wrong type is an error naming the full key path, and impossible
combinations are rejected by `validate`. Overrides come from `SLIPSTREAM__a__b=v` environment
variables and then `--set a.b=v`, both typed by the schema. Fields made with `identity(...)` define
what a run *is* (model shape, data, seed): a run resumes after runtime changes but refuses a
checkpoint whose identity differs (`identity_diff`).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import hashlib
import inspect
import json
import math
import os
import textwrap
import tomllib
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from common.net import is_loopback

ENV_PREFIX = "SLIPSTREAM__"


class ConfigError(ValueError):
    """A config value is unknown, mistyped or inconsistent; the message names the key and the fix."""


def identity(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, added: bool = False) -> Any:
    """A field that is part of the run's identity: changing it makes a different run. `added` marks a field
    introduced after checkpoints existed: left at its default it stays out of the identity fingerprint, so
    those checkpoints still resume."""
    return field(default=default, default_factory=factory, metadata={"identity": True, "added": added})


def _list(*items: Any) -> Any:
    return field(default_factory=lambda: list(items))


# ----------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------


@dataclass
class RunConfig:
    name: str = "demo"
    """Human name of the run; the launcher appends a short random suffix to form the experiment id."""
    root: str = "runs"
    """Directory that holds every run directory and the run registry (registry.sqlite)."""
    dir: str = ""
    """Run directory; empty means <root>/<experiment id>. Everything written at run time goes here."""
    seed: int = identity(0)
    """Seed of every random generator of the run (data order, sampling, initialisation)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest log level printed by every role."""


@dataclass
class RendezvousConfig:
    meet_dir: str = ""
    """Shared directory where the roles find Redis; empty means <run dir>/meet. SLIPSTREAM_MEET_DIR wins."""
    redis_server: str = "redis-server"
    """The redis-server binary the elected leader starts."""
    bind_host: str = "127.0.0.1"
    """Address Redis listens on; a routable address (or 0.0.0.0) for runs over several hosts (Redis always
    has a password, in the meet dir's 0600 redis.json)."""
    advertise_host: str = "auto"
    """Address written to redis.json for the others; auto = bind_host, or for a wildcard bind the host's
    one non-loopback address."""
    redis_port: int = 0
    """Port of Redis; 0 picks a free port."""
    redis_persistence: bool = True
    """Redis keeps an append-only file in the meet dir: a server restarted after its death (by the leader,
    or by a relaunch with --resume) has the run's state back. Off: the state lives only in memory."""
    wait_timeout_s: float = 60.0
    """How long a follower waits for the leader's redis.json before giving up with an error."""
    heartbeat_period_s: float = 2.0
    """Period at which every role refreshes its liveness key."""
    heartbeat_ttl_s: float = 10.0
    """Lifetime of a liveness key: a role whose key expired is considered dead."""
    leader_linger_s: float = 30.0
    """When the process that started Redis ends, how long it waits for the experiment's other processes
    to disconnect before stopping the server (torchrun-started trainer ranks end together, and the rank
    that won the election must not take Redis from a peer still writing its last state)."""


@dataclass
class RouterConfig:
    name: str = "default"
    """Router name; a second router with the same name in one experiment refuses to start."""
    bind_host: str = "127.0.0.1"
    """Address the router binds; a non-loopback address requires auth_token."""
    advertise_host: str = "auto"
    """Address in the URL the router publishes; auto = bind_host, or for a wildcard bind the address of the
    interface that routes to Redis."""
    port: int = 0
    """Port the router binds; 0 picks a free port (the URL is published in Redis)."""
    policy: Literal["least_outstanding", "round_robin", "affinity"] = "affinity"
    """Worker choice: least outstanding requests, round robin, or group affinity over least outstanding."""
    affinity_header: str = "X-Slipstream-Group"
    """Request header (or body field `slipstream_group`) whose value pins a request group to a worker."""
    affinity_overload_factor: float = 2.0
    """Leave the affinity worker when its outstanding requests exceed this factor times the pool's least."""
    max_retries: int = 2
    """Retries on another worker, only before any byte reached the client (transport errors, 408/425/429/5xx)."""
    health_interval_s: float = 1.0
    """Period of the active GET /health check of every worker."""
    health_timeout_s: float = 5.0
    """Timeout of one health check; a failing worker is evicted until it passes again."""
    auth_token: str = ""
    """Bearer token required from clients; empty disables auth (allowed only on loopback)."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest accepted request body; larger requests get 413."""


@dataclass
class PromptSourceConfig:
    name: str = identity("")
    """Source name: prefixes its problem ids (name/id) and is recorded per prompt in trained_prompts.jsonl."""
    format: Literal["auto", "jsonl", "parquet", "datasets", "arithmetic"] = identity("auto")
    """jsonl, parquet, datasets (a `Dataset.save_to_disk` directory), arithmetic (the seeded generator below,
    no path); auto = by the path (.jsonl/.json, .parquet, a directory)."""
    path: str = identity("")
    """File or directory of prompt/answer records (every format but arithmetic)."""
    weight: float = identity(1.0)
    """Share of the mixture: weight / sum of weights (> 0)."""
    verifier: Literal["auto", "math", "arithmetic", "exact", "import"] = identity("auto")
    """Reward of a completion: math (final answer, math-verify), arithmetic (first integer, exact), exact (last
    non-empty line equals the answer), import (verifier_import); auto = arithmetic for the generator, else math."""
    verifier_import: str = identity("")
    """`package.module:factory` called with this source's config, returning a callable (problem, completion) ->
    reward (verifier = import)."""
    prompt_key: str = identity("prompt")
    """Column (field) holding the prompt text."""
    answer_key: str = identity("answer")
    """Column (field) holding the reference answer (a string or a number)."""
    id_key: str = identity("id")
    """Column (field) holding a problem's id (unique within the source); a row without it, or every row when
    empty, is named <file stem>-<line or row number>."""
    shuffle: bool = identity(True)
    """Visit the rows in an order shuffled by `seed` (false: file order). The generator is random already."""
    repeat: bool = identity(False)
    """Cycle through the rows again, reshuffled each pass, instead of ending the mixture when they run out."""
    seed: int = identity(0)
    """Seed of this source's row order, and of the arithmetic generator."""
    num_problems: int = identity(100_000)
    """Problems of an arithmetic source."""
    min_operands: int = identity(2)
    """Fewest operands of an arithmetic problem."""
    max_operands: int = identity(2)
    """Most operands of an arithmetic problem."""
    max_value: int = identity(20)
    """Operands of an arithmetic problem are drawn from [0, max_value]."""
    operators: str = identity("+-")
    """Operators an arithmetic problem may use (a subset of "+-*")."""


@dataclass
class TaskConfig:
    kind: Literal["arithmetic", "jsonl_math", "import", "mixture"] = identity("arithmetic")
    """Prompt source and verifier: synthetic arithmetic, a JSONL math file, a user task (import_path), or a
    weighted mixture of sources, each with its own verifier (sources)."""
    path: str = identity("")
    """JSONL file of {"prompt", "answer"} records (kind = jsonl_math)."""
    import_path: str = identity("")
    """`package.module:factory` called with this TaskConfig, returning a Task (kind = import)."""
    seed: int = identity(0)
    """Seed of the arithmetic generator; held-out evaluation uses a different seed."""
    num_problems: int = identity(100_000)
    """Problems in the arithmetic source (the data ends after them)."""
    min_operands: int = identity(2)
    """Fewest operands of an arithmetic problem."""
    max_operands: int = identity(2)
    """Most operands of an arithmetic problem."""
    max_value: int = identity(20)
    """Operands are drawn from [0, max_value]."""
    operators: str = identity("+-")
    """Operators an arithmetic problem may use (a subset of "+-*")."""
    max_completion_chars: int = 4096
    """Verifiers read at most this many trailing characters of a completion (adversarial-size bound)."""
    verify_timeout_s: float = 5.0
    """Longest a symbolic answer comparison may take before the answer counts as wrong."""
    sources: list[PromptSourceConfig] = identity(factory=list, added=True)
    """Prompt sources of kind = mixture ([[rollout.task.sources]] tables, or on the command line
    --set 'rollout.task.sources=[{name = "a", ...}, ...]'); interleaved by weight, see rollout/tasks/mixture.py."""


@dataclass
class RolloutConfig:
    model: str = identity("tiny-deepseek")
    """Initial policy: an HF checkpoint directory, or a tiny-model kit name (tiny-deepseek, tiny-qwen3)."""
    served_model_name: str = "policy"
    """Model name that vLLM serves and clients put in requests."""
    max_model_len: int = 512
    """Longest prompt plus completion, in tokens."""
    dtype: str = "auto"
    """vLLM --dtype (auto, float32, bfloat16, ...)."""
    kv_cache_bytes: int = 128 * 1024 * 1024
    """KV-cache size in bytes on CPU (vLLM's default would ask for most of the machine's memory)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory vLLM may use (GPU only)."""
    bind_host: str = "127.0.0.1"
    """Address each vLLM worker's server binds; a non-loopback address requires rollout.api_key."""
    advertise_host: str = "auto"
    """Address in the URL a worker registers; auto = bind_host, or for a wildcard bind the address of the
    interface that routes to Redis."""
    api_key: str = ""
    """Bearer token every request to a vLLM worker must carry (every path but /health, the weight-update
    routes included); the router, publisher and evaluator send it. Set it through the environment
    (SLIPSTREAM__rollout__api_key) rather than a committed file."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallel size."""
    enforce_eager: bool = True
    """Skip CUDA graphs / torch.compile in vLLM (faster start; no speed loss for tiny models)."""
    return_routed_experts: bool = True
    """Have vLLM return, with every sample, the top-k experts each MoE layer chose at every position
    (`--enable-return-routed-experts`; `Sample.routed_experts`), for routing replay and mismatch telemetry.
    Only for models with MoE layers; costs about layers x top_k x 4/3 bytes per token of response."""
    extra_args: list[str] = _list()
    """More vLLM command-line arguments, passed through unchanged."""
    startup_timeout_s: float = 600.0
    """How long a worker may take to become ready (health plus one real completion)."""
    weight_backend: Literal["file", "nccl"] = "file"
    """Weight transfer: safetensors files under weight_dir (any machine) or vLLM's NCCL engine (GPUs)."""
    weight_dir: str = ""
    """Where published versions are written; empty means <run dir>/weights (use /dev/shm/... for speed)."""
    keep_versions: int = 2
    """Published version directories kept on disk; older ones are removed."""
    weight_shard_mb: int = 32
    """Size of the safetensors shards a published version is written as (MB; a bigger tensor gets its own)."""
    stream_weights: bool = True
    """Pause workers first and let them load each shard as soon as it is written (publish ~ max(write, load));
    false writes the whole version before pausing them (the pause window is then the load alone)."""
    pause_mode: Literal["keep", "abort", "wait"] = "keep"
    """How in-flight requests are treated during a weight update (keep = partial rollout)."""
    pool: Literal["train", "eval"] = "train"
    """Pool of a ROLE=vllm worker: train (routed, gets every publish) or eval (the evaluator pins its version)."""
    temperature: float = 1.0
    """Sampling temperature of rollouts."""
    top_p: float = 1.0
    """Nucleus sampling threshold of rollouts."""
    max_tokens: int = 64
    """Largest number of generated tokens per sample."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The task: where prompts come from and how completions are rewarded."""


@dataclass
class FlowConfig:
    strategy: Literal["on_policy", "one_step_off", "fully_async"] = "fully_async"
    """Flow controller: on-policy, one-step-off (generate t+1 while training t) or fully-async."""
    prompts_per_step: int = identity(8)
    """Prompt groups per optimizer step."""
    samples_per_prompt: int = identity(4)
    """Samples generated per prompt (the GRPO group size)."""
    max_concurrent: int = 64
    """Largest number of generation requests in flight at once (enforced at dispatch)."""
    max_untrained_prompts: int = 32
    """Fully-async admission control: in-flight plus buffered prompts never exceed this."""
    max_staleness: int = identity(2)
    """A sample whose oldest token was made by version < current - max_staleness is stale at consumption."""
    stale_policy: Literal["drop", "requeue"] = "requeue"
    """What happens to a stale sample's prompt: dropped (counted) or generated again."""
    partial_rollout: bool = True
    """In-flight requests survive weight updates (keep-mode pause) instead of being aborted."""
    end_of_data: Literal["train_partial", "drop"] = "train_partial"
    """At the end of the data, train the last partial batch or drop it."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop a group whose rewards are all equal and generate a new prompt in its place."""
    max_dynamic_refills_per_step: int = 32
    """Dynamic sampling drops at most this many groups per train step; past it, uniform groups are trained."""
    max_retries: int = 3
    """Retries of one generation request after a transient failure."""
    retry_backoff_s: float = 0.5
    """First retry delay; it doubles with every further retry."""
    error_budget: int = 32
    """Failed requests (after retries) tolerated in a run before the trainer stops with the last error."""
    request_timeout_s: float = 600.0
    """Longest a single generation request may take before it counts as failed."""


@dataclass
class ModelConfig:
    arch: Literal["deepseek_v3", "qwen3_moe"] = identity("deepseek_v3")
    """Architecture; decides the attention type and the HF naming (DeepseekV3 / Qwen3Moe)."""
    vocab_size: int = identity(128)
    """Vocabulary size (must match the tokenizer)."""
    hidden_size: int = identity(64)
    """Model width."""
    num_layers: int = identity(2)
    """Decoder layers."""
    first_k_dense: int = identity(1)
    """The first k layers use a dense SwiGLU MLP instead of experts."""
    intermediate_size: int = identity(128)
    """Width of the dense MLP."""
    moe_intermediate_size: int = identity(32)
    """Width of one expert (and of each shared expert)."""
    n_routed_experts: int = identity(8)
    """Routed experts per MoE layer."""
    n_shared_experts: int = identity(1)
    """Shared experts per MoE layer (0 for none)."""
    num_experts_per_tok: int = identity(2)
    """Experts each token is routed to (top-k)."""
    num_heads: int = identity(4)
    """Attention (query) heads."""
    num_kv_heads: int = identity(2)
    """Key/value heads (GQA only)."""
    head_dim: int = identity(32)
    """Head dimension (GQA only)."""
    q_lora_rank: int = identity(0)
    """MLA query low-rank dimension; 0 projects queries directly."""
    kv_lora_rank: int = identity(512)
    """MLA compressed key/value dimension."""
    qk_nope_head_dim: int = identity(32)
    """MLA per-head query/key dimension without rotary embedding."""
    qk_rope_head_dim: int = identity(64)
    """MLA per-head query/key dimension with rotary embedding."""
    v_head_dim: int = identity(32)
    """MLA per-head value dimension."""
    rope_theta: float = identity(10000.0)
    """RoPE base."""
    rms_norm_eps: float = identity(1e-6)
    """RMSNorm epsilon."""
    routed_scaling_factor: float = identity(1.0)
    """Scale applied to the routing weights after normalisation."""
    norm_topk_prob: bool = identity(True)
    """Normalise the top-k routing weights to sum to one."""
    n_group: int = identity(1)
    """Expert groups for group-limited routing (1 = off)."""
    topk_group: int = identity(1)
    """Groups each token may use under group-limited routing."""
    max_seq_len: int = identity(512)
    """Longest sequence the model is trained on."""
    tie_word_embeddings: bool = identity(False)
    """Share the input embedding with the output head."""


@dataclass
class ExpertsConfig:
    backend: Literal["auto", "reference", "grouped_mm"] = "auto"
    """Expert compute: auto picks the fastest that runs here; an explicit choice that cannot run fails."""


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate of dense parameters."""
    router_lr: float = 1e-3
    """Peak learning rate of router (gate) parameters."""
    expert_lr: float = 1e-3
    """Peak learning rate of routed-expert parameters."""
    betas: list[float] = _list(0.9, 0.95)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    warmup_tokens: int = 0
    """WSD schedule: tokens of linear warm-up."""
    decay_tokens: int = 0
    """WSD schedule: tokens of final decay (0 = constant after warm-up)."""
    total_tokens: int = 0
    """WSD schedule: total tokens of the run (the decay ends here); 0 = no decay."""
    min_lr_ratio: float = 0.0
    """Learning rate at the end of the decay, as a fraction of the peak."""
    bias_update_rate: float = 1e-3
    """Aux-loss-free balancing: step of the sign-based expert-bias update."""
    bias_update_decay: bool = True
    """Let the bias update step fall linearly to zero over the WSD decay phase (the bias is frozen at the end)."""
    seq_aux_loss_coef: float = 0.0
    """Coefficient of the sequence-wise balance loss (0 = off)."""
    muon: bool = identity(False)
    """Muon (orthogonalised momentum) for the 2-D dense matrices of the blocks; the rest stays on AdamW.
    Its rate is `lr`, rescaled to AdamW's update size."""
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov)."""


@dataclass
class ParallelConfig:
    ep: int = 1
    """Expert-parallel group size: routed experts are sharded over this many trainer ranks (RDEP); it must
    divide the number of ranks and n_routed_experts. The rest is data parallel (ranks / ep replicas)."""
    transport: Literal["auto", "p2p", "symm_mem"] = "auto"
    """How expert rows travel between ranks: p2p (torch.distributed point-to-point, CPU and GPU) or
    symm_mem (NVLink symmetric memory, GPUs); auto = p2p."""
    store_advertise_host: str = "auto"
    """Address of rank 0's process-group store that the other ranks are told when they bootstrap through
    Redis; auto = the address of rank 0's interface that routes to Redis (loopback when Redis is). torch's
    TCPStore listens on every interface, so there is no bind host to set. torchrun-style starts use
    MASTER_ADDR/MASTER_PORT instead."""


@dataclass
class DataSourceConfig:
    name: str = ""
    """Name of the source: its prepped shards live in <trainer.data.root>/<name>/ (letters, digits, _ . -)."""
    path: str = ""
    """Raw text: a .jsonl file, a .parquet file, a directory of those, or a `datasets` save_to_disk directory."""
    weight: float = 1.0
    """Relative sampling weight (any positive scale; the mixture normalises)."""
    temperature: float = 1.0
    """Sampling temperature: the source's probability is proportional to weight ** (1 / temperature)."""
    text_key: str = "text"
    """JSONL field / parquet or arrow column that holds the text."""


@dataclass
class DataConfig:
    path: str = identity("")
    """Pretraining data (trainer.mode = "pretrain"): a .jsonl file of texts or a .npy array of token ids,
    tokenized at start-up (a one-source mixture). For a mixture of prepped sources use `sources` instead."""
    sources: list[DataSourceConfig] = identity(factory=list, added=True)
    """Mixture of raw text sources ([[trainer.data.sources]] tables), tokenized beforehand by
    `slipstream prep CONFIG` into token shards under `root`; the whole list is part of the run's identity."""
    root: str = ""
    """Directory of prepped sources (one subdirectory per source name); empty = <run.root>/data, shared by
    every run under run.root (the run dir is not known before a launch picks the experiment id)."""
    shard_mb: float = 64.0
    """`slipstream prep`: MB of raw input text per token shard (the token stream does not depend on it)."""
    prep_processes: int = 0
    """`slipstream prep`: tokenizing processes (0 = one per CPU core)."""
    tokenizer: str = identity("")
    """HF tokenizer directory for text (empty: the rollout model's tokenizer when it is a local tiny one)."""
    text_key: str = identity("text")
    """Field of each JSONL object that holds the text (trainer.data.path)."""
    seq_len: int = identity(256)
    """Tokens per training row."""
    batch_size: int = identity(8)
    """Rows per micro-batch over all ranks (each of W ranks takes batch_size / W); times grad_accum per step."""


@dataclass
class CheckpointConfig:
    interval_steps: int = 10
    """Save a checkpoint every N optimizer steps (0 = not by steps); a run always saves at its end."""
    interval_minutes: float = 30.0
    """Also save when this many minutes passed since the last checkpoint (0 = not by time)."""
    keep: int = 2
    """Checkpoints kept on disk."""
    resume: bool = True
    """Resume from the newest checkpoint of the run dir if there is one."""


@dataclass
class RLConfig:
    normalize_std: bool = identity(True)
    """GRPO: divide group-centred rewards by the group's standard deviation."""
    filter_zero_variance: bool = identity(True)
    """Drop groups whose samples all got the same reward (their advantages are zero)."""
    clip_low: float = identity(0.2)
    """PPO ratio clip below 1 (ratio >= 1 - clip_low)."""
    clip_high: float = identity(0.28)
    """PPO ratio clip above 1 (ratio <= 1 + clip_high; a higher bound keeps exploration, as DAPO)."""
    tis_cap: float = identity(2.0)
    """Truncation of the behaviour-to-proximal importance weight (truncated importance sampling)."""
    kl_coef: float = identity(0.0)
    """Weight of the k3 KL estimate to the frozen reference policy (0 = no reference model)."""
    aggregation: Literal["token_mean", "seq_mean"] = identity("token_mean")
    """Loss aggregation: mean over all tokens of the batch, or mean over sequences of their token means."""
    micro_batch_samples: int = 16
    """Samples per forward/backward pass on each rank (memory knob; the gradient is the same)."""
    mini_batches: int = identity(1)
    """Optimizer updates per RL step (PPO mini-batches): the step's groups are cut, in order and whole, into
    this many mini-batches, each an update against the proximal log-probs of the weights that began the
    step (verl's ppo_mini_batch_size, AReaL's ppo_n_minibatches). Fewer when fewer groups carry a signal."""
    routing_replay: Literal["none", "rollout"] = identity("none")
    """Rollout routing replay (R3): `rollout` makes every MoE layer of the trainer use, for each token, the
    top-k experts vLLM chose when it generated (returned with rollout.return_routed_experts); the gate weights
    are still the trainer's own scores of those experts, so the router keeps its gradient. `none`: the
    trainer routes by itself (the rollout's routing is then only compared, as mismatch telemetry)."""
    token_mask_band: list[float] = identity(factory=list)
    """[low, high]: tokens whose behaviour-to-proximal importance weight falls outside the band are left out
    of the loss (IcePop-style token masking; e.g. [0.5, 2.0]). Empty = off."""
    seq_mask_band: list[float] = identity(factory=list)
    """[low, high]: a sample whose geometric-mean importance weight (exp of the mean per-token log ratio)
    falls outside the band is left out of the loss entirely (sequence-level masking). Empty = off."""


@dataclass
class WarmupConfig:
    steps: int = identity(0)
    """Supervised steps on the task's problems and reference answers before RL (0 = none)."""
    batch_size: int = identity(64)
    """Problems per supervised step."""
    lr: float = identity(3e-3)
    """Learning rate of the supervised warm start (constant)."""


@dataclass
class TrainerConfig:
    mode: Literal["rl", "pretrain"] = "rl"
    """What ROLE=trainer runs: RL through the flow controller, or next-token pretraining on trainer.data."""
    steps: int = 20
    """Steps of the run: optimizer steps when pretraining; RL steps (policy versions, each of
    trainer.rl.mini_batches optimizer updates) in RL."""
    device: str = "auto"
    """cpu, cuda or auto."""
    dtype: Literal["float32", "bfloat16"] = identity("float32")
    """Compute dtype (master weights and optimizer state stay fp32)."""
    init: str = identity("")
    """Initial weights: empty = fresh, or an HF checkpoint directory, or one of our checkpoints."""
    compile: bool = False
    """torch.compile each decoder block (GPUs: fuses the elementwise work around the GEMMs)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shape."""
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)
    """Expert compute backend."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the trainer's ranks share the model (expert parallelism; data parallelism over the rest)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Pretraining data (trainer.mode = "pretrain")."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    rl: RLConfig = field(default_factory=RLConfig)
    """The RL objective (GRPO advantages, decoupled PPO loss)."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """Supervised warm start before RL, so that rewards are not all zero at the start."""
    final_eval_wait_s: float = 300.0
    """At the end, how long the trainer waits for the evaluator's result of the last version (for its report)."""


@dataclass
class EvaluatorConfig:
    benchmarks: list[str] = _list("arithmetic")
    """Benchmarks evaluated on each evaluated policy version."""
    every_n_versions: int = 1
    """Evaluate every Nth published version."""
    data_root: str = "evaluator/data"
    """Root directory of the benchmarks' data files (nothing is downloaded)."""
    max_concurrent: int = 32
    """Evaluation requests in flight at once."""
    limit: int = 0
    """Evaluate only the first N cases of each benchmark (0 = all of them)."""
    max_tokens: int = 0
    """Cap on generated tokens per sample (0 keeps each benchmark's own); always clamped to the context left."""
    chunk_cases: int = 64
    """Cases generated between two checks of the served version; a moved or interrupted chunk is all that is redone."""
    router_wait_s: float = 600.0
    """How long the evaluator waits for the router and a served model behind it before failing."""
    request_timeout_s: float = 600.0
    """Seconds one evaluation request may take before it is retried."""
    until_version: int = -1
    """Exit (code 0) once this weight version is evaluated; -1 evaluates until stopped (eval-only runs: 0)."""
    pin: Literal["auto", "always", "never"] = "auto"
    """always: pin an eval-pool worker to each version; never: verify through the router; auto: pin if one exists."""


ROLES = ("trainer", "vllm", "router", "evaluator")


@dataclass
class RoleSpec:
    role: str = ""
    """Role run by this entry (trainer, vllm, router, evaluator); empty means the entry's name."""
    replicas: int = 1
    """Processes started for this entry."""
    critical: bool = False
    """The run ends when every critical entry has exited successfully."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of these processes."""
    command: str = ""
    """Command template; empty runs `slipstream run`. Fields: {python} {config} {role} {replica}."""
    restart: Literal["auto", "never", "on-failure"] = "auto"
    """on-failure: restart a replica that exits non-zero (up to max_restarts, after restart_backoff_s,
    doubling) instead of failing the run. auto: on-failure for every role (the router, vLLM workers and the
    evaluator rejoin a running experiment by themselves; the trainer resumes from its newest checkpoint, all
    of its ranks together); never for entries with their own command."""
    max_restarts: int = 3
    """Restarts allowed per replica when it restarts on failure."""
    restart_backoff_s: float = 1.0
    """Wait before a replica's first restart; each further restart of it waits twice as long."""
    node_group: str = ""
    """Entries with the same node group share nodes in `slipstream scripts` output (one Slurm hetjob component
    per group, pod affinity on Kubernetes); empty means the entry is a group of its own."""
    gpus_per_replica: int = 0
    """GPUs one replica uses on its node: 1 for a trainer rank, rollout.tensor_parallel_size for a vLLM
    worker, 0 for a process without GPUs. `slipstream scripts` packs replicas onto nodes by this count."""


@dataclass
class LaunchConfig:
    roles: dict[str, RoleSpec] = field(default_factory=dict)
    """Process entries started by `slipstream launch` / written by `slipstream scripts`."""
    stop_timeout_s: float = 10.0
    """Grace period between SIGTERM and SIGKILL when the launcher tears the run down."""
    gpus_per_node: int = 8
    """GPUs of one node of the cluster that `slipstream scripts` writes for; a node group takes as many
    nodes as its replicas need when packed by gpus_per_replica (a group without GPUs takes one)."""
    master_port: int = 29500
    """Port trainer rank 0 listens on for the process group when `slipstream scripts` starts the ranks
    torchrun-style (MASTER_PORT under Slurm and Kubernetes)."""
    image: str = "slipstream:latest"
    """Container image of every pod in the Kubernetes manifest; it must hold this checkout at the path
    `slipstream scripts` ran from, with the same Python."""
    shared_volume_size: str = "100Gi"
    """Size requested by the manifest's ReadWriteMany volume, mounted at the run dir in every pod (meet
    dir, published weights and checkpoints live there)."""
    dash: bool = False
    """Serve the run dashboard (`slipstream dash`) from the launcher on loopback while the run goes on, and
    print its URL; for a bind beyond loopback run `slipstream dash --host H --token T` instead."""
    dash_port: int = 0
    """Port of the launcher's dashboard; 0 picks a free one (printed)."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    """Run naming, directories and seed."""
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)
    """How roles find Redis."""
    router: RouterConfig = field(default_factory=RouterConfig)
    """The router in front of the vLLM workers."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """vLLM rollout workers and weight sync."""
    flow: FlowConfig = field(default_factory=FlowConfig)
    """Flow control between generation and training."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The trainer."""
    evaluator: EvaluatorConfig = field(default_factory=EvaluatorConfig)
    """The evaluator."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """Processes of a local or multi-node launch."""


# ----------------------------------------------------------------------------------------------
# Schema introspection
# ----------------------------------------------------------------------------------------------


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Docstrings of a dataclass's fields: the string literal right below each annotated field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in typing.get_args(tp))}]"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def _suggest(key: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, list(options), n=1, cutoff=0.5)
    if close:
        return f"did you mean '{close[0]}'?"
    return f"valid keys: {', '.join(options)}"


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check a TOML value against a schema type and return the typed value."""
    origin = typing.get_origin(tp)
    if _is_dataclass_type(tp):
        if isinstance(value, tp):  # a --set list of tables, typed (and checked) when the override was parsed
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a table ([{path}]), got {type(value).__name__} {value!r}")
        return _build(tp, value, path)
    if origin is Literal:
        options = typing.get_args(tp)
        if value not in options:
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(repr(o) for o in options)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list ({_type_name(tp)}), got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a table ({_type_name(tp)}), got {value!r}")
        _, val_tp = typing.get_args(tp)
        return {str(k): _coerce(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{path}: {value!r} matches none of {_type_name(tp)}")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f'{path}: expected a string (quote it: "{value}"), got {value!r}')
        return value
    raise TypeError(f"{path}: unsupported schema type {tp!r}")


def _build(cls: type, data: Mapping[str, Any], path: str) -> Any:
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else key
        if key not in hints:
            raise ConfigError(f"unknown key '{full}': {_suggest(key, names)}")
        kwargs[key] = _coerce(value, hints[key], full)
    return cls(**kwargs)


def _schema_type(path: Sequence[str]) -> Any:
    """The schema type at a dotted key path (dict keys included), or ConfigError naming the path."""
    tp: Any = Config
    walked: list[str] = []
    for part in path:
        walked.append(part)
        if _is_dataclass_type(tp):
            hints = _hints(tp)
            if part not in hints:
                names = [f.name for f in dataclasses.fields(tp)]
                raise ConfigError(f"unknown key '{'.'.join(walked)}': {_suggest(part, names)}")
            tp = hints[part]
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        else:
            raise ConfigError(f"'{'.'.join(walked[:-1])}' is a {_type_name(tp)}, it has no key '{part}'")
    return tp


def parse_value(raw: str, tp: Any, path: str) -> Any:
    """Parse an override's text by the schema type of its key."""
    origin = typing.get_origin(tp)
    if tp is str or (origin is Literal and all(isinstance(a, str) for a in typing.get_args(tp))):
        text = raw
        if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
            text = raw[1:-1]
        return _coerce(text, tp, path)
    if tp is bool:
        lowered = raw.strip().lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{path}: expected true or false, got {raw!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        raise ConfigError(f"{path}: cannot read {raw!r} as {_type_name(tp)}") from None
    return _coerce(value, tp, path)


def _set_path(data: dict[str, Any], path: Sequence[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"'{part}' is not a table; cannot set '{'.'.join(path)}'")
        node = child
    node[path[-1]] = value


def apply_override(data: dict[str, Any], assignment: str, source: str) -> None:
    """Apply one `a.b.c=value` override to raw config data, typed by the schema."""
    key, sep, raw = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"{source}: expected KEY=VALUE, for example trainer.optim.lr=3e-4")
    parts = key.split(".")
    try:
        tp = _schema_type(parts)
        if _is_dataclass_type(tp):
            raise ConfigError(f"{key}: is a section; set one of its keys, e.g. {key}.<field>=...")
        _set_path(data, parts, parse_value(raw.strip(), tp, key))
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def env_overrides(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """(variable, `a.b=v`) for every `SLIPSTREAM__a__b=v` environment variable, sorted for determinism."""
    out = []
    for name in sorted(environ):
        if name.startswith(ENV_PREFIX):
            key = name[len(ENV_PREFIX) :].replace("__", ".")
            out.append((name, f"{key}={environ[name]}"))
    return out


def from_dict(data: Mapping[str, Any]) -> Config:
    """Typed, validated config from raw TOML data."""
    cfg = _build(Config, data, "")
    validate(cfg)
    return cfg


def load_config(
    path: str | os.PathLike[str] | None,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Read a TOML file (None = all defaults), apply env then --set overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist; pass a TOML file, e.g. configs/demo.toml")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    for name, assignment in env_overrides(os.environ if environ is None else environ):
        apply_override(data, assignment, source=f"environment variable {name}")
    for assignment in overrides:
        apply_override(data, assignment, source=f"--set {assignment}")
    return from_dict(data)


# ----------------------------------------------------------------------------------------------
# Validation of combinations
# ----------------------------------------------------------------------------------------------


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
        _require(not t.sources, f"rollout.task.sources is read only by kind = 'mixture' (kind is {t.kind!r}): "
                                "set rollout.task.kind = 'mixture' or drop the sources")  # fmt: skip
        return
    _require(bool(t.sources), "rollout.task.kind = 'mixture' needs [[rollout.task.sources]] tables (name, path, "
                              "weight, verifier), or format = 'arithmetic' sources")  # fmt: skip
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
        _require(bool(src.path), f"{key} has no path: give a .jsonl/.parquet file or a datasets directory, or "
                                 "format = 'arithmetic' for the generator")  # fmt: skip
        path = Path(src.path)
        _require(path.exists(), f"{key}.path {src.path!r} does not exist (relative paths are from {os.getcwd()})")
        fmt = source_format(src)
        _require(bool(fmt), f"{key}.path {src.path!r}: cannot tell the format from its name; set format = 'jsonl', "
                            "'parquet' or 'datasets'")  # fmt: skip
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
        "flow.dynamic_sampling drops groups whose rewards are all equal, which a group of one sample always is: "
        "set flow.samples_per_prompt >= 2",
    )
    _require(f.max_staleness >= 0, f"flow.max_staleness must be >= 0, got {f.max_staleness}")
    if f.strategy == "fully_async":
        _require(
            f.max_untrained_prompts >= f.prompts_per_step,
            f"flow.max_untrained_prompts ({f.max_untrained_prompts}) is below flow.prompts_per_step "
            f"({f.prompts_per_step}): a batch could never fill; raise max_untrained_prompts",
        )
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
        "trainer.rl.routing_replay = \"rollout\" replays the experts the workers return: set "
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


# ----------------------------------------------------------------------------------------------
# Walking, printing, identity
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Leaf:
    path: str
    value: Any
    doc: str
    identity: bool
    fingerprinted: bool = False
    """Part of the identity fingerprint: an identity field, unless an `added` one still at its default."""


def leaves(obj: Any, prefix: str = "") -> Iterator[Leaf]:
    """Every scalar/list field of a config tree in declaration order, with its docstring."""
    docs = field_docs(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from leaves(value, path + ".")
        elif isinstance(value, dict) and value and all(dataclasses.is_dataclass(v) for v in value.values()):
            for key, sub in value.items():
                yield from leaves(sub, f"{path}.{key}.")
        else:
            ident = bool(f.metadata.get("identity"))
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            fingerprinted = ident and not (f.metadata.get("added") and value == default)
            yield Leaf(path, value, docs.get(f.name, ""), ident, fingerprinted)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if dataclasses.is_dataclass(value):  # an item of a list of tables (trainer.data.sources), inline
        items = (f"{f.name} = {_toml_value(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def _tables(obj: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    yield prefix, obj
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _tables(value, f"{prefix}.{f.name}" if prefix else f.name)
        elif isinstance(value, dict) and value and all(dataclasses.is_dataclass(v) for v in value.values()):
            for key, sub in value.items():
                yield from _tables(sub, f"{prefix}.{f.name}.{key}" if prefix else f"{f.name}.{key}")


def render(cfg: Config, with_docs: bool = True) -> str:
    """The resolved config as TOML; with docs, every field is preceded by its docstring."""
    lines: list[str] = []
    for table, obj in _tables(cfg, ""):
        scalars = [
            f
            for f in dataclasses.fields(obj)
            if not dataclasses.is_dataclass(getattr(obj, f.name))
            and not (
                isinstance(getattr(obj, f.name), dict)
                and getattr(obj, f.name)
                and all(dataclasses.is_dataclass(v) for v in getattr(obj, f.name).values())
            )
        ]
        if not table or not scalars:
            continue
        lines.append(f"[{table}]")
        docs = field_docs(type(obj))
        for f in scalars:
            if with_docs:
                mark = " (identity)" if f.metadata.get("identity") else ""
                lines.append(f"# {docs.get(f.name, '')}{mark}")
            lines.append(f"{f.name} = {_toml_value(getattr(obj, f.name))}")
        lines.append("")
    return "\n".join(lines)


def diff(a: Config, b: Config) -> list[tuple[str, Any, Any]]:
    """(path, value in a, value in b) for every leaf that differs; entries only in one side included."""
    left = {leaf.path: leaf.value for leaf in leaves(a)}
    right = {leaf.path: leaf.value for leaf in leaves(b)}
    missing = object()
    out = []
    for path in list(left) + [p for p in right if p not in left]:
        va, vb = left.get(path, missing), right.get(path, missing)
        if va != vb:
            out.append((path, None if va is missing else va, None if vb is missing else vb))
    return out


def identity_diff(a: Config, b: Config) -> list[str]:
    """Paths of identity fields that differ: a non-empty list means b is a different run than a."""
    ident = {leaf.path for leaf in leaves(a) if leaf.identity}
    return [path for path, _, _ in diff(a, b) if path in ident]


def identity_fingerprint(cfg: Config) -> str:
    """Short hash of the identity fields, stored with checkpoints (`added` fields at their default left out)."""
    blob = json.dumps([(leaf.path, leaf.value) for leaf in leaves(cfg) if leaf.fingerprinted], default=dataclasses.asdict)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def to_toml(cfg: Config) -> str:
    """The full config as TOML text that `load_config` reads back to an equal config."""
    return render(cfg, with_docs=False)
