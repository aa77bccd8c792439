"""Stage 3: losses per exit depth, gate statistics, plots, comparison."""
