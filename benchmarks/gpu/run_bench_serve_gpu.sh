#!/bin/bash
# On the GPU machine (device tool), from a folder holding repo/ (this project) and wheels/ (install_wheels.py's):
#   bash repo/benchmarks/gpu/run_bench_serve_gpu.sh SIZE BUDGET_S [bench_serve.py args...]
# Writes env.txt, bench_stdout.txt, bench_progress.txt, serve_gpu.json, logs.tgz under $OUT.
SIZE=${1:-1b}; BUDGET=${2:-420}; shift 2
export PYTHONUNBUFFERED=1
START=$(date +%s)
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; which python3; python3 --version
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } > $OUT/env.txt 2>&1
python3 repo/benchmarks/gpu/install_wheels.py wheels /tmp/site >> $OUT/env.txt 2>&1 || echo "pip install failed rc=$?" >> $OUT/env.txt
export PYTHONPATH=/tmp/site:$PWD/repo
python3 -c "import jax, flax, transformers, sgl_jax, kvcanary_jax; print('imports ok: jax', jax.__version__, 'flax', flax.__version__, 'transformers', transformers.__version__)" >> $OUT/env.txt 2>&1
python3 -m kvcanary_jax tiny-model /tmp/model_$SIZE --size $SIZE >> $OUT/env.txt 2>&1
echo "setup took $(( $(date +%s) - START )) s" >> $OUT/env.txt
cat $OUT/env.txt
timeout $(( BUDGET + 150 )) python3 repo/benchmarks/bench_serve.py --model-path /tmp/model_$SIZE --preset gpu \
  --time-budget $BUDGET --out $OUT/serve_gpu.json --log-dir /tmp/logs "$@" > $OUT/bench_stdout.txt 2> $OUT/bench_progress.txt
echo "bench rc=$?"
tar czf $OUT/logs.tgz -C /tmp logs
tail -c 3000 $OUT/bench_progress.txt; cat $OUT/bench_stdout.txt | tail -c 6000
