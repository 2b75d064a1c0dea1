#!/usr/bin/env bash
# TPU pod slice (multi-host): copies the project's tracked files to every worker, sets each up
# (launch/tpu_setup.sh: Python >= 3.11, the tested jax[tpu]/libtpu, jax sees the chips, the
# model/data/run paths exist on that worker), then starts one training process per host,
# detached (nohup), logging to ~/sparrow-jax/logs/train-<host>.log on each worker
# (jax.distributed auto-detects the pod topology).
#   launch/tpu_pod.sh TPU_NAME ZONE configs/qwen3_8b_tpu.gin [--gin_param ...]
# Follow a worker: gcloud compute tpus tpu-vm ssh TPU_NAME --zone ZONE --worker=0 \
#   --command 'tail -f ~/sparrow-jax/logs/train-*.log'
set -euo pipefail
cd "$(dirname "$0")/.."
tpu=$1; zone=$2; shift 2
args=$(printf ' %q' "$@")
# Only tracked files (their working-tree state): never .venv*/, runs/, .compile-env/ or caches.
command -v git >/dev/null 2>&1 && git rev-parse --is-inside-work-tree >/dev/null 2>&1 \
  || { echo "[tpu_pod.sh] ERROR: run from a git checkout of sparrow-jax (it copies the tracked files)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# (A tracked file deleted in the working tree is left out, not an error.)
git ls-files -z | while IFS= read -r -d '' f; do if [ -e "$f" ]; then printf '%s\0' "$f"; fi; done \
  | tar --null -T - -czf "$tmp/sparrow-jax.tgz"
echo "[tpu_pod.sh] copying $(git ls-files | wc -l | tr -d ' ') tracked files to every worker of $tpu" >&2
gcloud compute tpus tpu-vm scp --zone "$zone" --worker=all "$tmp/sparrow-jax.tgz" "$tpu":~/sparrow-jax.tgz
gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone" --worker=all --command "
  set -e; mkdir -p ~/sparrow-jax && tar -xzf ~/sparrow-jax.tgz -C ~/sparrow-jax && cd ~/sparrow-jax
  TPU_CHIPS_PER_HOST=${TPU_CHIPS_PER_HOST:-} bash launch/tpu_setup.sh$args
" || { echo "[tpu_pod.sh] ERROR: set-up failed on a worker (its lines above say why); nothing was started" >&2; exit 1; }
gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone" --worker=all --command "
  set -e; cd ~/sparrow-jax && . .venv-tpu/bin/activate && mkdir -p logs
  nohup sparrow train$args --gin_param 'TrainConfig.distributed = True' > logs/train-\$(hostname).log 2>&1 < /dev/null &
  echo \"[tpu_pod.sh] started on \$(hostname): ~/sparrow-jax/logs/train-\$(hostname).log\"
"
