#!/usr/bin/env bash
# Everything measured on the device in one call, most important first (each step time-boxed).
# Before it: `bash .fa4a/stage.sh` (carry .fa4a); this call carries .fa4b and .whl: the
# flash-attn-4 wheels split in two halves (.fa4a, .fa4b: the first half staged to /tmp/fa4 by one
# call, installed with the second by .fa4b/install.sh) and the diffusers wheels (.whl), all
# prepared outside the project. Results land in $OUT. Steps: $STEPS (default all).
set -u
bash .fa4b/install.sh || exit 3
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
# $PWD for varlen_attn itself; benchmarks/_common.py needs no entry (python puts a script's folder first).
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
export PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, diffusers; print(torch.__version__, torch.version.cuda, diffusers.__version__)"
STEPS=${STEPS:-"overhead attention step compiled tests"}
run() { local t=$1; shift; echo "== $*"; timeout "$t" "$@"; echo "== rc=$?"; }
for s in $STEPS; do case $s in
  overhead) for shape in chroma512 chroma1024; do
      run 90 python3 benchmarks/profile_overhead.py --shape $shape 2>&1 | grep -v "^ *\(---\|Name\|Self\)" | head -24 | tee -a "$OUT/overhead.txt"; done ;;
  attention) run 200 python3 benchmarks/attention.py --json "$OUT/attention.json" --png "$OUT/attention.png" 2>&1 | tee "$OUT/attention.txt" ;;
  step) run 120 python3 benchmarks/chroma_step.py --json "$OUT/chroma_step_fa4.json" 2>&1 | tee "$OUT/chroma_step_fa4.txt" ;;
  compiled) run 150 python3 benchmarks/chroma_step.py --compile --json "$OUT/chroma_step_fa4_compiled.json" 2>&1 | tee "$OUT/chroma_step_fa4_compiled.txt" ;;
  train) # $TRAIN: "model:px:compile[:mode]" cells, e.g. "chroma:1024:none chroma:512:blocks:reduce-overhead";
      # $TRAIN_ARGS: more train_step.py arguments for every cell (--gpu-busy, --checkpointing off)
      # $SIDES "before after": each cell first with $OLD's varlen_attn (another checkout), then this one's.
      for cell in ${TRAIN:-"chroma:1024:none chroma:512:none"}; do IFS=: read -r model px comp mode <<< "$cell"
      for side in ${SIDES:-after}; do
      name="train_step_${model}_${px}_${comp}${mode:+_$mode}"; pp=$PYTHONPATH
      [ "$side" = before ] && name="${name}_before" && pp=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/$OLD:$PWD
      PYTHONPATH=$pp run ${TRAIN_SECONDS:-280} python3 benchmarks/train_step.py --model $model --px $px --compile $comp ${mode:+--compile-mode $mode} \
        --backends ${TRAIN_BACKENDS:-auto,torch} --rounds ${TRAIN_ROUNDS:-3} --reps 2 --max-seconds ${TRAIN_MAX:-90} \
        ${TRAIN_ARGS:-} --json "$OUT/$name.json" --png "$OUT/$name.png" 2>&1 | tail -14 | tee "$OUT/$name.txt"; done; done ;;
  profile) run 300 python3 benchmarks/profile_step.py ${PROFILE_ARGS:---px 512 --compile blocks --double 2 --single 4} 2>&1 \
      | grep -v "^-\{20\}" | tee "$OUT/profile_step.txt" | head -150 ;;
  hostprof) # cProfile of a training step's host time per variant ($HOSTPROF_ARGS: train_step.py's arguments)
      for variant in ${HOSTPROF_VARIANTS:-stock varlen:torch varlen:auto}; do
        run 150 python3 benchmarks/host_profile.py --variant $variant --seconds ${HOSTPROF_SECONDS:-15} \
          --cprofile "$OUT/hostprof_${variant/:/_}.prof" ${HOSTPROF_ARGS:---model qwen --px 512 --layers 20} 2>&1 \
          | tail -32 | tee "$OUT/hostprof_${variant/:/_}.txt"; done ;;
  example) run 150 python3 examples/train_chroma.py 2>&1 | tail -8 | tee "$OUT/train_chroma.txt" ;;
  compare) # before/after: $OLD holds the other checkout's varlen_attn (+ kernels_ref); rounds interleaved
      for round in 1 2 3; do
        PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/$OLD run 60 python3 benchmarks/compare_checkouts.py --label before 2>&1 | grep " ms " | tee -a "$OUT/compare.txt"
        run 60 python3 benchmarks/compare_checkouts.py --label after 2>&1 | grep " ms " | tee -a "$OUT/compare.txt"
      done ;;
  tests) run 330 python3 -m pytest -q -m gpu ${TESTS:-tests/test_gpu.py tests/test_gpu_models.py} -p no:cacheprovider --tb=short 2>&1 \
      | grep -v "^DEBUG" | tail -60 | tee "$OUT/gpu_tests.log" ;;
esac; done
