"""Slipstream's vLLM general plugin: the `file` (and `collective`) weight-transfer engine and the CPU MoE reload fix.

vLLM runs `register` (entry point group `vllm.general_plugins`, see pyproject.toml) in every vLLM
process. It registers the `file` engine, which loads a published weight version from safetensors
files (common/weights/ writes them) and works on any machine that sees the files, also as `collective`, the
name it runs under when versions come through the trainer ranks' gloo groups, and, on the CPU
platform of vLLM 0.32, makes weight reloads re-run the CPU expert pre-packing that vLLM skips, and
in the server a worker role started, watches that role and ends the server when it dies (watchdog.py).
On that platform it also makes `--enable-return-routed-experts` work with the V1 CPU model runner
(routed_experts.py).
vLLM's own engines (nccl, ipc, ...) stay registered and selectable with
`--weight-transfer-config '{"backend": "nccl"}'` on GPUs.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

FILE_BACKEND = "file"
COLLECTIVE_BACKEND = "collective"
"""The same engine under the name of the collective transport (common/weights/collective.py): it receives a
version's shards through the trainer ranks' gloo groups, and loads versions from files as the `file` engine does
(a worker catching up, the evaluator's pinned worker)."""


def register() -> None:
    """Entry point run by vLLM in each of its processes; idempotent."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    # vLLM loads general plugins once per process, but a process that imports us twice (tests) must
    # not fail on the factory's duplicate-name check.
    for name in (FILE_BACKEND, COLLECTIVE_BACKEND):
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(
                name, "rollout.vllm_plugin.file_engine", "FileWeightTransferEngine"
            )
    from rollout.vllm_plugin import cpu_moe_fix, routed_experts, watchdog

    _log_to_server_output()
    cpu_moe_fix.install()
    routed_experts.install()
    watchdog.start()


def _log_to_server_output() -> None:
    """Our INFO lines (how many shards of a collective update came through the groups, the routed-experts
    capture) in the server's output beside vLLM's own: vLLM configures its `vllm` logger only."""
    plugin = logging.getLogger(__name__)
    if plugin.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S"))
    plugin.addHandler(handler)
    plugin.setLevel(logging.INFO)
    plugin.propagate = False
