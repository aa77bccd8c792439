"""bench/gpu_check.py keeps every figure it measured when a phase fails, hangs or the whole check is killed: a phase
past its cap is killed with its children and recorded with its partial output while the next phases run; the CUDA
tests' results reach the JSON one by one; the JSON is whole after the first phase whatever happens later. Run as the
dry run on this CPU (no CUDA), with tiny caps forcing the timeouts."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from conftest import load_bench

ROOT = Path(__file__).resolve().parents[1]


gpu_check = load_bench("gpu_check")


def dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.multiprocess  # bench/gpu_check.py starts the processes
def test_phase_past_its_cap_is_killed_with_its_children_and_keeps_its_output(tmp_path):
    code = ("import subprocess, sys, time; p = subprocess.Popen(['sleep', '300']); "
            "print('pid', p.pid, flush=True); print('halfway there', file=sys.stderr, flush=True); time.sleep(300)")
    t = time.time()
    with open(tmp_path / "log", "w") as log:
        res = gpu_check.run_phase(gpu_check.Phase("slow", ("-c", code), 2), 2, tmp_path, log)
    assert time.time() - t < 30
    assert res["status"] == "timed_out" and "cap of 2 s" in res["error"]
    assert "halfway there" in res["stderr_tail"]
    grandchild = int(res["stdout_tail"].split()[1])
    deadline = time.time() + 10
    while not dead(grandchild) and time.time() < deadline:
        time.sleep(0.1)
    assert dead(grandchild), "the phase's child process outlived the kill"
    assert "halfway there" in (tmp_path / "log").read_text()


FAKE_TESTS = '''
import sys, time

def test_first():
    pass

def test_second():
    assert 1 + 1 == 3, "two is not three"

def test_hangs():
    time.sleep(600)

def test_never_reached():
    pass

def helper():
    raise AssertionError("not a test: never called")
'''


@pytest.mark.multiprocess  # bench/gpu_check.py starts the processes
def test_tests_reach_the_json_one_by_one_and_survive_the_kill(tmp_path):
    path, results, out = tmp_path / "fake_gpu_tests.py", tmp_path / "tests.jsonl", tmp_path / "out"
    path.write_text(textwrap.dedent(FAKE_TESTS))
    out.mkdir()
    report = {"phases": {"tests": {"status": "pending"}}}
    phase = gpu_check.Phase("tests", (gpu_check.ME, "--run-tests", str(path), "--results", str(results)), 6)
    with open(tmp_path / "log", "w") as log:
        res = gpu_check.run_phase(phase, 6, tmp_path, log, gpu_check.tests_progress(report, results, out))
    assert res["status"] == "timed_out"
    # written while test_hangs ran, before the kill
    during = json.loads((out / "gpu_check.json").read_text())["phases"]["tests"]
    assert during["status"] == "running"
    assert during["results"]["test_first"]["ok"] is True
    assert during["results"]["test_second"]["ok"] is False
    assert "two is not three" in during["results"]["test_second"]["error"]
    assert during["results"]["test_hangs"] == {"ok": False, "error": "running"}
    after = gpu_check.read_test_results(results, finished=True)
    assert list(after) == ["test_first", "test_second", "test_hangs", "test_never_reached"]
    assert after["test_hangs"]["error"] == "was running when the phase was stopped"
    assert after["test_never_reached"]["error"] == "not run: the phase was stopped before it"


def test_tests_that_need_arguments_fail_and_skips_pass(tmp_path):
    path, results = tmp_path / "fake_gpu_tests.py", tmp_path / "tests.jsonl"
    path.write_text("import pytest\n\ndef test_fixture(tmp_path):\n    pass\n\ndef test_plain():\n    pass\n\n"
                    "def test_skips():\n    pytest.skip(\"not here\")\n")
    rc = subprocess.run([sys.executable, gpu_check.ME, "--run-tests", str(path), "--results", str(results)],
                        cwd=ROOT, capture_output=True, text=True, timeout=60).returncode
    assert rc == 1
    res = gpu_check.read_test_results(results, finished=True)
    assert res["test_plain"]["ok"] is True
    assert res["test_fixture"]["ok"] is False and "tmp_path" in res["test_fixture"]["error"]
    assert res["test_skips"]["ok"] is True and res["test_skips"]["skipped"] == "not here"


def check(*args: str, out: Path, **kw) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    return subprocess.Popen([sys.executable, "bench/gpu_check.py", "--tiny", "--out", str(out), *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.slow
def test_forced_timeout_of_arm_d_keeps_the_mfu_of_arm_e(tmp_path):
    """The issue's case: arm d fails (here: killed at a 1 s cap) and arm e's MFU and Table 4 still come back, from the
    phases after it; the estimate printed first is the sum of the caps."""
    proc = check("--only", "train_d,train_e,decode_table4", "--cap", "train_d=1", out=tmp_path)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 1, stderr
    assert "at most 181 s" in stderr.splitlines()[0]  # 1 + 120 + 60: train_d's forced cap, the tiny profile's others
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report == json.loads(stdout)
    assert report["status"] == "done" and report["estimate_s"] == 181
    p = report["phases"]
    assert p["train_d"]["status"] == "timed_out" and "cap of 1 s" in p["train_d"]["error"]
    assert p["train_e"]["status"] == "ok" and p["decode_table4"]["status"] == "ok"
    e = p["train_e"]["result"]["e_mfu_gpt2_medium"]
    assert e["steps"] == 1 and e["tokens_per_s"] == pytest.approx(e["batch"] * e["seq_len"] / e["step_s"], rel=2e-3)
    assert report["summary"] == {"train_e/e_mfu_gpt2_medium/tokens_per_s": e["tokens_per_s"]}  # no CPU peak: no MFU
    # Table 4 by hand at the tiny sizes (d = 32, T = 12, B = 3): KV = 2 tensors x 2 bytes (bf16) x B x T x d per layer
    # cache; GRT 2+5x4+2 averaged keeps 2 + 5 + 2 layer caches, full 2 + 5 x 4 + 2, GPT-2 medium 24
    t4 = p["decode_table4"]["result"]["table4"]["B=3"]
    for arm, layers in (("gpt2_medium", 24), ("grt_full", 24), ("grt_averaged", 9)):
        assert t4[arm]["kv_bytes"] == 2 * 2 * 3 * 12 * 32 * layers
    assert t4["grt_averaged"]["ratio_total"] == pytest.approx(
        t4["grt_averaged"]["total_bytes"] / t4["gpt2_medium"]["total_bytes"], abs=1e-4)
    assert "===== train_e" in (tmp_path / "gpu_check.log").read_text()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_json_is_whole_after_the_first_phase_when_the_check_is_killed(tmp_path, sig):
    """Killed (SIGKILL: nothing runs after) or stopped (SIGTERM: the running phase is recorded and its processes
    ended) while the second phase runs: the JSON holds the first phase's result."""
    proc = check("--only", "decode_table4,train_d", out=tmp_path, start_new_session=True)
    path, deadline, children = tmp_path / "gpu_check.json", time.time() + 300, []
    try:
        while time.time() < deadline:
            if path.exists() and json.loads(path.read_text())["phases"]["decode_table4"]["status"] == "ok":
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        else:
            pytest.fail("the first phase never reached the JSON")
        time.sleep(1)  # train_d started
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "the second phase is not running"
        os.kill(proc.pid, sig)
        proc.communicate(timeout=60)
        if sig == signal.SIGTERM:
            deadline = time.time() + 10
            while not all(dead(c.pid) for c in children) and time.time() < deadline:
                time.sleep(0.1)
            assert all(dead(c.pid) for c in children), "the stopped check left its phase running"
    finally:  # after a SIGKILL the phase's processes outlive the check (nothing is left to end them): end them here
        for c in children:
            try:
                c.kill()
            except psutil.NoSuchProcess:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    report = json.loads(path.read_text())
    assert report["phases"]["decode_table4"]["status"] == "ok"
    assert "B=1" in report["phases"]["decode_table4"]["result"]["table4"]
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
        assert report["status"] == "running" and report["phases"]["train_d"]["status"] == "running"
    else:
        assert proc.returncode == 143
        assert report["status"] == "interrupted"
        assert report["phases"]["train_d"]["status"] == "interrupted"


# ------------------------------------------------------------------------------- fits the GPU machine it is for
def test_phase_modules_import_without_the_packages_the_gpu_image_lacks():
    """Every phase's modules import with deepspeed, mlflow, zstandard, tiktoken, PyYAML, pytest, ... looking
    uninstalled, and numpy too except for train_fsdp (the trainer's data loader): a module-level import of one of
    them on a phase's import path (e.g. `import mlflow` at the top of pipeline/train/trainer.py) fails here."""
    r = subprocess.run([sys.executable, "bench/gpu_check.py", "--check-imports"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert {"mlflow", "deepspeed", "zstandard", "tiktoken", "yaml", "pytest", "numpy"} <= set(res["blocked"])
    assert res["numpy_allowed_for"] == ["train_fsdp"]
    assert set(res["modules"]) >= {"tests/test_gpu.py", "bench/gate_op.py", "bench/train.py", "bench/decode.py",
                                   "bench/document_attention.py",
                                   "pipeline.train.trainer"}
    assert set(res["modules"].values()) == {"ok"}, res["modules"]


def test_cuda_plan_fits_the_device_session():
    """The lent machine gives a session 15 minutes, its start included, one command at most 10: the default phases'
    caps fit 8.5 minutes with the parent's overhead and leave room for the compiled decode phases (or a rerun of a
    part) in what is left; the eager decode rows come before anything compiles a decoder; the three profiles name the
    same phases in the same order."""
    cuda = gpu_check.CUDA_PHASES
    default = [p for p in cuda if p.default]
    assert sum(p.cap_s for p in default) <= 510
    assert sum(p.cap_s for p in cuda if not p.default) <= 900 - 120 - 510 - 30  # start ~2 min, overheads
    names = [p.name for p in cuda]
    assert names == [p.name for p in gpu_check.CPU_PHASES] == [p.name for p in gpu_check.TINY_PHASES]
    assert names[:2] == ["tests", "train_fsdp"]  # the correctness gates first
    decode = [n for n in names if n.startswith("decode_")]
    assert decode[0] == "decode_eager" and all(not p.default for p in cuda if p.name.endswith("_compiled"))
    assert [p.default for p in cuda] == [p.default for p in gpu_check.TINY_PHASES]


@pytest.mark.slow
def test_train_fsdp_dry_run_resumes_where_it_stopped(tmp_path):
    """The train_fsdp phase on a CPU (gloo, tiny GRT, bf16, compiled with aot_eager): the trainer with FSDP2 saves a
    sharded checkpoint at step 4, a new process resumes from it and its steps 5-8 repeat the uninterrupted run's
    losses exactly (one thread: deterministic); the figures reach the JSON."""
    proc = check("--only", "train_fsdp", out=tmp_path)
    stdout, stderr = proc.communicate(timeout=600)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    phase = report["phases"]["train_fsdp"]
    assert proc.returncode == 0 and phase["status"] == "ok", (stderr[-3000:], phase.get("error"))
    r = phase["result"]
    assert r["recipe"]["train"]["backend"] == "fsdp" and r["recipe"]["train"]["compile"] is True
    assert r["recipe"]["train"]["dtype"] == "bfloat16" and r["recipe"]["tracking"]["enabled"] is False
    assert r["checkpoint"]["format"] == "sharded" and r["checkpoint"]["step"] == 4 and not r["checkpoint"]["damage"]
    assert any(f.endswith(".distcp") for f in r["checkpoint"]["shard_files"])
    first, resumed = r["uninterrupted"], r["resumed"]
    assert first["start_step"] == 0 and first["steps"] == list(range(1, 9)) and first["finite"]
    assert resumed["start_step"] == 4 and resumed["steps"] == [5, 6, 7, 8] and resumed["finite"]
    assert resumed["compile_backend"] == "aot_eager"
    c = r["comparison"]
    assert c["bitwise_equal"] is True and set(c["rel_diff"].values()) == {0.0} and c["max_rel_diff"] == 0.0
    assert report["summary"] == {"train_fsdp/comparison/bitwise_equal": True,
                                 "train_fsdp/comparison/max_rel_diff": 0.0}
    assert c["loss_resumed"] == {s: first["losses"][s] for s in ("5", "6", "7", "8")}
    assert r["ok"] is True and r["problems"] == []
