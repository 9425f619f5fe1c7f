#!/usr/bin/env bash
# One GPU session: bench/moe_bench.py's moonlet compiled row (16 x 4096) and a ROLE=trainer pretraining
# run of configs/moonlet.toml through the role path (`python -m common.runs.cli run`: rendezvous starts
# redis-server, the trainer forms an NCCL group of one, trains through trainer/core.py, logs to DuckDB),
# on the same machine in the same command; then one table (bench/h200_role_summary.py) and, if the role
# path is more than 5% slower, a profile of where the core step loses time (bench/h200_role_profile.py).
#
# On the H200 (`run`, kind nvidia-h200), carrying the ignored folders .whl (redis, duckdb wheels for
# cp312) and .redis (Debian 12's redis-server 7.0 with its shared libraries and a wrapper):
#     bash bench/h200_role_pretrain.sh
# Here on the CPU (tiny shapes, to check the plumbing; the figures mean nothing):
#     H200_ROLE_LOCAL=1 PY=.venv/bin/python bash bench/h200_role_pretrain.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/h200_role_out}
mkdir -p "$OUT"
LOCAL=${H200_ROLE_LOCAL:-0}
PY=${PY:-python3}
BUDGET_S=${BUDGET_S:-560}   # the whole script; the run tool's limit is 600
WORK=${WORK:-/tmp/h200rp}
STEPS=${STEPS:-20}
SKIP=3
# NVLink multicast stays off (already set on the GPU machine; set again, same values).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

main() {
  local t0=$SECONDS
  echo "== $(date -u +%FT%TZ) h200_role_pretrain: local=$LOCAL budget=${BUDGET_S}s steps=$STEPS"
  if [ "$LOCAL" != 1 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "wheel install failed"; return 3; }
    export PYTHONPATH=/tmp/site:$ROOT
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used --format=csv
  else
    export PYTHONPATH=$ROOT
  fi
  chmod +x .redis/redis-server .redis/redis-server.bin 2>/dev/null
  .redis/redis-server --version || { echo "carried redis-server does not start"; return 3; }
  "$PY" -c "import sys, torch, numpy, redis, duckdb; print('python', sys.version.split()[0], 'torch', torch.__version__,
'numpy', numpy.__version__, 'redis', redis.__version__, 'duckdb', duckdb.__version__, 'cuda', torch.cuda.is_available())" \
    || return 3
  env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=' | sort

  # Random token ids (vocab 32768; tiny vocab locally), a 1-D stream: enough rows for STEPS steps.
  rm -rf "$WORK"; mkdir -p "$WORK"
  local vocab=32768 seq=4096 batch=16
  local model_sets=()
  if [ "$LOCAL" = 1 ]; then
    vocab=128 seq=64 batch=4
    model_sets=(--set trainer.device=cpu --set trainer.dtype=float32 --set trainer.experts.backend=auto
      --set trainer.compile=false --set trainer.model.vocab_size=128 --set trainer.model.hidden_size=64
      --set trainer.model.num_layers=2 --set trainer.model.intermediate_size=128
      --set trainer.model.moe_intermediate_size=32 --set trainer.model.n_routed_experts=8
      --set trainer.model.num_experts_per_tok=2 --set trainer.model.num_heads=4 --set trainer.model.max_seq_len=512)
  fi
  "$PY" -c "import numpy as np; n = $STEPS * $batch * $seq + 1 + 10 * $seq
np.save('$WORK/tokens.npy', np.random.default_rng(0).integers(0, $vocab, size=n, dtype=np.int32)); print('tokens', n)" \
    || return 3

  echo "== $(date -u +%T) moe_bench moonlet row (compiled, ${batch}x${seq}); +$((SECONDS - t0))s"
  local bench_args=(--variants raw --shapes 1024,512,64,8 --moonlet-batch 16 --moonlet-seq 4096 --out "$OUT/moe_bench.json")
  [ "$LOCAL" = 1 ] && bench_args=(--smoke --variants raw --out "$OUT/moe_bench.json")
  echo "+ $PY bench/moe_bench.py ${bench_args[*]}"
  timeout 300 "$PY" bench/moe_bench.py "${bench_args[@]}" || echo "moe_bench exited $?"

  local role_sets=(--set trainer.mode=pretrain --set trainer.compile=true --set trainer.steps=$STEPS
    --set trainer.data.path=$WORK/tokens.npy --set trainer.data.seq_len=$seq --set trainer.data.batch_size=$batch
    --set trainer.optim.grad_accum=1 --set trainer.checkpoint.interval_steps=0 --set run.dir=$WORK/run
    --set rendezvous.redis_server=$ROOT/.redis/redis-server "${model_sets[@]}")
  local left=$((BUDGET_S - (SECONDS - t0)))
  echo "== $(date -u +%T) role path: ROLE=trainer python -m common.runs.cli run; +$((SECONDS - t0))s, ${left}s left"
  echo "+ ROLE=trainer $PY -m common.runs.cli run configs/moonlet.toml ${role_sets[*]}"
  local r0=$SECONDS
  ROLE=trainer timeout $((left - 40)) "$PY" -m common.runs.cli run configs/moonlet.toml "${role_sets[@]}"
  local rc=$?
  echo "role path exited $rc after $((SECONDS - r0))s (includes start, model init, compile, the final checkpoint)"
  du -sh "$WORK/run/checkpoints" 2>/dev/null

  echo "== $(date -u +%T) summary; +$((SECONDS - t0))s"
  local sum_sets=("${model_sets[@]}")
  "$PY" bench/h200_role_summary.py --bench-json "$OUT/moe_bench.json" --run-dir "$WORK/run" --seq $seq --batch $batch \
    --skip $SKIP --out "$OUT/summary.json" "${sum_sets[@]}" | tee "$WORK/summary.txt"
  local ratio
  ratio=$(sed -n 's/^RATIO=//p' "$WORK/summary.txt")
  left=$((BUDGET_S - (SECONDS - t0)))
  if [ "${FORCE_PROFILE:-0}" = 1 ] || "$PY" -c "import sys; r = '$ratio'; sys.exit(0 if r in ('', 'nan') or float(r) < 0.95 else 1)"; then
    if [ $left -gt 150 ]; then
      echo "== $(date -u +%T) profile of the core step (ratio $ratio); ${left}s left"
      timeout $((left - 15)) "$PY" bench/h200_role_profile.py configs/moonlet.toml "${role_sets[@]}" --steps 8 \
        --out "$OUT" || echo "profile exited $?"
    else
      echo "no time left for the profile (${left}s)"
    fi
  fi
  echo "== $(date -u +%T) done; total $((SECONDS - t0))s"
  cat "$WORK/summary.txt" | grep -v '^RATIO='
  return $rc
}

main 2>&1 | tee "$OUT/h200_role_pretrain.log"
