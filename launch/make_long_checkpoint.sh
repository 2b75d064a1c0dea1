#!/usr/bin/env bash
# Reproduces checkpoints/long_sft, the long-context task's warm-up (issue 41), from the shipped
# 1K demo checkpoint: one `sparrow sft` stage, configs/sft_long.gin (1K-token windows after their
# prompt, then whole 4-5K-token sequences). Its seed (21) is none of data/long's (31 train,
# 32 eval, 33 held-out): tests/test_sft.py checks.
set -euo pipefail
cd "$(dirname "$0")/.."
launch/local.sh sparrow sft configs/sft_long.gin "$@"
