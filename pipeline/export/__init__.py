"""Export of trained checkpoints to other frameworks' formats: ``grt export RUN --format hf --out DIR``
(:mod:`pipeline.export.hf`)."""
