# The body of single_node.sbatch and multi_node.sbatch (sourced from the repository root):
# starts scripts/train.sh once per node with srun, and requeues the job when Slurm's
# advance warning (USR1, from `#SBATCH --signal`) arrives, after the trainer has saved.
set -euo pipefail

source scripts/slurm/nccl.env
mkdir -p logs
# Set up once here, not once per node racing on a shared filesystem.
[ -x .venv/bin/torchrun ] || bash scripts/setup.sh

export NNODES=$SLURM_NNODES
export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)}
# Derived from the job id so that two jobs sharing a node do not collide on 29500.
export MASTER_PORT=${MASTER_PORT:-$(( 20000 + SLURM_JOB_ID % 20000 ))}
# Stable across requeues (the job id stays), so a requeued job finds its own checkpoints.
export RUN_NAME=${RUN_NAME:-$SLURM_JOB_NAME-$SLURM_JOB_ID}

overrides=("$@")
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
  overrides+=(resume.checkpoint_path=auto)
fi
echo "$(date -Is) job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $NNODES node(s)," \
     "master $MASTER_ADDR:$MASTER_PORT, run $RUN_NAME, overrides: ${overrides[*]}"

requeue=0
on_usr1() {
  echo "$(date -Is) USR1: the time limit is near; the trainer saves, then the job requeues"
  requeue=1
  # Without --batch this signals the job steps only: every trainer process on every node.
  scancel --signal=USR1 "$SLURM_JOB_ID"
}
trap on_usr1 USR1

# One task per node; each runs torchrun for its node rank and writes its own log.
srun --nodes="$NNODES" --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" \
     --kill-on-bad-exit=1 --open-mode=append --output="logs/%x-%j-node%n.out" \
     bash -c 'NODE_RANK=$SLURM_NODEID exec bash scripts/train.sh "$@"' train.sh "${overrides[@]}" &
srun_pid=$!
# A trap interrupts `wait`; keep waiting until srun itself has ended.
status=0
while kill -0 "$srun_pid" 2>/dev/null; do
  wait "$srun_pid" && status=0 || status=$?
done

if [ "$requeue" = 1 ]; then
  echo "$(date -Is) requeueing job $SLURM_JOB_ID; it resumes with resume.checkpoint_path=auto"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
