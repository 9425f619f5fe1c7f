"""The decoder: token embedding, `num_layers` pre-norm blocks (attention, then a dense MLP for the
first `first_k_dense` layers and an MoE for the rest), final norm, output head. Module and parameter
names are HF's (`model.layers.L.self_attn.kv_b_proj.weight`, ...) so a state dict maps 1:1 onto
DeepseekV3ForCausalLM / Qwen3MoeForCausalLM (and onto transformers' in-memory MixtralForCausalLM); only the
routed experts are stored stacked (HF's own in-memory layout), and trainer/hf.py splits them into per-expert
names on export (renamed to Mixtral's released `block_sparse_moe.experts.N.w1` layout for that family)."""

from __future__ import annotations

import torch
from torch import nn

from common.config import ModelConfig
from trainer.model.attention import GQA, MLA, DocumentMask, attention_backends
from trainer.model.moe import MLP, MoE
from trainer.model.norm import RMSNorm
from trainer.model.recompute import run_block
from trainer.model.rope import rope_tables, yarn_of
from trainer.model.sampling import RowSampling, logprobs_of, sampled_logprobs


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, backend: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLA(cfg) if cfg.arch == "deepseek_v3" else GQA(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size) if layer < cfg.first_k_dense else MoE(cfg, backend)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        routing: torch.Tensor | None = None,
        replay: bool = False,
        mask: DocumentMask | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, routing, replay) if isinstance(self.mlp, MoE) else self.mlp(h))


class Decoder(nn.Module):
    """HF's `model.` prefix: embeddings, blocks, final norm."""

    def __init__(self, cfg: ModelConfig, backend: str) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i, backend) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """Causal LM. `forward(tokens)` gives logits; `token_logprobs` gives log p(target) per position.

    A row holds one sample, or, packed, several (`documents` [B, S]: each position's sample within its row,
    -1 for padding; `positions` then restart at 0 for each sample): attention never crosses a sample's
    boundary, so each sample's results are those it has alone in a row."""

    rope_angles: torch.Tensor  # a buffer

    def __init__(self, cfg: ModelConfig, experts_backend: str = "reference") -> None:
        super().__init__()
        if experts_backend not in ("reference", "grouped_mm", "cutedsl", "cutedsl_fp8"):
            raise ValueError(
                f"experts_backend {experts_backend!r} is not a resolved backend; pass the result of "
                "trainer.experts.select_backend(...)"
            )
        self.cfg = cfg
        self._outside: torch.Tensor | None = None
        self.activation_checkpoint = "none"
        """How the blocks keep activations for the backward: none, full or selective (trainer/model/recompute.py)."""
        self.model = Decoder(cfg, experts_backend)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        rope_dim = cfg.qk_rope_head_dim if cfg.arch == "deepseek_v3" else cfg.head_dim
        yarn = yarn_of(cfg)
        angles = rope_tables(rope_dim, cfg.max_seq_len, cfg.rope_theta, yarn=yarn)
        self.register_buffer("rope_angles", angles, persistent=False)
        self.rope_scale = 1.0 if yarn is None else yarn.cos_sin_scale  # YaRN's magnitude on cos and sin

    def moe_layers(self) -> list[MoE]:
        return [blk.mlp for blk in self.model.layers if isinstance(blk.mlp, MoE)]

    def moe_layer_ids(self) -> list[int]:
        """Decoder layer index of each MoE layer (the layer axis of vLLM's routed-experts arrays)."""
        return [i for i, blk in enumerate(self.model.layers) if isinstance(blk.mlp, MoE)]

    def hidden_states(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        routing: torch.Tensor | None = None,
        replay: bool = False,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [B, S] (int64) -> final-normed hidden states [B, S, H]; positions [B, S] default 0..S-1.

        `routing` [B, S, moe layers, k]: the experts a rollout chose per token and MoE layer (-1: unknown);
        every MoE layer then measures its disagreement with it, and with `replay` uses it (MoE.forward).
        `documents` [B, S]: the samples of packed rows (see the class); None: one sample per row."""
        B, S = tokens.shape
        if positions is None:
            if S > self.cfg.max_seq_len:
                raise ValueError(f"sequence of {S} tokens exceeds trainer.model.max_seq_len = {self.cfg.max_seq_len}")
            angles = self.rope_angles[:S].unsqueeze(0)
        else:
            if int(positions.max()) >= self.cfg.max_seq_len:
                raise ValueError(f"position {int(positions.max())} exceeds trainer.model.max_seq_len")
            angles = self.rope_angles[positions]
        cos, sin = angles.cos() * self.rope_scale, angles.sin() * self.rope_scale
        x = self.model.embed_tokens(tokens)
        if routing is not None and routing.shape[2] != len(self.moe_layers()):
            raise ValueError(f"routing has {routing.shape[2]} MoE layers, the model {len(self.moe_layers())}")
        mask = None if documents is None else DocumentMask(documents)  # once for every layer
        moe = 0
        with attention_backends(tokens.device):
            for block in self.model.layers:
                if routing is not None and isinstance(block.mlp, MoE):
                    x = run_block(block, self.activation_checkpoint, x, cos, sin, routing[:, :, moe], replay, mask)
                    moe += 1
                else:
                    x = run_block(block, self.activation_checkpoint, x, cos, sin, None, False, mask)
        return self.model.norm(x)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        routing: torch.Tensor | None = None,
        replay: bool = False,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, vocab] (`routing`, `replay`, `documents`: see `hidden_states`)."""
        return self.lm_head(self.hidden_states(tokens, positions, routing, replay, documents))

    def token_logprobs(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        positions: torch.Tensor | None = None,
        routing: torch.Tensor | None = None,
        replay: bool = False,
        sampling: RowSampling | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """log p(targets[b, s] | tokens[b, :s+1]) as float32 [B, S]; targets < 0 give 0 (padding). With
        `sampling`, p is each row's (or token's) sampling distribution (temperature, top-k, top-p:
        trainer.model.sampling), and `sampling_outside()` then counts the targets outside the trainer's own
        truncation set. `documents`: packed rows (see `hidden_states`)."""
        logits = self(tokens, positions, routing, replay, documents)
        if sampling is None:
            return logprobs_of(logits, targets)
        logp, outside = sampled_logprobs(logits, targets, sampling)
        self._outside = outside.sum(1)
        return logp

    def sampling_outside(self) -> torch.Tensor:
        """Per row [B], of the last `token_logprobs` given a sampling: targets its truncation set left out
        (kept in their own position's set instead, see `sampled_logprobs`)."""
        if self._outside is None:
            raise RuntimeError("the last token_logprobs was not given a sampling")
        return self._outside

    def routing_disagreement(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row [B], summed over MoE layers, of the last forward given a routing: (token-layer pairs whose
        router top-k differs from the given routing, token-layer pairs with a given routing)."""
        pairs = []
        for m in self.moe_layers():
            if m.routing_disagreement is None:
                raise RuntimeError("the last forward was not given a routing")
            pairs.append(m.routing_disagreement)
        return torch.stack([p[0] for p in pairs]).sum(0), torch.stack([p[1] for p in pairs]).sum(0)

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the MoE layers' sequence balance losses of the last forward (None when not computed)."""
        losses = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None

    def set_aux_loss(self, enabled: bool) -> None:
        for m in self.moe_layers():
            m.compute_aux_loss = enabled


def compile_blocks(model: Transformer, **compile_kwargs) -> Transformer:
    """torch.compile each decoder block in place (parameter names unchanged); returns the model.

    The blocks share one code object, whose compiled variants (dense and MoE blocks, training and the no-grad
    proximal forward, padded rows and packed rows with a document mask) outnumber dynamo's default limit of 8:
    past it every block would run eager (and flex attention unfused), so the limit is raised."""
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, 64)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 512)
    for block in model.model.layers:
        block.compile(**compile_kwargs)
    return model


@torch.no_grad()
def init_weights(model: Transformer, seed: int, std: float = 0.02) -> None:
    """Deterministic initialisation from a seed: N(0, std) for matrices, embeddings, router and experts
    (HF's initializer_range), ones for norms, zeros for the expert bias. Same seed, same weights."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            # Draw on the CPU so the weights do not depend on the device the model lives on.
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(std))
    for moe in model.moe_layers():
        if hasattr(moe.gate, "e_score_correction_bias"):
            moe.gate.e_score_correction_bias.zero_()
        moe.tokens_per_expert.zero_()


def build_model(
    cfg: ModelConfig, experts_backend: str = "reference", seed: int | None = 0, device: str | torch.device = "cpu"
) -> Transformer:
    """A Transformer on `device`, initialised from `seed` (None leaves the weights uninitialised)."""
    model = Transformer(cfg, experts_backend)
    if seed is not None:
        init_weights(model, seed)
    return model.to(device)


def count_params(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active per token) parameter counts; active counts top-k routed experts, not embeddings."""
    with torch.device("meta"):
        model = Transformer(cfg)
    total = sum(p.numel() for p in model.parameters())
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    routed = sum(m.experts.gate_up_proj.numel() + m.experts.down_proj.numel() for m in model.moe_layers())
    embed = model.model.embed_tokens.weight.numel()
    active = total - routed + routed * k // E - (0 if cfg.tie_word_embeddings else embed)
    return total, active


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward+backward FLOPs per token of causal attention scores and values (not the projections)."""
    if cfg.arch == "deepseek_v3":
        qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    else:
        qk = v = cfg.head_dim
    # 2 FLOPs per MAC, half the keys on average under the causal mask, x3 for forward + backward.
    return 3 * 2 * cfg.num_heads * (qk + v) * seq_len / 2 * cfg.num_layers


__all__ = [
    "Transformer",
    "compile_blocks",
    "build_model",
    "init_weights",
    "count_params",
    "attention_flops_per_token",
    "logprobs_of",
]
