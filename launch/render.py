"""A :class:`~launch.plan.Plan` -> the exact commands and files of each launcher (pure: no I/O, no environment).

- torchrun: static rendezvous, one command per node (``--node_rank K``; the c10d rendezvous would ignore it); with
  ``--max-restarts N`` the c10d rendezvous, which can restart the group (:func:`torchrun_command`);
- deepspeed: one command on node 0 that starts every node over ssh (pdsh) from a hostfile, with the variables the
  remote ranks need in a ``.deepspeed_env`` file; or, without ssh, one ``--no_ssh --node_rank K`` command per node;
- slurm: an sbatch script from ``launch/templates/sbatch.sh``: one task per node, each running one torchrun.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

from launch.plan import PORT_BASE
from launch.plan import PORT_SPAN
from launch.plan import Plan

TEMPLATES = Path(__file__).parent / "templates"
PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
# Variables a remote rank started by DeepSpeed's pdsh runner must get from node 0: the remote shell starts with none
# of node 0's environment. DeepSpeed 0.19.8 passes by itself only those starting with MLFLOW, PYTHON, MV2, UCX (and
# NCCL on CUDA); everything else, e.g. the libfabric settings of an AWS EFA cluster (FI_PROVIDER=efa), would be lost
# and NCCL would fall back to TCP sockets. The ones DeepSpeed passes are listed too, so that the file alone carries
# them whatever DeepSpeed's own list becomes.
DEEPSPEED_ENV_PREFIXES = (
    # the collectives and their transports: NCCL and its libfabric plugin (EFA: FI_*, OFI_NCCL_*, RDMAV_FORK_SAFE),
    # UCX, gloo
    "NCCL_", "FI_", "OFI_NCCL_", "RDMAV_", "UCX_", "GLOO_",
    # torch, its compiler, CUDA and the libraries they load
    "TORCH_", "TORCHINDUCTOR_", "PYTORCH_", "TRITON_", "CUDA_", "LD_LIBRARY_PATH", "DS_ACCELERATOR",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS",
    # data, tracking, this pipeline, Python itself
    "HF_", "MLFLOW_", "GRT_", "PYTHON")
# Set on every node by the launcher itself: node 0's value would be wrong there (DeepSpeed gives each rank its
# CUDA_VISIBLE_DEVICES from the hostfile's slots)
DEEPSPEED_ENV_NODE_OWN = {"CUDA_VISIBLE_DEVICES", "DS_ENV_FILE"}
# DeepSpeed 0.19.8's EXCLUDE_ENVS: on a cluster that sets the key it drops these itself (per-node network cards); the
# file would otherwise put node 0's cards back on every node
DEEPSPEED_ENV_EXCLUDE = {"AISC_JOB_NAME": ("NCCL_IB_HCA", "UCX_NET_DEVICES")}


@dataclass
class Command:
    """One command line: ``env`` is set for it alone (written as ``KEY=VALUE`` before the program)."""

    argv: list[str]
    node: int | None = None  # the node it runs on (None: node 0 starts every node)
    env: dict[str, str] = field(default_factory=dict)

    def text(self) -> str:
        # an assignment word stays one: quote the value, never the whole KEY=VALUE (bash would run that as a command)
        return " ".join([f"{k}={shlex.quote(v)}" for k, v in self.env.items()] + [shlex.join(self.argv)])


def train_args(plan: Plan) -> list[str]:
    """What every rank runs after ``python -m``: the training command with the user's recipe and overrides."""
    data = ["--data", plan.data] if plan.data else []  # after the overrides: argparse ends `overrides` at an option
    return ["pipeline.cli", "train", plan.recipe, *plan.overrides, *data]


def torchrun_command(plan: Plan, node_rank: int) -> Command:
    """Static rendezvous (``--node_rank K``); with ``--max-restarts N`` the c10d rendezvous instead, the same command
    on every node but for ``is_host``: a static rendezvous never tells a node whose workers are healthy that another
    node's group restarts (its ``num_nodes_waiting`` is always 0), so only the failed node would restart and the
    group would hang; c10d's store (hosted by node 0's agent) does, and ranks are handed out anew each round.

    ``--rdzv_conf is_host=1`` on node 0, ``is_host=0`` elsewhere: node 0 alone hosts the agents' store. Left out,
    each agent guesses by matching the endpoint against its own hostname and addresses (torch 2.13's
    ``c10d_rendezvous_backend._create_tcp_store``): an endpoint given as the address of another NIC (InfiniBand) or
    a CNAME makes node 0 guess no, and every agent fails as a client after 60 s; and a store node 0 cannot open
    (port taken) falls back silently to a client, where ``is_host=1`` fails at once.

    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: the workers of each round meet in a new store that their rank 0 hosts
    (on a free port of its node), not in the agents' store. torch 2.13's shared store keeps every round's keys
    unprefixed, so a restarted round's gloo/NCCL setup would read the dead round's addresses and fail."""
    env = {}
    if plan.max_restarts:
        rdzv = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{plan.master_addr}:{plan.master_port}",
                "--rdzv_id", plan.name, "--max_restarts", str(plan.max_restarts),
                "--rdzv_conf", f"is_host={int(node_rank == 0)}"]
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    else:
        rdzv = ["--node_rank", str(node_rank), "--master_addr", plan.master_addr, "--master_port",
                str(plan.master_port)]
    return Command(["torchrun", "--nnodes", str(plan.nodes), "--nproc_per_node", str(plan.gpus_per_node), *rdzv,
                    "-m", *train_args(plan)], node=node_rank, env=env)


def hostfile_path(plan: Plan) -> str:
    return plan.hostfile or f"{plan.launch_dir}/hostfile"


def deepspeed_env_path(plan: Plan) -> str:
    return f"{plan.launch_dir}/.deepspeed_env"


def deepspeed_commands(plan: Plan, ranks: list[int] | None = None) -> list[Command]:
    """The deepspeed command(s): one node's (or ``ranks``') without ssh, else the one that starts every node."""
    module = ["--module", *train_args(plan)]
    if plan.nodes == 1:
        return [Command(["deepspeed", "--num_gpus", str(plan.gpus_per_node), "--master_port", str(plan.master_port),
                         *module], node=0)]
    # DeepSpeed needs the hostfile even without ssh: it gives the world (node count, slots) and the node ranks'
    # order; with --no_ssh the names are only labels.
    common = ["--num_nodes", str(plan.nodes), "--num_gpus", str(plan.gpus_per_node)]
    if plan.per_node or ranks is not None:
        ranks = ranks if ranks is not None else [plan.node_rank]
        return [Command(["deepspeed", "--hostfile", hostfile_path(plan), "--no_ssh", "--node_rank", str(k),
                         "--master_addr", plan.master_addr, "--master_port", str(plan.master_port), *common, *module],
                        node=k) for k in ranks]
    addr = ["--master_addr", plan.master_addr] if plan.master_addr else []  # else DeepSpeed asks host 0 over ssh
    return [Command(["deepspeed", "--hostfile", hostfile_path(plan), *common, *addr, "--master_port",
                     str(plan.master_port), *module], env={"DS_ENV_FILE": deepspeed_env_path(plan)})]


def per_node_commands(plan: Plan) -> list[Command]:
    """Every node's command (torchrun, deepspeed --no_ssh), whatever ``--node-rank`` says."""
    if plan.launcher == "torchrun":
        return [torchrun_command(plan, k) for k in range(plan.nodes)]
    return deepspeed_commands(plan, list(range(plan.nodes)))


def commands(plan: Plan) -> list[Command]:
    """The commands this invocation runs: the given node's, or the one that starts everything."""
    if plan.launcher == "torchrun":
        ranks = [plan.node_rank] if plan.node_rank is not None else range(plan.nodes)
        return [torchrun_command(plan, k) for k in ranks]
    if plan.launcher == "deepspeed":
        return deepspeed_commands(plan)
    return [Command(["sbatch", sbatch_path(plan)])]


def hostfile_text(plan: Plan) -> str:
    """``host slots=G`` per node: the given ``--hosts``, else labels (only valid with --no_ssh, where names are not
    contacted)."""
    hosts = plan.hosts or [f"node-{k}" for k in range(plan.nodes)]
    return "".join(f"{h} slots={plan.gpus_per_node}\n" for h in hosts)


def deepspeed_env_text(plan: Plan, environ: dict) -> str:
    """``KEY=VALUE`` lines for DeepSpeed's pdsh runner, which exports them on every node before starting the ranks.

    DeepSpeed 0.19.8 (launcher/runner.py) reads the file ``$DS_ENV_FILE`` (default ``.deepspeed_env``) from ``~`` and
    from the working directory, only when it starts nodes over ssh, and splits every line at the first ``=``: no
    comments or blank lines are allowed. Its own entries are added after the variables it exports by itself, so
    PYTHONPATH is written as DeepSpeed would set it (the working directory first)."""
    dropped = DEEPSPEED_ENV_NODE_OWN.union(*(names for key, names in DEEPSPEED_ENV_EXCLUDE.items() if key in environ))
    env = {k: v for k, v in sorted(environ.items())
           if k.startswith(DEEPSPEED_ENV_PREFIXES) and "\n" not in v and k not in dropped}
    env["PYTHONPATH"] = ":".join(x for x in (plan.workdir, environ.get("PYTHONPATH", "")) if x)
    return "".join(f"{k}={v}\n" for k, v in env.items())


def sbatch_path(plan: Plan) -> str:
    return f"{plan.launch_dir}/{plan.name}.sbatch"


def fill(template: str, values: dict) -> str:
    """Replace ``{{name}}`` placeholders (``$`` and single braces stay bash's); an unknown name is an error."""
    def sub(m: re.Match) -> str:
        if m.group(1) not in values:
            raise KeyError(f"sbatch template: unknown placeholder {{{{{m.group(1)}}}}}; known: {', '.join(values)}")
        return str(values[m.group(1)])
    return PLACEHOLDER.sub(sub, template)


def sbatch_script(plan: Plan, template: str | None = None) -> str:
    """The sbatch script of the plan, from ``launch/templates/sbatch.sh`` (or ``template``'s text)."""
    # One task per node runs all of the node's ranks, but a job that asks for no CPUs gets one per task (or the
    # cluster's DefCpuPerGPU): every rank, its compile workers and its collectives' threads would share one core.
    # Given a count, the task gets it (srun is passed it below: SRUN_CPUS_PER_TASK); otherwise the whole node.
    cpus = "--exclusive" if plan.cpus_per_node is None else f"--cpus-per-task={plan.cpus_per_node}"
    options = [f"#SBATCH {cpus}"] + [f"#SBATCH --{k}={v}" for k, v in (
        ("time", plan.time), ("partition", plan.partition), ("account", plan.account)) if v]
    # An explicit --master-port is used as is; otherwise bash computes job_port()'s formula from the job id.
    port = (str(plan.master_port) if plan.port_source == "--master-port"
            else f"$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))")
    values = {
        "name": plan.name, "nodes": plan.nodes, "gpus_per_node": plan.gpus_per_node, "world_size": plan.world_size,
        "backend": plan.backend, "grace_s": plan.grace_s, "launch_dir": plan.launch_dir, "workdir": plan.workdir,
        "sbatch_options": "\n".join(options), "setup": plan.setup, "master_port": port,
        # torchrun SIGKILLs its ranks this long after passing them the TERM; keep a minute for the requeue
        "shutdown_timeout_s": plan.grace_s - 60,
        "train_command": shlex.join(["-m", *train_args(plan)]),
    }
    text = template if template is not None else (TEMPLATES / "sbatch.sh").read_text()
    return fill(text, values)


def files(plan: Plan, environ: dict, template: str | None = None) -> dict[str, str]:
    """The files the launch needs, path -> text (written before any command runs)."""
    if plan.launcher == "slurm":
        return {sbatch_path(plan): sbatch_script(plan, template)}
    out = {}
    if plan.launcher == "deepspeed" and plan.nodes > 1:
        if not plan.hostfile:
            out[hostfile_path(plan)] = hostfile_text(plan)
        if not plan.per_node:
            out[deepspeed_env_path(plan)] = deepspeed_env_text(plan, environ)
    return out


def describe(plan: Plan, environ: dict, template: str | None = None) -> str:
    """What ``grt launch --dry-run`` prints: the plan, every file's text, every node's command."""
    static = (f"c10d rendezvous, at most {plan.max_restarts} restart(s) of the group" if plan.max_restarts
              else "static rendezvous")
    how = {"torchrun": f"torchrun, {static}", "slurm": "sbatch, one torchrun per node",
           "deepspeed": ("deepspeed, one command per node (--no_ssh)" if plan.per_node or plan.nodes == 1
                         else "deepspeed, node 0 starts every node over ssh (pdsh)")}[plan.launcher]
    if plan.launcher == "slurm":
        addr = "the job's first node (scontrol show hostnames)"
        port = (f"{plan.master_port}, from --master-port" if plan.port_source == "--master-port" else
                f"$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} )), computed in the job")
    else:
        addr = plan.master_addr or "DeepSpeed asks the hostfile's first host (ssh hostname -I)"
        port = f"{plan.master_port}, from {plan.port_source}"
    lines = [f"# run {plan.name}: train.backend={plan.backend} (recipe + overrides), {plan.nodes} node(s) x "
             f"{plan.gpus_per_node} rank(s) = world size {plan.world_size}; launcher {how}",
             f"# rendezvous: {addr}, port {port}",
             f"# every node starts in {plan.workdir} (the recipe path and run folder are relative to it)"]
    for path, text in files(plan, environ, template).items():
        lines += [f"# file {path}:", text.rstrip("\n")]
    if plan.launcher == "slurm":
        lines.append("# submit:")
        lines += [c.text() for c in commands(plan)]
    elif plan.per_node:
        for c in per_node_commands(plan):
            lines += [f"# on node {c.node}:", c.text()]
    else:
        lines.append("# on node 0 (starts every node):" if plan.nodes > 1 else "# on this node:")
        lines += [c.text() for c in commands(plan)]
    return "\n".join(lines) + "\n"
