"""`slipstream launch` and `slipstream scripts` with small stand-in roles (tests/support/launch_roles.py):
exit codes propagate, signals tear the whole process tree down, and nothing survives."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from common.runs.registry import Registry
from common.runs.scripts import write_scripts

REPO = Path(__file__).resolve().parents[2]


def role(name: str, mode: str, critical: bool = False, extra: str = "") -> str:
    return (
        f"[launch.roles.{name}]\ncritical = {str(critical).lower()}\n"
        f'command = "{{python}} tests/support/launch_roles.py {mode} {{run_dir}}"\n{extra}'
    )


def make_config(tmp_path: Path, *roles: str) -> Path:
    text = f'[run]\nname = "lt"\nroot = "{tmp_path / "runs"}"\n\n[launch]\nstop_timeout_s = 5.0\n\n' + "\n".join(roles)
    path = tmp_path / "launch.toml"
    path.write_text(text)
    return path


def start_launch(cfg: Path, exp: str, *flags: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM")} | {"SLIPSTREAM_EXP": exp}
    return subprocess.Popen(
        [sys.executable, "-m", "common.runs.cli", "launch", str(cfg), *flags],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def recorded_pids(run_dir: Path) -> list[int]:
    return [int(p.name.rsplit("-", 1)[1]) for p in (run_dir / "pids").glob("*") if not p.name.startswith("ready")]


def survivors(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_a_failing_role_stops_the_run_with_its_exit_code(tmp_path):
    cfg = make_config(
        tmp_path,
        role("server", "grandchild", critical=True),
        role("helper", "sleep"),
        role("broken", "exit7", extra='env = {EXIT_AFTER_S = "2"}\n'),
    )
    launcher = start_launch(cfg, "lt-fail")
    out, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 7, out
    run_dir = tmp_path / "runs" / "lt-fail"
    assert f"broken/0 failed with exit code 7: stopping the run (its log: {run_dir / 'logs' / 'broken-0.log'})" in out
    # Every stand-in printed what the launcher gave it: into its own log, not onto the quiet console, except
    # the broken one's last lines (it printed no error of its own, so they are all the console can say of it).
    given = f"role=helper exp=lt-fail meet={run_dir / 'meet'}"
    assert given in (run_dir / "logs" / "helper-0.log").read_text() and given not in out, out
    assert "[broken/0] the last lines of its log:" in out and "[broken/0]   role=broken exp=lt-fail" in out, out
    assert "started helper/0" in (run_dir / "logs" / "launch.log").read_text()
    pids = recorded_pids(run_dir)
    assert len(pids) == 4  # three roles and the grandchild in its own session
    wait_for(lambda: not survivors(pids), 5, "all processes to be gone")
    record = Registry.for_root(tmp_path / "runs").get("lt-fail")
    assert record.status == "failed"


@pytest.mark.timeout(120)
def test_a_full_run_dir_disk_stops_the_run_with_one_error_line_naming_it_and_no_traceback(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs as the run dir needs root")
    run_dir = tmp_path / "runs" / "lt-full"
    run_dir.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(run_dir)], check=True)
    try:
        cfg = make_config(tmp_path, role("server", "grandchild", critical=True), role("chatty", "chatty"))
        launcher = start_launch(cfg, "lt-full")
        wait_for(lambda: (run_dir / "pids" / "ready-chatty-0").exists(), 30, "the chatty role to start")
        with open(run_dir / "filler", "wb", buffering=0) as fh, contextlib.suppress(OSError):
            while True:
                fh.write(b"\0" * 65536)
        filled = time.monotonic()
        out, _ = launcher.communicate(timeout=60)
        assert launcher.returncode == errno.ENOSPC, out
        assert time.monotonic() - filled < 15
        assert f"the disk of the run dir {run_dir} is full" in out and "launch --resume" in out, out
        assert "Traceback" not in out and "Logging error" not in out, out
        pids = recorded_pids(run_dir)
        wait_for(lambda: not survivors(pids), 5, "all processes to be gone")
        assert Registry.for_root(tmp_path / "runs").get("lt-full").status == "failed"
    finally:
        subprocess.run(["umount", "-l", str(run_dir)], check=False)


@pytest.mark.timeout(120)
def test_sigint_tears_the_whole_tree_down_within_ten_seconds(tmp_path):
    cfg = make_config(
        tmp_path,
        role("server", "grandchild", critical=True),
        role("stubborn", "stubborn"),
        role("helper", "sleep", extra="replicas = 2\n"),
    )
    launcher = start_launch(cfg, "lt-int")
    run_dir = tmp_path / "runs" / "lt-int"
    wait_for(
        lambda: len(list((run_dir / "pids").glob("ready-*"))) == 4 if (run_dir / "pids").exists() else False,
        60,
        "four replicas to be ready",
    )
    pids = recorded_pids(run_dir)
    assert len(pids) == 5
    start = time.monotonic()
    launcher.send_signal(signal.SIGINT)
    out, _ = launcher.communicate(timeout=20)
    elapsed = time.monotonic() - start
    assert launcher.returncode == 130, out
    assert elapsed < 10.0
    assert "ignored SIGTERM" in out  # the stubborn one needed SIGKILL
    wait_for(lambda: not survivors(pids), 5, "all processes to be gone")
    assert Registry.for_root(tmp_path / "runs").get("lt-int").status == "interrupted"
    # The launcher was the rendezvous leader and stopped its Redis.
    assert not any(
        "redis" in (p.info["name"] or "") and _cwd(p) == run_dir / "meet" for p in psutil.process_iter(["name"])
    )


@pytest.mark.timeout(120)
def test_teardown_stops_the_callers_before_the_router_and_the_router_before_the_workers(tmp_path):
    """At the end of a run the evaluator (and any caller) gets SIGTERM first, the router next, the vLLM workers
    last: no client sees its server go away mid-request (the demo's evaluator used to retry into a dying vLLM)."""
    cfg = make_config(
        tmp_path,
        role("trainer", "exit0", critical=True, extra='env = {EXIT_AFTER_S = "3"}\n'),
        role("vllm", "record-term"),
        role("router", "record-term"),
        role("evaluator", "record-term"),
    )
    launcher = start_launch(cfg, "lt-order")
    out, _ = launcher.communicate(timeout=90)
    assert launcher.returncode == 0, out
    terms = sorted(
        (tmp_path / "runs" / "lt-order" / "pids").glob("term-*"), key=lambda p: int(p.name.rsplit("-", 1)[1])
    )
    assert [p.name.split("-")[1] for p in terms] == ["evaluator", "router", "vllm"], out


@pytest.mark.timeout(120)
def test_kill_9_of_the_launcher_ends_every_role_and_its_redis(tmp_path):
    """A SIGKILLed launcher cannot tear anything down: the kernel sends each role SIGTERM for it."""
    cfg = make_config(tmp_path, role("server", "sleep", critical=True), role("helper", "sleep", extra="replicas = 2\n"))
    launcher = start_launch(cfg, "lt-kill")
    run_dir = tmp_path / "runs" / "lt-kill"
    wait_for(
        lambda: len(list((run_dir / "pids").glob("ready-*"))) == 3 if (run_dir / "pids").exists() else False,
        60,
        "three replicas to be ready",
    )
    pids = recorded_pids(run_dir)
    redis = [
        p.pid
        for p in psutil.process_iter(["name"])
        if "redis" in (p.info["name"] or "") and _cwd(p) == run_dir / "meet"
    ]
    assert len(pids) == 3 and len(redis) == 1
    launcher.kill()
    launcher.communicate(timeout=10)
    wait_for(lambda: not survivors(pids + redis), 10, "every role and Redis to be gone after the launcher's death")


def _cwd(p: psutil.Process) -> Path | None:
    try:
        return Path(p.cwd())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


@pytest.mark.timeout(120)
def test_success_of_the_critical_roles_ends_the_run_with_zero(tmp_path):
    cfg = make_config(
        tmp_path,
        role("trainerish", "exit0", critical=True, extra='env = {EXIT_AFTER_S = "1"}\n'),
        role("service", "sleep"),
    )
    launcher = start_launch(cfg, "lt-ok")
    out, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, out
    pids = recorded_pids(tmp_path / "runs" / "lt-ok")
    wait_for(lambda: not survivors(pids), 5, "the service to be stopped")
    record = Registry.for_root(tmp_path / "runs").get("lt-ok")
    assert record.status == "succeeded" and record.ended_at is not None
    assert (tmp_path / "runs" / "lt-ok" / "config.toml").read_text().count("[launch.roles.") == 2


@pytest.mark.timeout(120)
def test_verbose_prints_every_line_of_every_role_with_its_label(tmp_path):
    cfg = make_config(
        tmp_path,
        role("trainerish", "exit0", critical=True, extra='env = {EXIT_AFTER_S = "0.5"}\nreplicas = 2\n'),
    )
    launcher = start_launch(cfg, "lt-verbose", "--verbose")
    out, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, out
    run_dir = tmp_path / "runs" / "lt-verbose"
    for i in (0, 1):
        assert f"[trainerish/{i}] role=trainerish exp=lt-verbose meet={run_dir / 'meet'}" in out, out
    # The logs are written as without --verbose: a restarted replica appends below a line naming its start.
    log = (run_dir / "logs" / "trainerish-1.log").read_text().splitlines()
    assert len(log) == 2 and "trainerish/1 started by the launcher (pid" in log[0], log
    assert log[1] == f"role=trainerish exp=lt-verbose meet={run_dir / 'meet'}", log


@pytest.mark.timeout(120)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to give two entries one each")
def test_cpus_binds_each_replica_and_what_it_starts_and_sizes_its_threads(tmp_path):
    first, second = sorted(os.sched_getaffinity(0))[:2]
    cfg = make_config(
        tmp_path,
        role("trainerish", "affinity", critical=True, extra=f'cpus = "{first}"\nenv = {{EXIT_AFTER_S = "1"}}\n'),
        role("gen", "affinity", extra=f'role = "vllm"\ncpus = "{second}"\n'),
    )
    launcher = start_launch(cfg, "lt-cpus", "--verbose")
    out, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, out
    assert f"[trainerish/0] cpus=[{first}] child=[{first}] omp=1 bind=None" in out, out
    # A vLLM worker's OpenMP threads are bound to its CPUs, not to vLLM's own choice.
    assert f"[gen/0] cpus=[{second}] child=[{second}] omp=1 bind={second}" in out, out


@pytest.mark.timeout(60)
def test_cpus_this_machine_lacks_stop_the_launch_before_any_role_starts(tmp_path):
    cfg = make_config(tmp_path, role("trainerish", "exit0", critical=True, extra='cpus = "0,4096"\n'))
    launcher = start_launch(cfg, "lt-nocpus")
    out, _ = launcher.communicate(timeout=30)
    assert launcher.returncode != 0
    assert "launch.roles.trainerish.cpus = '0,4096' names CPUs [4096]" in out, out
    assert not (tmp_path / "runs" / "lt-nocpus" / "pids").exists(), "a role started"


def test_cpus_must_be_cpu_ids_or_ranges(tmp_path):
    from common.config import ConfigError, load_config
    from common.proc import parse_cpus

    assert parse_cpus("3,0-1, 1") == [0, 1, 3]
    for bad in ("a", "2-1", "-1", ""):
        with pytest.raises(ValueError, match="is not a CPU id or a range"):
            parse_cpus(bad)
    cfg = make_config(tmp_path, role("trainerish", "exit0", critical=True, extra='cpus = "0-x"\n'))
    with pytest.raises(ConfigError, match=r"launch.roles.trainerish.cpus = '0-x': '0-x' is not a CPU id"):
        load_config(cfg)


@pytest.mark.timeout(120)
def test_launch_dash_serves_the_run_page_while_the_run_goes_on_and_prints_its_url(tmp_path):
    cfg = make_config(tmp_path, role("trainerish", "exit0", critical=True, extra='env = {EXIT_AFTER_S = "4"}\n'))
    launcher = start_launch(cfg, "lt-dash", "--set", "launch.dash=true")
    try:
        assert launcher.stdout is not None
        lines = []
        for line in launcher.stdout:
            lines.append(line)
            if found := re.search(
                r"dashboard: (http://127\.0\.0\.1:\d+/run/lt-dash) \(.*`(slipstream token .*)`", line
            ):
                break
        else:
            raise AssertionError("".join(lines))
        # The log line carries no token, only the command that prints it; the page asks for it, on loopback too.
        assert "token=" not in found.group(0)
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(found.group(1), timeout=30)
        printed = subprocess.run(
            [sys.executable, "-m", "common.runs.cli", *found.group(2).split()[1:]],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        )
        token = printed.stdout.strip()
        assert token and token not in "".join(lines)
        with urllib.request.urlopen(f"{found.group(1)}?token={token}", timeout=30) as page:
            assert page.status == 200 and "lt-dash" in page.read().decode()
        out, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, "".join(lines) + out
    assert token not in out and token not in (tmp_path / "runs" / "lt-dash" / "logs" / "launch.log").read_text()


@pytest.mark.timeout(120)
def test_on_failure_restarts_a_replica_up_to_its_limit(tmp_path):
    cfg = make_config(
        tmp_path,
        role(
            "flaky",
            "exit3",
            critical=True,
            extra='restart = "on-failure"\nmax_restarts = 2\nrestart_backoff_s = 0.3\nenv = {EXIT_AFTER_S = "0.1"}\n',
        ),
    )
    launcher = start_launch(cfg, "lt-restart")
    out, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 3, out
    assert "restarting (1/2) in 0.3s" in out and "restarting (2/2) in 0.6s" in out, out
    assert "failed with exit code 3 after 2 restart(s), the most launch.roles.flaky.max_restarts allows" in out
    assert len(recorded_pids(tmp_path / "runs" / "lt-restart")) == 3
    # The three lives of the replica, one after the other in its log.
    log = (tmp_path / "runs" / "lt-restart" / "logs" / "flaky-0.log").read_text()
    assert log.count("flaky/0 started by the launcher") == 3 and log.count("role=flaky exp=lt-restart") == 3, log


def test_restart_auto_restarts_every_role_but_not_a_command_of_ones_own():
    from common.config import RoleSpec
    from common.runs.launch import restarts_on_failure
    from common.runs.prepare import Replica

    def rep(role: str, **kw: object) -> Replica:
        return Replica(entry=role, role=role, index=0, spec=RoleSpec(**kw))  # type: ignore[arg-type]

    assert [restarts_on_failure(rep(r)) for r in ("router", "vllm", "evaluator", "trainer")] == [True] * 4
    assert not restarts_on_failure(rep("router", command="{python} my_router.py"))  # a command of one's own
    assert not restarts_on_failure(rep("vllm", restart="never"))
    assert restarts_on_failure(rep("trainer", command="{python} t.py", restart="on-failure"))


@pytest.mark.timeout(120)
def test_a_failed_trainer_rank_restarts_all_ranks_of_the_trainer_together(tmp_path):
    """Ranks form one process group, so a lone restarted rank could never rejoin its old peers: the
    launcher stops the other ranks (their exit is no failure) and starts the whole group again."""
    cfg = make_config(
        tmp_path,
        role(
            "trainer",
            "once",
            critical=True,
            extra='replicas = 2\nrestart = "on-failure"\nrestart_backoff_s = 0.2\nenv = {FAIL_REPLICA = "1"}\n',
        ),
    )
    launcher = start_launch(cfg, "lt-gang")
    out, _ = launcher.communicate(timeout=90)
    assert launcher.returncode == 0, out
    assert "trainer/1 exited with code 3: restarting all 2 replicas of trainer (1/3) in 0.2s" in out, out
    assert "trainer/0 stopped (exit code" in out and "for its group's restart" in out, out
    pids = tmp_path / "runs" / "lt-gang" / "pids"
    assert len(list(pids.glob("trainer-0-*"))) == 2 and len(list(pids.glob("trainer-1-*"))) == 2


def test_scripts_export_meet_dir_and_experiment_for_every_replica(tmp_path, monkeypatch):
    cfg = make_config(
        tmp_path,
        role("trainer", "sleep", critical=True),
        '[launch.roles.vllm]\nreplicas = 2\nenv = {VLLM_CPU_KVCACHE_SPACE = "1"}\n',
    )
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("SLIPSTREAM_EXP", "lt-scripts")
    out = tmp_path / "scripts"
    paths = write_scripts(str(cfg), [], out)
    names = sorted(p.name for p in paths)
    assert names == ["config.toml", "k8s.yaml", "slurm.sbatch", "trainer-0.sh", "vllm-0.sh", "vllm-1.sh"]
    meet = tmp_path / "runs" / "lt-scripts" / "meet"
    for script in ("trainer-0.sh", "vllm-0.sh", "vllm-1.sh", "slurm.sbatch"):
        subprocess.run(["bash", "-n", str(out / script)], check=True)
    vllm1 = (out / "vllm-1.sh").read_text()
    assert f"export SLIPSTREAM_MEET_DIR={meet}" in vllm1
    assert "export SLIPSTREAM_EXP=lt-scripts" in vllm1
    assert "export ROLE=vllm" in vllm1 and "export SLIPSTREAM_REPLICA=1" in vllm1
    assert "export VLLM_CPU_KVCACHE_SPACE=1" in vllm1
    assert "-m common.runs.cli run" in vllm1 and str(tmp_path / "runs" / "lt-scripts" / "config.toml") in vllm1
    assert os.access(out / "vllm-1.sh", os.X_OK)
    # No placement given: each entry is its own node group, and CPU-only replicas share that group's node.
    slurm = (out / "slurm.sbatch").read_text()
    assert slurm.count("#SBATCH hetjob") == 1 and slurm.count("#SBATCH --nodes=1\n") == 2
    assert slurm.count("srun ") == 3 and f"bash {out / 'vllm-1.sh'} &" in slurm
    k8s = (out / "k8s.yaml").read_text()
    assert k8s.count("kind: Job") == 1 and k8s.count("kind: Deployment") == 1  # the critical trainer; the workers
    assert f"- name: SLIPSTREAM_MEET_DIR\n          value: {meet}" in k8s and "name: lt-scripts-vllm" in k8s


def launch_cmd(*args: str, exp: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM")} | (
        {"SLIPSTREAM_EXP": exp} if exp else {}
    )
    return subprocess.run(
        [sys.executable, "-m", "common.runs.cli", "launch", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )


@pytest.mark.timeout(180)
def test_resume_relaunches_the_experiment_of_a_run_dir_and_refuses_a_running_one(tmp_path):
    cfg = make_config(tmp_path, role("worker", "exit0", critical=True, extra='env = {EXIT_AFTER_S = "0.2"}\n'))
    run_dir = tmp_path / "runs" / "lt-resume"
    first = launch_cmd(str(cfg), exp="lt-resume")
    assert first.returncode == 0, first.stdout + first.stderr
    # The same id again without --resume is refused with the way to continue it, not a traceback.
    again = launch_cmd(str(cfg), exp="lt-resume")
    assert again.returncode == 2 and f"slipstream launch --resume {run_dir}" in again.stderr, again.stderr
    assert "Traceback" not in again.stderr
    # --resume alone: the run dir's own config, the same experiment, its registry row running then succeeded.
    second = launch_cmd("--resume", str(run_dir))
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"resuming experiment lt-resume in {run_dir}" in second.stderr + second.stdout
    assert len(recorded_pids(run_dir)) == 2
    assert [r.id for r in Registry.for_root(tmp_path / "runs").list()] == ["lt-resume"]
    assert Registry.for_root(tmp_path / "runs").get("lt-resume").status == "succeeded"
    # While the experiment runs, a second launch of it is refused.
    busy = make_config(tmp_path, role("server", "sleep", critical=True))
    launcher = start_launch(busy, "lt-busy")
    try:
        busy_dir = tmp_path / "runs" / "lt-busy"
        wait_for(lambda: (busy_dir / "pids").exists() and any((busy_dir / "pids").glob("ready-*")), 60, "the run")
        refused = launch_cmd("--resume", str(busy_dir))
        assert refused.returncode == 2 and "experiment lt-busy is still running" in refused.stderr, refused.stderr
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.communicate(timeout=60)
