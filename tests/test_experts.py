"""Expert backends: grouped_mm agrees with the reference (outputs and gradients); backend selection."""

import pytest
import torch

import trainer.experts as experts
from common.config import ModelConfig
from trainer.experts import BackendUnavailable, grouped_mm_experts, reference_experts, select_backend
from trainer.model.moe import MoE

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
