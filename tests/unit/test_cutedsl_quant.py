"""The CuTeDSL quantization kernel (trainer/experts/cutedsl/quant.py): on an H200 with the DSL it writes bit for
bit what `trainer.experts.fp8.quantize_rows` computes on the same GPU, for full and partial 128-column
blocks, one row, no rows, all-zero rows, tiny rows, negative zeros, strided inputs and under torch.compile
(skipped elsewhere, with the reason); on any machine the module imports without the DSL and refuses a width
that is not a multiple of 8 before touching it."""

import subprocess
import sys

import pytest
import torch

from trainer.experts.cutedsl import cutedsl_unavailable, grouped
from trainer.experts.cutedsl.quant import quantize_rows_kernel, quantize_rows_op
from trainer.experts.fp8 import quantize_rows

GPU_REASON = cutedsl_unavailable(torch.device("cuda"), torch.bfloat16) if torch.cuda.is_available() else "no CUDA GPU"
needs_gpu = pytest.mark.skipif(GPU_REASON is not None, reason=f"cutedsl cannot run here: {GPU_REASON}")


def test_the_quant_module_imports_without_loading_the_dsl():
    code = "import sys, trainer.experts.cutedsl.quant; assert 'cutlass' not in sys.modules, 'cutlass imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_width_that_is_not_a_multiple_of_8_is_refused_with_the_shape():
    with pytest.raises(ValueError, match=r"multiple of 8.*\(4, 12\)"):
        quantize_rows_kernel(torch.zeros(4, 12, dtype=torch.bfloat16))


def _tokens(M: int, K: int, seed: int = 0) -> torch.Tensor:
    """bf16 [M, K] whose columns span 12 decades (each block's maximum far above most of its elements, many in
    e4m3's subnormals), with an all-zero row, a row below the 1e-12 floor of the maximum, negative zeros."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g) * torch.logspace(-6, 6, K, device="cuda")
    x = x[:, torch.randperm(K, device="cuda", generator=g)]
    if M >= 4:
        x[M // 2] = 0
        x[M // 3] *= 1e-20
    if M:
        x[0, :8] = -0.0
    return x.bfloat16()


def _assert_same_bits(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    (q, s), (q_ref, s_ref) = got, want
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert q.shape == q_ref.shape and s.shape == s_ref.shape
    q_bits, q_ref_bits = q.view(torch.uint8), q_ref.view(torch.uint8)
    assert torch.equal(q_bits, q_ref_bits), f"{int((q_bits != q_ref_bits).sum())} values differ"
    assert torch.equal(s.view(torch.int32), s_ref.view(torch.int32)), f"{int((s != s_ref).sum())} scales differ"


@needs_gpu
@pytest.mark.parametrize(
    "M,K", [(0, 2048), (1, 2048), (1, 320), (3, 128), (37, 768), (300, 1536), (129, 320), (4099, 256), (16, 8)]
)
def test_the_kernel_writes_the_bits_of_the_torch_quantizer(monkeypatch, M, K):
    monkeypatch.setattr(grouped, "POISON_OUTPUTS", True)  # an element the kernel skips stays NaN and differs
    x = _tokens(M, K)
    _assert_same_bits(quantize_rows_kernel(x), quantize_rows(x))


@needs_gpu
def test_a_strided_input_and_the_compiled_op_give_the_same_bits():
    wide = _tokens(257, 2048, seed=1)
    x = wide[:, 512:1280]  # [257, 768], rows 4 KB apart
    _assert_same_bits(quantize_rows_kernel(x), quantize_rows(x))
    compiled = torch.compile(lambda t: quantize_rows_op(t), fullgraph=True)
    _assert_same_bits(compiled(wide), quantize_rows(wide))


@needs_gpu
def test_a_nan_poisons_its_own_block_and_no_other():
    x = _tokens(5, 320, seed=2)
    x[2, 200] = float("nan")
    q, s = quantize_rows_kernel(x)
    q_ref, s_ref = quantize_rows(x)
    assert torch.equal(s.isnan(), s_ref.isnan()) and s.isnan().sum() == 1 and s[1, 2].isnan()
    assert torch.equal(q.float().isnan(), q_ref.float().isnan()) and q[2, 128:256].float().isnan().all()
    finite = ~q_ref.float().isnan()
    assert torch.equal(q.view(torch.uint8)[finite], q_ref.view(torch.uint8)[finite])


def _weights(E: int, N: int, K: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[E, N, K] whose 128x128 blocks span 12 decades, with an all-zero block row, a tiny block and a NaN in one
    expert (its block's scale and values become NaN, as in torch)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(E, N, K, device="cuda", generator=g) * torch.logspace(-6, 6, K, device="cuda")
    w = w[:, :, torch.randperm(K, device="cuda", generator=g)]
    w[0, : min(N, 128)] = 0
    w[-1, -1:] *= 1e-20
    if E > 1:
        w[1, 0, 0] = float("nan")
    return w.to(dtype)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("E,N,K", [(3, 256, 384), (2, 200, 136), (1, 128, 8), (4, 1536, 2048), (5, 70, 300)])
def test_the_weight_kernel_writes_the_bits_of_the_torch_pack(monkeypatch, dtype, E, N, K):
    """quantize_expert_weights_fast on the GPU: the 8 tensors of trainer.experts.fp8.quantize_expert_weights (the
    values, the scales and both transposes), bit for bit, made fresh and rewritten in place, for partial blocks
    along either side and fp32 or bf16 masters."""
    from trainer.experts.cutedsl.quant import quantize_expert_weights_fast
    from trainer.experts.fp8 import quantize_expert_weights

    monkeypatch.setattr(grouped, "POISON_OUTPUTS", True)
    gate_up, down = _weights(E, N, K, dtype), _weights(E, K, N, dtype, seed=1)
    want = quantize_expert_weights(gate_up, down)
    got = quantize_expert_weights_fast(gate_up, down)
    again = quantize_expert_weights_fast(gate_up * 2, down * 2, out=tuple(t.clone() for t in got))
    quantize_expert_weights_fast(gate_up, down, out=again)
    for fresh, rewritten, ref in zip(got, again, want, strict=True):
        assert fresh.shape == ref.shape and fresh.dtype == ref.dtype
        bits = torch.int32 if ref.dtype == torch.float32 else torch.uint8
        for t in (fresh, rewritten):
            assert torch.equal(t.view(bits), ref.view(bits)), f"{int((t.view(bits) != ref.view(bits)).sum())} differ"


def test_the_weight_pack_off_the_gpu_is_the_torch_one():
    from trainer.experts.cutedsl.quant import quantize_expert_weights_fast
    from trainer.experts.fp8 import quantize_expert_weights

    gate_up, down = torch.randn(2, 256, 136), torch.randn(2, 136, 256)
    for a, b in zip(quantize_expert_weights_fast(gate_up, down), quantize_expert_weights(gate_up, down), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _both_references(x: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    from trainer.experts.fp8 import quantize_tokens_t

    return (*quantize_rows(x), *quantize_tokens_t(x, offsets))


def _both_kernel(x: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """quantize_both_kernel over the padded blocks of `offsets`, with their ends: the references' five outputs."""
    from trainer.experts.cutedsl.quant import quantize_both_kernel
    from trainer.experts.fp8 import token_blocks

    ends, src, rows, _ = token_blocks(offsets, x.shape[0])
    return (*quantize_both_kernel(x, src, rows), ends)


def _assert_same_five(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    """q and q_t compared as bytes, the scales as int32 words, the ends as they are."""
    assert len(got) == len(want) == 5
    bits = {torch.float8_e4m3fn: torch.uint8, torch.float32: torch.int32, torch.int32: torch.int32}
    for name, a, b in zip(("q", "scale", "q_t", "scale_t", "ends"), got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{name}: {a.dtype} {tuple(a.shape)} != {tuple(b.shape)}"
        a_bits, b_bits = a.view(bits[a.dtype]), b.view(bits[b.dtype])
        assert torch.equal(a_bits, b_bits), f"{name}: {int((a_bits != b_bits).sum())} differ"


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("F", [8, 128, 136, 200, 2048])
@pytest.mark.parametrize("counts", [[300, 0, 129, 64, 1, 511], [1], [0, 0], [4096, 333], [128, 256]])
def test_the_two_way_kernel_writes_the_bits_of_both_torch_quantizers(monkeypatch, dtype, F, counts):
    """quantize_both_kernel gives quantize_rows' and quantize_tokens_t's five outputs bit for bit (partial blocks
    both ways, one feature lane, an empty expert, experts across blocks and in whole ones, one row, no rows; the
    cases of the transposed-only kernel it replaced, too)."""
    monkeypatch.setattr(grouped, "POISON_OUTPUTS", True)  # an element the kernel skips stays NaN and differs
    R = sum(counts)
    x = _tokens(R, F).to(dtype) if R else torch.zeros(0, F, device="cuda", dtype=dtype)
    offsets = torch.tensor(counts, device="cuda").cumsum(0).int()
    _assert_same_five(_both_kernel(x, offsets), _both_references(x, offsets))


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_two_way_kernel_divides_as_ieee_division_at_the_edges(dtype):
    """The kernel's quotients (a reciprocal per scale and two residual steps instead of a division per element)
    give torch's bits where rounding is hardest: values spread over 2^-126 .. 2^120 within one block, subnormals,
    signed zeros (-0 / s stays -0), an infinity (x / inf = 0, inf / inf = NaN), an all-zero block; a million
    quotients in all."""
    g = torch.Generator(device="cuda").manual_seed(11)
    R, F = 1024, 1024
    mantissa = torch.rand(R, F, device="cuda", generator=g) + 1.0
    exponent = torch.randint(-126, 121, (R, F), device="cuda", generator=g).float()
    sign = torch.where(torch.rand(R, F, device="cuda", generator=g) < 0.5, -1.0, 1.0)
    x = (sign * mantissa * torch.exp2(exponent)).to(dtype)
    x[:256] = torch.randn(256, F, device="cuda", generator=g).to(dtype)  # ordinary blocks, ordinary scales
    x[300, :128] = 0.0
    x[301, :] = -0.0
    x[302, 5] = 1e-40  # subnormal in both dtypes
    x[303, 7] = float("inf")
    x[304, 9] = float("-inf")
    x[400:528, 256:384] = 0.0  # an all-zero 128x128 block: both scales are the floor
    offsets = torch.tensor([300, 700, 1024], device="cuda", dtype=torch.int32)
    _assert_same_five(_both_kernel(x, offsets), _both_references(x, offsets))


@needs_gpu
def test_a_nan_poisons_its_row_block_and_its_feature_token_block_and_nothing_else():
    """A NaN at (row 150, feature 130) makes NaN exactly q's row block, its scale, q_t's 128-token block of that
    feature (its padding tokens too) and its scale; every other bit is torch's."""
    x = _tokens(300, 256, seed=3)
    x[150, 130] = float("nan")
    offsets = torch.tensor([200, 300], device="cuda", dtype=torch.int32)
    got = _both_kernel(x, offsets)
    want = _both_references(x, offsets)
    q, scale, q_t, scale_t, _ = got
    expected = [torch.zeros_like(t, dtype=torch.bool) for t in (q, scale, q_t, scale_t)]
    expected[0][150, 128:] = True
    expected[1][1, 150] = True
    expected[2][130, 128:256] = True  # row 150 is padded token 150: expert 0's second block
    expected[3][1, 130] = True
    for t, ref, nan in zip(got[:4], want[:4], expected, strict=True):
        assert torch.equal(t.float().isnan(), nan) and torch.equal(ref.float().isnan(), nan)
        bits = torch.uint8 if t.dtype == torch.float8_e4m3fn else torch.int32
        assert torch.equal(t.view(bits)[~nan], ref.view(bits)[~nan])
    assert torch.equal(got[4], want[4])


def test_the_two_way_op_off_the_gpu_is_the_torch_pair_and_a_bad_width_is_refused():
    """On the CPU quantize_both_op runs the torch references, its fake gives their shapes, and the kernel refuses
    a width that is not a multiple of 8, naming the shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainer.experts.cutedsl.quant import quantize_both_kernel, quantize_both_op
    from trainer.experts.fp8 import token_blocks

    x = torch.randn(259, 200).bfloat16()
    offsets = torch.tensor([3, 3, 259], dtype=torch.int32)
    want = _both_references(x, offsets)[:4]
    _, src, rows, _ = token_blocks(offsets, x.shape[0])
    got = quantize_both_op(x, src, rows)
    _assert_same_five((*got, offsets), (*want, offsets))
    with FakeTensorMode() as mode:
        fake = quantize_both_op(*(mode.from_tensor(t) for t in (x, src, rows)))
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in want]
    with pytest.raises(ValueError, match=r"multiple of 8.*\(4, 12\)"):
        quantize_both_kernel(torch.zeros(4, 12, dtype=torch.bfloat16), src, rows)


def test_the_two_way_launcher_refuses_an_unknown_kind_or_sigmoid():
    """_both_launcher names the bad kind or quant.SIGMOID value and the choices, before compiling anything (an
    unknown kind used to compile the last branch)."""
    from trainer.experts.cutedsl.quant import _both_launcher

    with pytest.raises(ValueError, match=r"kind 'gelu' is not one of \('copy', 'swiglu', 'swiglu_grad'\)"):
        _both_launcher("gelu")
    with pytest.raises(ValueError, match=r"quant.SIGMOID = 'tanh' is not one of \('ieee', 'rcp'\)"):
        _both_launcher("swiglu", "tanh")


def _swiglu_inputs(R: int, inter: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """h = gate|up [R, 2I] and grad_act [R, I] in bf16: gates over -12 .. 12 (the sigmoid saturated both ways and
    everything between) and four out to +-100, ups and gradients spanning 6 decades, a row of zeros."""
    g = torch.Generator(device=device).manual_seed(seed)
    gate = (torch.rand(R, inter, device=device, generator=g) - 0.5) * 24
    up = torch.randn(R, inter, device=device, generator=g) * torch.logspace(-3, 3, inter, device=device)
    grad = torch.randn(R, inter, device=device, generator=g) * torch.logspace(3, -3, inter, device=device)
    if R >= 3:
        gate[R // 3], up[R // 3], grad[R // 3] = 0.0, 0.0, 0.0
    if R >= 4:  # e^-g past fp32's range (the denominator infinite), past 2^126 (its reciprocal flushed), below it
        gate[R // 4, :4] = torch.tensor([-100.0, -88.5, 88.5, 100.0], device=device)
    return torch.cat([gate, up], dim=-1).bfloat16(), grad.bfloat16()


def _assert_within_a_step(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    """The fused kernels against quantize_both of the torch SwiGLU: their exponential (libdevice's) and products
    (which the compiler may fuse into FMAs, in another order than torch's separate kernels) can move an fp32
    value by a few ulps, so a value on a rounding boundary of e4m3 may land one code away (each mismatch exactly
    one code, in the same sign, one in a thousand at most; 1 in 4 million measured on an H100), and a scale (the
    block maximum over 448) by as much as that maximum moves. The bound on a scale is 2^-16 relative: the fp32
    references are themselves within 1e-6 (activation) and 1e-5 (gradient, where 1 + g (1 - sigmoid(g))
    cancels) of float64 (test_the_torch_swiglu_and_its_gradient_are_the_float64_ones), and the kernels compute
    the same functions in fp32 in another order; 4.7e-6 measured on an H100 (2^-20 failed, 2026-12-07). A scale
    of the wrong block or feature is off by far more."""
    assert len(got) == len(want) == 5
    for name, a, b in zip(("q", "scale", "q_t", "scale_t"), got, want, strict=False):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{name}: {a.dtype} {tuple(a.shape)} != {tuple(b.shape)}"
        if a.dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=2**-16, atol=0, msg=lambda m, name=name: f"{name}: {m}")
            continue
        a_bits, b_bits = a.view(torch.uint8).int(), b.view(torch.uint8).int()
        off = a_bits != b_bits
        assert int(off.sum()) <= max(1, a.numel() // 1000), f"{name}: {int(off.sum())} of {a.numel()} differ"
        assert bool(((a_bits - b_bits).abs()[off] == 1).all()), f"{name}: a value off by more than one e4m3 code"
    assert torch.equal(got[4], want[4])


@needs_gpu
@pytest.mark.parametrize("inter", [8, 128, 200, 768])
@pytest.mark.parametrize("counts", [[300, 0, 129, 64, 1, 511], [1], [0, 0], [4096, 333]])
@pytest.mark.parametrize("sigmoid", ["ieee", "rcp"])
def test_the_fused_swiglu_kernels_quantize_what_torch_computes(monkeypatch, inter, counts, sigmoid):
    """swiglu_both_kernel gives quantize_both of trainer.experts.fp8.swiglu(h) and swiglu_grad_both_kernel that of
    swiglu_grad(grad_act, h), within an e4m3 code (see _assert_within_a_step), with either sigmoid (quant.SIGMOID):
    partial blocks, empty experts, no rows, I of one feature lane, and I = 200, whose 128-feature block 1 of
    grad_h holds gate and up features; gates out to -100, the sigmoid's denominator infinite."""
    from trainer.experts.cutedsl import quant
    from trainer.experts.cutedsl.quant import quantize_both_kernel, swiglu_both_kernel, swiglu_grad_both_kernel
    from trainer.experts.fp8 import swiglu, swiglu_grad, token_blocks

    monkeypatch.setattr(grouped, "POISON_OUTPUTS", True)  # an element the kernel skips stays NaN and differs
    monkeypatch.setattr(quant, "SIGMOID", sigmoid)
    h, grad_act = _swiglu_inputs(sum(counts), inter, seed=inter, device="cuda")
    offsets = torch.tensor(counts, device="cuda").cumsum(0).int()
    ends, src, rows, _ = token_blocks(offsets, h.shape[0])
    for got, value in (
        (swiglu_both_kernel(h, src, rows), swiglu(h)),
        (swiglu_grad_both_kernel(grad_act, h, src, rows), swiglu_grad(grad_act, h)),
    ):
        _assert_within_a_step((*got, ends), (*quantize_both_kernel(value, src, rows), ends))


def test_the_torch_swiglu_and_its_gradient_are_the_float64_ones():
    """trainer.experts.fp8's swiglu and swiglu_grad, the fused kernels' references, match float64 autograd of
    silu(gate) * up to fp32 precision."""
    from trainer.experts.fp8 import swiglu, swiglu_grad

    h, grad_act = _swiglu_inputs(64, 200, seed=5, device="cpu")
    h64 = h.double().requires_grad_()
    gate, up = h64.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    act.backward(grad_act.double())
    torch.testing.assert_close(swiglu(h), act.detach().float(), rtol=1e-6, atol=1e-30)
    torch.testing.assert_close(swiglu_grad(grad_act, h), h64.grad.float(), rtol=1e-5, atol=1e-30)


def test_the_fused_swiglu_ops_off_the_gpu_are_the_torch_functions_and_bad_shapes_are_refused():
    """On the CPU swiglu_both_op and swiglu_grad_both_op run quantize_both of the torch SwiGLU and its gradient,
    their fakes give those shapes, and the kernels refuse an odd I or mismatched shapes, naming them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainer.experts.cutedsl.quant import (
        quantize_both_op,
        swiglu_both_kernel,
        swiglu_both_op,
        swiglu_grad_both_kernel,
        swiglu_grad_both_op,
    )
    from trainer.experts.fp8 import swiglu, swiglu_grad, token_blocks

    h, grad_act = _swiglu_inputs(259, 136, seed=2, device="cpu")
    offsets = torch.tensor([3, 3, 259], dtype=torch.int32)
    _, src, rows, _ = token_blocks(offsets, h.shape[0])
    cases = (
        (swiglu_both_op, (h, src, rows), swiglu(h)),
        (swiglu_grad_both_op, (grad_act, h, src, rows), swiglu_grad(grad_act, h)),
    )
    for op, args, value in cases:
        want = quantize_both_op(value, src, rows)
        _assert_same_five((*op(*args), offsets), (*want, offsets))
        with FakeTensorMode() as mode:
            fake = op(*(mode.from_tensor(t) for t in args))
        assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in want]
    with pytest.raises(ValueError, match=r"I a multiple of 8.*\(4, 24\)"):
        swiglu_both_kernel(torch.zeros(4, 24, dtype=torch.bfloat16), src, rows)
    with pytest.raises(ValueError, match=r"h must be \[R, 2I\] = \(4, 16\).*\(4, 24\)"):
        swiglu_grad_both_kernel(
            torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 24, dtype=torch.bfloat16), src, rows
        )
