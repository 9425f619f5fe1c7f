"""The `file` weight-transfer engine: applies a published weight version read from safetensors files.

Update info is `{"path": DIR_OR_FILE}`; every `*.safetensors` file of a directory is read in name
order and streamed, one tensor at a time, into `model.load_weights` inside vLLM's layer-wise reload
(`initialize_layerwise_reload` on start, `finalize_layerwise_reload` on finish), so HF-named
checkpoint tensors (one name per expert) are sharded, fused and post-processed exactly as at load.
No process group or handshake is needed: trainer and workers only share the files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)


@dataclass
class FileInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the files are the transport."""


@dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    path: str
    """A safetensors file, or a directory whose *.safetensors files together hold the version."""

    def files(self) -> list[Path]:
        p = Path(self.path)
        if p.is_file():
            return [p]
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else []
        if not files:
            raise FileNotFoundError(
                f"file weight update: {self.path!r} is not a safetensors file nor a directory holding any; "
                "is the weight dir shared with this worker (rollout.weight_dir)?"
            )
        return files


def _tensors(files: list[Path]):
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, fh.get_tensor(name)


class FileWeightTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    """Loads HF-named safetensors into the running model through vLLM's layer-wise reload."""

    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        pass  # the files need no connection

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        files = update_info.files()
        if self.device.type != "cpu":
            tensors = ((name, t.to(self.device, non_blocking=True)) for name, t in _tensors(files))
        else:
            tensors = _tensors(files)
        self.model.load_weights(tensors)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        # The base class synchronizes the accelerator unconditionally, which raises on CPU.
        if torch.accelerator.current_accelerator() is not None:
            torch.accelerator.synchronize()

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        pass  # nothing held between updates
