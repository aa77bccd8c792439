"""What `grt launch` is asked to start: launcher, nodes, ranks per node, rendezvous; checked once, rendered elsewhere.

The rendezvous port is derived from the job, so that two jobs sharing a host never pick the same one: from
``SLURM_JOB_ID`` when the launch happens inside a SLURM job (every node of the job sees the same id, and a requeued
job keeps it), else from the run name (every node of a run computes the same value).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from dataclasses import field

LAUNCHERS = ("torchrun", "deepspeed", "slurm")
# Ports [20000, 32767]: above the well-known/registered ports most services bind, below Linux's default ephemeral
# range (32768-60999, /proc/sys/net/ipv4/ip_local_port_range), so an outgoing connection never holds our port.
PORT_BASE, PORT_SPAN = 20000, 12768


class PlanError(ValueError):
    """Every problem of a launch plan at once, each naming its fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        listed = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"launch plan: {problems[0]}" if len(problems) == 1 else
                         f"{len(problems)} problem(s) with the launch plan:\n{listed}")


def job_port(environ: dict, name: str) -> tuple[int, str]:
    """(port, where it came from): ``PORT_BASE + SLURM_JOB_ID % PORT_SPAN``, else the same from a hash of the name.

    The SLURM formula is the one the sbatch script evaluates in bash (``$(( BASE + SLURM_JOB_ID % SPAN ))``)."""
    job = environ.get("SLURM_JOB_ID", "")
    if job.isdigit():
        return PORT_BASE + int(job) % PORT_SPAN, f"SLURM_JOB_ID={job}"
    digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")
    return PORT_BASE + digest % PORT_SPAN, f"sha256 of the run name {name!r}"


HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")  # DeepSpeed 0.19.8 launcher/runner.py:_parse_hostfile


def read_hostfile(path: str, problems: list[str]) -> list[tuple[str, int]] | None:
    """``[(host, slots)]`` of a DeepSpeed hostfile (``host slots=N`` lines, ``#`` comments); problems appended."""
    try:
        lines = open(path).read().splitlines()
    except OSError as e:
        problems.append(f"--hostfile {path}: cannot read it ({e.strerror}); give an existing file")
        return None
    out = []
    for i, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = HOSTFILE_LINE.match(line)
        if not m:
            problems.append(f"--hostfile {path}:{i}: {line!r} is not `host slots=N`")
            continue
        out.append((m.group(1), int(m.group(2))))
    return out


def duplicate_hosts(source: str, hosts: list[str], problems: list[str]) -> None:
    """One problem if a host is named twice in ``hosts`` (from ``source``: --hosts or --hostfile F): DeepSpeed's
    hostfile parser refuses a repeated host, and two nodes of one host would double its ranks."""
    twice = sorted({h for h in hosts if hosts.count(h) > 1})
    if twice:
        problems.append(f"{source}: {', '.join(twice)} named twice (DeepSpeed refuses duplicate hostfile entries); "
                        f"name each node once")


# sbatch(1) --time: "minutes", "minutes:seconds", "hours:minutes:seconds", "days-hours", "days-hours:minutes",
# "days-hours:minutes:seconds"; 0, -1, INFINITE and UNLIMITED mean no limit (Slurm's parse_time.c, time_str2secs)
SLURM_DAYS = re.compile(r"(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?")
SLURM_CLOCK = re.compile(r"\d+(?::\d+){0,2}")


def slurm_time_s(text: str) -> int | None:
    """The time limit of a SLURM ``--time`` in seconds, rounded up to the minute as SLURM does ("time resolution is
    one minute and second values are rounded up"); None for no limit. Raises ValueError on any other text."""
    if text.upper() in ("-1", "INFINITE", "UNLIMITED"):
        return None
    if m := SLURM_DAYS.fullmatch(text):
        d, h, mi, sec = (int(x or 0) for x in m.groups())
        secs = ((d * 24 + h) * 60 + mi) * 60 + sec
    elif SLURM_CLOCK.fullmatch(text):
        parts = [int(x) for x in text.split(":")]
        h, mi, sec = {1: [0, parts[0], 0], 2: [0, *parts], 3: parts}[len(parts)]  # one number: minutes
        secs = (h * 60 + mi) * 60 + sec
    else:
        raise ValueError(f"not a SLURM time: {text!r}")
    return None if secs == 0 else -(-secs // 60) * 60


@dataclass
class Plan:
    """One launch, fully decided: every field is what ends up in a command or a file."""

    launcher: str
    nodes: int
    gpus_per_node: int
    recipe: str  # as the user wrote it: the nodes resolve it from `workdir`
    overrides: list[str]
    name: str  # the run name (recipe + overrides)
    backend: str  # train.backend
    run_dir: str  # out_dir/name, where the launch files go (launch/)
    workdir: str  # where every node starts (the folder grt launch ran in)
    master_port: int
    port_source: str
    master_addr: str | None = None
    node_rank: int | None = None
    data: str | None = None  # --data DATA_RECIPE, forwarded to `grt train`
    hostfile: str | None = None  # deepspeed: given by the user, or written from `hosts`
    hosts: list[str] = field(default_factory=list)
    setup: str = ""  # shell lines each SLURM node runs first (environment activation)
    grace_s: int = 300  # slurm: TERM this long before the time limit
    cpus_per_node: int | None = None  # slurm: CPUs of each node's task (its ranks share them); None: the whole node
    time: str | None = None  # slurm --time
    partition: str | None = None
    account: str | None = None
    max_restarts: int = 0  # torchrun --max-restarts (c10d rendezvous when > 0): restarts of the worker group

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def launch_dir(self) -> str:
        return f"{self.run_dir}/launch"

    @property
    def per_node(self) -> bool:
        """One command per node, run by the user on that node (torchrun, deepspeed --no_ssh)."""
        return self.launcher == "torchrun" or (self.launcher == "deepspeed" and self.nodes > 1 and
                                               self.node_rank is not None)


def make_plan(*, launcher: str, nodes: int, gpus_per_node: int, recipe: str, overrides: list[str], name: str,
              backend: str, run_dir: str, workdir: str, environ: dict, master_addr: str | None = None,
              master_port: int | None = None, node_rank: int | None = None, data: str | None = None,
              hostfile: str | None = None, hosts: list[str] | None = None, setup: str = "", grace_s: int = 300,
              time: str | None = None, partition: str | None = None, account: str | None = None,
              cpus_per_node: int | None = None, max_restarts: int = 0) -> Plan:
    """Check the launch options against each other and the recipe; raise :class:`PlanError` listing every problem."""
    p = []
    if launcher not in LAUNCHERS:
        p.append(f"--launcher {launcher}: choose one of {', '.join(LAUNCHERS)}")
    if nodes < 1 or gpus_per_node < 1:
        p.append(f"--nodes {nodes} --gpus-per-node {gpus_per_node}: both must be >= 1")
    world = nodes * gpus_per_node
    if backend == "single" and world > 1:
        p.append(f"train.backend=single with {nodes} node(s) x {gpus_per_node} = {world} ranks would train {world} "
                 f"independent copies of the model: set train.backend=fsdp, ddp or deepspeed (or --nodes 1 "
                 f"--gpus-per-node 1)")
    if node_rank is not None:
        if not 0 <= node_rank < max(nodes, 1):
            p.append(f"--node-rank {node_rank}: must be in 0..{nodes - 1} for --nodes {nodes}")
        if launcher == "slurm":
            p.append("--node-rank does not apply to --launcher slurm: SLURM gives every node its rank "
                     "($SLURM_NODEID); drop --node-rank")
    per_node = launcher == "torchrun" or (launcher == "deepspeed" and node_rank is not None)
    if nodes > 1 and not master_addr and per_node:
        p.append(f"--master-addr is needed with --nodes {nodes}: node 0's address, the same on every node and "
                 f"reachable from all of them (on node 0: `hostname -I`)")
    hosts = list(hosts or [])
    if hostfile and hosts:
        p.append("--hostfile and --hosts both given: keep one (--hosts writes a hostfile)")
    if launcher == "deepspeed" and nodes > 1 and node_rank is None and not (hostfile or hosts):
        p.append(f"--launcher deepspeed --nodes {nodes} starts the other nodes over ssh (pdsh) and needs their names: "
                 f"--hostfile FILE (lines `host slots={gpus_per_node}`) or --hosts h1,h2,...; without ssh, run "
                 f"`grt launch ... --node-rank K --master-addr NODE0` on every node instead")
    if hosts and len(hosts) < nodes:
        p.append(f"--hosts names {len(hosts)} host(s) for --nodes {nodes}: name at least {nodes}")
    duplicate_hosts(f"--hosts {','.join(hosts)}", hosts, p)
    if hostfile:
        listed = read_hostfile(hostfile, p)
        duplicate_hosts(f"--hostfile {hostfile}", [h for h, _ in listed or []], p)
        if listed is not None and len(listed) < nodes:
            p.append(f"--hostfile {hostfile} lists {len(listed)} host(s) for --nodes {nodes}: add a line "
                     f"`host slots={gpus_per_node}` per node")
        short = [h for h, slots in (listed or []) if slots < gpus_per_node]
        if short:
            p.append(f"--hostfile {hostfile}: {', '.join(short)} offer(s) fewer than --gpus-per-node "
                     f"{gpus_per_node} slots; fix their `slots=`")
    if (hostfile or hosts) and launcher != "deepspeed":
        p.append(f"--hostfile/--hosts are for --launcher deepspeed; {launcher} does not read them")
    if cpus_per_node is not None:
        if launcher != "slurm":
            p.append(f"--cpus-per-node is for --launcher slurm (it sets the job's --cpus-per-task); {launcher} runs on "
                     f"the CPUs the node gives it: drop --cpus-per-node")
        elif cpus_per_node < gpus_per_node:
            p.append(f"--cpus-per-node {cpus_per_node} is fewer than --gpus-per-node {gpus_per_node}: every rank needs "
                     f"a CPU of its own; give at least {gpus_per_node}, or leave it out to take whole nodes "
                     f"(--exclusive)")
    if max_restarts < 0:
        p.append(f"--max-restarts {max_restarts}: give 0 (no restart) or more")
    elif max_restarts and launcher != "torchrun":
        p.append(f"--max-restarts is for --launcher torchrun (its elastic agent restarts the group); {launcher} "
                 + ("cannot restart a failed group: use --launcher torchrun (train.backend=deepspeed runs under it "
                    "too)" if launcher == "deepspeed" else "requeues the job instead (--grace): drop --max-restarts"))
    if master_port is not None and not 1024 <= master_port <= 65535:
        p.append(f"--master-port {master_port}: choose a free port in 1024..65535")
    if launcher == "slurm" and any(c.isspace() for c in workdir + run_dir):
        p.append(f"--launcher slurm: the working folder {workdir!r} or run folder {run_dir!r} contains white space, "
                 f"which #SBATCH lines cannot hold; run grt launch from a folder without spaces (or set out_dir=)")
    if grace_s < 90:
        p.append(f"--grace {grace_s}: give at least 90 s between SIGTERM and the time limit (torchrun gives the ranks "
                 f"GRACE - 60 s to save a checkpoint, the last minute is for the requeue)")
    if launcher == "slurm" and time is not None:
        try:
            limit_s = slurm_time_s(time)
        except ValueError:
            p.append(f"--time {time}: not a SLURM time limit; give minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
                     f"D-HH:MM:SS (e.g. 24:00:00)")
        else:
            # equal is refused too: TERM would come as the job starts, and it would save and stop having trained nothing
            if limit_s is not None and grace_s >= limit_s:
                p.append(f"--grace {grace_s} s is not shorter than --time {time} ({limit_s} s): SLURM sends TERM "
                         f"GRACE seconds before the limit, so the job would stop as it starts; give a longer --time "
                         f"or a shorter --grace (at least 90)")
    if p:
        raise PlanError(p)
    if master_port is not None:
        port, source = master_port, "--master-port"
    else:
        port, source = job_port(environ, name)
    return Plan(launcher=launcher, nodes=nodes, gpus_per_node=gpus_per_node, recipe=recipe, overrides=list(overrides),
                name=name, backend=backend, run_dir=run_dir, workdir=workdir, master_port=port, port_source=source,
                master_addr=master_addr or (None if nodes > 1 else "127.0.0.1"), node_rank=node_rank, data=data,
                hostfile=hostfile, hosts=hosts, setup=setup, grace_s=grace_s, time=time, partition=partition,
                account=account, cpus_per_node=cpus_per_node, max_restarts=max_restarts)
