#!/usr/bin/env bash
# Reproduces checkpoints/demo_sft exactly as shipped: four `sparrow sft` stages (~60 min on 2 cores).
# Measured along the way (token accuracy / greedy exact on held-out K in [8, 13]):
#   1. random crops          : the copy-from-81-back circuit forms ~step 400, acc 0.98, exact 0
#                              (every generation fails in cycle 1: reading the prompt table)
#   2-3. crops at the prompt : cycle 1 learned, exact 0 (only the stop decision is wrong)
#   4. whole sequences       : the "cycle label == K -> '='" stop decision
set -euo pipefail
cd "$(dirname "$0")/.."
# Each stage replaces checkpoints/demo_sft on purpose (sparrow sft refuses to, unless told).
run() { launch/local.sh sparrow sft configs/sft_demo.gin --gin_param "SFTConfig.overwrite = True" "$@"; }
out=checkpoints/demo_sft; tmp=$(mktemp -d)
run --gin_param "SFTConfig.crop_start_fraction = 0.0"
for stage in 2 3 4; do
  rm -rf "$tmp/in"; cp -r "$out" "$tmp/in"
  case $stage in
    2) extra=(--gin_param "SFTConfig.crop_steps = 300" --gin_param "SFTConfig.crop_start_fraction = 0.5"
              --gin_param "SFTConfig.long_steps = 150" --gin_param "SFTConfig.learning_rate = 5e-4") ;;
    3) extra=(--gin_param "SFTConfig.crop_steps = 500" --gin_param "SFTConfig.crop_start_fraction = 0.8"
              --gin_param "SFTConfig.long_steps = 120" --gin_param "SFTConfig.learning_rate = 5e-4") ;;
    4) extra=(--gin_param "SFTConfig.crop_steps = 0" --gin_param "SFTConfig.long_steps = 250"
              --gin_param "SFTConfig.learning_rate = 3e-4" --gin_param "SFTConfig.warmup_steps = 10") ;;
  esac
  run --gin_param "SFTConfig.init_from = '$tmp/in'" --gin_param "SFTConfig.warmup_steps = 20" "${extra[@]}"
done
rm -rf "$tmp"
