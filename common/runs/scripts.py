"""Scripts for multi-node runs (`slipstream scripts`): the processes the local launcher would start
(common/runs/prepare.py), written as shell scripts, one per replica, plus a Slurm batch file and a Kubernetes
manifest. Placement comes from the config: entries with the same `node_group` share nodes, and `place`
packs each group's replicas onto nodes of `launch.gpus_per_node` GPUs by their `gpus_per_replica`. Slurm
gets one heterogeneous-job component per node group and one step per replica pinned to its node and GPUs;
Kubernetes gets the trainer as an indexed Job (and every other critical entry likewise), the other entries
as Deployments, a Service in front of the router, and one shared volume. Left out: restart policies under
Slurm (a failed step fails the job) and any per-cluster tuning (partitions, accounts, storage classes),
which belongs in the written files.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import string
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from common.config import ENV_PREFIX, Config
from common.runs.prepare import Prepared, Replica, command_of, env_of, prepare, replicas_of

DEPLOY_DIR = Path(__file__).resolve().parent.parent.parent / "deploy"

# Where pods find the resolved config (a Secret: it may carry router.auth_token and rollout.api_key).
POD_CONFIG_DIR = Path("/etc/slipstream")
# Kubernetes' own annotation that holds an indexed Job pod's index.
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
# The router's port in pods when router.port = 0 (random), so that its Service has a target.
ROUTER_SERVICE_PORT = 8000


@dataclass(frozen=True)
class Slot:
    """Where one replica runs: node `node` of its node group, on GPUs `gpus` of that node."""

    replica: Replica
    node: int
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class NodeGroup:
    """Entries that share nodes (`launch.roles.<entry>.node_group`) and the slot of each of their replicas."""

    name: str
    entries: tuple[str, ...]
    nodes: int
    gpus_per_node: int
    """GPUs each node of the group is asked for: launch.gpus_per_node, or 0 when no replica uses a GPU."""
    slots: tuple[Slot, ...]


def place(cfg: Config) -> list[NodeGroup]:
    """Pack each node group's replicas onto nodes by GPUs: first fit, the replicas with most GPUs first.

    A replica never spans nodes (a vLLM worker's tensor-parallel GPUs sit on one node), so a group may need
    more nodes than its GPU total divided by launch.gpus_per_node. Replicas without GPUs go to the group's
    first node; a group of them takes one node. Groups come in the order of their first entry.
    """
    members: dict[str, list[Replica]] = {}
    for rep in replicas_of(cfg):
        members.setdefault(rep.spec.node_group or rep.entry, []).append(rep)
    per_node = cfg.launch.gpus_per_node
    groups = []
    for name, reps in members.items():
        free: list[int] = []  # GPUs still free on each node opened so far
        slots: dict[str, Slot] = {}
        for rep in sorted(reps, key=lambda r: -r.spec.gpus_per_replica):  # stable: launch.roles order within a size
            need = rep.spec.gpus_per_replica
            node = next((n for n, left in enumerate(free) if left >= need), len(free))
            if node == len(free):
                free.append(per_node)
            first = per_node - free[node]
            free[node] -= need
            slots[rep.label] = Slot(rep, node, tuple(range(first, first + need)))
        entries = tuple(dict.fromkeys(rep.entry for rep in reps))
        gpus = per_node if any(rep.spec.gpus_per_replica for rep in reps) else 0
        groups.append(NodeGroup(name, entries, len(free), gpus, tuple(slots[rep.label] for rep in reps)))
    return groups


def _render(template: str, **fields: str) -> str:
    return string.Template((DEPLOY_DIR / template).read_text()).substitute(fields)


def write_scripts(config_path: str | None, overrides: Sequence[str], outdir: str | os.PathLike[str]) -> list[Path]:
    """Write one script per replica, a Slurm batch file and a Kubernetes manifest; returns their paths."""
    prep = prepare(config_path, overrides)
    if not prep.cfg.launch.roles:
        raise ValueError(f"{config_path}: [launch.roles] is empty; nothing to write")
    out = Path(outdir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path.cwd().resolve()
    scripts: dict[str, Path] = {}
    for rep in replicas_of(prep.cfg):
        exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env_of(rep, prep).items())
        path = out / f"{rep.entry}-{rep.index}.sh"
        path.write_text(
            _render(
                "role.sh.tmpl",
                entry=rep.entry,
                index=str(rep.index),
                exp=prep.exp,
                exports=exports,
                workdir=shlex.quote(str(workdir)),
                command=shlex.join(command_of(rep, prep)),
            )
        )
        path.chmod(0o755)
        scripts[rep.label] = path
    groups = place(prep.cfg)
    slurm = out / "slurm.sbatch"
    slurm.write_text(slurm_batch(prep, groups, scripts))
    k8s = out / "k8s.yaml"
    k8s.write_text(k8s_manifest(prep, groups, workdir))
    return [*scripts.values(), slurm, k8s, prep.config_file]


def slurm_batch(prep: Prepared, groups: Sequence[NodeGroup], scripts: Mapping[str, Path]) -> str:
    """One component per node group (a plain job for one group), one step per replica on its node and GPUs.

    Trainer ranks get torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR = rank 0's node, ...); each
    rank sees only its own GPU, so LOCAL_RANK is 0.
    """
    het = len(groups) > 1
    header: list[str] = []
    hosts: list[str] = []
    steps: list[str] = []
    for k, group in enumerate(groups):
        if k:
            header.append("#SBATCH hetjob")
        header += [
            f"# component {k}: node group {group.name!r} ({', '.join(group.entries)})",
            f"#SBATCH --nodes={group.nodes}",
            "#SBATCH --exclusive",
            "#SBATCH --mem=0",
        ]
        if group.gpus_per_node:
            header.append(f"#SBATCH --gpus-per-node={group.gpus_per_node}")
        nodelist = f"SLURM_JOB_NODELIST_HET_GROUP_{k}" if het else "SLURM_JOB_NODELIST"
        hosts.append(f'mapfile -t hosts_{k} < <(scontrol show hostnames "${nodelist}")')
        for slot in group.slots:
            rep = slot.replica
            srun = [
                "srun",
                *([f"--het-group={k}"] if het else []),
                "--nodes=1",
                "--ntasks=1",
                "--overlap",
                f'--nodelist="${{hosts_{k}[{slot.node}]}}"',
            ]
            env: list[str] = []
            if group.gpus_per_node:  # co-located replicas split the node's GPUs; one without GPUs sees none
                srun += [f"--gpus-per-node={group.gpus_per_node}"] if slot.gpus else []
                env.append(f"CUDA_VISIBLE_DEVICES={','.join(map(str, slot.gpus))}")
            if rep.role == "trainer":
                rank0 = next(s for s in group.slots if s.replica.entry == rep.entry and s.replica.index == 0)
                master = f'"${{hosts_{k}[{rank0.node}]}}"'
                env += [
                    f"RANK={rep.index}",
                    f"WORLD_SIZE={rep.spec.replicas}",
                    "LOCAL_RANK=0",
                    f"MASTER_ADDR={master}",
                    f"MASTER_PORT={prep.cfg.launch.master_port}",
                ]
            command = ["env", *env] if env else []
            steps.append(" ".join([*srun, *command, "bash", shlex.quote(str(scripts[rep.label])), "&"]))
            if rep.spec.critical:
                steps.append("critical_pids+=($!)")
    return _render(
        "slurm.sbatch.tmpl", exp=prep.exp, components="\n".join(header), hosts="\n".join(hosts), steps="\n".join(steps)
    )


def k8s_manifest(prep: Prepared, groups: Sequence[NodeGroup], workdir: Path) -> str:
    """The run as Kubernetes objects: a shared volume and the config, then each entry's workload.

    Critical entries (the trainer) are indexed Jobs, one index per replica, so the run is over when they
    complete; the trainer's pods also get torchrun-style variables and a headless Service that gives rank 0
    a stable name. The other entries are Deployments (Kubernetes restarts their pods), whose
    SLIPSTREAM_REPLICA is the pod name. The router gets a Service on router.port (ROUTER_SERVICE_PORT when 0).
    """
    cfg, launch = prep.cfg, prep.cfg.launch
    exp = _k8s_name(prep.exp)
    shared, config = _k8s_name(f"{prep.exp}-shared"), _k8s_name(f"{prep.exp}-config")
    run_labels = {"app": "slipstream", "experiment": exp}
    # The volume sits at the run dir, so the meet dir (by default <run dir>/meet), published weights and
    # checkpoints are shared by every pod at the paths the config names.
    mounts: list[dict[str, Any]] = [
        {"name": "shared", "mountPath": str(prep.run_dir)},
        {"name": "config", "mountPath": str(POD_CONFIG_DIR), "readOnly": True},
    ]
    if not prep.meet_dir.is_relative_to(prep.run_dir):
        mounts.append({"name": "shared", "mountPath": str(prep.meet_dir), "subPath": "meet"})
    volumes = [
        {"name": "shared", "persistentVolumeClaim": {"claimName": shared}},
        {"name": "config", "secret": {"secretName": config}},
    ]
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": shared, "labels": run_labels},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "resources": {"requests": {"storage": launch.shared_volume_size}},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": config, "labels": run_labels},
            "type": "Opaque",
            "stringData": {"config.toml": prep.config_file.read_text()},
        },
    ]
    pod_prep = dataclasses.replace(prep, config_file=POD_CONFIG_DIR / "config.toml")
    group_of = {entry: group.name for group in groups for entry in group.entries}
    for entry, spec in launch.roles.items():
        if spec.replicas == 0:
            continue
        rep = Replica(entry=entry, role=spec.role or entry, index=0, spec=spec)
        indexed = rep.role == "trainer" or spec.critical
        # An indexed Job's pods are named <job>-<index>, and a pod's host name is one DNS label.
        name = _k8s_name(f"{prep.exp}-{entry}", 62 - len(str(spec.replicas - 1)) if indexed else 63)
        selector = {**run_labels, "entry": _k8s_name(entry)}
        labels = {**selector, "role": _k8s_name(rep.role), "node-group": _k8s_name(group_of[entry])}
        env: list[dict[str, Any]] = [
            {"name": k, "value": v} for k, v in env_of(rep, prep).items() if k != "SLIPSTREAM_REPLICA"
        ]
        env.append(_field_env("SLIPSTREAM_REPLICA", COMPLETION_INDEX if indexed else "metadata.name"))
        container: dict[str, Any] = {
            "name": _k8s_name(rep.role),
            "image": launch.image,
            "workingDir": str(workdir),
            # Kubernetes expands $(VAR) from the container's environment: each pod gets its own index.
            "command": command_of(rep, pod_prep, replica="$(SLIPSTREAM_REPLICA)"),
            "env": env,
            "volumeMounts": mounts,
        }
        if spec.gpus_per_replica:
            container["resources"] = {"limits": {"nvidia.com/gpu": spec.gpus_per_replica}}
        pod: dict[str, Any] = {"containers": [container], "volumes": volumes, "affinity": _share_nodes(exp, labels)}
        if rep.role == "trainer":
            env += [
                _field_env("RANK", COMPLETION_INDEX),
                {"name": "WORLD_SIZE", "value": str(spec.replicas)},
                {"name": "LOCAL_RANK", "value": "0"},  # one rank per pod
                {"name": "MASTER_ADDR", "value": f"{name}-0.{name}"},  # rank 0's pod through the headless Service
                {"name": "MASTER_PORT", "value": str(launch.master_port)},
            ]
            pod["subdomain"] = name
            docs.append(_service(name, labels, selector, launch.master_port, headless=True))
        if rep.role == "router":
            port = cfg.router.port or ROUTER_SERVICE_PORT
            if not cfg.router.port:  # a random port cannot be a Service's target: pin it in the pod
                env.append({"name": f"{ENV_PREFIX}router__port", "value": str(port)})
            container["ports"] = [{"name": "http", "containerPort": port}]
            docs.append(_service(name, labels, selector, port, headless=False))
        template = {"metadata": {"labels": labels}, "spec": pod}
        if indexed:
            pod["restartPolicy"] = "Never"
            docs.append(
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "metadata": {"name": name, "labels": labels},
                    "spec": {
                        "completionMode": "Indexed",
                        "completions": spec.replicas,
                        "parallelism": spec.replicas,
                        "backoffLimit": 0,
                        "template": template,
                    },
                }
            )
        else:
            docs.append(
                {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "metadata": {"name": name, "labels": labels},
                    "spec": {"replicas": spec.replicas, "selector": {"matchLabels": selector}, "template": template},
                }
            )
    header = (
        f"# Slipstream experiment {prep.exp}, written by `slipstream scripts`. Apply with: kubectl apply -f k8s.yaml\n"
        "# The shared volume must be ReadWriteMany: add spec.storageClassName for a class that is (NFS, CephFS, ...).\n"
        f"# Image {launch.image} must hold this checkout at {workdir} and its Python at {sys.executable}.\n"
    )
    return header + yaml.dump_all(docs, Dumper=_ManifestDumper, sort_keys=False, width=120)


def _field_env(name: str, field_path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def _service(name: str, labels: dict[str, str], selector: dict[str, str], port: int, headless: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": selector, "ports": [{"port": port, "targetPort": port}]}
    if headless:  # DNS names for the pods themselves; published before they are ready, so rank 0 resolves early
        spec |= {"clusterIP": "None", "publishNotReadyAddresses": True}
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels}, "spec": spec}


def _share_nodes(exp: str, labels: dict[str, str]) -> dict[str, Any]:
    """Prefer nodes that run pods of the same node group (Kubernetes' reading of `node_group`)."""
    same_group = {"experiment": exp, "node-group": labels["node-group"]}
    term = {"labelSelector": {"matchLabels": same_group}, "topologyKey": "kubernetes.io/hostname"}
    return {
        "podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]}
    }


class _ManifestDumper(yaml.SafeDumper):
    """Writes multi-line strings (the embedded config) as literal blocks, and shared parts (mounts, labels)
    out in full at every use rather than as YAML anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _block_if_multiline(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_ManifestDumper.add_representer(str, _block_if_multiline)


def _k8s_name(value: str, limit: int = 63) -> str:
    """A DNS-1035 label made from `value` (lowercase letters, digits and '-', starting with a letter)."""
    name = "".join(c if c.isascii() and c.isalnum() else "-" for c in value.lower()).strip("-")
    if not name[:1].isalpha():
        name = "x-" + name
    return name[:limit].rstrip("-")
