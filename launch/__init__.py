"""Multi-node launch: render and run the torchrun / deepspeed / SLURM commands of a recipe, after a preflight."""
