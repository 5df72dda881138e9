# Diagnostics: conv net under a cap (cuDNN's fallbacks), the LM's floor at 10 GiB.
set -x
python -m lmsrt build > $OUT/build.log 2>&1
P=benchmarks/offload.py
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
python $P --workloads seg --caps 0,10 --methods ckpt,lmsrt --fracs auto --segments 8 --warmup 4 --steps 4 --out $OUT/seg > $OUT/seg.log 2>&1
python $P --workloads lm --caps 0 --methods save_on_cpu --warmup 2 --steps 2 --out $OUT/lm > $OUT/lm.log 2>&1
python $P --workloads segtuned --caps 12 --methods lmsrt --fracs auto --warmup 6 --steps 6 --out $OUT/segtuned > $OUT/segtuned.log 2>&1
