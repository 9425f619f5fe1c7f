"""Delta publishing (`rollout.weight_delta`): a version sent as its difference from a version the workers hold.

Encoding, per tensor: the bit patterns of the new tensor XOR those of the same tensor in the base version,
byte-shuffled (all first bytes of the elements, then all second bytes, ...) and compressed with zstd level 1.
An element that did not change is zero after the XOR, and one that moved by a few units in the last place
differs only in its low mantissa bits, so the shuffled stream is mostly zeros. Measured on the CPU
(bench/RESULTS.md, "Delta publishing"): at the demo's learning rate nearly every bf16 weight changes each step
and the delta is about a third of the full bytes; at 1e-6 it is a few percent. Sparse (index, value) pairs
cost 6 bytes per changed bf16 element and lost at every rate measured, so they are not offered.

On disk a delta version has the file layout of a full one (common/weights/index.py): the same shards with
the same tensors in the same order, where an encoded tensor is a uint8 tensor of its compressed bytes. Each
shard's safetensors metadata `slipstream_delta` (JSON) says, for every tensor of the shard, whether it is
`raw` or `xor-zstd` (then its dtype and shape) and the CRC-32 of the tensor it stands for, plus the version
and the base. A tensor is encoded only when its rank holds the base version's tensor of the same dtype and
shape (`DeltaEncoder`); otherwise it is written raw. A version none of whose tensors is encoded is a full
snapshot, and the publisher sends one every `rollout.weight_snapshot_every` versions.

The reader (`DeltaDecoder`, used by the `file` engine inside vLLM) keeps the full tensors of the last
version it loaded (`HeldWeights`: a host copy of the HF-named weights, as large as the model's share the
worker loads). A delta whose base is not what it holds (a worker that restarted, or missed a version) is
applied on top of the base rebuilt from disk: the base's last snapshot and the deltas after it. Every
decoded tensor is checked against its CRC-32 before it is handed to the model, so the weights a worker
serves are bit for bit the full version's, or the update fails naming the tensor.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.weights.index import DELTA_META_KEY as META_KEY

RAW = "raw"
XOR_ZSTD = "xor-zstd"
ZSTD_LEVEL = 1


class DeltaError(RuntimeError):
    """A delta cannot be applied: its base is unavailable, or a tensor does not decode to its checksum."""


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a view of a contiguous tensor)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def tensor_crc(t: torch.Tensor) -> int:
    """zlib's CRC-32 of the tensor's bytes (row-major)."""
    return zlib.crc32(_bytes(t).numpy().data)


def _shuffle(flat: np.ndarray, width: int) -> np.ndarray:
    """Bytes grouped by their place in the element: every element's first byte, then every second byte, ..."""
    return np.ascontiguousarray(flat.reshape(-1, width).T) if width > 1 else flat


def _unshuffle(flat: np.ndarray, width: int) -> np.ndarray:
    return np.ascontiguousarray(flat.reshape(width, -1).T).reshape(-1) if width > 1 else flat


def encode(new: torch.Tensor, base: torch.Tensor) -> bytes:
    """The compressed, byte-shuffled XOR of two tensors of one dtype and shape. (numpy does the byte work: torch
    transposes uint8 several times slower.)"""
    import zstandard

    xor = np.bitwise_xor(_bytes(new).numpy(), _bytes(base).numpy())
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(_shuffle(xor, new.element_size()).data)


def decode(blob: bytes | np.ndarray, base: torch.Tensor) -> torch.Tensor:
    """The tensor `encode(new, base)` was made from."""
    import zstandard

    size = base.numel() * base.element_size()
    raw = zstandard.ZstdDecompressor().decompress(blob if isinstance(blob, bytes) else blob.data, max_output_size=size)
    if len(raw) != size:
        raise ValueError(f"the delta decompresses to {len(raw)} bytes, the tensor has {size}")
    xor = _unshuffle(np.frombuffer(raw, dtype=np.uint8), base.element_size())
    full = np.bitwise_xor(xor, _bytes(base).numpy())
    return torch.from_numpy(full).view(base.dtype).reshape(base.shape)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise DeltaError(f"delta metadata names dtype {name!r}, which torch does not have")
    return dtype


class DeltaEncoder:
    """One trainer rank's memory of the part of the last version it wrote, the base of its next delta.

    It keeps a host copy of those tensors (as large as the rank's part of the exported model)."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.tensors: dict[str, torch.Tensor] = {}

    def base_for(self, base: int | None) -> int | None:
        """The base this rank's part can be encoded against: `base` when it holds that version, else None (raw)."""
        return base if base is not None and base == self.version else None

    def encode_shard(
        self, version: int, base: int | None, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], str]:
        """The tensors to write for one shard (encoded where the base has the tensor) and its metadata JSON.
        `base` must be what `base_for` returned."""
        out: dict[str, torch.Tensor] = {}
        entries: dict[str, dict[str, Any]] = {}
        for name, t in tensors.items():
            held = self.tensors.get(name) if base is not None else None
            entry: dict[str, Any] = {"crc32": tensor_crc(t)}
            if held is not None and held.dtype == t.dtype and held.shape == t.shape:
                out[name] = torch.frombuffer(bytearray(encode(t, held)), dtype=torch.uint8)
                entry.update(enc=XOR_ZSTD, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape))
            else:
                out[name] = t
                entry["enc"] = RAW
            entries[name] = entry
        return out, json.dumps({"version": version, "base": base, "tensors": entries})

    def remember(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """After this rank wrote its whole part of `version`: keep copies of those tensors as the next base."""
        self.version = None  # a failure while copying leaves no half-updated base
        self.tensors = {name: t.detach().to("cpu", copy=True) for name, t in tensors}
        self.version = version


@dataclass
class HeldWeights:
    """The full HF-named tensors of the version a reader last loaded (`version` None: nothing held)."""

    version: int | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def shard_meta(metadata: Mapping[str, str] | None) -> dict[str, Any] | None:
    """A shard's delta metadata, or None for a shard written without delta publishing."""
    if not metadata or META_KEY not in metadata:
        return None
    return json.loads(metadata[META_KEY])


class DeltaDecoder:
    """Turns the shards of one version into full tensors, checked against their CRC-32 (see the module docstring).

    `held` is what the reader holds before this version; `load_base(version)` rebuilds the full tensors of an
    older version from disk when a delta's base is not the one held. `finish(version)` makes the decoded
    tensors the held ones once every shard went through."""

    def __init__(self, held: HeldWeights, load_base: Callable[[int], dict[str, torch.Tensor]] | None) -> None:
        self.held, self.load_base = held, load_base
        self.fresh: dict[str, torch.Tensor] = {}

    def tensors(
        self, where: str, meta: Mapping[str, Any], tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        entries: Mapping[str, Any] = meta["tensors"]
        base = meta.get("base")
        for name, stored in tensors:
            entry = entries.get(name)
            if entry is None:
                raise DeltaError(f"{where}: tensor {name!r} has no entry in the shard's delta metadata")
            if entry["enc"] == RAW:
                full = stored
            elif entry["enc"] == XOR_ZSTD:
                full = self._decode(where, name, stored, base, entry)
            else:
                raise DeltaError(
                    f"{where}: tensor {name!r} has encoding {entry['enc']!r}; expected {RAW} or {XOR_ZSTD}"
                )
            if (crc := tensor_crc(full)) != entry["crc32"]:
                raise DeltaError(
                    f"{where}: tensor {name!r} decodes to CRC-32 {crc:#010x}, its metadata says {entry['crc32']:#010x}; "
                    "the delta (or the base it was applied to) is corrupt"
                )
            self.fresh[name] = full
            yield name, full

    def _decode(
        self, where: str, name: str, stored: torch.Tensor, base: int | None, entry: Mapping[str, Any]
    ) -> torch.Tensor:
        if base is None:
            raise DeltaError(f"{where}: tensor {name!r} is a delta but the shard names no base version")
        if self.held.version != base:
            if self.load_base is None:
                raise DeltaError(
                    f"{where}: tensor {name!r} is a delta of version {base}, which this reader cannot rebuild"
                )
            self.held = HeldWeights(base, self.load_base(base))
        old = self.held.tensors.pop(name, None)  # each name comes once per version: the base copy can go
        dtype, shape = _dtype(entry["dtype"]), torch.Size(entry["shape"])
        if old is None or old.dtype != dtype or old.shape != shape:
            found = "nothing" if old is None else f"{old.dtype} {tuple(old.shape)}"
            raise DeltaError(
                f"{where}: tensor {name!r} is a delta of version {base}'s {dtype} {tuple(shape)}, "
                f"but that version holds {found} under the name"
            )
        try:
            return decode(stored.numpy(), old)
        except Exception as exc:  # zstd's errors, or a stream that decompresses to the wrong length
            raise DeltaError(f"{where}: tensor {name!r} does not decode against version {base}: {exc}") from exc

    def finish(self, version: int) -> HeldWeights:
        """What the reader holds after this version loaded whole."""
        return HeldWeights(version, self.fresh)


def shard_tensors(data: bytes) -> tuple[dict[str, Any] | None, Iterable[tuple[str, torch.Tensor]]]:
    """A safetensors shard held in memory: its delta metadata (None without) and its tensors, by name."""
    from safetensors.torch import load

    from common.weights.index import safetensors_metadata

    return shard_meta(safetensors_metadata(data)), sorted(load(data).items())  # by name, as safe_open lists them


def rebuild(root: Path, version: int, held: HeldWeights) -> dict[str, torch.Tensor]:
    """The full tensors of the committed version `version` under `root`: `held`'s when it holds that version,
    else the version's last snapshot with the deltas after it applied in order (starting from `held` when the
    chain passes through the version it holds). Every shard is checked against its index, every tensor against
    its CRC-32; DeltaError names what is missing or wrong."""
    from common.weights.index import CorruptShardError, committed_shards, delta_base, read_index
    from common.weights.versions import version_dir

    chain: list[int] = []
    v: int | None = version
    while v is not None and v != held.version:
        directory = version_dir(root, v)
        if not directory.is_dir():
            raise DeltaError(
                f"cannot rebuild weight version {version}: {directory}, on its chain of deltas, is gone; "
                "a version's snapshot and the deltas after it must stay on disk while it is in use"
            )
        chain.append(v)
        base = delta_base(directory)
        if base is not None and base >= v:
            raise DeltaError(f"{directory}'s index names delta base {base}, not an older version")
        v = base
    current = held if v is not None else HeldWeights()
    for v in reversed(chain):
        directory = version_dir(root, v)
        records = read_index(directory)
        if records is None:
            raise DeltaError(f"cannot rebuild weight version {version}: {directory} has no index with checksums")
        decoder = DeltaDecoder(current, _no_base(directory))
        try:
            for path, data in committed_shards(directory, records):
                meta, tensors = shard_tensors(data)
                if meta is None:  # written whole without delta publishing: its shard checksums vouch for it
                    decoder.fresh.update(tensors)
                    continue
                for _ in decoder.tensors(str(path), meta, tensors):
                    pass
        except CorruptShardError as exc:
            raise DeltaError(f"cannot rebuild weight version {version}: {exc}") from exc
        current = decoder.finish(v)
    return current.tensors


def _no_base(directory: Path) -> Callable[[int], dict[str, torch.Tensor]]:
    def fail(base: int) -> dict[str, torch.Tensor]:
        raise DeltaError(f"{directory} is a delta of version {base}, which its chain did not produce")

    return fail
