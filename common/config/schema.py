"""The schema, second half: the trainer's sections (model, experts, optimizer, parallelism, data,
checkpoints, the RL objective, the warm start), the evaluator's and the root `Config` that holds every
section. Dataclasses, their field docstrings and each section's own `check()`; the run, rendezvous,
router, rollout and flow sections are in sections.py, the launcher's in launch.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from common.config.coerce import require
from common.config.launch import LaunchConfig
from common.config.sections import (
    FlowConfig,
    RendezvousConfig,
    RolloutConfig,
    RouterConfig,
    RunConfig,
    _list,
    identity,
)


@dataclass
class ModelConfig:
    arch: Literal["deepseek_v3", "qwen3_moe", "mixtral"] = identity("deepseek_v3")
    """Architecture; decides the attention, the routing and the HF naming. deepseek_v3: MLA, sigmoid routing
    (DeepseekV3ForCausalLM); qwen3_moe: GQA with per-head q/k RMSNorm, softmax routing (Qwen3MoeForCausalLM);
    mixtral: GQA without q/k norm, softmax top-k renormalised, every layer MoE, no shared experts
    (MixtralForCausalLM: experts `block_sparse_moe.experts.N.{w1,w2,w3}`)."""
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
    rope_scaling: Literal["none", "yarn"] = identity("none", added=True)
    """RoPE context extension: none, or yarn (every released DeepSeek-V3 / R1 / Kimi-K2 / Moonlight checkpoint,
    Qwen3's long context): slow rotary frequencies divided by rope_factor, cos/sin and (MLA) the softmax scale
    corrected by the rope_mscale terms. The rope_* fields below apply to yarn only."""
    rope_factor: float = identity(1.0, added=True)
    """YaRN: how many times the original context is extended (> 1); positions reach rope_factor *
    rope_original_max_len (HF `factor`)."""
    rope_original_max_len: int = identity(0, added=True)
    """YaRN: the context length the model was pretrained with (HF `original_max_position_embeddings`)."""
    rope_beta_fast: float = identity(32.0, added=True)
    """YaRN: frequencies turning at least this many times over the original context keep their speed."""
    rope_beta_slow: float = identity(1.0, added=True)
    """YaRN: frequencies turning at most this many times over the original context are divided by rope_factor;
    a linear ramp over the frequency index blends the two between beta_fast and beta_slow."""
    rope_mscale: float = identity(1.0, added=True)
    """YaRN: cos and sin are scaled by m(rope_mscale) / m(rope_mscale_all_dim), m(s) = 1 + 0.1 s ln(rope_factor)
    (HF `mscale`)."""
    rope_mscale_all_dim: float = identity(0.0, added=True)
    """YaRN: MLA's softmax scale is multiplied by m(rope_mscale_all_dim)^2; 0 leaves it and makes the cos/sin
    scale m(rope_mscale) alone (HF `mscale_all_dim`; DeepSeek-V3 and Kimi-K2 set it and rope_mscale to 1)."""
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

    def check(self) -> None:
        require(
            0 <= self.first_k_dense <= self.num_layers, "trainer.model.first_k_dense must be within [0, num_layers]"
        )
        require(
            1 <= self.num_experts_per_tok <= self.n_routed_experts,
            f"trainer.model.num_experts_per_tok ({self.num_experts_per_tok}) must be within [1, n_routed_experts "
            f"({self.n_routed_experts})]",
        )
        require(
            self.n_routed_experts % self.n_group == 0 and 1 <= self.topk_group <= self.n_group,
            "trainer.model.n_group must divide n_routed_experts and topk_group must be within [1, n_group]",
        )
        if self.arch in ("qwen3_moe", "mixtral"):
            require(
                self.num_heads % self.num_kv_heads == 0, "trainer.model.num_heads must be a multiple of num_kv_heads"
            )
        if self.arch == "mixtral":
            self._check_mixtral()
        self._check_rope_scaling()

    def _check_mixtral(self) -> None:
        """Mixtral has none of these knobs: each one set would train a model that MixtralForCausalLM (and vLLM)
        cannot express."""
        fixed = (
            ("first_k_dense", 0, "0", "every Mixtral layer is MoE"),
            ("n_shared_experts", 0, "0", "Mixtral has no shared experts"),
            ("n_group", 1, "1", "Mixtral has no group-limited routing"),
            ("routed_scaling_factor", 1.0, "1.0", "Mixtral does not scale routing weights"),
            ("norm_topk_prob", True, "true", "Mixtral always renormalises its top-k weights"),
        )
        for name, value, toml, why in fixed:
            require(
                getattr(self, name) == value,
                f"trainer.model.{name} = {getattr(self, name)!r} with arch = 'mixtral': {why}; set {name} = {toml}",
            )

    def _check_rope_scaling(self) -> None:
        yarn_fields = {
            "rope_factor": 1.0,
            "rope_original_max_len": 0,
            "rope_beta_fast": 32.0,
            "rope_beta_slow": 1.0,
            "rope_mscale": 1.0,
            "rope_mscale_all_dim": 0.0,
        }
        if self.rope_scaling == "none":
            for name, default in yarn_fields.items():
                require(
                    getattr(self, name) == default,
                    f"trainer.model.{name} = {getattr(self, name)} has no effect with rope_scaling = 'none': set "
                    f"rope_scaling = 'yarn' or leave {name} at {default}",
                )
            return
        require(
            self.rope_factor > 1.0,
            f"trainer.model.rope_factor = {self.rope_factor}: YaRN extends the context, so it must be > 1 "
            "(rope_scaling = 'none' for no extension)",
        )
        require(
            self.rope_original_max_len >= 1,
            "trainer.model.rope_original_max_len must be the pretraining context length (HF "
            f"original_max_position_embeddings) under rope_scaling = 'yarn', is {self.rope_original_max_len}",
        )
        require(
            self.max_seq_len <= self.rope_factor * self.rope_original_max_len,
            f"trainer.model.max_seq_len = {self.max_seq_len} exceeds rope_factor * rope_original_max_len = "
            f"{self.rope_factor * self.rope_original_max_len}, the longest context YaRN extends to (vLLM serves no "
            "further): raise rope_factor or lower max_seq_len",
        )
        require(
            0 < self.rope_beta_slow <= self.rope_beta_fast,
            f"trainer.model.rope_beta_slow = {self.rope_beta_slow} must be > 0 and <= rope_beta_fast = "
            f"{self.rope_beta_fast} (rotation counts; DeepSeek-V3: beta_fast 32, beta_slow 1)",
        )
        require(
            self.rope_mscale > 0 and self.rope_mscale_all_dim >= 0,
            f"trainer.model.rope_mscale = {self.rope_mscale} must be > 0 and rope_mscale_all_dim = "
            f"{self.rope_mscale_all_dim} >= 0",
        )
        # transformers reads mscale only together with mscale_all_dim (alone it is taken as 1), vLLM always:
        # a lone mscale other than 1 would serve a different model than the one trained.
        require(
            self.rope_mscale_all_dim > 0 or self.rope_mscale == 1.0,
            f"trainer.model.rope_mscale = {self.rope_mscale} with rope_mscale_all_dim = 0: transformers ignores "
            "mscale unless mscale_all_dim is set; set rope_mscale = 1 or a rope_mscale_all_dim > 0",
        )
        require(
            self.arch == "deepseek_v3" or self.rope_mscale_all_dim == 0,
            f"trainer.model.rope_mscale_all_dim = {self.rope_mscale_all_dim}: only MLA (arch = 'deepseek_v3') scales "
            "its softmax by it (vLLM's Qwen3-MoE reads neither mscale field); set 0 for arch = 'qwen3_moe'",
        )


@dataclass
class ExpertsConfig:
    backend: Literal["auto", "reference", "grouped_mm", "cutedsl"] = "auto"
    """Expert compute: auto picks the fastest that runs here; an explicit choice that cannot run fails.
    cutedsl: our CuTeDSL grouped GEMM (Hopper, bf16, the `gpu` extra); auto does not pick it (parity with
    grouped_mm on the H200, not faster)."""
    precision: Literal["bf16", "fp8"] = "bf16"
    """fp8: the forward and dgrad expert GEMMs in FP8 e4m3 with DeepSeek-V3 block scales (1x128 tokens, 128x128
    weights), wgrad in bf16; runs on the cutedsl backend only (auto picks it), needs trainer.dtype = bfloat16."""

    def check(self) -> None:
        if self.precision == "fp8":
            require(
                self.backend in ("auto", "cutedsl"),
                f"trainer.experts.precision = 'fp8' runs on the cutedsl backend only, not {self.backend!r}: set "
                "trainer.experts.backend = 'cutedsl' (or 'auto'), or precision = 'bf16'",
            )


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
    """Micro-batches accumulated per optimizer step: pretraining takes grad_accum batches of
    trainer.data.batch_size rows per step; RL computes each optimizer update in at least grad_accum
    micro-batches per rank (more when trainer.rl.micro_batch_samples asks; at most one per sample). The
    update is the same either way (the loss is normalised by the update's global count)."""
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

    def check(self) -> None:
        require(self.grad_accum >= 1, "trainer.optim.grad_accum must be >= 1")
        require(len(self.betas) == 2, "trainer.optim.betas must hold two numbers, e.g. [0.9, 0.95]")


@dataclass
class ParallelConfig:
    ep: int = 1
    """Expert-parallel group size: routed experts are sharded over this many trainer ranks (RDEP); it must
    divide the number of ranks and n_routed_experts. The rest is data parallel (ranks / ep replicas)."""
    dp_shard: int = 1
    """FSDP2 degree of the dense weights (attention, dense MLPs, shared experts, router gates, norms,
    embeddings, LM head): each is sharded on dim 0 over this many ranks, and replicated over the other
    ranks / (ep * dp_shard) replicas and the ep ranks (HSDP). The ranks are dp_replicate x dp_shard x ep, ep
    innermost; ep * dp_shard must divide them. 1 = the dense weights are replicated (trainer/fsdp.py)."""
    reshard_after_forward: bool = True
    """With dp_shard > 1: free each block's gathered weights after its forward and gather them again for
    the backward (less memory, one more all-gather per block and step), as torch's fully_shard default."""
    transport: Literal["auto", "p2p", "symm_mem"] = "auto"
    """How expert rows travel between ranks: p2p (torch.distributed point-to-point, CPU and GPU) or
    symm_mem (NVLink symmetric memory, GPUs); auto = p2p."""
    store_advertise_host: str = "auto"
    """Address of rank 0's process-group store that the other ranks are told when they bootstrap through
    Redis; auto = the address of rank 0's interface that routes to Redis (loopback when Redis is). Rank 0's
    store listens on this address only, so it must be one of rank 0's own; gloo and NCCL use its interface.
    torchrun-style starts use MASTER_ADDR/MASTER_PORT instead (rank 0 listens on MASTER_ADDR)."""
    command_timeout_s: float = 1800.0
    """How long the other ranks wait for rank 0's next command. Between two commands rank 0 may wait for
    rollouts (every worker restarting, a slow generation, a loaded machine), so this is far longer than the
    collectives' own timeout (two minutes); a rank that died is caught sooner, by the rank watch."""

    def check(self) -> None:
        require(self.ep >= 1, f"trainer.parallel.ep must be >= 1, got {self.ep}")
        require(self.dp_shard >= 1, f"trainer.parallel.dp_shard must be >= 1, got {self.dp_shard}")
        require(
            self.command_timeout_s > 0, f"trainer.parallel.command_timeout_s must be > 0, got {self.command_timeout_s}"
        )


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

    def check(self, key: str) -> None:
        """This source's own knobs; `key` names it in errors (the names' uniqueness is DataConfig's check)."""
        require(
            bool(self.name) and all(c.isalnum() or c in "_.-" for c in self.name) and self.name not in (".", ".."),
            f"{key}.name = {self.name!r}: give a name of letters, digits, '_', '.' or '-' (it names a directory)",
        )
        require(bool(self.path), f"{key} ({self.name!r}) has no path; set it to a .jsonl/.parquet file or directory")
        require(self.weight > 0, f"{key}.weight = {self.weight} must be > 0 (drop the source to leave it out)")
        require(self.temperature > 0, f"{key}.temperature = {self.temperature} must be > 0 (1 = weights as given)")


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

    def check(self) -> None:
        require(
            self.seq_len >= 1 and self.batch_size >= 1, "trainer.data.seq_len and trainer.data.batch_size must be >= 1"
        )
        require(
            not (self.path and self.sources),
            "trainer.data.path and trainer.data.sources are both set: keep one (a path is a mixture of one source)",
        )
        require(self.shard_mb > 0, f"trainer.data.shard_mb must be > 0 (MB of input per shard), got {self.shard_mb}")
        require(
            self.prep_processes >= 0,
            f"trainer.data.prep_processes must be >= 0 (0 = one per core): {self.prep_processes}",
        )
        seen: set[str] = set()
        for i, src in enumerate(self.sources):
            key = f"trainer.data.sources[{i}]"
            src.check(key)
            require(
                src.name not in seen, f"{key}.name = {src.name!r} is used by an earlier source; names must be unique"
            )
            seen.add(src.name)


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
class CriticConfig:
    """The value model of trainer.rl.algorithm = "ppo" (trainer/rl/critic.py): a copy of the policy's trunk
    with a scalar head, trained beside the policy on the same mini-batches."""

    lr: float = identity(2e-3, added=True)
    """The critic's AdamW learning rate (every group: dense, router, experts; the other optimizer knobs and the
    schedule are trainer.optim's). A critic learns faster than the policy may (verl's critic rate is 10x the
    actor's): its head starts at 0. On the demo's task 2e-3 (13x the demo's policy rate) learned as well as
    GRPO in 15 steps, 5e-4 a little less (bench/ppo_learning.py)."""
    warmup_steps: int = identity(0, added=True)
    """The first N RL steps train only the critic: the policy is not updated (its published weights do not
    change), so its first updates see a trained critic instead of the zero-initialised head's 0. Off by
    default: with whitened advantages a critic that knows only the mean reward is no better than none, and
    two warm-up steps of the demo's 15 learned less (+14 against +17 held-out points, one seed)."""
    value_clip: float = identity(0.2, added=True)
    """Clip of the new value around the old one in the value loss (PPO's value clipping; the seed's and verl's
    cliprange_value); 0 = off."""

    def check(self) -> None:
        require(self.lr > 0, f"trainer.rl.critic.lr = {self.lr}: give the critic a positive learning rate (e.g. 5e-4)")
        require(
            self.warmup_steps >= 0,
            f"trainer.rl.critic.warmup_steps = {self.warmup_steps}: give 0 (no warm-up) or a positive step count",
        )
        require(
            self.value_clip >= 0,
            f"trainer.rl.critic.value_clip = {self.value_clip}: give 0 (off) or a positive clip (e.g. 0.2)",
        )


@dataclass
class RLConfig:
    algorithm: Literal["grpo", "ppo"] = identity("grpo", added=True)
    """grpo: critic-free group advantages (each sample's reward against its group's). ppo: a learned value
    model (trainer.rl.critic) and per-token GAE advantages (gamma, gae_lambda), whitened over the step."""
    gamma: float = identity(1.0, added=True)
    """ppo: discount of GAE per token (1 = undiscounted, verl's default: an RLVR reward comes at the end)."""
    gae_lambda: float = identity(1.0, added=True)
    """ppo: GAE's lambda. 1 makes each token's advantage the sample's return minus the token's value (no bias
    from an untrained critic, the variance of a Monte Carlo return), verl's default (its algorithm.lam);
    smaller values lean on the critic's later values, which helps only once the critic is good."""
    dual_clip: float = identity(0.0, added=True)
    """Dual-clip PPO (both algorithms): for negative advantages the surrogate is bounded below by
    dual_clip * A, so a token whose ratio grew far past the clip cannot dominate the update. 0 = off, else
    a constant > 1 (3.0 in the dual-clip paper and verl's clip_ratio_c)."""
    whiten_advantages: bool = identity(True, added=True)
    """ppo: whiten the token advantages (subtract the mean, divide by the std) over every completion token of
    the step, on every rank alike (global, token-level)."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """ppo: the value model and its optimizer (ignored by grpo)."""
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
    """Weight of the KL estimate to the frozen reference policy (`kl_estimator`), added to the loss with the
    policy-gradient term's aggregation. 0 = no KL term (and no reference model unless `log_kl`)."""
    kl_estimator: Literal["k1", "k2", "k3"] = identity("k3", added=True)
    """Per-token estimator of KL(policy || reference) from a sampled token, with r = ref / policy:
    k1 = -log r; k2 = 0.5 * (log r)^2; k3 = r - 1 - log r. As values, k1 and k3 are unbiased for
    KL(policy || reference) (k3 never negative, lower variance), k2 is biased. As losses their gradient is
    each estimator's own: k1's is zero in expectation (it only adds noise), k2's is the gradient of
    KL(policy || reference), k3's that of the forward KL(reference || policy). Samples are taken as
    on-policy (no importance weight on the KL term)."""
    kl_mode: Literal["loss", "reward"] = identity("loss", added=True)
    """How the KL enters: `loss`, a term of the loss (kl_coef * aggregated estimator); `reward`, a per-token
    penalty kl_coef * estimator subtracted from the token rewards before GAE (the seed's k1 in the reward),
    which needs token-level advantages (algorithm = "ppo"). The demo trains without a KL (kl_coef = 0)."""
    reference: str = identity("", added=True)
    """The frozen reference policy: empty = the policy RL starts from (after the warm start, or trainer.init's
    weights); else an HF checkpoint directory or one of our checkpoints, loaded as trainer.init is."""
    reference_refresh_steps: int = identity(0, added=True)
    """Every N RL steps the reference becomes the current policy (before that step's first pass); 0 = never."""
    log_kl: bool = False
    """Keep the reference and log the KL to it (loss/kl, loss/kl_k1, loss/kl_k3) even with kl_coef = 0."""
    aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "token_mean", "seq_mean"] = (
        identity("token-mean")
    )
    """How the loss's per-token terms (policy gradient and KL) become one number: `token-mean`, their mean over
    every completion token of the update; `seq-mean-token-sum`, per sample the sum of its token terms, mean
    over samples; `seq-mean-token-mean`, per sample the mean of its token terms, mean over samples. (The old
    names token_mean / seq_mean are refused with the new name to use.)"""
    reward_clip: list[float] = identity(factory=list, added=True)
    """[low, high]: sample rewards are clamped to this range before any advantage is computed. Empty = off."""
    advantage_clip: float = identity(0.0, added=True)
    """Advantages are clamped to [-c, c] after they are computed (0 = off)."""
    micro_batch_samples: int = 16
    """Samples per forward/backward pass on each rank (memory knob; the gradient is the same). Each optimizer
    update also takes at least trainer.optim.grad_accum micro-batches per rank (at least one sample each)."""
    mini_batches: int = identity(1)
    """Optimizer updates per RL step (PPO mini-batches): the step's groups are cut, in order and whole, into
    this many mini-batches, each an update against the proximal log-probs of the weights that began the
    step (verl's ppo_mini_batch_size, AReaL's ppo_n_minibatches). Fewer when fewer groups carry a signal."""
    audit_tokens: bool = False
    """Check, every step, that each trained sample's row in the batch the ranks train on (after packing) holds
    exactly the ids its episode recorded turn by turn (the ids vLLM returned for each policy turn, the ids appended
    for each observation) and that only the policy's are targets; a mismatch stops the run naming the sample.
    Logs audit/samples, audit/policy_tokens and audit/env_tokens per step. Costs a pass over the batch."""
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

    def check(self) -> None:
        require(
            0 <= self.clip_low < 1 and self.clip_high >= 0, "trainer.rl.clip_low must be in [0, 1) and clip_high >= 0"
        )
        require(
            self.dual_clip == 0 or self.dual_clip > 1,
            f"trainer.rl.dual_clip = {self.dual_clip}: give 0 (off) or a constant > 1 (e.g. 3.0); at or below 1 it "
            "would bound the surrogate of negative advantages above the PPO clip itself",
        )
        require(
            0 < self.gamma <= 1 and 0 <= self.gae_lambda <= 1,
            f"trainer.rl.gamma = {self.gamma} and gae_lambda = {self.gae_lambda}: give gamma in (0, 1] and gae_lambda "
            "in [0, 1] (1 and 1 for RLVR's single terminal reward)",
        )
        if self.algorithm == "ppo":
            self.critic.check()
        require(self.tis_cap >= 1.0, f"trainer.rl.tis_cap ({self.tis_cap}) must be >= 1 (1 = weights capped at one)")
        require(self.micro_batch_samples >= 1, "trainer.rl.micro_batch_samples must be >= 1")
        for name in ("token_mask_band", "seq_mask_band"):
            band = getattr(self, name)
            require(
                not band or (len(band) == 2 and 0 <= band[0] < 1 < band[1]),
                f"trainer.rl.{name} = {band}: give [low, high] with 0 <= low < 1 < high (e.g. [0.5, 2.0]), or [] "
                "for none",
            )
        renamed = {"token_mean": "token-mean", "seq_mean": "seq-mean-token-mean"}
        require(
            self.aggregation not in renamed,
            f"trainer.rl.aggregation = {self.aggregation!r} is an old name: set it to "
            f"{renamed.get(self.aggregation)!r} (the same aggregation)",
        )
        require(self.kl_coef >= 0, f"trainer.rl.kl_coef = {self.kl_coef} must be >= 0 (0 = no KL term)")
        require(
            self.kl_mode == "loss" or self.algorithm == "ppo",
            f"trainer.rl.kl_mode = {self.kl_mode!r}: the KL as a per-token reward penalty needs token-level "
            'advantages (trainer.rl.algorithm = "ppo"), which GRPO\'s one reward per sample cannot carry; set '
            'trainer.rl.kl_mode = "loss"',
        )
        require(
            self.reference_refresh_steps >= 0,
            f"trainer.rl.reference_refresh_steps = {self.reference_refresh_steps} must be >= 0 (0 = never refresh)",
        )
        require(
            not (self.reference or self.reference_refresh_steps) or self.keeps_reference,
            f"trainer.rl.reference = {self.reference!r} / reference_refresh_steps = {self.reference_refresh_steps} "
            "describe a reference policy no one uses: set trainer.rl.kl_coef > 0 or trainer.rl.log_kl = true, or "
            "leave them at their defaults",
        )
        require(
            not self.reward_clip or (len(self.reward_clip) == 2 and self.reward_clip[0] < self.reward_clip[1]),
            f"trainer.rl.reward_clip = {self.reward_clip}: give [low, high] with low < high (e.g. [-1.0, 1.0]), "
            "or [] for none",
        )
        require(
            self.advantage_clip >= 0,
            f"trainer.rl.advantage_clip = {self.advantage_clip} must be >= 0 (advantages clamped to [-c, c]; 0 = off)",
        )

    @property
    def keeps_reference(self) -> bool:
        """Whether the trainer keeps a frozen reference policy: for the KL term, or to log the KL."""
        return self.kl_coef > 0 or self.log_kl


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
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    """Activation checkpointing of the decoder blocks: none keeps every activation; full keeps each block's input
    and runs its forward again in the backward; selective keeps the matrix products' and attention's results and
    recomputes the cheap ops (norms, RoPE, activations, routing, permutations). Which ops are kept, and what
    torch.compile changes: trainer/model/recompute.py. Training results are the same in every mode."""
    pack: bool = True
    """Sequence packing: samples laid end to end in rows of at most trainer.pack_tokens tokens instead of one
    right-padded row each, attention kept inside each sample (trainer/pack.py). The same losses and updates as
    padding, on fewer positions. Applies to GRPO's RL updates, the warm start and pretraining (documents end
    at the tokenizer's EOS); PPO with a critic (GAE runs per row) and a sequence balance loss
    (trainer.optim.seq_aux_loss_coef > 0, taken per row) train padded rows whatever this says (the trainer's log
    says so at the start). false: padding."""
    pack_tokens: int = 0
    """Token budget of a packed row; 0: the step's longest sample (rows no longer than padding's, so a forward of
    trainer.rl.micro_batch_samples rows holds at most the tokens it holds padded). Pretraining rows are
    trainer.data.seq_len long whatever this says."""
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
    """The RL objective (GRPO or critic-based PPO advantages, decoupled PPO loss)."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """Supervised warm start before RL, so that rewards are not all zero at the start."""
    final_eval_wait_s: float = 300.0
    """At the end, how long the trainer waits in all for the evaluator's results of the last version, every benchmark
    (for its report)."""

    def check(self) -> None:
        """Every trainer section's own checks, then those that tie two of them together."""
        for section in (self.model, self.optim, self.rl, self.experts, self.parallel, self.data):
            section.check()
        m = self.model
        if self.experts.precision == "fp8":
            require(
                self.dtype == "bfloat16",
                f"trainer.experts.precision = 'fp8' quantizes bf16 tokens: set trainer.dtype = 'bfloat16' (is "
                f"{self.dtype!r})",
            )
            require(
                m.hidden_size % 16 == 0 and m.moe_intermediate_size % 16 == 0,
                f"trainer.experts.precision = 'fp8' needs trainer.model.hidden_size ({m.hidden_size}) and "
                f"moe_intermediate_size ({m.moe_intermediate_size}) divisible by 16 (16-byte e4m3 rows for TMA)",
            )
        require(
            m.n_routed_experts % self.parallel.ep == 0,
            f"trainer.parallel.ep = {self.parallel.ep} does not divide trainer.model.n_routed_experts = "
            f"{m.n_routed_experts}; pick an expert-parallel size that divides the expert count",
        )
        require(
            self.rl.algorithm != "ppo" or self.rl.critic.warmup_steps < self.steps,
            f"trainer.rl.critic.warmup_steps = {self.rl.critic.warmup_steps} leaves none of trainer.steps = "
            f"{self.steps} RL steps to the policy; set fewer warm-up steps or more steps",
        )
        require(
            not (self.optim.muon and self.parallel.dp_shard > 1),
            "trainer.optim.muon orthogonalises whole matrices, and trainer.parallel.dp_shard = "
            f"{self.parallel.dp_shard} gives each rank a block of rows of them: set dp_shard = 1 (replicated dense "
            "weights) to use Muon, or muon = false",
        )
        require(self.pack_tokens >= 0, f"trainer.pack_tokens = {self.pack_tokens} must be >= 0 (0: the longest sample)")
        require(
            self.mode != "pretrain" or bool(self.data.path) or bool(self.data.sources),
            'trainer.mode = "pretrain" needs trainer.data.path (one file) or [[trainer.data.sources]] (a mixture)',
        )

    def packs(self) -> bool:
        """Whether rows are packed: trainer.pack, where packing gives padding's update (see `padding_reasons`)."""
        return self.pack and not self.padding_reasons()

    def padding_reasons(self) -> list[str]:
        """Why rows stay padded although trainer.pack is true, each with the setting that would pack them: PPO's
        critic (its GAE runs per row) and a sequence balance loss (taken per row). Empty when nothing stops it."""
        reasons = []
        if self.mode == "rl" and self.rl.algorithm == "ppo":
            reasons.append('trainer.rl.algorithm = "ppo" (its critic\'s GAE runs per row; "grpo" packs)')
        if self.optim.seq_aux_loss_coef > 0:
            reasons.append(
                f"trainer.optim.seq_aux_loss_coef = {self.optim.seq_aux_loss_coef:g} (the sequence balance loss is "
                "taken per row; 0 packs)"
            )
        return reasons


@dataclass
class EvaluatorConfig:
    benchmarks: list[str] = _list("arithmetic")
    """Benchmarks evaluated on each evaluated policy version: arithmetic, arithmetic_train, gsm8k, ifeval,
    ifeval_google, tool_arithmetic (held-out arithmetic as greedy episodes of rollout.episode's tools), or
    "lm_eval:<task>" for an lm-evaluation-harness task (needs the `lmeval` extra; see lm_eval_include_path)."""
    lm_eval_include_path: str = ""
    """Directory of lm-evaluation-harness task YAMLs of one's own, for "lm_eval:<task>" benchmarks (empty: lm-eval's
    own tasks only). Datasets are read offline, so a task's data must be local (e.g. dataset_path: json)."""
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

    def check(self) -> None:
        require(self.every_n_versions >= 1, "evaluator.every_n_versions must be >= 1")
        require(self.chunk_cases >= 1, "evaluator.chunk_cases must be >= 1")


@dataclass
class MetricsConfig:
    sinks: list[str] = _list("duckdb")
    """Where each role's metric points go: "duckdb" (always on, the dashboard and evaluator read it), "tensorboard"
    (<run_dir>/tensorboard/<role>-<rank>/), "wandb" (<run_dir>/wandb/). Extra sinks need `pip install
    'slipstream[tools]'`."""
    wandb_project: str = "slipstream"
    """W&B project of the run (one W&B run per role and rank, grouped by the experiment name)."""
    wandb_entity: str = ""
    """W&B entity (user or team) for online mode; empty: the account's default entity."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline: W&B writes only files under <run_dir>/wandb/ (upload later with `wandb sync`); online: streams to the
    W&B server (needs `wandb login` or WANDB_API_KEY)."""

    def check(self) -> None:
        unknown = [s for s in self.sinks if s not in METRIC_SINKS]
        require(not unknown, f"metrics.sinks has unknown sink(s) {unknown}: choose from {list(METRIC_SINKS)}")
        require(
            len(set(self.sinks)) == len(self.sinks), f"metrics.sinks = {self.sinks} names a sink twice: list each once"
        )


METRIC_SINKS = ("duckdb", "tensorboard", "wandb")


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
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Where metric points go besides DuckDB (TensorBoard, W&B)."""
