"""The `slipstream` command line: run a role, launch a whole run, write multi-node scripts, show
configs, and hand over to the subcommands other packages own (simulate, eval, prep)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from common.config import ROLES, ConfigError, add_set_argument, diff, load_config, render

# subcommand -> "module:function" taking the remaining argv and returning an exit code; imported
# only when used, so `slipstream --help` stays fast and needs none of their dependencies.
DELEGATED = {
    "simulate": ("rollout.flow.sim.cli:cli_main", "run the flow-control simulator"),
    "eval": ("evaluator.cli:cli_main", "run benchmarks against an OpenAI-compatible URL"),
    "prep": ("trainer.data.prep:cli_main", "tokenize trainer.data.sources into token shards under trainer.data.root"),
    "convert": ("trainer.convert:cli_main", "convert a model between our checkpoint (DCP) and an HF directory"),
    "plan": ("trainer.plan:cli_main", "the memory one training rank needs: params, grads, optimizer, activations"),
}


def _add_config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("config", nargs=None if required else "?", help="TOML config file, e.g. configs/demo.toml")
    add_set_argument(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slipstream",
        description="RL post-training of Mixture-of-Experts models: trainer, vLLM workers, router, evaluator.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("run", help=f"run the role named by the ROLE environment variable ({'|'.join(ROLES)})")
    _add_config_args(p)
    p = sub.add_parser("launch", help="start every role of the config on this machine and wait for the run")
    _add_config_args(p, required=False)
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the experiment of this run dir from its newest checkpoint (CONFIG defaults to its "
        "config.toml); the run must not be running",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="print every line of every role (default: warnings, errors and one progress line; the "
        "whole output is in <run dir>/logs either way)",
    )
    p = sub.add_parser("scripts", help="write one script per role replica plus Slurm and Kubernetes files")
    _add_config_args(p)
    p.add_argument("outdir", help="directory to write the scripts into")
    p = sub.add_parser("show", help="print the resolved config with each field's docstring, or a diff of two")
    p.add_argument("config", help="TOML config file")
    p.add_argument("other", nargs="?", help="a second config: print only the differences")
    add_set_argument(p)
    p = sub.add_parser("dash", help="serve the run dashboard of a run root (all its runs) or of one run dir")
    p.add_argument("path", nargs="?", default="runs", metavar="RUN_ROOT|RUN_DIR", help="default: runs")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (printed)")
    p.add_argument(
        "--token",
        help="the secret it asks for (as ?token=T once, or 'Authorization: Bearer T'); default: the run's own for "
        "a run dir whose meet dir holds one, else a fresh one; the URL printed at start carries it",
    )
    p = sub.add_parser("token", help="print one of a run's generated bearer tokens (from its meet dir's secrets.json)")
    p.add_argument("path", metavar="MEET_DIR|RUN_DIR", help="the run's meet dir, or a run dir holding meet/")
    p.add_argument(
        "which",
        nargs="?",
        default="router",
        choices=("router", "workers", "dash"),
        help="router: the openai-compatible URL's (default); workers: the vLLM workers'; dash: the dashboard's",
    )
    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _cmd_show(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.other is None:
        print(render(cfg))
        return 0
    other = load_config(args.other, args.overrides)
    rows = diff(cfg, other)
    if not rows:
        print(f"no differences between {args.config} and {args.other}")
    for path, a, b in rows:
        print(f"{path}: {a!r} -> {b!r}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    import uvloop

    from common import log
    from common.pyfix import serialize_ast_parse
    from common.roles import RoleError, context_for, lifecycle, resolve_exp, role_main

    serialize_ast_parse()  # before any thread of the role starts (common/pyfix.py says why)

    role = os.environ.get("ROLE", "")
    if not role:
        raise RoleError(f"ROLE is not set; run e.g. ROLE=router slipstream run CFG (roles: {', '.join(ROLES)})")
    main = role_main(role)
    cfg = load_config(args.config, args.overrides)
    log.setup(role, resolve_exp(cfg, os.environ), cfg.run.log_level)
    ctx = context_for(cfg, role, config_path=args.config)
    try:
        return uvloop.run(lifecycle(ctx, main))
    finally:
        ctx.rendezvous.close()


def _cmd_launch(args: argparse.Namespace) -> int:
    from common.runs.launch import launch

    if args.config is None and args.resume is None:
        raise ConfigError("slipstream launch needs a CONFIG (e.g. configs/demo.toml) or --resume RUN_DIR")
    return launch(args.config, args.overrides, resume=args.resume, verbose=args.verbose)


def _cmd_scripts(args: argparse.Namespace) -> int:
    from common.net import is_loopback
    from common.runs.scripts import write_scripts

    for path in write_scripts(args.config, args.overrides, args.outdir):
        print(path)
    cfg = load_config(args.config, args.overrides)
    binds = {
        "rendezvous.bind_host": cfg.rendezvous.bind_host,
        "router.bind_host": cfg.router.bind_host,
        "rollout.bind_host": cfg.rollout.bind_host,
    }
    local = [f"{name} = {host!r}" for name, host in binds.items() if is_loopback(host)]
    if local:
        print(
            f"slipstream: note: {', '.join(local)}: fine for the role scripts on one host, but the Slurm batch "
            "and the Kubernetes manifest put roles on other nodes, which cannot reach a loopback address; "
            "set them to 0.0.0.0 (the router and the workers ask for the run's generated tokens, kept in the "
            "shared meet dir)",
            file=sys.stderr,
        )
    return 0


def _cmd_dash(args: argparse.Namespace) -> int:
    import uvloop

    from common.runs.dash.server import serve
    from common.runs.dash.sources import DashError

    try:
        uvloop.run(serve(args.path, args.host, args.port, args.token))
    except DashError as exc:
        print(f"slipstream: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


def _cmd_token(args: argparse.Namespace) -> int:
    from common.run_secrets import SecretsError, locate_meet, read_secrets

    try:
        run = read_secrets(locate_meet(Path(args.path)))
    except SecretsError as exc:
        print(f"slipstream: {exc}", file=sys.stderr)
        return 2
    assert run is not None  # locate_meet found the file
    print(getattr(run, args.which))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        target, _ = DELEGATED[argv[0]]
        module_name, func = target.split(":")
        return int(getattr(importlib.import_module(module_name), func)(argv[1:]))
    args = build_parser().parse_args(argv)
    commands = {
        "show": _cmd_show,
        "run": _cmd_run,
        "launch": _cmd_launch,
        "scripts": _cmd_scripts,
        "dash": _cmd_dash,
        "token": _cmd_token,
    }
    try:
        return commands[args.command](args)
    except ConfigError as exc:
        print(f"slipstream: config error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from common.redis_client import RendezvousError
        from common.roles import RoleError
        from common.runs.prepare import LaunchError

        if isinstance(exc, (RoleError, RendezvousError, LaunchError)):
            print(f"slipstream: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
