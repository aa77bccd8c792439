"""Stage 3: `grt eval` (stage.py): losses per exit depth (exit_losses.py), the analyses and their plots (analyses/),
downstream tasks through lm-eval (lm_eval/); results.py reads back what it saved."""
