#!/bin/bash
# Run from the repository root of the GPU machine, this tree copied to .gpu40 beside /work/main's.
# $OUT: where logs and JSON go. Builds both trees, runs this tree's CUDA region tests, then
# offload.py: this tree (lmsrt with regions, checkpointing) and main's (lmsrt before regions).
set -u
ROOT=$PWD
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
(cd .gpu40 && PYTHONPATH=. python setup.py -q build_ext --inplace && PYTHONPATH=. python -c "import lmsrt.copy_path as c; c.build()") > $OUT/build.log 2>&1
(PYTHONPATH=. python setup.py -q build_ext --inplace && PYTHONPATH=. python -c "import lmsrt.copy_path as c; c.build()") > $OUT/build-main.log 2>&1
(cd .gpu40 && PYTHONPATH=. timeout 120 python -m pytest -q -n 0 -p no:cacheprovider -m cuda tests/test_regions.py) > $OUT/cuda-regions.log 2>&1
tail -2 $OUT/cuda-regions.log
bench() {   # tree name workload caps methods [more args]
  local tree=$1 name=$2 w=$3 caps=$4 methods=$5; shift 5
  (cd $tree && PYTHONPATH=. python benchmarks/offload.py --workloads $w --caps $caps \
     --methods $methods --fracs auto --warmup ${WARMUP:-12} --timeout 100 --out $OUT/$name "$@") \
     > $OUT/$name.log 2>&1
  grep -E "^  $w|checkpointing's" $OUT/$name.log
}
for spec in "${@}"; do
  if [ $SECONDS -gt ${BUDGET_S:-400} ]; then echo "skipped (time): $spec"; continue; fi
  bench $spec
done
# One archive: the device returns a limited number of files.
(cd $OUT && tar czf results.tgz --exclude='*.png' --exclude=results.tgz * && find . -mindepth 1 ! -name results.tgz -delete)
