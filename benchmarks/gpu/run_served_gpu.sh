#!/bin/bash
# On the GPU machine (device tool), from a folder holding repo/ (this project) and wheels/ (install_wheels.py's):
#   bash repo/benchmarks/gpu/run_served_gpu.sh CHECK|NOCHECK SIZE BUDGET_S [bench_serve.py args...]
# CHECK runs served_check.py first (the tiny model: token equality and a live_kv drill on the device), then
# bench_serve.py on a SIZE model for BUDGET_S seconds. Writes env.txt, served_check.*, bench_*, serve_gpu.json,
# logs.tgz under $OUT.
CHECK=$1; SIZE=${2:-1b}; BUDGET=${3:-420}; shift 3
export PYTHONUNBUFFERED=1
START=$(date +%s)
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 --version
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } > $OUT/env.txt 2>&1
python3 repo/benchmarks/gpu/install_wheels.py wheels /tmp/site >> $OUT/env.txt 2>&1 || echo "pip install failed rc=$?" >> $OUT/env.txt
export PYTHONPATH=/tmp/site:$PWD/repo
python3 -c "import jax, flax, transformers, sgl_jax, kvcanary_jax; print('imports ok: jax', jax.__version__, 'flax', flax.__version__, 'transformers', transformers.__version__)" >> $OUT/env.txt 2>&1
echo "setup took $(( $(date +%s) - START )) s" >> $OUT/env.txt
cat $OUT/env.txt
if [ "$CHECK" = CHECK ]; then
  timeout 420 python3 repo/benchmarks/gpu/served_check.py --device gpu --out $OUT/served_check.json \
    > $OUT/served_check.txt 2>&1
  echo "served_check rc=$? after $(( $(date +%s) - START )) s"
  grep -E '^\{"check|served check' $OUT/served_check.txt
  mkdir -p /tmp/logs && cp /tmp/served_check_*/*.log /tmp/logs/ 2>/dev/null
fi
if [ "$BUDGET" -gt 0 ]; then
  python3 -m kvcanary_jax tiny-model /tmp/model_$SIZE --size $SIZE >> $OUT/env.txt 2>&1
  timeout $(( BUDGET + 150 )) python3 repo/benchmarks/bench_serve.py --model-path /tmp/model_$SIZE --preset gpu \
    --time-budget $BUDGET --out $OUT/serve_gpu.json --log-dir /tmp/logs "$@" > $OUT/bench_stdout.txt 2> $OUT/bench_progress.txt
  echo "bench rc=$?"
  tail -c 3000 $OUT/bench_progress.txt; tail -c 6000 $OUT/bench_stdout.txt
fi
tar czf $OUT/logs.tgz -C /tmp logs
