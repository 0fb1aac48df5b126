#!/usr/bin/env bash
# Issue 23's first diagnosis runs: GWT-2 and GaLore (GWT-2's state) at 128 and 512 tokens a
# sequence, 2048 tokens a step, the seqlen study's settings (seed 0), with --diagnostics.
#   bash results/diagnostics/run.sh   (two runs at a time; about 10 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
common="--config 9m --steps 300 --eval-every 30 --eval-batches 8 --seed 0 --diagnostics --json"
gwt="--optimizer gwt --level 2 --lr 1e-2 --alpha 0.125"
galore="--optimizer galore --level 2 --galore-gap 100 --lr 3e-2 --alpha 0.25"
run() { python -m examples.llama.train $common $2 --seq-len $3 --batch-size $((2048 / $3)) \
          --run-dir results/diagnostics/$1-seq$3 > results/diagnostics/$1-seq$3.json; }
run gwt-2 "$gwt" 128 & run gwt-2 "$gwt" 512 & wait
run galore "$galore" 128 & run galore "$galore" 512 & wait
