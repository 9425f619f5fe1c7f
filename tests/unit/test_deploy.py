"""`slipstream scripts` for clusters: replicas packed onto nodes by GPUs, a Slurm batch file whose
components are the node groups (run here with stand-in srun and scontrol), and a Kubernetes manifest
checked against the official schemas (kubernetes-validate bundles them, so this runs offline)."""

from __future__ import annotations

import copy
import json
import os
import shlex
import subprocess
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from common.config import ConfigError, from_dict
from common.runs.scripts import place, write_scripts

REPO = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.31.0"  # the schemas the manifest must pass; raise it with the oldest cluster we deploy to


def cluster_config(tmp_path: Path, command: str = "") -> Path:
    """Two trainer ranks and two vLLM workers (TP 2) share GPU nodes of 4; router and evaluator share a CPU node."""
    cmd = f"command = {json.dumps(command)}\n" if command else ""
    text = f"""
[run]
name = "dep"
root = "{tmp_path / "runs"}"

[rollout]
tensor_parallel_size = 2

[launch]
gpus_per_node = 4

[launch.roles.trainer]
critical = true
replicas = 2
gpus_per_replica = 1
node_group = "gpu"
{cmd}
[launch.roles.vllm]
replicas = 2
gpus_per_replica = 2
node_group = "gpu"
{cmd}
[launch.roles.router]
node_group = "cpu"
{cmd}
[launch.roles.evaluator]
node_group = "cpu"
{cmd}"""
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str = "") -> Path:
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("SLIPSTREAM_EXP", "dep-1")
    out = tmp_path / "out"
    write_scripts(str(cluster_config(tmp_path, command)), [], out)
    return out


# ----------------------------------------------------------------------------------------------
# Placement
# ----------------------------------------------------------------------------------------------


def test_replicas_are_packed_onto_nodes_by_gpus_and_never_split_across_nodes():
    cfg = from_dict(
        {
            "rollout": {"tensor_parallel_size": 3},
            "launch": {
                "gpus_per_node": 8,
                "roles": {
                    "vllm": {"replicas": 5, "gpus_per_replica": 3, "node_group": "gpu"},
                    "trainer": {"critical": True, "gpus_per_replica": 1, "node_group": "gpu"},
                    "router": {"node_group": "cpu"},
                    "evaluator": {"node_group": "cpu"},
                },
            },
        }
    )
    gpu, cpu = place(cfg)
    # 16 GPUs would fit on two nodes of 8, but a worker of 3 cannot be split: two per node, so three nodes.
    assert (gpu.name, gpu.entries, gpu.nodes, gpu.gpus_per_node) == ("gpu", ("vllm", "trainer"), 3, 8)
    assert {s.replica.label: (s.node, s.gpus) for s in gpu.slots} == {
        "vllm/0": (0, (0, 1, 2)),
        "vllm/1": (0, (3, 4, 5)),
        "vllm/2": (1, (0, 1, 2)),
        "vllm/3": (1, (3, 4, 5)),
        "vllm/4": (2, (0, 1, 2)),
        "trainer/0": (0, (6,)),
    }
    assert (cpu.entries, cpu.nodes, cpu.gpus_per_node) == (("router", "evaluator"), 1, 0)
    assert [(s.node, s.gpus) for s in cpu.slots] == [(0, ()), (0, ())]


def test_an_entry_without_a_node_group_is_a_group_of_its_own():
    cfg = from_dict({"launch": {"roles": {"trainer": {"critical": True, "replicas": 3}, "router": {}}}})
    groups = place(cfg)
    assert [(g.name, g.entries, g.nodes) for g in groups] == [("trainer", ("trainer",), 1), ("router", ("router",), 1)]


@pytest.mark.parametrize(
    ("roles", "message"),
    [
        (
            {"vllm": {"gpus_per_replica": 16}},
            r"launch\.roles\.vllm\.gpus_per_replica = 16 exceeds launch\.gpus_per_node = 8",
        ),
        (
            {"trainer": {"gpus_per_replica": 2}},
            r"a trainer rank drives one GPU; set 1 and raise launch\.roles\.trainer\.replicas",
        ),
        (
            {"vllm": {"gpus_per_replica": 1}},
            r"tensor_parallel_size = 2: .* set launch\.roles\.vllm\.gpus_per_replica = 2",
        ),
        ({"vllm": {"gpus_per_replica": -1}}, r"launch\.roles\.vllm\.gpus_per_replica must be >= 0"),
    ],
)
def test_impossible_gpu_placements_are_config_errors_that_name_the_field(roles, message):
    data = {"rollout": {"tensor_parallel_size": 2}, "launch": {"roles": {"t": {"role": "trainer", "critical": True}}}}
    data["launch"]["roles"] |= roles
    with pytest.raises(ConfigError, match=message):
        from_dict(data)


def test_a_vllm_entry_may_run_its_workers_at_its_own_tensor_parallel_size():
    env = {"SLIPSTREAM__rollout__tensor_parallel_size": "4"}
    roles = {"trainer": {"critical": True}, "vllm": {"gpus_per_replica": 4, "env": env}}
    assert from_dict({"launch": {"roles": roles}}).launch.roles["vllm"].gpus_per_replica == 4
    roles["vllm"]["gpus_per_replica"] = 1
    with pytest.raises(ConfigError, match=r"workers' rollout\.tensor_parallel_size = 4"):
        from_dict({"launch": {"roles": roles}})


# ----------------------------------------------------------------------------------------------
# Kubernetes
# ----------------------------------------------------------------------------------------------


def test_kubernetes_manifest_passes_the_schemas_and_wires_ranks_router_and_shared_volume(tmp_path, monkeypatch):
    out = write(tmp_path, monkeypatch)
    docs = [d for d in yaml.safe_load_all((out / "k8s.yaml").read_text()) if d]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    # The check is live: strict mode rejects a field Kubernetes does not know.
    job = next(d for d in docs if d["kind"] == "Job")
    broken = copy.deepcopy(job)
    broken["spec"]["completion"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)

    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["Deployment"] * 3 + ["Job", "PersistentVolumeClaim", "Secret"] + ["Service"] * 2
    workloads = {d["metadata"]["labels"]["entry"]: d for d in docs if d["kind"] in ("Job", "Deployment")}
    pods = {entry: w["spec"]["template"] for entry, w in workloads.items()}
    containers = {entry: pod["spec"]["containers"][0] for entry, pod in pods.items()}
    env = {entry: {e["name"]: e for e in c["env"]} for entry, c in containers.items()}

    # The trainer: one indexed Job, each pod's rank its completion index, rank 0 reachable by name.
    assert workloads["trainer"] is job
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert env["trainer"]["RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == index
    assert env["trainer"]["WORLD_SIZE"]["value"] == "2" and env["trainer"]["LOCAL_RANK"]["value"] == "0"
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    subdomain = pods["trainer"]["spec"]["subdomain"]
    assert env["trainer"]["MASTER_ADDR"]["value"] == f"{job['metadata']['name']}-0.{subdomain}"
    headless = services[subdomain]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= pods["trainer"]["metadata"]["labels"].items()
    assert headless["spec"]["ports"][0]["port"] == int(env["trainer"]["MASTER_PORT"]["value"])

    # The router: a Service that selects the router's pods and no other, on the port the router binds.
    router_service = next(s for name, s in services.items() if name != subdomain)
    selector = router_service["spec"]["selector"].items()
    assert [entry for entry, pod in pods.items() if selector <= pod["metadata"]["labels"].items()] == ["router"]
    port = router_service["spec"]["ports"][0]["targetPort"]
    assert containers["router"]["ports"][0]["containerPort"] == port
    assert env["router"]["SLIPSTREAM__router__port"]["value"] == str(port)  # router.port = 0 would be random

    # GPUs: a rank has one, a worker its tensor-parallel size, the rest none.
    limits = {entry: c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu") for entry, c in containers.items()}
    assert limits == {"trainer": 1, "vllm": 2, "router": None, "evaluator": None}
    assert workloads["vllm"]["kind"] == "Deployment" and workloads["vllm"]["spec"]["replicas"] == 2

    # Every pod mounts the shared claim where its meet dir lies, and reads the config from the Secret.
    claim = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    secret = next(d for d in docs if d["kind"] == "Secret")
    config = tomllib.loads(secret["stringData"]["config.toml"])
    assert config["launch"]["roles"]["vllm"]["gpus_per_replica"] == 2
    claim_name = claim["metadata"]["name"]
    for entry, pod in pods.items():
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        shared = next(
            n for n, v in volumes.items() if v.get("persistentVolumeClaim", {}).get("claimName") == claim_name
        )
        meet = Path(env[entry]["SLIPSTREAM_MEET_DIR"]["value"])
        mounts = containers[entry]["volumeMounts"]
        assert any(m["name"] == shared and meet.is_relative_to(m["mountPath"]) for m in mounts), entry
        config_dir = next(m["mountPath"] for m in mounts if volumes[m["name"]].get("secret"))
        assert containers[entry]["command"][-1] == f"{config_dir}/config.toml", entry


# ----------------------------------------------------------------------------------------------
# Slurm
# ----------------------------------------------------------------------------------------------


def test_slurm_batch_has_one_component_per_node_group_and_each_step_names_its_own(tmp_path, monkeypatch):
    out = write(tmp_path, monkeypatch)
    batch = (out / "slurm.sbatch").read_text()
    subprocess.run(["bash", "-n", str(out / "slurm.sbatch")], check=True)
    header = batch[: batch.index("set -euo pipefail")]
    components = header.split("#SBATCH hetjob\n")
    assert len(components) == 2  # node groups gpu (trainer, vllm) and cpu (router, evaluator)
    gpu, cpu = components
    # Two workers of 2 GPUs fill one node of 4, the two ranks take a second; the CPU group needs one node.
    assert "#SBATCH --nodes=2\n" in gpu and "#SBATCH --gpus-per-node=4\n" in gpu
    assert "#SBATCH --nodes=1\n" in cpu and "--gpus-per-node" not in cpu
    steps = [line for line in batch.splitlines() if line.startswith("srun ")]
    group_of = {"trainer": 0, "vllm": 0, "router": 1, "evaluator": 1}
    assert sorted(Path(s.split()[-2]).name for s in steps) == sorted(
        ["trainer-0.sh", "trainer-1.sh", "vllm-0.sh", "vllm-1.sh", "router-0.sh", "evaluator-0.sh"]
    )
    for step in steps:
        entry = Path(step.split()[-2]).name.rsplit("-", 1)[0]
        assert f"--het-group={group_of[entry]} " in step, step
        assert f'--nodelist="${{hosts_{group_of[entry]}[' in step, step


FAKE_SRUN = """#!/usr/bin/env bash
# Stand-in srun: run the step here, on the "node" named by --nodelist.
node=""
while [[ $1 == --* ]]; do
    case $1 in --nodelist=*) node=${1#--nodelist=} ;; esac
    shift
done
SLURMD_NODENAME=$node exec "$@"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" ]] && tr ',' '\\n' <<< "$3"
"""


@pytest.mark.timeout(60)
def test_slurm_batch_starts_every_replica_on_its_node_with_its_gpus_and_rank(tmp_path, monkeypatch):
    envs, partial = tmp_path / "envs", tmp_path / "partial"
    envs.mkdir()
    partial.mkdir()
    # Every replica records its environment, then waits for all six: the batch stops the others once the
    # critical trainer ranks are done.
    record = (
        f"env > {partial}/{{role}}-{{replica}} && mv {partial}/{{role}}-{{replica}} {envs}/ && "
        f'while [ "$(ls {envs} | wc -l)" -lt 6 ]; do sleep 0.05; done'
    )
    out = write(tmp_path, monkeypatch, command=f"sh -c {shlex.quote(record)}")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLIPSTREAM", "CUDA_"))} | {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST_HET_GROUP_0": "gpu-a,gpu-b",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "cpu-a",
    }
    done = subprocess.run(["bash", str(out / "slurm.sbatch")], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr

    def seen(name: str) -> dict[str, str]:
        return dict(line.split("=", 1) for line in (envs / name).read_text().splitlines() if "=" in line)

    for rank in (0, 1):
        trainer = seen(f"trainer-{rank}")
        assert trainer["SLURMD_NODENAME"] == "gpu-b"  # the workers filled gpu-a
        assert (trainer["RANK"], trainer["WORLD_SIZE"], trainer["LOCAL_RANK"]) == (str(rank), "2", "0")
        assert (trainer["MASTER_ADDR"], trainer["MASTER_PORT"]) == ("gpu-b", "29500")
        assert trainer["CUDA_VISIBLE_DEVICES"] == str(rank)
        assert trainer["SLIPSTREAM_EXP"] == "dep-1"
    for replica, gpus in ((0, "0,1"), (1, "2,3")):
        worker = seen(f"vllm-{replica}")
        assert (worker["SLURMD_NODENAME"], worker["CUDA_VISIBLE_DEVICES"]) == ("gpu-a", gpus)
        assert "RANK" not in worker
    for role in ("router", "evaluator"):
        cpu = seen(f"{role}-0")
        assert cpu["SLURMD_NODENAME"] == "cpu-a" and "CUDA_VISIBLE_DEVICES" not in cpu
