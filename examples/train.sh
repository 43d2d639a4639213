#!/bin/sh
# A toy training rank for Gangway: it reads the torchrun-style variables the
# agent sets, "trains" by counting steps, checkpoints after every step into
# $GANGWAY_CHECKPOINT_DIR, resumes from that checkpoint when restarted or
# requeued, and on SIGTERM (the checkpoint signal) saves and exits.
set -eu
steps=${STEPS:-20}
ckpt="$GANGWAY_CHECKPOINT_DIR/rank-$RANK.step"
step=0
if [ -f "$ckpt" ]; then
  step=$(cat "$ckpt")
  echo "rank $RANK: resuming from checkpoint at step $step"
fi
echo "rank $RANK of $WORLD_SIZE (local $LOCAL_RANK, node $NODE_RANK of $NNODES) on $GANGWAY_NODE," \
  "GPUs $CUDA_VISIBLE_DEVICES, rendezvous $MASTER_ADDR:$MASTER_PORT, attempt $GANGWAY_ATTEMPT"
trap 'echo "$step" > "$ckpt"; echo "rank $RANK: checkpoint signal, saved step $step"; exit 0' TERM
while [ "$step" -lt "$steps" ]; do
  sleep "${STEP_SECONDS:-1}"
  step=$((step + 1))
  echo "$step" > "$ckpt.tmp" && mv "$ckpt.tmp" "$ckpt"
  echo "rank $RANK: step $step/$steps"
done
echo "rank $RANK: done"
