#!/usr/bin/env bash
# The headline cells of benchmarks/train_step.py side by side in one device run: one cell per GPU,
# all at once (a machine of several GPUs), each its own process with its own time box. Run after
# the set-up device_run.sh does (diffusers, and FA4 if it is to be measured, in /tmp/site).
# Four host-bound 512 px cells at once were as noisy as one alone on the machine (NOTES 34).
#
#   CELLS="chroma:512:none qwen:512:none chroma:1024:none qwen:1024:none" bash benchmarks/cells.sh
#
# $CELLS: "model:px:compile" (compile none or blocks), one per GPU in order; $CELL_ARGS: more
# train_step.py arguments for every cell; $CELL_SECONDS: each cell's time box (default 300);
# $CELL_BACKENDS: train_step.py's --backends (default auto,torch).
# Each cell writes train_step_<model>_<px>_<compile>.{json,png,txt}, packed at the end into one
# archive, $OUT/cells.tgz (a device call brings back only a few files: 8 in the run of NOTES 34);
# benchmarks/cells_table.py makes the README's table of them.
set -u
final=$OUT
OUT=$(mktemp -d)
export PYTHONPATH=${PYTHONPATH:-/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD}
export PYTHONWARNINGS=ignore
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
i=0
for cell in $CELLS; do
  IFS=: read -r model px comp <<< "$cell"
  if [ "$i" -ge "$gpus" ]; then echo "cell $cell: no GPU left ($gpus)"; continue; fi
  name="train_step_${model}_${px}_${comp}"
  CUDA_VISIBLE_DEVICES=$i timeout "${CELL_SECONDS:-300}" python3 benchmarks/train_step.py --model "$model" --px "$px" \
    --compile "$comp" --backends "${CELL_BACKENDS:-auto,torch}" ${CELL_ARGS:-} \
    --json "$OUT/$name.json" --png "$OUT/$name.png" > "$OUT/$name.txt" 2>&1 &
  i=$((i + 1))
done
wait
for cell in $CELLS; do IFS=: read -r model px comp <<< "$cell"; echo "== $cell"; grep -v "pow_by_natural" "$OUT/train_step_${model}_${px}_${comp}.txt" | tail -12; done
tar czf "$final/cells.tgz" -C "$OUT" .
