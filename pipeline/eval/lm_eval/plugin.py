"""Makes ``lm_eval --model grt`` work from the shell.

lm-eval has no plugin entry point for models: its registry is filled from a fixed table when ``lm_eval.models`` is
imported. The installed ``grt_pipeline_lm_eval.pth`` calls :func:`install` at interpreter start, which adds an
import hook (cheap: nothing is imported until lm-eval itself is) that registers ``grt`` as a lazy entry, pointing at
:class:`pipeline.eval.lm_eval.harness.GRTLM`, right after lm-eval fills its registry.
"""
from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder

MODEL_NAME = "grt"
TARGET = "pipeline.eval.lm_eval.harness:GRTLM"


def register(model_registry) -> None:
    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=TARGET)


class _RegisterAfterLmEvalModels(MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "lm_eval.models":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            from lm_eval.api.registry import model_registry

            register(model_registry)

        spec.loader.exec_module = exec_then_register
        return spec


def install() -> None:
    if not any(isinstance(f, _RegisterAfterLmEvalModels) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLmEvalModels())


PTH_NAME = "grt_pipeline_lm_eval.pth"
PTH_LINE = "import pipeline.eval.lm_eval.plugin as p; p.install()\n"


def write_pth() -> str:
    """Write the start-up hook into this environment's site-packages. A regular ``pip install .`` places it as a
    data file; an editable install (``pip install -e .``) skips data files, so ``make`` runs
    ``python -m pipeline.eval.lm_eval.plugin`` after it."""
    import sysconfig
    from pathlib import Path

    path = Path(sysconfig.get_path("purelib")) / PTH_NAME
    path.write_text(PTH_LINE)
    return str(path)


if __name__ == "__main__":
    print(f"lm-eval hook for --model {MODEL_NAME}: {write_pth()}")
