#!/bin/bash
# lit-mesh on several nodes with torchrun: run this script once on every node, with the same MASTER_ADDR (the
# first node's address) and its own NODE_RANK. Lightning's TorchElasticEnvironment reads torchrun's variables.
#
#   node 0:  NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 examples/torchrun.sh
#   node 1:  NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 examples/torchrun.sh
#
# On a real cluster change: NPROC_PER_NODE (GPUs per node), MASTER_ADDR/MASTER_PORT (reachable from every
# node), ACCELERATOR=gpu, and the mesh degrees (MESH_ARGS). For elastic jobs use --rdzv-backend=c10d instead.
# A dead rank restarts the workers (up to MAX_RESTARTS times); they resume from the newest complete checkpoint
# in CKPT_DIR (ckpt_path=last); SIGTERM saves at the next step boundary and stops (lit_mesh.Preemption).
set -euo pipefail

NNODES=${NNODES:-2}
NODE_RANK=${NODE_RANK:-0}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
ACCELERATOR=${ACCELERATOR:-gpu}
MAX_RESTARTS=${MAX_RESTARTS:-3}
CKPT_DIR=${CKPT_DIR:-checkpoints}
MESH_ARGS=${MESH_ARGS:-"--trainer.strategy.init_args.dp_replicate=$((NNODES * NPROC_PER_NODE))"}

torchrun --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="$NPROC_PER_NODE" \
  --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" --max-restarts="$MAX_RESTARTS" \
  -m lit_mesh.cli fit -c configs/gpt.yaml \
  --trainer.accelerator="$ACCELERATOR" \
  --trainer.num_nodes="$NNODES" \
  --trainer.devices="$NPROC_PER_NODE" \
  --trainer.strategy.init_args.allreduce=auto \
  --trainer.callbacks+=ModelCheckpoint --trainer.callbacks.dirpath="$CKPT_DIR" \
  --trainer.callbacks.every_n_train_steps=50 --trainer.callbacks.save_last=true \
  --trainer.callbacks+=lit_mesh.Preemption --ckpt_path=last \
  $MESH_ARGS "$@"
