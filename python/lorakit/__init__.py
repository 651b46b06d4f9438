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
import logging
import os
import sys
import warnings
from collections.abc import Mapping

from . import _adapter as _adapter_mod
from . import _lorakit as _c
from ._adapter import CONVENTIONS, Adapter, _check_convention
from ._lorakit import LoraError, __version__

# Defaults and bounds of every setting: one table in the C library
# (lorakit/knobs.h), read through the extension.
_KNOBS = _c.knobs()


def _default(knob):
    v = _KNOBS[knob]["default"]
    return int(v) if float(v).is_integer() else v

__all__ = [
    "Adapter", "CONVENTIONS", "LoraError", "LoraWarning", "Tracker", "__version__", "check_replicas", "digest", "digest_tensors", "fuse", "fuse_",
    "convert", "extract", "inspect", "merge", "resize", "set_log_level", "sync_grads", "sync_param_grads",
]

# ---- logging: the C library's lines as records on the `lorakit` logger ----

logger = logging.getLogger("lorakit")
_LEVELS = {0: logging.ERROR, 1: logging.WARNING, 2: logging.INFO, 3: logging.DEBUG}


class LoraWarning(UserWarning):
    """A lorakit warning that asks for action (e.g. an adapter whose alpha
    defaults to r because its config is missing). Delivered once, through
    the warnings module only (filter it, turn it into an error, or send it
    to logging with logging.captureWarnings(True))."""


def _on_log(level, msg):
    if getattr(_adapter_mod._quiet, "on", False):  # Adapter.check: its warnings come at the fuse
        return
    # One copy of each line: a warning is a LoraWarning and not also a
    # record (with no handler configured, logging's last-resort handler
    # would print it a second time; with one, it would arrive twice);
    # errors, info and debug lines are records on the `lorakit` logger.
    if level == 1:
        warnings.warn(msg, LoraWarning, stacklevel=3)  # _on_log, the lorakit call, its caller
    else:
        logger.log(_LEVELS.get(level, logging.WARNING), msg)


def set_log_level(level):
    """The C library's threshold: "error", "warn", "info" or "debug"
    (LORAKIT_LOG sets it at start; default "warn"). Warnings become
    LoraWarning (the warnings module); the other lines at or above the
    threshold become records on the `lorakit` logger."""
    names = {"error": 0, "warn": 1, "info": 2, "debug": 3}
    if level not in names:
        raise ValueError(f"level must be one of {list(names)}, got {level!r}")
    _c.log_level(names[level])


_c.set_log_sink(_on_log)


@atexit.register
def _unset_log_sink():
    _c.set_log_sink(None)


# NumPy dtypes that the buffer protocol cannot describe (ml_dtypes), passed
# as a raw unsigned view plus the lorakit dtype name.
_NUMPY_RAW = {"bfloat16": ("BF16", "uint16"), "float8_e4m3fn": ("F8_E4M3", "uint8"), "float8_e5m2": ("F8_E5M2", "uint8")}


def _torch_tensor(value):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


_KDLCUDA = 2  # DLPack's device type of CUDA memory


def _device_name(value):
    """Where a tensor's memory is, as torch names it ('cpu', 'cuda:0',
    'meta', 'mps', ...); for other objects what their __dlpack_device__
    says ('cuda:N' for CUDA memory: CuPy arrays, the test-only
    lorakit._testing.EmulTensor), else 'cpu' (NumPy arrays, host buffers)."""
    if not _torch_tensor(value):
        if hasattr(value, "__dlpack_device__") and not isinstance(value, _np_ndarray()):
            try:
                kind, index = value.__dlpack_device__()
            except Exception:
                return "cpu"
            if int(kind) == _KDLCUDA:
                return f"cuda:{int(index)}"
        return "cpu"
    d = value.device
    return d.type if d.index is None or d.type == "cpu" else f"{d.type}:{d.index}"


def _np_ndarray():
    np = sys.modules.get("numpy")
    return np.ndarray if np is not None else ()


def _stream_handle(named):
    """The handle (cudaStream_t as an int; 0 is the default stream) of
    torch's current stream on the device of a call's torch CUDA tensors,
    where lorakit queues the call's device work; None for anything else
    (host memory; other DLPack exporters: the device's default stream)."""
    for _, v in named:
        if _torch_tensor(v) and v.device.type == "cuda":
            return sys.modules["torch"].cuda.current_stream(v.device).cuda_stream
        break
    return None


def _sync_current(named):
    """Waits for torch's current stream on the device of a call's torch CUDA
    tensors (only the calls that work on the device's default stream: the
    Tracker); nothing for other tensors."""
    for _, v in named:
        if _torch_tensor(v) and v.device.type == "cuda":
            sys.modules["torch"].cuda.current_stream(v.device).synchronize()
        break


def _one_device(named):
    """The device of every (name, tensor) of one call; tensors on different
    devices are refused naming a key on each (a mixed call would need a
    copy lorakit does not make: the caller chooses where they live)."""
    first = {}
    for k, v in named:
        first.setdefault(_device_name(v), k)
    if len(first) > 1:
        where = ", ".join(f"{k} is on {d}" for d, k in first.items())
        raise ValueError(f"tensors of one call are on different devices ({where}): lorakit works on one device per "
                         "call; move them to one device")
    return next(iter(first), "cpu")


_STRIDED = ("lorakit writes a tensor's own memory, and a .contiguous() copy would leave the model unchanged; "
            "make the model's tensor itself contiguous (e.g. module.weight.data = module.weight.data.contiguous()) "
            "and pass that")


def _strided_why(value):
    st = value.stride() if hasattr(value, "stride") else value.strides  # torch: elements; numpy: bytes
    return f"it is not contiguous (strides {tuple(st)} for shape {tuple(value.shape)}): {_STRIDED}"


def _item(name, value, allow_cuda=True, strided=False):
    """(name, value, dtype hint) for the C layer; raises naming the key.
    allow_cuda: a CUDA tensor is passed as device memory (every call that
    takes tensors does; False refuses it). strided: a non-contiguous tensor
    is passed as a contiguous copy with why it may not be written, (name,
    copy, hint, why) (lk_tensor.frozen: the call fails naming it only if an
    adapter writes it); else it is refused here."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.ndarray):
        if strided and not value.flags.c_contiguous:
            why = _strided_why(value)
            return _item(name, np.ascontiguousarray(value), allow_cuda)[:3] + (why,)
        raw = _NUMPY_RAW.get(value.dtype.name)
        if raw is not None:
            return (name, value.view(raw[1]), raw[0])
        if value.dtype.kind not in "fiub" or value.dtype.itemsize > 8 or value.dtype.name == "longdouble":
            raise TypeError(f"{name}: dtype {value.dtype} is not one lorakit reads (float32, float16, bfloat16, "
                            "float8_e4m3fn, float8_e5m2, float64, integers, bool)")
    elif _torch_tensor(value):
        dev = value.device.type
        if dev == "meta":
            raise ValueError(f"{name}: a tensor on the 'meta' device holds no data (shape and dtype only); lorakit "
                             "reads and writes a tensor's memory: materialize it first (e.g. module.to_empty(...) "
                             "and load the weights)")
        if dev == "cuda" and not allow_cuda:
            raise ValueError(f"{name}: a CUDA tensor (on {value.device}) where lorakit reads host memory only")
        if dev not in ("cpu", "cuda"):
            raise ValueError(f"{name}: on device {value.device}; lorakit works on CPU and CUDA memory")
        if value.requires_grad:
            # a parameter: the same storage without autograd (DLPack refuses
            # tensors that require grad); lorakit writes it in place, as an
            # assignment under torch.no_grad() would
            value = value.detach()
        if not value.is_contiguous():
            if strided:
                return (name, value.contiguous(), None, _strided_why(value))
            raise ValueError(f"{name}: not contiguous (strides {tuple(value.stride())} for shape {tuple(value.shape)}): "
                             + _STRIDED)
    return (name, value, None)


def _is_module(x):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.nn.Module)


def _pairs(tensors):
    """(name, value) pairs of a mapping, an nn.Module (its state_dict:
    parameters and persistent buffers) or named parameters."""
    if _is_module(tensors):
        return list(tensors.state_dict(keep_vars=True).items())
    if isinstance(tensors, Mapping):
        return list(tensors.items())
    raise TypeError(f"tensors must be a mapping of name to tensor (a state_dict) or an nn.Module, "
                    f"got {type(tensors).__name__}")


def _storage_span(v):
    """(storage key, first byte, end byte, view key) of a torch tensor; None
    for anything else."""
    if not _torch_tensor(v) or v.device.type not in ("cpu", "cuda"):
        return None
    try:
        base = v.untyped_storage().data_ptr()
    except Exception:
        return None
    start = v.data_ptr()
    return (base, start, start + v.numel() * v.element_size(), (start, v.dtype, tuple(v.shape), tuple(v.stride())))


def _dedupe(pairs):
    """Tied tensors (one memory under several names: same storage, same
    view) become one weight under its first name, the others recorded as
    aliases of it; partly overlapping views are refused naming both keys.
    Returns (pairs, aliases {alias: kept name})."""
    spans, out, aliases, seen = [], [], {}, {}
    for k, v in pairs:
        sp = _storage_span(v)
        if sp is None or sp[1] == sp[2]:
            out.append((k, v))
            continue
        key = sp[3]
        if key in seen:
            aliases[k] = seen[key]
            continue
        seen[key] = k
        spans.append((sp[1], sp[2], k))
        out.append((k, v))
    spans.sort()
    for (a0, a1, ka), (b0, b1, kb) in zip(spans, spans[1:]):
        if b0 < a1:
            raise ValueError(f"{ka} and {kb} overlap in memory as different views (bytes [{a0:#x}, {a1:#x}) and "
                             f"[{b0:#x}, {b1:#x})): lorakit would write the shared bytes twice; pass one of them")
    return out, aliases


def _tied(aliases, tied=None):
    """The C layer's tied names (lk_resolve_opts.tied): a flat list of
    (name, kept key) pairs, so an adapter naming any name of a tied tensor
    lands on the one weight: the aliases found in memory and the caller's
    tied={NAME: KEY} (`--tie NAME=KEY`: a weight saved once under KEY)."""
    if tied is None:
        tied = {}
    if not isinstance(tied, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tied.items()):
        raise TypeError(f"tied must be a mapping of str to str ({{NAME: KEY}}: NAME is another name of the "
                        f"tensor KEY), got {tied!r}")
    return [s for a, k in {**tied, **aliases}.items() for s in (a, k)]


def _axes(module):
    """{weight name: lk_tensor.axes} of an nn.Module's 2-D layer weights whose
    type says how they store their axes: torch.nn.Linear [out, in] (1) and
    transformers' Conv1D [in, out] (2: GPT-2's c_attn / c_proj / c_fc). PEFT
    sets fan_in_fan_out per layer from this type and saves whichever value
    its last layer set, so a saved config can say false for a Conv1D layer
    (a file on c_proj and an nn.Linear lm_head): the C layer lands a PEFT
    LoRA by these, not by the config."""
    torch = sys.modules["torch"]
    out = {}
    for name, m in module.named_modules():
        w = m.__dict__.get("_parameters", {}).get("weight")
        if w is None or not _torch_tensor(w) or w.dim() != 2:
            continue
        key = f"{name}.weight" if name else "weight"
        if isinstance(m, torch.nn.Linear):
            out[key] = 1
        elif type(m).__name__ == "Conv1D" and getattr(m, "nf", None) == w.shape[1] and getattr(m, "nx", w.shape[0]) == w.shape[0]:
            out[key] = 2  # transformers.pytorch_utils.Conv1D: weight [nx, nf], y = x W + b
    return out


def _items(tensors, dedupe=False, allow_cuda=True):
    """[(name, value, hint)] for the C layer. dedupe (the calls that write
    the tensors: fuse_, Tracker): tied names become one weight and
    non-contiguous tensors pass as copies that only an adapter writing them
    refuses (_item's strided); returns (items, aliases, {name: the caller's
    tensor})."""
    pairs = _pairs(tensors)
    aliases = {}
    if dedupe:
        pairs, aliases = _dedupe(pairs)
    _one_device(pairs)
    out = []
    for k, v in pairs:
        if not isinstance(k, str):
            raise TypeError(f"tensor names must be str, got {k!r}")
        if v is None:
            raise TypeError(f"{k}: None is not a tensor")
        out.append(_item(k, v, allow_cuda, strided=dedupe))
    if dedupe and _is_module(tensors):
        axes = _axes(tensors)
        out = [it + (None,) * (4 - len(it)) + (axes[it[0]],) if it[0] in axes else it for it in out]
    return (out, aliases, dict(pairs)) if dedupe else out


def _strength(i, typed):
    """A strength as the double it names: a number (not a bool: True is not
    1.0 here), or text read by the CLI's and the plan's parser (so "0.7",
    "0x1p-3" and "1e-400" mean what -l PATH:STRENGTH makes of them)."""
    # Python's and numpy's bools (numpy 1.x names its type bool_, numpy 2.x bool)
    if isinstance(typed, bool) or (type(typed).__module__ == "numpy" and type(typed).__name__ in ("bool_", "bool")):
        raise TypeError(f"loras[{i}]: strength must be a number, got {typed!r} (a bool)")
    if isinstance(typed, bytes):
        typed = typed.decode("utf-8", "replace")
    if isinstance(typed, str):
        if "\0" in typed:
            raise TypeError(f"loras[{i}]: strength must be a number, got {typed!r}")
        try:
            return _c.strength_parse(typed)
        except LoraError as e:
            raise TypeError(f"loras[{i}]: strength must be a number: {e}") from None
    try:
        return float(typed)  # a double, used exactly (0.7 is 0.7 in C too)
    except (TypeError, ValueError):
        raise TypeError(f"loras[{i}]: strength must be a number, got {typed!r}") from None
    except OverflowError:
        raise ValueError(f"loras[{i}]: strength {typed!r} is beyond the range of a double") from None


def _loras(loras):
    """[(path bytes, strength, format[, in-memory source])] for C and
    [(path or Adapter, strength)] to show. An entry is a path, an Adapter,
    (path or Adapter, strength) or (path, strength, format)."""
    if isinstance(loras, (str, bytes, os.PathLike, Adapter)) or isinstance(loras, Mapping):
        raise TypeError("loras must be a list of (path, strength) pairs")
    req, shown = [], []
    for i, e in enumerate(loras):
        fmt = "auto"
        if isinstance(e, (str, bytes, os.PathLike, Adapter)):
            path, strength = e, 1.0
        elif isinstance(e, (tuple, list)) and len(e) in (2, 3):
            path, strength = e[0], e[1]
            if len(e) == 3:
                fmt = e[2]
        else:
            raise TypeError(f"loras[{i}]: expected (path, strength) or (path, strength, format), got {e!r}")
        if not isinstance(path, (str, bytes, os.PathLike, Adapter)):
            raise TypeError(f"loras[{i}]: path must be str, os.PathLike or a lorakit.Adapter, got "
                            f"{type(path).__name__}")
        strength = _strength(i, strength)
        if not isinstance(fmt, str):
            raise TypeError(f"loras[{i}]: format must be a str, got {fmt!r}")
        if isinstance(path, Adapter):
            req.append((path.label.encode(), strength, path.format if fmt == "auto" else fmt, path._source(),
                        path.alpha))
            shown.append((path, strength))
        else:
            req.append((os.fsencode(path), strength, fmt))
            shown.append((os.fsdecode(path), strength))
    return req, shown


# ---- communicators: one lorakit Comm per mpi4py comm or ProcessGroup ----

_comms = {}
_self_comm = None

# environment variables that say this process is one of several
_LAUNCHERS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS")


def _launched_size():
    """(variable, size) when a launcher (torchrun, mpirun, PMI) started this
    process as one of several, else None."""
    for var in _LAUNCHERS:
        v = os.environ.get(var, "")
        if v.isdigit() and int(v) > 1:
            return var, int(v)
    return None


def _self():
    global _self_comm
    if _self_comm is None:
        _self_comm = _c.Comm(None)
    return _self_comm


def _torch_dist():
    """torch.distributed when it is imported and initialised, else None."""
    if "torch" not in sys.modules:
        return None
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def _default_comm():
    """comm=None: the default torch.distributed group when it spans more
    than one process; one process when nothing says there are others; an
    error when a launcher started several processes but no group exists
    (acting alone would silently leave each rank's own result)."""
    dist = _torch_dist()
    if dist is not None and dist.get_world_size() > 1:
        return _comm(dist.group.WORLD)
    launched = _launched_size()
    if launched is not None and dist is None:
        var, n = launched
        hint = ("call torch.distributed.init_process_group('gloo') first (lorakit then uses its default group), "
                "or pass comm=" if var == "WORLD_SIZE" else "pass comm=MPI.COMM_WORLD (mpi4py) or ")
        raise RuntimeError(f"lorakit: this process is one of {n} ({var}={n}) but comm=None and torch.distributed is "
                           f"not initialised; {hint}a ProcessGroup, or comm='self' to act on this process alone")
    return _self()


def _comm(comm, timeout=None):
    """The lorakit Comm for comm: None (see _default_comm), 'self', an
    mpi4py communicator or a torch.distributed ProcessGroup. Creating one
    is collective; each is made once and kept."""
    if comm is None:
        return _default_comm()
    if isinstance(comm, str) and comm == "self":
        return _self()
    if isinstance(comm, _c.Comm):
        return comm
    key = id(comm)
    hit = _comms.get(key)
    if hit is not None and hit[0] is comm:
        return hit[1]
    mpi = sys.modules.get("mpi4py.MPI")
    dist = sys.modules.get("torch.distributed")
    if mpi is not None and isinstance(comm, mpi.Comm):
        if comm == mpi.COMM_NULL:
            raise ValueError("comm is MPI.COMM_NULL")
        lc = _c.Comm(mpi._addressof(comm))  # collective: every rank creates it at the same call
    elif dist is not None and isinstance(comm, dist.ProcessGroup):
        if not dist.is_initialized():
            raise RuntimeError("comm is a ProcessGroup but torch.distributed is not initialised")
        from ._torch import _TorchHost
        host = _TorchHost(comm, timeout)
        lc = _c.Comm(host=host, rank=host.rank, size=host.size, nonblocking=True)  # collective
    else:
        raise TypeError(f"comm must be None, 'self', an mpi4py communicator or a torch.distributed ProcessGroup, "
                        f"got {type(comm).__name__}")
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

def _algebra(op, inputs, out, rank, err, fro, ratio, max_rank, conv_rank, format, dtype, threads, base=None):
    ins = [(os.fspath(p), float(st)) for p, st in inputs]
    rep = _c.algebra(op, ins, os.fspath(out), int(rank or 0), float(err or 0), float(fro or 0), float(ratio or 0),
                     int(max_rank or 0), int(conv_rank or 0), format or "auto", dtype or "", int(threads or 0),
                     None if base is None else os.fspath(base))
    return json.loads(rep)


def merge(loras, out, *, rank=None, err=None, fro=None, ratio=None, max_rank=None, conv_rank=None, format=None,
          dtype=None, threads=0):
    """`lorakit merge`: the adapter whose delta is sum_i s_i scale_i B_i A_i,
    written to out. loras: paths or (path, strength) pairs. Exact (ranks
    concatenated) unless one of rank / err / fro / ratio is given; format
    "kohya" | "peft" | "diffusers" (default: the first input's); dtype
    "F32" | "F16" | "BF16". Returns the report as a dict (rel_fro of the file
    as written, rel_fro_opt, rel_spec, per module under "modules")."""
    ins = [(x, 1.0) if isinstance(x, (str, os.PathLike)) else (x[0], x[1]) for x in loras]
    return _algebra("merge", ins, out, rank, err, fro, ratio, max_rank, conv_rank, format, dtype, threads)


def resize(path, out, *, rank=None, err=None, fro=None, ratio=None, max_rank=None, conv_rank=None, format=None,
           dtype=None, threads=0):
    """`lorakit resize`: merge of one adapter at strength 1 (see merge)."""
    return _algebra("resize", [(path, 1.0)], out, rank, err, fro, ratio, max_rank, conv_rank, format, dtype, threads)


def extract(base, tuned, out, *, rank=None, err=None, max_rank=None, conv_rank=None, include=(), exclude=(),
            seed=0, oversample=None, power=None, exact_svd=False, format=None, dtype=None, threads=0):
    """`lorakit extract`: a LoRA of tuned - base (safetensors checkpoints),
    written to out (a .safetensors file: diffusers names; a folder: PEFT;
    or format "kohya" | "peft" | "diffusers"). Give rank or err (max_rank caps
    it); conv_rank for conv kernels; include / exclude: regexes searched in
    weight names; seed, oversample (default 8), power (default 2) of the
    randomized subspace iteration, or exact_svd. Returns the report as a dict:
    per module rel_fro (exact, of the file as written), rel_fro_opt (a proven
    lower bound of the optimum, "rel_fro_opt_kind"), rel_fro_opt_upper, and
    the lists unchanged / excluded / not_extracted / only_in_base / only_in_tuned."""
    if isinstance(include, str):
        include = [include]
    if isinstance(exclude, str):
        exclude = [exclude]
    rep = _c.extract(os.fspath(base), os.fspath(tuned), os.fspath(out), int(rank or 0), float(err or 0),
                     int(max_rank or 0), int(conv_rank or 0), format or "auto", dtype or "", int(threads or 0),
                     int(seed), int(oversample or 0), -1 if power is None else int(power), bool(exact_svd),
                     list(include), list(exclude))
    return json.loads(rep)


def convert(path, out, *, format=None, base=None):
    """`lorakit convert`: the same LoRA in format "kohya" | "peft" |
    "diffusers" | "comfyui", its factor bytes copied and each scale carried
    exactly as an alpha, so fusing out gives the bytes fusing path gives;
    base: a checkpoint the names are resolved against (`--base`: kohya names
    become the model keys they land on). What the target cannot carry exactly
    raises LoraError. Returns the report as a dict."""
    return _algebra("convert", [(path, 1.0)], out, 0, 0, 0, 0, 0, 0, format, None, 0, base)


def digest(path):
    """The content digest of a safetensors file: the 32 hex digits of
    `lorakit digest`."""
    return _c.digest(path)


def digest_tensors(tensors):
    """The same digest over a mapping of name to tensor held in memory.
    CUDA tensors (on one device): once torch's current stream has run what
    it queued, their bytes are read to the host in pieces of at most 4 MiB
    for the hash (no copy of the tensors is made)."""
    items = _items(tensors)
    return _c.digest_tensors(items, _stream_handle((k, v) for k, v, _ in items))


_ALPHA_FROM = ("auto", "tensors", "metadata")


def _alpha_from(v):
    """alpha_from=None | "tensors" | "metadata" (`--alpha-from`): where a
    file's alpha comes from when its .alpha tensors and metadata both give
    one (by default they must agree; kohya's ss_network_alpha counts only
    with "metadata")."""
    v = "auto" if v is None else v
    if v not in _ALPHA_FROM:
        raise ValueError(f"alpha_from must be None, 'tensors' or 'metadata', got {v!r}")
    return v


def _convention(v):
    """convention=None | "lorakit" | "comfyui" | "lycoris" | "peft"
    (`--convention`): whose rules apply where the tools disagree on what a
    file means (README "Conventions"). None (the default) is "lorakit",
    unless every Adapter in the call says otherwise (_call_convention).
    Returns the name, or None when not given."""
    return _check_convention(v)


def _call_convention(given, shown):
    """The convention of a call: `given` (checked), else the one the call's
    Adapters were made with, else "lorakit". An Adapter made with another
    convention than the call's (or than another Adapter's) is a ValueError
    naming both: a fuse follows one convention for all its adapters."""
    given = _convention(given)
    conv, who = given, "the call"
    for src, _ in shown:
        c = getattr(src, "convention", None) if isinstance(src, Adapter) else None
        if c is None:
            continue
        if conv is None:
            conv, who = c, f"adapter {src.label}"
        elif c != conv:
            raise ValueError(f"adapter {src.label} was made with convention '{c}' but {who} uses '{conv}' "
                             "(one convention per fuse)")
    return conv or "lorakit"


def _tables(arch, maps):
    """arch=None | a family name, maps=() | paths of extra name tables: the
    name tables every adapter is resolved with, as `lorakit fuse --arch NAME
    --map FILE` (README "Model families and layouts"). Returns (arch, [maps])
    checked for type; the tables themselves are read by the library."""
    if arch is not None and not isinstance(arch, str):
        raise TypeError(f"arch must be a family name (str) or None, not {type(arch).__name__}")
    if isinstance(maps, (str, bytes, os.PathLike)):
        raise TypeError("maps must be a sequence of paths (maps=[path]), not one path")
    maps = list(maps)
    for m in maps:
        if not isinstance(m, (str, bytes, os.PathLike)):
            raise TypeError(f"maps must hold paths, not {type(m).__name__}")
    return arch, maps


def inspect(path, base=None, *, arch=None, maps=(), alpha_from=None, convention=None, strength=0.5):
    """What a checkpoint or adapter holds: the content of `lorakit inspect
    --json` as a dict (alpha_from as `--alpha-from`). With base (a
    checkpoint), where each module of the adapter at path lands on it, as
    `lorakit inspect ADAPTER --base CKPT --json`: weights, row slices, the
    matching rule, algorithm, scale and alpha source; unmatched modules with
    the three nearest weight names. arch and maps as `lorakit fuse --arch /
    --map`; convention as `--convention` (the alpha and scale shown). An
    adapter's description also holds "conventions": where lorakit, comfyui,
    lycoris and peft would give different weights for it (on base, fused
    under each at strengths 1 and `strength`, as `--strength`), as the CLI's."""
    cv = _convention(convention) or "lorakit"
    if isinstance(strength, bool) or not isinstance(strength, (int, float)):
        raise TypeError(f"strength must be a number, got {strength!r}")
    if base is None:
        if arch is not None or maps:
            raise ValueError("arch and maps need base")
        d = json.loads(_c.inspect(path, _alpha_from(alpha_from), cv))
    else:
        d = json.loads(_c.inspect_base(path, base, *_tables(arch, maps), _alpha_from(alpha_from), cv))
    try:  # a comparison that cannot be made is said, never a failed inspect (as the CLI)
        c = _c.conventions(path, base, *_tables(arch, maps), _alpha_from(alpha_from), cv, float(strength))
        if c is not None:
            d["conventions"] = json.loads(c)
    except LoraError as e:
        d["conventions"] = {"error": str(e)}
    return d


def fuse(base, loras, out, *, threads=0, allow_unmatched=False, allow_nonfinite=False, alpha_from=None,
         arch=None, maps=(), convention=None, tied=None):
    """Fuses loras [(path, strength), ...] into the checkpoint base and
    writes out atomically, as `lorakit fuse`; returns its --json summary.
    base may be a diffusers pipeline folder (model_index.json): out is then
    a pipeline folder, as `lorakit fuse PIPELINE_DIR -o OUT_DIR`. arch (a
    family name, "none" for no table) and maps (paths of extra name tables)
    are `--arch` and `--map`. convention ("lorakit", "comfyui", "lycoris",
    "peft"; None: lorakit, or the one the call's Adapters were made with)
    is `--convention`: the same bytes as the CLI's. tied {NAME: KEY} is
    `--tie NAME=KEY`: NAME is another name of base's tensor KEY (a weight
    tied to another and saved once, e.g. lm_head.weight under
    model.embed_tokens.weight), so a module naming NAME fuses into KEY."""
    req, shown = _loras(loras)
    cv = _call_convention(convention, shown)
    return json.loads(_c.fuse(base, out, req, int(threads), bool(allow_unmatched), bool(allow_nonfinite),
                              _alpha_from(alpha_from), *_tables(arch, maps), cv, _tied({}, tied)))


def fuse_(tensors, loras, *, threads=0, allow_unmatched=False, allow_nonfinite=False, alpha_from=None,
          arch=None, maps=(), convention=None, tied=None):
    """Fuses loras into tensors (a state_dict: name -> tensor, or an
    nn.Module: its state_dict names, parameters and persistent buffers) in
    place; the bytes equal those of `lorakit fuse` on a checkpoint holding
    the same tensors. Parameters that require grad are written through
    their storage (as under torch.no_grad()). Tied tensors (one memory under
    several names) are one weight, fused once and reported under its first
    name, whichever of its names an adapter uses (an adapter naming two of
    them is refused: "modules ... both target ..."); views that overlap
    differently are refused. tied {NAME: KEY}: names not in tensors that
    stand for the tensor KEY (as fuse's). Every value is checked first
    (writable, CPU or CUDA, a dtype lorakit reads) and every adapter
    validated before the first write; on any error every tensor keeps its
    bytes. A non-contiguous tensor is left alone unless an adapter writes
    it, which is refused naming it (lorakit writes a tensor's own memory). arch, maps and convention as fuse's, against the tensors' names. Returns the
    summary (as fuse's, without base and out). CUDA tensors (on one device)
    are fused where they are, on torch's current stream: the touched
    tensors backed up on the device (device-to-device copies; peak extra
    GPU memory their bytes), each key by the device kernel (the same bytes
    as the CPU; the term kinds it does not run take its pinned host path),
    restored on the device on failure; the summary then adds "device",
    "keys_device" and "keys_host_fallback"."""
    req, shown = _loras(loras)
    cv = _call_convention(convention, shown)
    items, aliases, _ = _items(tensors, dedupe=True)
    return json.loads(_c.fuse_(items, req, int(threads), bool(allow_unmatched), bool(allow_nonfinite),
                               _alpha_from(alpha_from), *_tables(arch, maps), cv,
                               _stream_handle((k, v) for k, v, *_ in items), _tied(aliases, tied)))


# ---- hot-swap ----

class Tracker:
    """The hot-swap tracker over tensors this process holds (a state_dict
    or an nn.Module).

    comm: None, 'self', an mpi4py communicator or a torch.distributed
    ProcessGroup. None means the default torch.distributed group when it is
    initialised with more than one process, this process alone when nothing
    says there are others, and an error when a launcher (torchrun, mpirun)
    started several processes but no group exists. Every rank passes its
    own tensors (same names, dtypes and shapes). apply/reset are collective:
    call them on every rank with the same request. A failed apply raises
    LoraError on every rank and leaves every rank's tensors unchanged; ranks
    that ask for different sets all raise (status LK_ERR_MISMATCH). The
    tensors are borrowed, never copied: keep them alive while the tracker
    exists (close() releases them). Tied tensors are one weight (fused once
    and backed up once, whichever of its names an adapter uses, as by fuse_;
    tied= as fuse_'s). A non-contiguous tensor is left alone unless an
    adapter writes it (that apply raises naming it, changing nothing). The tracker remembers where each tensor's memory is: if
    the tensors came from a module and a later call finds one reallocated
    (model.to(...), a reassigned parameter), it raises naming the key on
    every rank instead of writing memory the model no longer uses.

    timeout: seconds each collective of the tracker's calls may wait for the
    other ranks (0 = none; the default, shown in the signature, is the
    library's timeout_s setting in lorakit/knobs.h). On expiry every waiting rank raises
    LoraError (status LK_ERR_TIMEOUT) naming the collective, the phase and
    the ranks it waited for. A collective cannot be cancelled: the tracker
    and its communicator are unusable after that and the job should end
    (e.g. mpi4py's comm.Abort()).

    arch and maps: the name tables adapters are resolved with, as
    `lorakit fuse --arch NAME --map FILE` and fuse(arch=, maps=): a family
    name ("flux", "sdxl", ...; "none": no table; None: recognised from the
    tensors' names) and paths of extra tables. They are read when the
    tracker is made (an unknown family or a bad table raises on every rank)
    and must be equal on every rank. An adapter lands where fuse() with the
    same arch and maps puts it, row slices of fused weights included (a
    diffusers Flux LoRA's to_q/to_k/to_v on a BFL state_dict's qkv). The
    tensors are one model: for a diffusers pipeline, make one Tracker per
    component (the transformer's or UNet's state_dict).

    convention: "lorakit" (None, the default), "comfyui", "lycoris" or
    "peft", as `lorakit swap --convention` / a plan's `convention:`; fixed
    when the tracker is made and part of what the ranks agree on (a rank
    with another raises LoraError, status LK_ERR_MISMATCH, on every rank).
    apply() refuses an Adapter made with another convention (ValueError on
    every rank).
    """

    def __init__(self, tensors, *, comm=None, bucket_mb=_default("swap_bucket_mb"), no_lora_swap=False,
                 threads=_default("threads"), allow_nonfinite=False, timeout=float(_default("timeout_s")),
                 alpha_from=None, arch=None, maps=(), convention=None, tied=None):
        lc = _comm(comm)
        self._source = tensors if _is_module(tensors) else None

        def prepare():
            items, aliases, given = _items(tensors, dedupe=True)
            return (items, _c.mib_bytes("swap_bucket_mb", float(bucket_mb)), int(threads), float(timeout),
                    _alpha_from(alpha_from), _tables(arch, maps), _convention(convention) or "lorakit",
                    _tied(aliases, tied), given)

        items = _collective(lc, prepare)
        self._comm = lc
        self._convention = items[6]
        self._named = [(k, v) for k, v, *_ in items[0]]
        self._ptrs = {k: _storage_span(items[8][k]) for k, *_ in items[0]}
        self._t = _c.Tracker(lc, items[0], items[1], bool(no_lora_swap), items[2], bool(allow_nonfinite), items[3],
                             items[4], *items[5], items[6], items[7])

    def _check_moved(self):
        """Raises naming the first key of the module whose memory moved
        since the tracker was made."""
        if self._source is None:
            return
        now = dict(self._source.state_dict(keep_vars=True))
        for k, sp in self._ptrs.items():
            if sp is None:
                continue
            v = now.get(k)
            cur = _storage_span(v) if v is not None else None
            if cur is None or cur[3] != sp[3]:
                where = "is gone from the module" if v is None else (
                    f"moved (its memory was at {sp[1]:#x}, now {'on ' + str(v.device) if v.device.type != 'cpu' else hex(cur[1])})")
                raise RuntimeError(f"{k}: {where} since the Tracker was made (model.to(...) or a reassigned "
                                   "parameter reallocates it); lorakit would write memory the model no longer uses. "
                                   "Make a new Tracker over the model as it is now")

    def apply(self, loras, *, digest=False):
        """Makes the fused set equal loras [(path, strength), ...] (order
        does not matter; strength 0 entries are dropped; [] resets). Returns
        the fields of a `lorakit swap --json` line as a dict (the same on
        every rank):
          status            "ok" (a failure raises LoraError instead)
          keys_fused        keys fused by this call, summed over the ranks
          keys_restored     keys put back to their base bytes (touched by
                            the old set only), summed over the ranks
          bytes_broadcast   bytes the owners broadcast (0 at one rank)
          seconds           the slowest rank's whole call
          digest            rank 0's content digest of its weights (32 hex)
          digests_agree     every rank's digest equals rank 0's
                            (digest and digests_agree: only with
                            digest=True, else None)
          skipped           the request equalled the fused set and no file
                            of it changed: nothing was done
          adapters_changed  adapters of the set whose file changed since
                            they were read (content, not mtime): read
                            again and fused again, never skipped
          backup_bytes_max  the most base bytes one rank holds as backup
          phases            {"agree", "load", "fuse", "broadcast"}: the
                            slowest rank's seconds in each phase."""
        def prepare():
            self._check_moved()
            self._stream_sync()
            req, shown = _loras(loras)
            _call_convention(self._convention, shown)
            return req, shown

        req, shown = _collective(self._comm, prepare)
        return json.loads(self._t.apply(req, bool(digest), shown, _stream_handle(self._named)))

    def reset(self, *, digest=False):
        """Every touched tensor back to its clean bytes on every rank."""
        _collective(self._comm, lambda: (self._check_moved(), self._stream_sync()))
        return json.loads(self._t.reset(bool(digest), _stream_handle(self._named)))

    def _stream_sync(self):
        """CUDA weights: the tracker queues its device work (restores,
        backups, the fuse kernel, staging copies) on torch's current stream,
        each move complete before the next step; what that stream queued
        before completes first here, so a collective on another stream (a
        communicator's own) never races it (that stream only, not the
        device)."""
        _sync_current(self._named)

    @property
    def loras(self):
        """The set fused now, as [(path, strength), ...]."""
        return self._t.loras

    @property
    def convention(self):
        """The convention the tracker fuses under (fixed at creation)."""
        return self._convention

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
    """Zeros shaped like x, in x's dtype where it is one sync_grads averages
    (float32, float16, bfloat16), else float32."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if hasattr(x, "to_local"):  # a DTensor: its local shard's shape
            x = x.to_local()
        dt = x.dtype if x.dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32
        return torch.zeros(x.shape, dtype=dt, device=x.device)
    import numpy as np
    dt = getattr(x, "dtype", None)
    return np.zeros(np.shape(x), dtype=dt if dt in (np.float32, np.float16) else np.float32)


def _low_precision(g):
    """True for a float16/bfloat16 tensor or float16 array: averaged as a
    float32 copy, rounded back once."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(g, torch.Tensor):
        return g.dtype in (torch.float16, torch.bfloat16)
    np = sys.modules.get("numpy")
    return np is not None and isinstance(g, np.ndarray) and g.dtype.name in ("float16", "bfloat16")


def _as_f32(g):
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(g, torch.Tensor):
        return g.detach().to(torch.float32, memory_format=torch.contiguous_format)
    import numpy as np
    return np.ascontiguousarray(g, dtype=np.float32)


def _round_back(g, work):
    """g <- work, rounded once to g's dtype (round to nearest even)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(g, torch.Tensor):
        with torch.no_grad():
            g.copy_(work)
    else:
        g[...] = work


def sync_grads(grads, comm=None, *, like=None, bucket_mb=_default("sync_bucket_mb"), names=None):
    """Averages gradients over comm, in place, in buckets of bucket_mb MiB
    (a few collectives, not one per tensor). float32 entries are averaged
    where they are; float16 and bfloat16 ones (tensors or arrays) through a
    float32 copy: the sum and the division in float32, then one rounding
    back into the gradient's own memory. A None entry (a layer this rank
    skipped) contributes zeros shaped like like[i] (in its dtype) and comes
    back as a new averaged tensor, so a skipped layer never hangs the other
    ranks. names (optional, one per entry, e.g. the parameters' names) name
    the entries in errors (else grads[i]). Returns the list with every entry
    filled. Ranks holding different gradient sets raise LoraError
    (LK_ERR_MISMATCH) together. CUDA gradients (on one device) are averaged
    where they are, on torch's current stream: float16/bfloat16 ones through
    a float32 copy on the device (torch's .to(float32), then one rounding
    back by copy_); over an NCCL ProcessGroup each bucket's allreduce gets
    the device memory itself, over another group a pinned host copy of the
    bucket; the division by the rank count is lorakit's device kernel (one
    IEEE float division, the host's bytes)."""
    lc = _comm(comm)

    def prepare():
        out = list(grads)
        if like is not None and len(like) != len(out):
            raise ValueError(f"like has {len(like)} entries for {len(out)} gradients")
        if names is not None and len(names) != len(out):
            raise ValueError(f"names has {len(names)} entries for {len(out)} gradients")
        label = [names[i] if names is not None else f"grads[{i}]" for i in range(len(out))]
        for i, g in enumerate(out):
            if g is None:
                if like is None or like[i] is None:
                    raise ValueError(f"{label[i]} is None and like[{i}] does not give its shape")
                out[i] = _zeros_like(like[i])
        work = [_as_f32(g) if _low_precision(g) else g for g in out]
        bucket = _c.mib_bytes("sync_bucket_mb", float(bucket_mb))
        named = [(label[i], g) for i, g in enumerate(out)]
        _one_device(named)
        return out, work, [_item(label[i], g) for i, g in enumerate(work)], bucket, _stream_handle(named)

    out, work, items, bucket, stream = _collective(lc, prepare)
    _c.sync_grads(lc, items, bucket, stream)
    for g, w in zip(out, work):
        if w is not g:
            _round_back(g, w)
    return out


def _params(params):
    """Parameters from module.parameters(), named_parameters() pairs or a
    module."""
    if _is_module(params):
        return list(params.parameters())
    out = []
    for p in params:
        if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
            p = p[1]
        out.append(p)
    return out


def sync_param_grads(params, comm=None, *, bucket_mb=_default("sync_bucket_mb")):
    """sync_grads over PyTorch parameters' .grad (module.parameters(),
    module.named_parameters() or a module; float32, float16 or bfloat16):
    a parameter whose .grad is None gets the averaged gradient assigned (as
    FastVideo does). Errors name the parameter where names are known
    (named_parameters() or a module)."""
    names = None
    if not _is_module(params):
        params = list(params)
        if params and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in params):
            names = [n for n, _ in params]
    else:
        names = [n for n, _ in params.named_parameters()]
    params = _params(params)
    grads = sync_grads([p.grad for p in params], comm, like=params, bucket_mb=bucket_mb, names=names)
    for p, g in zip(params, grads):
        if p.grad is None:
            p.grad = g
    return params


def check_replicas(tensors, comm=None):
    """True when every rank holds the same tensors (names, dtypes, shapes,
    bytes): a mapping, an nn.Module (its state_dict) or a sequence of
    tensors (module.parameters() too). Collective."""
    lc = _comm(comm)

    def prepare():
        if isinstance(tensors, Mapping) or _is_module(tensors):
            items = _items(tensors)
        else:
            named = [(f"tensors[{i}]", t) for i, t in enumerate(_params(tensors))]
            _one_device(named)
            items = [_item(k, v) for k, v in named]
        return items, _stream_handle((k, v) for k, v, _ in items)

    items, stream = _collective(lc, prepare)
    return _c.check_replicas(lc, items, stream)
