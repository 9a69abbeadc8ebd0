#!/usr/bin/env bash
# Multi-node GPU pretraining with Lion Cub under megatron-core (run the same command on every node).
#
#   NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=<node 0 address> bash examples/launch_megatron_multinode.sh
#
# Layout: GPUS_PER_NODE ranks per node, tensor parallel TP inside a node, data parallel across
# the rest: DP = NNODES * GPUS_PER_NODE / (TP * PP). Every model-parallel rank votes only with
# its DP peers (1-bit votes, comm chosen by the cost model unless LIONCUB_COMM is set), and DDP's
# gradient all-reduce is off. Momentum sync is two-level: every SYNC_EVERY steps among the DP
# peers on the same node (NVLink), every SYNC_INTER_EVERY steps across all nodes. With Megatron's
# default rank order a node holds GPUS_PER_NODE / (TP * PP) DP peers of each group when
# TP * PP <= GPUS_PER_NODE (lioncub_ds reads LOCAL_WORLD_SIZE from torchrun to find them).
#
# Extra arguments are passed to examples/pretrain_gpt_megatron.py, e.g. --train-iters 20000.
#
# Megatron-LM's own pretrain_gpt.py instead of this megatron-core example: run the same torchrun line
# with `-m lioncub_ds.megatron.run pretrain_gpt.py <Megatron-LM args>` from a Megatron-LM checkout
# (flags and the memory note: docs/megatron.md).
set -euo pipefail

NNODES=${NNODES:-2}
NODE_RANK=${NODE_RANK:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
TP=${TP:-2}
PP=${PP:-1}
LIONCUB_COMM=${LIONCUB_COMM:-auto}
SYNC_EVERY=${SYNC_EVERY:-10}
SYNC_INTER_EVERY=${SYNC_INTER_EVERY:-100}
SAVE_DIR=${SAVE_DIR:-runs/megatron-lioncub}
# Network model for comm=auto (inter-node bandwidth and latency of the slowest link).
NET_GBIT=${NET_GBIT:-100}
NET_LAT_US=${NET_LAT_US:-10}

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# Megatron's usual settings for tensor-parallel communication overlap on GPUs.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

exec torchrun \
    --nnodes "${NNODES}" --node_rank "${NODE_RANK}" --nproc_per_node "${GPUS_PER_NODE}" \
    --master_addr "${MASTER_ADDR}" --master_port "${MASTER_PORT}" \
    "${HERE}/pretrain_gpt_megatron.py" \
    --tensor-model-parallel-size "${TP}" --pipeline-model-parallel-size "${PP}" \
    --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 \
    --micro-batch-size 8 --train-iters 5000 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 200 \
    --weight-decay 0.3 --adam-beta1 0.95 --adam-beta2 0.98 --clip-grad 1.0 --bf16 \
    --data stdlib --log-interval 20 --eval-interval 500 --eval-iters 20 \
    --save "${SAVE_DIR}" --save-interval 1000 --load "${SAVE_DIR}" \
    --lioncub-comm "${LIONCUB_COMM}" \
    --lioncub-bandwidth-gbit "${NET_GBIT}" --lioncub-latency-us "${NET_LAT_US}" \
    --lioncub-momentum-sync-group node \
    --lioncub-momentum-sync-every "${SYNC_EVERY}" \
    --lioncub-momentum-sync-inter-every "${SYNC_INTER_EVERY}" \
    --lioncub-checkpoint-mode per_rank \
    "$@"
