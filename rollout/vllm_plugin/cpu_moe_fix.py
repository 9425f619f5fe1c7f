"""Fix for vLLM 0.32's CPU MoE reload: re-run the CPU expert pre-pack after a weight update.

On the first load, the unquantized fused-MoE method shuffles w13/w2 and then lets the CPU experts
kernel pre-pack them into its grouped-GEMM layout. On a reload (`moe_kernel` already built) vLLM
copies the freshly shuffled, *unpacked* weights into the parameters and skips the pre-pack, so the
kernel reads a wrong layout (outputs about 1.3 nats off). The wrapper below runs that pre-pack on
reloads too. It is installed only where the bug exists: vLLM 0.32 on the CPU platform.
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)

_MARK = "_slipstream_cpu_moe_reload_fix"


def install() -> bool:
    """Wrap the unquantized MoE method's post-load hook; True when installed (or already installed)."""
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not vllm.__version__.startswith("0.32."):
        return False
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    original = UnquantizedFusedMoEMethod.process_weights_after_loading
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def process_weights_after_loading(self, layer) -> None:
        is_reload = getattr(self, "moe_kernel", None) is not None
        original(self, layer)
        if not is_reload:
            return
        experts = self.moe_kernel.fused_experts
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)

    setattr(process_weights_after_loading, _MARK, True)
    UnquantizedFusedMoEMethod.process_weights_after_loading = process_weights_after_loading  # type: ignore[method-assign]
    return True
