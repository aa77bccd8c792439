"""The exit statuses of every `grt` command, so that scripts (a Slurm requeue, `grt train && grt eval`) can tell a
finished job from a stopped one. Documented in the README.

0    finished
1    failed: the one-line error names the cause and the fix (GRT_DEBUG=1 shows the traceback); also a checkpoint
     that did not fit on its disk (DiskFull: its unfinished folder removed, stopped.json written)
2    the recipe, its overrides or the command line are wrong (every problem listed)
130  stopped by Ctrl-C (SIGINT): the finished steps were saved; the same command resumes
143  stopped by SIGTERM (pre-emption, scancel, time limit): the finished steps were saved; the same command resumes
"""
from __future__ import annotations

import signal

OK, FAILED, USAGE = 0, 1, 2


def stopped_status(signum: int) -> int:
    """128 + the signal number, as a shell reports a process killed by that signal (130 SIGINT, 143 SIGTERM)."""
    return 128 + int(signum)


class TrainingStopped(Exception):
    """Training stopped on a signal after saving its finished steps: not a success, not a failure to debug."""

    def __init__(self, signum: int, step: int, checkpoint_dir, message: str, report: bool = True):
        super().__init__(message)
        self.report = report  # False on the ranks other than 0: one line per job, not per rank
        self.signum, self.step, self.checkpoint_dir = signum, step, checkpoint_dir
        self.exit_status = stopped_status(signum)
        self.signal_name = signal.Signals(signum).name


class DiskFull(TrainingStopped):
    """Training stopped because a checkpoint did not fit on its disk: the save's unfinished folder is removed and the
    newest intact checkpoint resumes the run once there is space. Exit 1 (failed: the fix is the user's); rank 0
    prints the one line as it stops (a launcher may SIGTERM it once the others exit) and writes stopped.json."""

    def __init__(self, step: int, checkpoint_dir, message: str, report: bool = True):
        Exception.__init__(self, message)
        self.report, self.step, self.checkpoint_dir = report, step, checkpoint_dir
        self.signum, self.signal_name, self.exit_status = None, None, FAILED
