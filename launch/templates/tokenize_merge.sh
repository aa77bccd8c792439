#!/bin/bash
# {{name}}: the merge of the {{tasks}} tokenize tasks into {{dataset_dir}} (manifest, shards, validation split),
# submitted with --dependency=afterok on the array job: it starts once every task has succeeded, and SLURM cancels it
# (--kill-on-invalid-dep) when a task fails, instead of leaving it pending for good.
#SBATCH --job-name={{name}}-tokenize-merge
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --requeue
#SBATCH --kill-on-invalid-dep=yes
#SBATCH --open-mode=append
#SBATCH --output={{launch_dir}}/tokenize-merge-%j.out
#SBATCH --chdir={{workdir}}
{{merge_options}}
{{setup}}
set -euo pipefail
exec {{merge_command}}
