"""Small stand-in processes for the launcher tests: each records its pid under <run_dir>/pids and then
sleeps, exits with a code, ignores SIGTERM, leaves a grandchild in its own session, or (`once`) fails on its
first start when it is replica FAIL_REPLICA, sleeps on the first start otherwise, and succeeds after a second;
`record-term` notes when SIGTERM came;
`chatty` prints a line every 50 ms;
`affinity` prints the CPUs it and a child of it may run on and its thread settings."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

mode, run_dir = sys.argv[1], Path(sys.argv[2])
pids = run_dir / "pids"
pids.mkdir(exist_ok=True)
replica = os.environ["SLIPSTREAM_REPLICA"]
(pids / f"{os.environ['ROLE']}-{replica}-{os.getpid()}").touch()
print(
    f"role={os.environ['ROLE']} exp={os.environ['SLIPSTREAM_EXP']} meet={os.environ['SLIPSTREAM_MEET_DIR']}", flush=True
)

if mode == "grandchild":
    # A descendant in its own session: outside the child's process group, like vLLM's engine.
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    (pids / f"grandchild-{replica}-{orphan.pid}").touch()
elif mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
elif mode == "once":
    starts = len(list(pids.glob(f"{os.environ['ROLE']}-{replica}-*")))
    if starts > 1:
        time.sleep(1.0)
        sys.exit(0)
    if replica == os.environ.get("FAIL_REPLICA"):
        time.sleep(0.5)
        sys.exit(3)
elif mode == "affinity":
    # What launch.roles.<entry>.cpus gave this process and a child it starts.
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"], capture_output=True, text=True
    ).stdout.strip()
    threads, bind = os.environ.get("OMP_NUM_THREADS"), os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    print(f"cpus={sorted(os.sched_getaffinity(0))} child={child} omp={threads} bind={bind}", flush=True)
    if "EXIT_AFTER_S" in os.environ:
        time.sleep(float(os.environ["EXIT_AFTER_S"]))
        sys.exit(0)
elif mode == "record-term":
    # Notes when SIGTERM came (the launcher's teardown order), then exits.
    def on_term(*_: object) -> None:
        (pids / f"term-{os.environ['ROLE']}-{time.monotonic_ns()}").touch()
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
elif mode == "chatty":
    # A line every 50 ms: output the launcher keeps writing to the role's log (until the disk is full).
    (pids / f"ready-{os.environ['ROLE']}-{replica}").touch()
    for i in range(12000):
        print(f"line {i}", flush=True)
        time.sleep(0.05)
elif mode.startswith("exit"):
    time.sleep(float(os.environ.get("EXIT_AFTER_S", "0.5")))
    sys.exit(int(mode[len("exit") :]))
(pids / f"ready-{os.environ['ROLE']}-{replica}").touch()
time.sleep(600)
