"""Expert backends: grouped_mm agrees with the reference (outputs and gradients); the bf16 weight copy of the
grouped_mm path is made once and refreshed by every optimizer step and in-place load (not by a check in the
forward); backend selection."""

import pytest
import torch
import torch.nn.functional as F

import trainer.experts as experts
from common.config import ModelConfig, OptimConfig
from trainer.experts import BackendUnavailable, grouped_mm_experts, reference_experts, select_backend
from trainer.model.moe import Experts, MoE
from trainer.optim import Optimizer

GROUPED_MM_RUNS = experts.grouped_mm_unavailable(torch.device("cpu"), torch.float32) is None


def _inputs(seed: int, counts: list[int], H: int = 16, inter: int = 8):
    g = torch.Generator().manual_seed(seed)
    N, E = sum(counts), len(counts)
    x = torch.randn(N, H, generator=g)
    gate_up = torch.randn(E, 2 * inter, H, generator=g) * 0.3
    down = torch.randn(E, H, inter, generator=g) * 0.3
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    return x, offsets, gate_up, down


def _run(fn, x, offsets, gate_up, down, grad):
    x, gate_up, down = (t.clone().requires_grad_() for t in (x, gate_up, down))
    y = fn(x, offsets, gate_up, down)
    y.backward(grad)
    return y, x.grad, gate_up.grad, down.grad


@pytest.mark.skipif(not GROUPED_MM_RUNS, reason="torch._grouped_mm does not run on this CPU build")
@pytest.mark.parametrize("counts", [[5, 0, 7, 1], [0, 0, 12, 0], [3, 3, 3, 3, 3, 3]])
def test_grouped_mm_matches_reference_outputs_and_gradients(counts):
    x, offsets, gate_up, down = _inputs(0, counts)
    grad = torch.randn(sum(counts), x.shape[1], generator=torch.Generator().manual_seed(1))
    ref = _run(reference_experts, x, offsets, gate_up, down, grad)
    fast = _run(grouped_mm_experts, x, offsets, gate_up, down, grad)
    for a, b in zip(ref, fast, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not GROUPED_MM_RUNS, reason="torch._grouped_mm does not run on this CPU build")
def test_moe_layer_agrees_across_backends():
    cfg = ModelConfig(hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3)
    torch.manual_seed(0)
    ref = MoE(cfg, "reference")
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    fast = MoE(cfg, "grouped_mm")
    fast.load_state_dict(ref.state_dict())
    x = torch.randn(2, 10, 32)
    outs = []
    for layer in (ref, fast):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.square().sum().backward()
        outs.append((y, xi.grad, *(p.grad for p in layer.parameters())))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


GROUPED_MM_BF16_RUNS = experts.grouped_mm_unavailable(torch.device("cpu"), torch.bfloat16) is None
needs_bf16_grouped_mm = pytest.mark.skipif(not GROUPED_MM_BF16_RUNS, reason="no bf16 torch._grouped_mm on this CPU")


@needs_bf16_grouped_mm
def test_grouped_mm_on_cast_weights_sends_fp32_gradients_to_the_masters():
    """bf16 GEMMs on a bf16 copy, gradients on the fp32 masters: the same as autograd through a per-call cast."""
    x, offsets, gate_up, down = _inputs(2, [9, 0, 16, 7], H=32, inter=16)
    x = x.bfloat16()
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    masters = [t.clone().requires_grad_() for t in (gate_up, down)]
    y = grouped_mm_experts(x, offsets, *masters, cast_weights=(gate_up.bfloat16(), down.bfloat16()))
    y.backward(grad)
    # Plain autograd over the cast: what the layer computed before it kept a copy.
    plain = [t.clone().requires_grad_() for t in (gate_up, down)]
    gate, up = torch._grouped_mm(x, plain[0].bfloat16().transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
    y_ref = torch._grouped_mm(F.silu(gate) * up, plain[1].bfloat16().transpose(-2, -1), offs=offsets)
    y_ref.backward(grad)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    for m, p in zip(masters, plain, strict=True):
        assert m.grad.dtype == torch.float32 and m.grad.is_contiguous()  # AccumulateGrad takes it without a copy
        torch.testing.assert_close(m.grad, p.grad, rtol=2e-2, atol=2e-3)


def _bf16_layer(seed: int) -> Experts:
    layer = Experts(ModelConfig(hidden_size=32, moe_intermediate_size=16, n_routed_experts=4), "grouped_mm")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return layer


def _autocast_forward(layer: Experts, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return layer(x, offsets)


def _per_call_cast(layer: Experts, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return grouped_mm_experts(x.bfloat16(), offsets, layer.gate_up_proj, layer.down_proj)


@needs_bf16_grouped_mm
def test_bf16_copy_is_made_once_and_kept_out_of_the_state_dict():
    layer = _bf16_layer(0)
    x, offsets = torch.randn(24, 32), torch.tensor([5, 5, 20, 24], dtype=torch.int32)
    _autocast_forward(layer, x, offsets)
    first = layer.weight_copy(torch.bfloat16)
    _autocast_forward(layer, x, offsets).sum().backward()
    assert all(a is b for a, b in zip(first, layer.weight_copy(torch.bfloat16), strict=True))
    assert set(layer.state_dict()) == {"gate_up_proj", "down_proj"}
    assert all(p.dtype == torch.float32 for p in layer.state_dict().values())


@needs_bf16_grouped_mm
def test_bf16_copy_follows_every_optimizer_step():
    """The trainer's optimizer rewrites the copy after every step (fused AdamW on GPUs writes the masters
    without moving their version counters, so nothing in the forward could notice)."""
    layer = _bf16_layer(1)
    x, offsets = torch.randn(24, 32), torch.tensor([3, 10, 10, 24], dtype=torch.int32)
    opt = Optimizer(layer, OptimConfig(lr=0.1, expert_lr=0.1, grad_clip=0.0))
    for _ in range(3):
        before = [p.detach().clone() for p in layer.parameters()]
        _autocast_forward(layer, x, offsets).square().sum().backward()
        opt.step(24)
        assert not any(torch.equal(a, p) for a, p in zip(before, layer.parameters(), strict=True))
        expected = _per_call_cast(layer, x, offsets)
        torch.testing.assert_close(_autocast_forward(layer, x, offsets), expected, rtol=0, atol=0)


@needs_bf16_grouped_mm
def test_bf16_copy_follows_the_trainer_optimizer_and_in_place_loads():
    cfg = ModelConfig(hidden_size=32, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2)
    moe = MoE(cfg, "grouped_mm")
    torch.manual_seed(4)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    opt = Optimizer(moe, OptimConfig(lr=0.05, expert_lr=0.05, grad_clip=0.0))
    layer, rows, offsets = moe.experts, torch.randn(24, 32), torch.tensor([6, 12, 18, 24], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        moe(torch.randn(2, 12, 32)).float().square().sum().backward()
    opt.step(24)
    torch.testing.assert_close(
        _autocast_forward(layer, rows, offsets), _per_call_cast(layer, rows, offsets), rtol=0, atol=0
    )
    other = _bf16_layer(5)
    layer.load_state_dict(other.state_dict())  # copy_ into the parameters under no_grad
    torch.testing.assert_close(
        _autocast_forward(layer, rows, offsets), _per_call_cast(other, rows, offsets), rtol=0, atol=0
    )


def _copy_equals_fresh_cast(layer: Experts) -> bool:
    return all(
        torch.equal(c, p.detach().bfloat16())
        for c, p in zip(layer.weight_copy(torch.bfloat16), (layer.gate_up_proj, layer.down_proj), strict=True)
    )


@needs_bf16_grouped_mm
def test_optimizer_step_refreshes_the_copy_without_a_forward():
    """The refresh is the trainer optimizer's own doing (trainer.optim.Optimizer.step), not a check in the
    next forward: right after `step()` the copy already equals a fresh cast of the new masters."""
    layer = _bf16_layer(7)
    x, offsets = torch.randn(24, 32), torch.tensor([3, 10, 10, 24], dtype=torch.int32)
    layer.weight_copy(torch.bfloat16)
    opt = Optimizer(layer, OptimConfig(lr=0.1, expert_lr=0.1, grad_clip=0.0))
    for p in layer.parameters():
        p.grad = torch.randn_like(p)
    before = [c.clone() for c in layer._cast]
    opt.step(24)
    assert not any(torch.equal(a, c) for a, c in zip(before, layer._cast, strict=True))
    assert _copy_equals_fresh_cast(layer)
    assert torch.equal(_autocast_forward(layer, x, offsets), _per_call_cast(layer, x, offsets))


def test_step_of_an_optimizer_over_other_parameters_leaves_the_copy_alone():
    layer, other = _bf16_layer(8), torch.nn.Linear(4, 4)
    first = [c.clone() for c in layer.weight_copy(torch.bfloat16)]
    with torch.no_grad():
        layer.gate_up_proj.add_(1.0)  # an in-place write nobody announced: the copy is stale by contract
    other.weight.grad = torch.ones_like(other.weight)
    torch.optim.SGD(other.parameters(), lr=0.1).step()
    assert all(torch.equal(a, c) for a, c in zip(first, layer._cast, strict=True))
    from trainer.model.moe import refresh_expert_weight_copies

    refresh_expert_weight_copies(layer)
    assert _copy_equals_fresh_cast(layer)


def test_to_drops_the_copy_and_deepcopy_remakes_its_own():
    import copy

    layer = _bf16_layer(9)
    layer.weight_copy(torch.bfloat16)
    twin = copy.deepcopy(layer)
    assert twin._cast is None
    twin.weight_copy(torch.bfloat16)
    with torch.no_grad():
        for p in twin.parameters():
            p.grad = torch.randn_like(p)
    Optimizer(twin, OptimConfig(lr=0.5, grad_clip=0.0)).step(1)
    assert _copy_equals_fresh_cast(twin) and _copy_equals_fresh_cast(layer)
    assert not torch.equal(twin._cast[0], layer._cast[0])
    layer.to(torch.float64)
    assert layer._cast is None


def test_moe_matches_per_token_loop_forward_and_backward():
    """The permutation and its hand-written backward equal a naive per-token computation."""
    cfg = ModelConfig(hidden_size=16, moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2)
    torch.manual_seed(3)
    layer = MoE(cfg, "reference")
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(1, 6, 16, requires_grad=True)
    y = layer(x)
    weights, ids, _ = layer.gate(x.view(6, 16))
    naive = []
    for t in range(6):
        acc = layer.shared_experts(x[0, t])
        for c in range(2):
            e = int(ids[t, c])
            gate, up = (layer.experts.gate_up_proj[e] @ x[0, t]).chunk(2)
            acc = acc + weights[t, c] * (layer.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
        naive.append(acc)
    naive = torch.stack(naive).unsqueeze(0)
    torch.testing.assert_close(y, naive, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, layer.experts.gate_up_proj, layer.gate.weight], g)
    naive_grads = torch.autograd.grad(naive, [x, layer.experts.gate_up_proj, layer.gate.weight], g)
    for a, b in zip(grads, naive_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_auto_picks_grouped_mm_where_it_runs():
    expected = "grouped_mm" if GROUPED_MM_RUNS else "reference"
    assert select_backend("auto", "cpu") == expected
    assert select_backend("reference", "cpu") == "reference"


def test_explicit_backend_that_cannot_run_fails_with_the_reason(monkeypatch):
    experts._why_not.cache_clear()
    monkeypatch.setattr(experts, "grouped_mm_unavailable", lambda device, dtype: "no kernel for test-device")
    try:
        with pytest.raises(BackendUnavailable, match="no kernel for test-device"):
            select_backend("grouped_mm", "cpu")
        assert select_backend("auto", "cpu") == "reference"
    finally:
        experts._why_not.cache_clear()


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown expert backend 'fast'"):
        select_backend("fast", "cpu")


def test_router_logits_of_bf16_activations_are_fp32_accurate():
    """The split-bf16 GEMM gives fp32 logits (forward) and near-fp32 weight gradients (backward)."""
    from trainer.model.moe import router_logits

    g = torch.Generator().manual_seed(6)
    x = torch.randn(300, 64, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(16, 64, generator=g) * 0.02).requires_grad_()
    grad = torch.randn(300, 16, generator=g)
    logits = router_logits(x, w)
    logits.backward(grad)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.linear(x64, w64)
    ref.backward(grad.double())

    def rel(a, b):
        return float((a.detach().double() - b.detach()).norm() / b.detach().norm())

    assert logits.dtype == torch.float32 and rel(logits, ref) < 3e-7  # a plain fp32 GEMM: ~1.4e-7
    assert rel(w.grad, w64.grad) < 2e-5
    assert x.grad.dtype == torch.bfloat16 and rel(x.grad, x64.grad) < 4e-3  # bf16 rounding of the result
