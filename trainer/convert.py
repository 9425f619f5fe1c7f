"""`slipstream convert SRC DST`: a model between our checkpoint layout (a DCP directory with .metadata: a
training checkpoint's step directory, or what this command writes) and the HF layout (config.json +
safetensors with one entry per expert), either direction, decided by what SRC is.

DCP -> HF: the model shape comes from the run config (`--config`, with `--set`; a run whose rollout.model is an
HF directory takes it from that directory's config.json: trainer/hf_run.py), else from the config the
checkpoint recorded. The HF directory gets the model's tokenizer, chat template and generation config: those
of rollout.model when it is an HF directory, the tiny kit's for a tiny-model name. `--dtype` is the dtype of
the written weights; `--fp8` writes FP8 block-quantized experts (export_hf's fp8_blocks).

HF -> DCP: the model shape comes from SRC's config.json; the checkpoint holds the float32 model tensors and a
config naming SRC as rollout.model (so converting back finds the tokenizer again). `trainer.init` loads it."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from common.config import Config, ConfigError, add_set_argument, load_config, to_toml
from common.weights.model_files import TOKENIZER_FILES, copy_model_files
from trainer.checkpoint import checkpoint_config, load_model_weights, save_model_weights
from trainer.hf import HFFormatError, export_hf, import_hf
from trainer.hf_run import config_for_hf_model
from trainer.model import build_model
from trainer.tinykit import TINY_MODELS, build_tokenizer

DTYPES = ("float32", "bfloat16")
# config.json fields of the source model that the written one keeps (the tokenizer's special token ids).
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def layout(path: Path) -> str:
    """ "hf" (a config.json) or "dcp" (a .metadata); ConfigError naming the path otherwise."""
    if (path / "config.json").is_file():
        return "hf"
    if (path / ".metadata").is_file():
        return "dcp"
    raise ConfigError(
        f"{path} is neither an HF directory (config.json) nor one of our checkpoints (.metadata): pass a "
        "checkpoint step directory (e.g. runs/RUN/checkpoints/step_000100) or an HF model directory"
    )


def hf_to_dcp(src: Path, dst: Path) -> Config:
    """Write the model of the HF directory `src` as our checkpoint `dst`; the config recorded with it."""
    model = import_hf(src)
    cfg = Config()
    cfg = replace(cfg, rollout=replace(cfg.rollout, model=str(src)), trainer=replace(cfg.trainer, model=model.cfg))
    save_model_weights(dst, model, to_toml(cfg))
    return cfg


def dcp_to_hf(src: Path, dst: Path, cfg: Config, dtype: str = "float32", fp8: bool = False) -> list[str]:
    """Write the model of our checkpoint `src`, shaped by `cfg.trainer.model`, as the HF directory `dst`, with
    the tokenizer files of cfg's rollout.model; the names of the files copied or written beside the weights."""
    model = build_model(cfg.trainer.model, seed=None)
    load_model_weights(src, model)
    source = Path(cfg.rollout.model)
    extra: dict[str, Any] = {}
    if cfg.rollout.model not in TINY_MODELS and (source / "config.json").is_file():
        hf = json.loads((source / "config.json").read_text())
        extra = {k: hf[k] for k in TOKEN_ID_FIELDS if k in hf}
    # fp8_blocks is export_hf's FP8 block-quantized layout (the "fp8" branch of issue 34 adds it).
    fp8_args: dict[str, Any] = {"fp8_blocks": True} if fp8 else {}
    export_hf(model, dst, dtype, extra, **fp8_args)
    if cfg.rollout.model in TINY_MODELS:
        build_tokenizer(dst)
        return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    if not source.is_dir():
        raise ConfigError(
            f"rollout.model = {cfg.rollout.model!r} does not exist here, so the converted model would have no "
            "tokenizer: pass --config with the run's config and rollout.model set to the model's HF directory"
        )
    return copy_model_files(source, dst, ("generation_config.json", *TOKENIZER_FILES))


def run_config(config: str | None, overrides: Sequence[str], src: Path) -> Config:
    """The config that shapes a DCP checkpoint's model: `config` (resolved against an HF rollout.model), else the
    one the checkpoint recorded."""
    if config is not None:
        return config_for_hf_model(load_config(config, overrides))
    if overrides:
        raise ConfigError(f"--set {overrides[0]} needs --config (the checkpoint's recorded config is used as is)")
    return checkpoint_config(src)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slipstream convert",
        description="Convert a model between our checkpoint (a DCP step directory) and an HF directory, either "
        "direction (decided by SRC).",
    )
    p.add_argument(
        "src", metavar="SRC", help="a checkpoint step directory (.metadata) or an HF directory (config.json)"
    )
    p.add_argument("dst", metavar="DST", help="the directory to write; must not exist yet")
    p.add_argument(
        "--config",
        help="DCP -> HF: the run's TOML config, whose trainer.model (or rollout.model's config.json) shapes the "
        "model (default: the config the checkpoint recorded)",
    )
    add_set_argument(p, "trainer.model.num_layers=4")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="DCP -> HF: dtype of the written weights")
    p.add_argument("--fp8", action="store_true", help="DCP -> HF: write FP8 block-quantized weights (128 x 128 scales)")
    return p


def convert(args: argparse.Namespace) -> str:
    """Run one conversion; the line that reports it."""
    src, dst = Path(args.src), Path(args.dst)
    kind = layout(src)
    if dst.exists():
        raise ConfigError(f"DST {dst} exists; converting never overwrites: pass a new directory")
    if kind == "hf":
        given = {
            "--dtype": args.dtype != "float32",
            "--fp8": args.fp8,
            "--config": args.config is not None,
            "--set": bool(args.overrides),
        }
        unused = [flag for flag, on in given.items() if on]
        if unused:
            raise ConfigError(
                f"{', '.join(unused)}: apply to DCP -> HF only; an HF -> DCP conversion takes the shape from "
                f"{src / 'config.json'} and writes float32 masters"
            )
        cfg = hf_to_dcp(src, dst)
        return f"{src} (HF) -> {dst} (checkpoint, trainer.init loads it): {cfg.trainer.model.arch}"
    cfg = run_config(args.config, args.overrides, src)
    files = dcp_to_hf(src, dst, cfg, args.dtype, args.fp8)
    carried = ", ".join(files) if files else "no tokenizer files (rollout.model has none)"
    return f"{src} (checkpoint) -> {dst} (HF, {args.dtype}{', fp8 blocks' if args.fp8 else ''}) with {carried}"


def cli_main(argv: Sequence[str]) -> int:
    """`slipstream convert ...`: exit 2 on a usage, config or format error."""
    args = build_parser().parse_args(list(argv))
    try:
        print(convert(args))
    except (ConfigError, HFFormatError, FileNotFoundError) as exc:
        print(f"slipstream convert: {exc}", file=sys.stderr)
        return 2
    return 0
