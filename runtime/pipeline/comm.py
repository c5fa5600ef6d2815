"""torch.distributed for the interpreter: the process group, one group per replicated
stage, point-to-point messages and collectives, all with timeouts.

Why each choice:
- Sends are posted with `isend` and completed later (`Mailbox.drain`): a plan may send
  before it receives in both directions (Chimera), and a blocking send there deadlocks.
- Receives block (`irecv(...).wait(timeout)`): the op after a receive needs the data. On
  gloo the rank's next receives are posted ahead (`Mailbox.post`, the
  interpreter's `recv_ahead`, by default all of the step's, within the step before once its own
  receives are in): gloo pairs a send with its receive before moving the data,
  so a receive posted only when it is needed, after its send was posted, waits for the
  sender's gloo thread to answer while the sender computes (a delay on every message);
  posted ahead, and its notice read by the sender's gloo thread at one of the sender's waits,
  the data moves when the send is posted. Not on NCCL: its point-to-point ops run in issue order on one stream per
  peer, and a receive posted ahead of a send to the same peer can deadlock the pair.
- Tags are optional (`tags=False`, the default on NCCL). NCCL ignores point-to-point tags
  and matches the messages between a pair of ranks in issue order (pytorch/pytorch#94819);
  with tags off every message uses tag 0, so gloo matches the same way and the CPU tests
  exercise the NCCL rule. A plan that runs tag-free must keep, for every ordered pair of
  ranks, the sender's sends in the receiver's order of receives (the replay checks it).
  With tags on (gloo), each message's tag is derived from its key (kind, producing stage,
  micro-batch), so a receive matches exactly its send whatever order they are posted in.
- The backend follows the DEVICE the run asks for, not what the host has: gloo for CPU
  tensors even on a GPU host, NCCL with one GPU per local rank for CUDA.
- A collective's `wait` carries the same timeout as the group, so a lost peer ends the
  run with an error naming the op instead of hanging forever.
- Every call that talks to another rank (posting a send or a receive, waiting for one, a
  collective, a barrier) goes through `talking`: gloo reports a peer that died as a
  RuntimeError from whichever call notices first ("Connection reset by peer" from an
  isend, a timeout from a wait), and every one of them ends the rank with the same one
  line, CommTimeout (exit status 3), instead of a traceback on one side.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from pfcompile.formats.errors import InputError
from runtime.config.network_threads import idle_network_threads

DEFAULT_TIMEOUT_S = 60.0


class CommTimeout(RuntimeError):
    """A peer did not answer within the timeout (it died, or the plan is inconsistent)."""


@contextlib.contextmanager
def talking(what: str, timeout: timedelta):
    """A block of calls that talk to other ranks: what torch.distributed raises in it (a
    lost peer, a timeout) becomes one CommTimeout line naming `what`."""
    try:
        yield
    except CommTimeout:
        raise
    except RuntimeError as e:  # gloo/NCCL: DistBackendError, DistNetworkError, plain RuntimeError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CommTimeout(f"{what}: no answer within {timeout.total_seconds():g} s or peer lost "
                          f"({first[:300]})") from None


@dataclass
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    timeout: timedelta
    # stage -> process group of its replicas (only stages with more than one replica)
    stage_groups: dict[int, dist.ProcessGroup] = field(default_factory=dict)
    # the whole world again, for the collectives a rank posts and reads later (the
    # divergence check, the logged losses): None is the default group (control_group)
    control: dist.ProcessGroup | None = None
    # gloo's network threads under SCHED_IDLE, those of groups made later too
    # (runtime.config.network_threads)
    idle_network_threads: bool = True


def env_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) as torchrun sets them; a plain `python -m runtime` is rank 0 of 1."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


def backend_for(device_type: str) -> str:
    """The process-group backend for tensors on `device_type` ("cpu" or "cuda")."""
    if device_type == "cpu":
        return "gloo"
    if device_type == "cuda":
        return "nccl"
    raise InputError("--device", None, f"unsupported device {device_type!r} (use cpu or cuda)")


def rank_device(device_type: str, local_rank: int) -> torch.device:
    """cpu, or cuda:LOCAL_RANK (one GPU per local rank); a missing GPU is a one-line error."""
    if device_type == "cpu":
        return torch.device("cpu")
    backend_for(device_type)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_rank >= count:
        raise InputError("--device", None, f"cuda for local rank {local_rank}, but this host has {count} CUDA "
                                           f"device(s) (torch {torch.__version__}, CUDA {torch.version.cuda})")
    return torch.device("cuda", local_rank)


def init_world(timeout_s: float = DEFAULT_TIMEOUT_S, device_type: str = "cpu",
               idle_threads: bool = True) -> World:
    """Join the job: gloo for CPU tensors, NCCL with one device per local rank for CUDA.
    `idle_threads`: gloo's network threads under SCHED_IDLE (runtime.idle_network_threads)."""
    rank, world_size, local_rank = env_world()
    backend, device = backend_for(device_type), rank_device(device_type, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    if "MASTER_ADDR" not in os.environ:  # a single process without torchrun
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    with talking("joining the job (rendezvous)", timeout):
        dist.init_process_group(backend, timeout=timeout, rank=rank, world_size=world_size,
                                store=_attempt_store(rank, world_size, timeout))
    world = World(rank, world_size, local_rank, device, backend, timeout, idle_network_threads=idle_threads)
    world.control = control_group(world)
    idle_network_threads(backend, idle_threads)
    return world


def control_group(world: World) -> dist.ProcessGroup | None:
    """A second group of the whole world, on gloo, for the collectives posted and read later.

    Gloo runs a posted collective on its own worker thread, through the same pairs as the
    point-to-point messages; while one is in flight there (the last step's divergence
    check, waiting for the rank that ends its step last), posting a receive on that pair
    waits for it, and the next step's receives stall for milliseconds. On their own group
    they have their own pairs. NCCL keeps point-to-point and collectives on separate
    communicators already: None, the default group."""
    if world.backend != "gloo" or world.world_size == 1:
        return None
    with talking("making the control group", world.timeout):
        return dist.new_group(list(range(world.world_size)), timeout=world.timeout)


def _attempt_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The rendezvous store, with keys prefixed by torchrun's restart count. After a restart
    (--max-restarts) torchrun's agent store still holds the previous attempt's keys, and
    gloo would read a dead worker's address from them ("Connection refused")."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=(rank == 0 and not agent_store), timeout=timeout,
                          multi_tenant=not agent_store)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"pfcompile-runtime/attempt-{attempt}", store)


def free_port() -> int:
    """A TCP port free on this host now (for a rendezvous on 127.0.0.1)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_stage_groups(world: World, replica_ranks: list[list[int]]) -> None:
    """One group per stage with >1 replica. new_group is itself a collective over the whole
    world, so every rank creates every group, in stage order, even those it is not in."""
    for stage, ranks in enumerate(replica_ranks):
        if len(ranks) > 1:
            with talking(f"making the group of stage {stage}", world.timeout):
                group = dist.new_group(sorted(ranks), timeout=world.timeout)
            if world.rank in ranks:
                world.stage_groups[stage] = group
    if world.stage_groups:  # their network threads as init_world set the others'
        idle_network_threads(world.backend, world.idle_network_threads)


def shutdown(clean: bool = True, timeout: timedelta = timedelta(seconds=DEFAULT_TIMEOUT_S)) -> None:
    """Leave the job.

    After a clean run every rank meets at a barrier and then leaves WITHOUT tearing down
    gloo: a rank destroying its pairs while a peer still closes its own sometimes aborts
    the peer ("terminate called without an active exception"), so the caller ends the
    process with os._exit (see runtime.__main__). After an error, tear down normally."""
    if not dist.is_initialized():
        return
    if clean:
        barrier("the final barrier", timeout)
        return
    try:
        dist.destroy_process_group()
    except RuntimeError:  # a peer already gone: the error that ended the run is what is reported
        pass


def barrier(what: str, timeout: timedelta, group=None) -> None:
    with talking(what, timeout):
        dist.barrier(group=group)


MIN = dist.ReduceOp.MIN


def all_reduce(tensor: torch.Tensor, what: str, timeout: timedelta, op=None, group=None) -> None:
    """One tensor reduced in place over the group (default: the world; op default: sum)."""
    post_all_reduce(tensor, what, timeout, op, group).wait()


class InFlight:
    """A collective posted now and completed later (`wait`, with the group's timeout): a rank
    does not stop at the end of its step for the others, so the ranks run the plan as it is
    planned, where a rank's next step follows its own last op, not the last rank's."""

    def __init__(self, work, tensor: torch.Tensor, what: str, timeout: timedelta):
        self.work, self.tensor, self.what, self.timeout = work, tensor, what, timeout

    def wait(self) -> torch.Tensor:
        with talking(self.what, self.timeout):
            self.work.wait(self.timeout)
        return self.tensor


def post_all_reduce(tensor: torch.Tensor, what: str, timeout: timedelta, op=None, group=None) -> InFlight:
    """`all_reduce`, posted: the tensor holds the result once the returned InFlight's wait returns."""
    with talking(what, timeout):
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op, group=group, async_op=True)
    return InFlight(work, tensor, what, timeout)


# --- point-to-point --------------------------------------------------------------------
def message_tag(kind: str, stage: int, mb: int, micro_batches: int) -> int:
    """A distinct tag per (kind, producing stage, micro-batch) within one step."""
    return ((stage * micro_batches + mb) << 1) | (1 if kind == "grad" else 0)


def default_tags(backend: str) -> bool:
    """Tags on gloo (which honours them), off on NCCL (which ignores them)."""
    return backend != "nccl"


class Mailbox:
    """Posted sends of this rank, completed at the end of the step (or when many are in flight).

    With `tags` False every message goes with tag 0: matched per pair in issue order."""

    def __init__(self, world: World, tags: bool | None = None):
        self.world = world
        self.tags = default_tags(world.backend) if tags is None else tags
        self.in_flight: list[tuple[str, dist.Work, torch.Tensor]] = []
        self.posted: dict[tuple[int, int], tuple[dist.Work, torch.Tensor]] = {}  # (src, tag) -> receive

    def send(self, what: str, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()  # the buffer must live until the send completes
        with talking(what, self.world.timeout):
            work = dist.isend(tensor, dst=dst, tag=tag if self.tags else 0)
        self.in_flight.append((what, work, tensor))

    def post(self, shape, dtype, src: int, tag: int) -> None:
        """Post a receive now; `recv` with the same source and tag completes it."""
        if (src, tag) not in self.posted:
            buf = torch.empty(shape, dtype=dtype, device=self.world.device)
            with talking(f"posting a receive from rank {src}", self.world.timeout):
                self.posted[(src, tag)] = (dist.irecv(buf, src=src, tag=tag if self.tags else 0), buf)

    def recv(self, what: str, shape, dtype, src: int, tag: int) -> torch.Tensor:
        self.post(shape, dtype, src, tag)
        work, buf = self.posted.pop((src, tag))
        _wait(work, self.world.timeout, f"{what} from rank {src}")
        return buf

    def drain(self) -> None:
        for what, work, _ in self.in_flight:
            _wait(work, self.world.timeout, what)
        self.in_flight.clear()


# --- collectives -----------------------------------------------------------------------
def all_reduce_sum(tensors: list[torch.Tensor], group, timeout: timedelta, what: str) -> None:
    """Sum tensors in place over the group, as one flat message (one rendezvous, not one per tensor)."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    with talking(what, timeout):
        dist.all_reduce(flat, group=group, async_op=True).wait(timeout)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def broadcast(tensor: torch.Tensor, src: int, group, timeout: timedelta, what: str) -> None:
    with talking(what, timeout):
        dist.broadcast(tensor, src=src, group=group, async_op=True).wait(timeout)


def gather_json(world: World, obj) -> list | None:
    """Every rank's JSON-able `obj`, on rank 0 (None elsewhere). JSON bytes in a tensor
    rather than gather_object: nothing received from the network is unpickled."""
    import json
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=world.device)
    sizes = [torch.zeros_like(size) for _ in range(world.world_size)]
    with talking("gathering every rank's JSON", world.timeout):
        dist.all_gather(sizes, size)
    longest = int(max(int(s) for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=world.device)
    padded[: data.numel()] = data.to(world.device)
    bufs = [torch.zeros_like(padded) for _ in range(world.world_size)]
    with talking("gathering every rank's JSON", world.timeout):
        dist.all_gather(bufs, padded)
    if world.rank != 0:
        return None
    return [json.loads(bytes(b[: int(n)].cpu().tolist())) for b, n in zip(bufs, sizes)]


def _wait(work, timeout: timedelta, what: str) -> None:
    with talking(what, timeout):
        work.wait(timeout)
