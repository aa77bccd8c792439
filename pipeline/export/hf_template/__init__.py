"""The files `grt export --format hf` copies into an exported folder (configuration_grt.py, modeling_grt.py). They
import only torch and transformers; being a package here lets the exporter and the tests import them directly."""
