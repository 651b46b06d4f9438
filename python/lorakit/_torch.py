"""torch.distributed under lorakit's `host` communicator backend.

_TorchHost is the object the C layer calls back (python/src/_lorakit.c,
lorakit/comm_host.h): each method is one torch.distributed collective over
the process group, on zero-copy windows on lorakit's own buffers (the
weights themselves for large keys, a staging round for small ones,
gradient buckets, agreement records): host memory comes as a memoryview
(torch.frombuffer), memory of the group's device (`device`: the current
CUDA device over NCCL) as a DLPack capsule (torch.from_dlpack), e.g.
sync_grads' buckets of CUDA gradients, reduced where they are. Roots are
group ranks, translated to the global ranks torch.distributed's src=
expects.

Over an NCCL process group (which moves device memory only) the host
buffers lorakit passes go through a tensor on the current CUDA device:
copied in, the NCCL collective (ProcessGroupNCCL orders it after the work
queued on torch's current stream, and that stream after it on wait()),
copied back (`_stage`); device buffers move in place. A gloo group moves
host memory in place.

Everything that makes lorakit safe over a group (agreement before any
collective whose size depends on a rank's data) happens in C above these
calls, so they are plain byte movers.
"""
import datetime
import time

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
_DT = {"f32": torch.float32, "i64": torch.int64}


def _stage_device(group):
    """Where a collective's bytes must be for this group's backend: a CUDA
    device for NCCL (torch's current one), None (in place) otherwise."""
    if _TorchHost.force_stage is not None:
        return _TorchHost.force_stage
    try:
        backend = str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError):
        return None
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None


def _tensor(buf, dtype):
    """A zero-copy tensor over what the C layer passed: a memoryview of host
    memory, or a DLPack capsule over device memory (lorakit's own: the
    capsule's deleter releases nothing)."""
    if isinstance(buf, memoryview):
        return torch.frombuffer(buf, dtype=dtype)
    t = torch.from_dlpack(buf)
    return t if dtype == torch.uint8 else t.view(dtype)


class _TorchHost:
    # tests: stage through this device whatever the backend (the NCCL path's
    # copies, checked over gloo with torch.device("cpu"))
    force_stage = None
    # TEST ONLY: the device whose memory the callbacks take ("emul": lorakit's
    # emulated device, whose buffers arrive as kDLCPU capsules over gloo;
    # python/tests/torch_dist_worker.py); None: the group's own (_device)
    force_device = None

    def __init__(self, group, timeout=None):
        self.group = group
        self.dev = _stage_device(group)
        # read by the C layer at creation: memory of this device reaches the
        # callbacks as DLPack capsules (NCCL: the current CUDA device)
        self.device = self.force_device or (f"cuda:{self.dev.index}" if self.dev is not None and
                                            self.dev.type == "cuda" else None)
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.globals = [dist.get_global_rank(group, r) for r in range(self.size)]
        self.timeout = datetime.timedelta(seconds=timeout) if timeout else None

    def set_timeout(self, seconds):
        """The lorakit communicator's collective timeout (lk_comm_set_timeout,
        0 = none), applied to every wait below."""
        self.timeout = datetime.timedelta(seconds=seconds) if seconds > 0 else None

    def _peers(self, root=None):
        """The group ranks a collective waits for on this rank: the root for
        a broadcast received, every other rank otherwise."""
        return [root] if root is not None and root != self.rank else [r for r in range(self.size) if r != self.rank]

    def _wait(self, work, what, peers):
        if self.timeout is None:
            work.wait()
            return
        t0 = time.monotonic()
        try:
            work.wait(self.timeout)
        except RuntimeError as e:  # gloo/NCCL report their timeout as a RuntimeError
            waited = time.monotonic() - t0
            if waited < 0.9 * self.timeout.total_seconds():
                raise
            glob = [self.globals[r] for r in peers]
            where = f" (global ranks {', '.join(map(str, glob))})" if glob != peers else ""
            raise TimeoutError(f"torch.distributed {what} not complete after {waited:.1f} s (timeout "
                               f"{self.timeout.total_seconds():g} s) on group rank {self.rank} of {self.size}, "
                               f"waiting for group ranks {', '.join(map(str, peers))}{where}: {e}") from e

    def _stage(self, t, buf):
        """t itself (no staging device; buf a capsule: device memory, moved
        in place), or its copy on the staging device (see the module doc)."""
        if self.dev is None or not isinstance(buf, memoryview):
            return t
        d = torch.empty(t.shape, dtype=t.dtype, device=self.dev)
        d.copy_(t)
        return d

    @staticmethod
    def _unstage(t, d):
        if d is not t:
            t.copy_(d)

    def barrier(self):
        self._wait(dist.barrier(group=self.group, async_op=True), "barrier", self._peers())

    def bcast(self, mv, root):
        t = _tensor(mv, torch.uint8)
        d = self._stage(t, mv)
        self._wait(dist.broadcast(d, src=self.globals[root], group=self.group, async_op=True), f"broadcast from rank {root}",
                   self._peers(root))
        self._unstage(t, d)

    def ibcast(self, mv, root):
        t = _tensor(mv, torch.uint8)
        d = self._stage(t, mv)
        return (dist.broadcast(d, src=self.globals[root], group=self.group, async_op=True), t, d, root)

    def test(self, handle):
        done = handle[0].is_completed()
        if done:  # tested until done exactly once (comm_host.h): the bytes back now
            handle[0].wait()
            self._unstage(handle[1], handle[2])
        return done

    def wait(self, handle):
        self._wait(handle[0], f"broadcast from rank {handle[3]}", self._peers(handle[3]))
        self._unstage(handle[1], handle[2])

    def allreduce(self, mv, kind, op):
        t = _tensor(mv, _DT[kind])
        d = self._stage(t, mv)
        self._wait(dist.all_reduce(d, op=_OPS[op], group=self.group, async_op=True), f"all_reduce ({op})", self._peers())
        self._unstage(t, d)

    def allgather(self, send, recv):
        out = _tensor(recv, torch.uint8)
        inp = _tensor(send, torch.uint8)
        od, idd = self._stage(out, recv), self._stage(inp, send)
        self._wait(dist.all_gather(list(od.chunk(self.size)), idd, group=self.group, async_op=True), "all_gather",
                   self._peers())
        self._unstage(out, od)
