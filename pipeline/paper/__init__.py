"""The paper's reported numbers (``results.yaml``, each with its source) and `grt paper-table`, which sets them
beside the runs found in MLflow."""
