#!/usr/bin/env bash
# Submit a training job to Slurm and show the queue.
#   bash scripts/slurm/launch.sh training.max_steps=1000           # one node; arguments: key=value overrides
#   NODES=4 GPUS_PER_NODE=8 bash scripts/slurm/launch.sh            # four nodes of eight GPUs
#   SBATCH_PARTITION=gpu SBATCH_ACCOUNT=lab SBATCH_TIMELIMIT=48:00:00 bash scripts/slurm/launch.sh
# NODES (1) picks single_node.sbatch or multi_node.sbatch; GPUS_PER_NODE (unset: no GPU request)
# becomes --gpus-per-node. Other sbatch options come from sbatch's own SBATCH_* variables, and
# CONFIG, DEEPSPEED_CONFIG, RUN_NAME, MASTER_PORT reach the job through the environment.
set -euo pipefail
cd "$(dirname "$0")/../.."

NODES=${NODES:-1}
script=scripts/slurm/multi_node.sbatch
[ "$NODES" = 1 ] && script=scripts/slurm/single_node.sbatch
args=(--parsable --nodes="$NODES")
[ -n "${GPUS_PER_NODE:-}" ] && args+=(--gpus-per-node="$GPUS_PER_NODE")

mkdir -p logs  # sbatch does not create the directory of --output
job=$(sbatch "${args[@]}" "$script" "$@")
job=${job%%;*}  # --parsable prints "id" or "id;cluster"
echo "submitted $script as job $job"
echo "logs: logs/<job name>-$job.out (the job) and logs/<job name>-$job-node<N>.out (one per node)"
squeue --me
