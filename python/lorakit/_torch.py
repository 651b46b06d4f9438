"""torch.distributed under lorakit's `host` communicator backend.

_TorchHost is the object the C layer calls back (python/src/_lorakit.c,
lorakit/comm_host.h): each method is one torch.distributed collective over
the process group, on tensors made with torch.frombuffer from the
memoryview the C layer passes, so they are zero-copy windows on lorakit's
own buffers (the weights themselves for large keys, a staging round for
small ones, gradient buckets, agreement records). Roots are group ranks,
translated to the global ranks torch.distributed's src= expects.

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


class _TorchHost:
    def __init__(self, group, timeout=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.globals = [dist.get_global_rank(group, r) for r in range(self.size)]
        self.timeout = datetime.timedelta(seconds=timeout) if timeout else None

    def set_timeout(self, seconds):
        """The lorakit communicator's collective timeout (lk_comm_set_timeout,
        0 = none), applied to every wait below."""
        self.timeout = datetime.timedelta(seconds=seconds) if seconds > 0 else None

    def _wait(self, work):
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
            raise TimeoutError(f"not complete after {waited:.1f} s (timeout {self.timeout.total_seconds():g} s): "
                               f"{e}") from e

    def barrier(self):
        self._wait(dist.barrier(group=self.group, async_op=True))

    def bcast(self, mv, root):
        t = torch.frombuffer(mv, dtype=torch.uint8)
        self._wait(dist.broadcast(t, src=self.globals[root], group=self.group, async_op=True))

    def ibcast(self, mv, root):
        t = torch.frombuffer(mv, dtype=torch.uint8)
        return (dist.broadcast(t, src=self.globals[root], group=self.group, async_op=True), t)

    def test(self, handle):
        return handle[0].is_completed()

    def wait(self, handle):
        self._wait(handle[0])

    def allreduce(self, mv, kind, op):
        t = torch.frombuffer(mv, dtype=_DT[kind])
        self._wait(dist.all_reduce(t, op=_OPS[op], group=self.group, async_op=True))

    def allgather(self, send, recv):
        out = torch.frombuffer(recv, dtype=torch.uint8)
        inp = torch.frombuffer(send, dtype=torch.uint8)
        self._wait(dist.all_gather(list(out.chunk(self.size)), inp, group=self.group, async_op=True))
