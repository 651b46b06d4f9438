"""lorakit: LoRA fuse, hot-swap and gradient sync on the tensors a Python
process already holds (NumPy arrays, PyTorch CPU tensors), in place, without
copies.

A thin layer over the C library liblorakit (the _lorakit extension): the
same validation, the same bytes as the `lorakit` CLI, the same guarantees
(a failed call changes nothing; a collective call raises on every rank
together, never hangs). This module only normalises arguments: it turns a
state_dict into (name, tensor) items, ml_dtypes arrays into raw views with
their lorakit dtype, mpi4py communicators into lorakit ones, and JSON
summaries into dicts. Tensor memory is borrowed by the C layer through the
buffer protocol (NumPy) or DLPack (PyTorch).
"""
import atexit
import json
import os
import sys
from collections.abc import Mapping

from . import _lorakit as _c
from ._lorakit import LoraError, __version__

__all__ = [
    "LoraError", "Tracker", "__version__", "check_replicas", "digest", "digest_tensors", "fuse", "fuse_",
    "inspect", "sync_grads", "sync_param_grads",
]

# NumPy dtypes that the buffer protocol cannot describe (ml_dtypes), passed
# as a raw unsigned view plus the lorakit dtype name.
_NUMPY_RAW = {"bfloat16": ("BF16", "uint16"), "float8_e4m3fn": ("F8_E4M3", "uint8"), "float8_e5m2": ("F8_E5M2", "uint8")}


def _item(name, value):
    """(name, value, dtype hint) for the C layer; raises naming the key."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.ndarray):
        raw = _NUMPY_RAW.get(value.dtype.name)
        if raw is not None:
            return (name, value.view(raw[1]), raw[0])
        if value.dtype.kind not in "fiub" or value.dtype.itemsize > 8 or value.dtype.name == "longdouble":
            raise TypeError(f"{name}: dtype {value.dtype} is not one lorakit reads (float32, float16, bfloat16, "
                            "float8_e4m3fn, float8_e5m2, float64, integers, bool)")
    return (name, value, None)


def _items(tensors):
    if isinstance(tensors, Mapping):
        pairs = tensors.items()
    else:
        raise TypeError(f"tensors must be a mapping of name to tensor (a state_dict), got {type(tensors).__name__}")
    out = []
    for k, v in pairs:
        if not isinstance(k, str):
            raise TypeError(f"tensor names must be str, got {k!r}")
        if v is None:
            raise TypeError(f"{k}: None is not a tensor")
        out.append(_item(k, v))
    return out


def _loras(loras):
    """[(path bytes, strength, format)] for C and [(path, strength)] to show."""
    if isinstance(loras, (str, bytes, os.PathLike)) or isinstance(loras, Mapping):
        raise TypeError("loras must be a list of (path, strength) pairs")
    req, shown = [], []
    for i, e in enumerate(loras):
        fmt = "auto"
        if isinstance(e, (str, bytes, os.PathLike)):
            path, strength = e, 1.0
        elif isinstance(e, (tuple, list)) and len(e) in (2, 3):
            path, strength = e[0], e[1]
            if len(e) == 3:
                fmt = e[2]
        else:
            raise TypeError(f"loras[{i}]: expected (path, strength) or (path, strength, format), got {e!r}")
        if not isinstance(path, (str, bytes, os.PathLike)):
            raise TypeError(f"loras[{i}]: path must be str or os.PathLike, got {type(path).__name__}")
        typed = strength
        try:
            strength = float(strength)  # a double, used exactly (0.7 is 0.7 in C too)
        except (TypeError, ValueError):
            raise TypeError(f"loras[{i}]: strength must be a number, got {typed!r}") from None
        except OverflowError:
            raise ValueError(f"loras[{i}]: strength {typed!r} is beyond the range of a double") from None
        if not isinstance(fmt, str):
            raise TypeError(f"loras[{i}]: format must be a str, got {fmt!r}")
        req.append((os.fsencode(path), strength, fmt))
        shown.append((os.fsdecode(path), strength))
    return req, shown


# ---- communicators: one lorakit Comm (an MPI_Comm_dup) per mpi4py comm ----

_comms = {}
_self_comm = None


def _comm(comm):
    global _self_comm
    if comm is None:
        if _self_comm is None:
            _self_comm = _c.Comm(None)
        return _self_comm
    if isinstance(comm, _c.Comm):
        return comm
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not isinstance(comm, mpi.Comm):
        raise TypeError(f"comm must be None or an mpi4py communicator, got {type(comm).__name__}")
    if comm == mpi.COMM_NULL:
        raise ValueError("comm is MPI.COMM_NULL")
    key = id(comm)
    hit = _comms.get(key)
    if hit is not None and hit[0] is comm:
        return hit[1]
    lc = _c.Comm(mpi._addressof(comm))  # collective: every rank creates it at the same call
    _comms[key] = (comm, lc)
    return lc


@atexit.register
def _free_comms():
    # before mpi4py finalizes MPI (its own exit hook runs after atexit's)
    _comms.clear()


def _collective(comm, prepare):
    """Runs prepare(); if it raises, joins the collective's first agreement
    as failed (so the other ranks raise too, instead of waiting) and
    re-raises."""
    try:
        return prepare()
    except Exception as e:
        _c.agree_error(comm, str(e))
        raise


# ---- files ----

def digest(path):
    """The content digest of a safetensors file: the 32 hex digits of
    `lorakit digest`."""
    return _c.digest(path)


def digest_tensors(tensors):
    """The same digest over a mapping of name to tensor held in memory."""
    return _c.digest_tensors(_items(tensors))


def inspect(path):
    """What a checkpoint or adapter holds: the content of `lorakit inspect
    --json` as a dict."""
    return json.loads(_c.inspect(path))


def fuse(base, loras, out, *, threads=0, allow_unmatched=False, allow_nonfinite=False):
    """Fuses loras [(path, strength), ...] into the checkpoint base and
    writes out atomically, as `lorakit fuse`; returns its --json summary."""
    req, _ = _loras(loras)
    return json.loads(_c.fuse(base, out, req, int(threads), bool(allow_unmatched), bool(allow_nonfinite)))


def fuse_(tensors, loras, *, threads=0, allow_unmatched=False, allow_nonfinite=False):
    """Fuses loras into tensors (a state_dict: name -> tensor) in place; the
    bytes equal those of `lorakit fuse` on a checkpoint holding the same
    tensors. Every value is checked first (contiguous, writable, a dtype
    lorakit reads) and every adapter validated before the first write; on any
    error every tensor keeps its bytes. Returns the summary (as fuse's,
    without base and out)."""
    items = _items(tensors)
    req, _ = _loras(loras)
    return json.loads(_c.fuse_(items, req, int(threads), bool(allow_unmatched), bool(allow_nonfinite)))


# ---- hot-swap ----

class Tracker:
    """The hot-swap tracker over tensors this process holds (a state_dict).

    comm: None (one process) or an mpi4py communicator; every rank passes its
    own tensors (same names, dtypes and shapes). apply/reset are collective:
    call them on every rank with the same request. A failed apply raises
    LoraError on every rank and leaves every rank's tensors unchanged; ranks
    that ask for different sets all raise (status LK_ERR_MISMATCH). The
    tensors are borrowed, never copied: keep them alive and do not resize
    them while the tracker exists (close() releases them).
    """

    def __init__(self, tensors, *, comm=None, bucket_mb=64, no_lora_swap=False, threads=0,
                 allow_nonfinite=False):
        lc = _comm(comm)
        items = _collective(lc, lambda: (_items(tensors), int(bucket_mb), int(threads)))
        self._comm = lc
        self._t = _c.Tracker(lc, items[0], items[1], bool(no_lora_swap), items[2], bool(allow_nonfinite))

    def apply(self, loras, *, digest=False):
        """Makes the fused set equal loras [(path, strength), ...] (order
        does not matter; strength 0 entries are dropped; [] resets). Returns
        the fields of a `lorakit swap --json` line; digest and digests_agree
        are computed (a hash of every rank's weights) only with digest=True,
        else None."""
        req, shown = _collective(self._comm, lambda: _loras(loras))
        return json.loads(self._t.apply(req, bool(digest), shown))

    def reset(self, *, digest=False):
        """Every touched tensor back to its clean bytes on every rank."""
        return json.loads(self._t.reset(bool(digest)))

    @property
    def loras(self):
        """The set fused now, as [(path, strength), ...]."""
        return self._t.loras

    @property
    def busy(self):
        """True while another thread is inside apply/reset (they release the
        GIL; a second concurrent call is refused with LK_ERR_STATE)."""
        return self._t.busy

    @property
    def staging_bytes(self):
        return self._t.staging_bytes

    def close(self):
        """Releases the borrowed tensors (the tracker cannot be used after)."""
        self._t.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- training ----

def _zeros_like(x):
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return torch.zeros_like(x, dtype=torch.float32, memory_format=torch.contiguous_format)
    import numpy as np
    return np.zeros(np.shape(x), dtype=np.float32)


def sync_grads(grads, comm, *, like=None, bucket_mb=4):
    """Averages float32 gradients over comm, in place, in buckets of
    bucket_mb MiB (a few collectives, not one per tensor). A None entry (a
    layer this rank skipped) contributes zeros shaped like like[i] and comes
    back as a new averaged tensor, so a skipped layer never hangs the other
    ranks. Returns the list with every entry filled. Ranks holding different
    gradient sets raise LoraError (LK_ERR_MISMATCH) together."""
    lc = _comm(comm)

    def prepare():
        out = list(grads)
        if like is not None and len(like) != len(out):
            raise ValueError(f"like has {len(like)} entries for {len(out)} gradients")
        for i, g in enumerate(out):
            if g is None:
                if like is None or like[i] is None:
                    raise ValueError(f"grads[{i}] is None and like[{i}] does not give its shape")
                out[i] = _zeros_like(like[i])
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        return out, [_item(f"grads[{i}]", g) for i, g in enumerate(out)]

    out, items = _collective(lc, prepare)
    _c.sync_grads(lc, items, int(bucket_mb * (1 << 20)))
    return out


def sync_param_grads(params, comm, *, bucket_mb=4):
    """sync_grads over PyTorch parameters' .grad: a parameter whose .grad is
    None gets the averaged gradient assigned (as FastVideo does)."""
    params = list(params)
    grads = sync_grads([p.grad for p in params], comm, like=params, bucket_mb=bucket_mb)
    for p, g in zip(params, grads):
        if p.grad is None:
            p.grad = g
    return params


def check_replicas(tensors, comm):
    """True when every rank holds the same tensors (names, dtypes, shapes,
    bytes). Collective."""
    lc = _comm(comm)
    items = _collective(lc, lambda: _items(tensors) if isinstance(tensors, Mapping)
                        else [_item(f"tensors[{i}]", t) for i, t in enumerate(tensors)])
    return _c.check_replicas(lc, items)
