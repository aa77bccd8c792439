#!/bin/bash
# {{name}}: {{nodes}} node(s) x {{gpus_per_node}} GPU(s) = world size {{world_size}}, train.backend={{backend}}.
# Written by `grt launch --launcher slurm` from launch/templates/sbatch.sh (edit either one); submit it with
# `sbatch THIS_FILE`. {{grace_s}} s before the time limit (or on a preemption) every rank saves a checkpoint and the
# job requeues itself; the requeued job resumes from the run folder's latest checkpoint and continues the same
# MLflow run (train.resume: auto).
#SBATCH --job-name={{name}}
#SBATCH --nodes={{nodes}}
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:{{gpus_per_node}}
#SBATCH --signal=B:TERM@{{grace_s}}
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={{launch_dir}}/slurm-%j.out
#SBATCH --chdir={{workdir}}
{{sbatch_options}}
{{setup}}
set -uo pipefail
# The job asks for the whole node (--exclusive: the step then gets every CPU of it) or, with `grt launch
# --cpus-per-node N`, for --cpus-per-task=N. Since Slurm 22.05 srun no longer inherits --cpus-per-task from the
# allocation: pass it on, or the node's ranks would share one CPU.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK; fi

# Node 0 of the allocation hosts the rendezvous; the port comes from the job id, so two jobs sharing a node do not
# collide and a requeued job (same id) gets the same port.
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
export MASTER_PORT={{master_port}}
echo "grt: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NUM_NODES node(s), rendezvous $MASTER_ADDR:$MASTER_PORT"

# ONE task per node, running ONE torchrun that starts that node's {{gpus_per_node}} ranks (never one task per GPU
# plus torchrun: that starts {{gpus_per_node}} torchruns per node, a duplicate world). The single quotes keep
# $SLURM_NODEID for each task to expand on its own node; the training command follows as "$@".
srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c 'exec torchrun --nnodes {{nodes}} --nproc_per_node {{gpus_per_node}} --node_rank "$SLURM_NODEID" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" --shutdown_timeout {{shutdown_timeout_s}} "$@"' torchrun \
    {{train_command}} &
srun_pid=$!

# SLURM signals only this shell (B:). The TERM goes on to the tasks of the job's steps with `scancel --signal`
# (not to srun itself: srun answers a TERM by terminating its step, SIGKILL after KillWait, which would cut a
# checkpoint short): torchrun passes it to every rank, each saves a checkpoint at its current step and exits. Then
# the job requeues itself. `scancel` of the whole job also TERMs this shell, but then the job is no longer RUNNING:
# it is not requeued.
on_term() {
    echo "grt: SIGTERM: passing it to the ranks (each saves a checkpoint at its current step)"
    scancel --signal=TERM "$SLURM_JOB_ID"
    wait "$srun_pid"
    state=$(squeue -h -j "$SLURM_JOB_ID" -o %T 2>/dev/null)
    if [ "$state" = RUNNING ]; then
        echo "grt: requeueing job $SLURM_JOB_ID: it resumes from the latest checkpoint"
        scontrol requeue "$SLURM_JOB_ID"
    else
        echo "grt: job $SLURM_JOB_ID is ${state:-gone} (cancelled?): not requeued"
    fi
    exit 0
}
trap on_term TERM
wait "$srun_pid"
exit $?
