#!/bin/bash
# {{name}}: `grt tokenize` on {{tasks}} nodes, one slice of the sources per array task (docs/data.md, "Tokenizing on
# many nodes"). Written by `grt launch tokenize --launcher slurm` from launch/templates/tokenize_array.sh; the merge
# runs as a separate job once every task has succeeded. A task killed or requeued resumes from its saved state.
#SBATCH --job-name={{name}}-tokenize
#SBATCH --array=0-{{last_task}}
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={{launch_dir}}/tokenize-%A_%a.out
#SBATCH --chdir={{workdir}}
{{sbatch_options}}
{{setup}}
set -euo pipefail
echo "grt: tokenize task $SLURM_ARRAY_TASK_ID of {{tasks}} (job ${SLURM_ARRAY_JOB_ID:-?}) on $(hostname)"
# the task's tokenizer processes: the CPUs the job was given (else every CPU of the node)
exec {{tokenize_command}} --tasks {{tasks}} --task-id "$SLURM_ARRAY_TASK_ID" ${SLURM_CPUS_PER_TASK:+--workers "$SLURM_CPUS_PER_TASK"}
