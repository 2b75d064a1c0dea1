#!/usr/bin/env bash
# TPU pod slice (multi-host): copies the repo to every worker, installs jax[tpu] + sparrow-jax,
# and starts one training process per host (jax.distributed auto-detects TPU pod topology).
#   launch/tpu_pod.sh TPU_NAME ZONE configs/qwen3_8b_tpu.gin [--gin_param ...]
set -euo pipefail
cd "$(dirname "$0")/.."
tpu=$1; zone=$2; shift 2
args=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm scp --recurse --zone "$zone" --worker=all . "$tpu":~/sparrow-jax
gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone" --worker=all --command "
  set -e; cd ~/sparrow-jax
  python3 -m venv .venv-tpu && . .venv-tpu/bin/activate
  pip install -q -e '.[tpu]'
  sparrow train$args --gin_param 'TrainConfig.distributed = True'
"
