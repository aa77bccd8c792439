"""The nodes of a per-node launch meet before the launcher starts: torchrun's static rendezvous waits in silence (600 s,
then a traceback) for a node that went to another port, and the port is derived from the run name, so two nodes
given different ``name=`` never meet. Here node 0 hosts a store at the rendezvous address and port, every node says
its run name, and a node missing after ``--rendezvous-timeout`` seconds is named in one line."""
from __future__ import annotations

import datetime
import socket
import time

from launch.plan import Plan

DEFAULT_TIMEOUT_S = 300


class RendezvousError(ConnectionError):
    """The nodes of a launch did not all meet: which, where, and the likely cause."""


def needs_meeting(plan: Plan) -> bool:
    """Per-node launches of several nodes (torchrun, deepspeed --no_ssh): each node is started by hand or by a
    script, with its own name= and port. SLURM derives the port from the job id, pdsh starts all nodes at once."""
    return plan.launcher != "slurm" and plan.nodes > 1 and plan.node_rank is not None


def meet(plan: Plan, timeout_s: float) -> None:
    """Every node of the plan: meet at the rendezvous, compare run names, leave (node 0 last, then the launcher binds
    the same port). Raises :class:`RendezvousError` naming the node, the address, the port and the run name."""
    import torch.distributed as dist

    k, n = plan.node_rank, plan.nodes
    timeout = datetime.timedelta(seconds=timeout_s)
    at = f"{plan.master_addr}:{plan.master_port}"
    cause = (f"the port comes from {plan.port_source}: all nodes must use the same name= (the port is derived from "
             f"it) and the same --master-addr/--master-port")
    fix = (f"start every node with the same recipe and overrides (if a node is only slow to start, raise "
           f"--rendezvous-timeout, now {timeout_s:g} s)")
    deadline = time.monotonic() + timeout_s
    try:
        if k > 0:
            _reachable(plan.master_addr, plan.master_port, deadline)
        store = dist.TCPStore(plan.master_addr, plan.master_port, is_master=k == 0, timeout=timeout,
                              wait_for_workers=False)
    except (RuntimeError, OSError, TimeoutError) as e:
        if k == 0:
            raise RendezvousError(f"node 0 cannot listen at {at} for run {plan.name!r} ({e}): the port is taken "
                                  f"(another job?); give every node the same free --master-port") from None
        raise RendezvousError(f"node {k} of {n} found no node 0 at {at} within {timeout_s:g} s (run name "
                              f"{plan.name!r}): {cause}; check that node 0 was started with --node-rank 0 and that "
                              f"{at} is reachable from here; {fix}") from None
    try:
        store.set(f"name/{k}", plan.name)
        _wait(store, [f"name/{j}" for j in range(n)], deadline)
        names = {j: store.get(f"name/{j}").decode() for j in range(n)}
        store.set(f"left/{k}", "1")
        if k == 0:  # the others read every name before node 0's store goes
            _wait(store, [f"left/{j}" for j in range(n)], deadline)
    except (RuntimeError, OSError, TimeoutError):
        missing = [j for j in range(n) if not _has(store, f"name/{j}")]
        raise RendezvousError(f"node {k} of {n}: node(s) {', '.join(map(str, missing)) or '?'} did not join at {at} "
                              f"within {timeout_s:g} s (run name {plan.name!r}): {cause}; check that every node was "
                              f"started with its --node-rank; {fix}") from None
    finally:
        del store  # node 0's listening socket closes: the launcher binds the port next
    if len(set(names.values())) > 1:
        held = ", ".join(f"node {j} name={v!r}" for j, v in names.items())
        raise RendezvousError(f"the nodes met at {at} with different run names ({held}): all nodes must use the same "
                              f"name=; {fix}")


def _reachable(addr: str, port: int, deadline: float) -> None:
    """Wait for node 0's store to listen, with plain connects: TCPStore's own retries log C++ warnings."""
    while True:
        try:
            socket.create_connection((addr, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{addr}:{port}") from None
            time.sleep(0.1)


def _wait(store, keys: list[str], deadline: float) -> None:
    """Poll rather than ``store.wait``: its timeout logs C++ socket warnings around the one line."""
    while not store.check(keys):
        if time.monotonic() > deadline:
            raise TimeoutError(keys)
        time.sleep(0.05)


def _has(store, key: str) -> bool:
    try:
        return store.check([key])
    except (RuntimeError, OSError):
        return False
