#!/usr/bin/env bash
# Issue 31's work on the two-GPU machine (nvidia-h200-x2), in two `run` calls made back to back:
#   bash bench/h200x2_ep.sh bench   # the two-GPU step test (both transports) + bench/ep_scaling.py's table
#   bash bench/h200x2_ep.sh role    # ROLE=trainer pretraining of moonlet with 2 replicas through `slipstream launch`
#                                   # (rendezvous, Redis, one rank per GPU, NCCL, EP 2), against the bench's EP = 2 row
# `role` carries the ignored folders .whl (redis and duckdb wheels for cp312) and .redis (a redis-server that runs
# there), as bench/h200_role_pretrain.sh does; `bench` needs neither. Outputs land in $OUT (the run tool's folder).
# Here on the CPU, the plumbing only (tiny shapes, gloo, figures mean nothing):
#     H200X2_LOCAL=1 PY=.venv/bin/python bash bench/h200x2_ep.sh bench|role
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$(mktemp -d)}
LOCAL=${H200X2_LOCAL:-0}
PY=${PY:-python3}
WORK=${WORK:-/tmp/h200x2}   # kept between the two calls while the machine stays warm (the bench's table)
mkdir -p "$WORK"
STEPS=${STEPS:-20}
ROWS=${ROWS:-4}   # rows of 4096 tokens per GPU, as bench/ep_scaling.py's EP = 2 rows
SKIP=3
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

bench() {
  if [ "$LOCAL" = 1 ]; then
    "$PY" bench/ep_scaling.py --device cpu --tiny --steps 2 | tee "$WORK/ep_scaling.txt"
    return
  fi
  nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu,memory.used --format=csv
  nvidia-smi topo -m
  echo "== $(date -u +%T) two-GPU step test"
  timeout 240 "$PY" -m pytest -q -s --noconftest -p no:cacheprovider tests/unit/test_ep_dist.py -k "two_gpus or one_gpu" \
    2>&1 | tail -15
  echo "== $(date -u +%T) bench/ep_scaling.py --rows $ROWS"
  timeout 330 "$PY" bench/ep_scaling.py --rows "$ROWS" --steps 10 | tee "$WORK/ep_scaling.txt"
}

role() {
  local vocab=32768 seq=4096 batch=$((2 * ROWS)) device_sets=()
  if [ "$LOCAL" = 1 ]; then
    vocab=128 seq=64
    device_sets=(--set trainer.device=cpu --set trainer.dtype=float32 --set trainer.experts.backend=auto
      --set trainer.compile=false --set trainer.model.vocab_size=128 --set trainer.model.hidden_size=64
      --set trainer.model.num_layers=2 --set trainer.model.intermediate_size=128
      --set trainer.model.moe_intermediate_size=32 --set trainer.model.n_routed_experts=8
      --set trainer.model.num_experts_per_tok=2 --set trainer.model.num_heads=4 --set trainer.model.max_seq_len=512)
    export PYTHONPATH=$ROOT
  else
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "wheel install failed"; return 3; }
    export PYTHONPATH=/tmp/site:$ROOT
    chmod +x .redis/redis-server .redis/redis-server.bin 2>/dev/null
    device_sets=(--set rendezvous.redis_server=$ROOT/.redis/redis-server)
  fi
  "$PY" -c "import numpy as np; n = $STEPS * $batch * $seq + 1 + 10 * $seq
np.save('$WORK/tokens.npy', np.random.default_rng(0).integers(0, $vocab, size=n, dtype=np.int32))" || return 3
  # The moonlet config with two trainer replicas: the launcher gives replica r the GPU cuda:r (trainer/role.py).
  { cat configs/moonlet.toml; printf '\n[launch.roles.trainer]\nreplicas = 2\ngpus_per_replica = 1\ncritical = true\n'; } > "$WORK/x2.toml"
  local sets=(--set trainer.mode=pretrain --set trainer.compile=true --set trainer.steps=$STEPS
    --set trainer.parallel.ep=2 --set trainer.parallel.transport=${TRANSPORT:-p2p}
    --set trainer.data.path=$WORK/tokens.npy --set trainer.data.seq_len=$seq --set trainer.data.batch_size=$batch
    --set trainer.optim.grad_accum=1 --set trainer.checkpoint.interval_steps=0 --set run.dir=$WORK/run
    "${device_sets[@]}")
  echo "== $(date -u +%T) slipstream launch $WORK/x2.toml ${sets[*]}"
  rm -rf "$WORK/run"
  local r0=$SECONDS
  timeout 480 "$PY" -m common.runs.cli launch "$WORK/x2.toml" "${sets[@]}"
  local rc=$?
  echo "launch exited $rc after $((SECONDS - r0))s"
  "$PY" - "$WORK/run" "$SKIP" "$WORK" "$batch" "$seq" <<'EOF'
import statistics, sys
from pathlib import Path
from common.metrics import read_metrics
run_dir, skip, out, batch, seq = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
points = sorted(read_metrics(run_dir, ["train/tokens_per_s"], role="trainer"), key=lambda p: p.step)
kept = [p.value for p in points if p.step > skip]
role = statistics.median(kept) if kept else float("nan")
bench = float("nan")
table = out / "ep_scaling.txt"
for line in table.read_text().splitlines() if table.exists() else []:
    cells = [c.strip() for c in line.split("|")]
    if len(cells) > 6 and cells[1].endswith("EP=2") and cells[4] == "p2p":
        bench = float(cells[6].replace(",", ""))
print(f"role path, 2 replicas (EP 2, p2p), {batch} x {seq} tokens per step: median train/tokens_per_s {role:,.0f} "
      f"over steps {skip + 1}..{len(points)}; bench/ep_scaling.py EP=2 p2p row {bench:,.0f}; role / bench {role / bench:.3f}")
EOF
  return $rc
}

case "${1:-}" in
  bench) bench 2>&1 | tee "$OUT/h200x2_bench.log" ;;
  role) role 2>&1 | tee "$OUT/h200x2_role.log" ;;
  *) echo "usage: bash bench/h200x2_ep.sh bench|role"; exit 2 ;;
esac
