# Type stubs for lorakit (the public API of python/lorakit/__init__.py).
import logging
import os
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, TypedDict, Union

from ._adapter import CONVENTIONS as CONVENTIONS, Adapter as Adapter

__version__: str
logger: logging.Logger

class LoraError(RuntimeError):
    status: str  # the lk_status name, e.g. "LK_ERR_UNMATCHED"
    path: Optional[str]  # the file (checkpoint, adapter, in-memory adapter's label) the failure is about, if known
    key: Optional[str]  # the tensor key (adapter module or tensor, model weight) it is about, if known

class LoraWarning(UserWarning): ...

# a NumPy array, a PyTorch CPU tensor, or anything with __dlpack__
Tensor = Any
# a state_dict (name -> tensor) or a torch.nn.Module
Tensors = Union[Mapping[str, Tensor], Any]
PathLike = Union[str, bytes, "os.PathLike[str]"]
LoraSource = Union[PathLike, Adapter]
LoraEntry = Union[LoraSource, Tuple[LoraSource, float], Tuple[PathLike, float, str]]
# None, "self", an mpi4py communicator or a torch.distributed ProcessGroup
Comm = Any

def set_log_level(level: str) -> None: ...
def digest(path: PathLike) -> str: ...
def digest_tensors(tensors: Tensors) -> str: ...
def inspect(path: PathLike, base: Optional[PathLike] = ..., *, arch: Optional[str] = ...,
            maps: Sequence[PathLike] = ..., alpha_from: Optional[str] = ...,
            convention: Optional[str] = ..., strength: float = ...) -> Dict[str, Any]: ...
def fuse(base: PathLike, loras: Sequence[LoraEntry], out: PathLike, *, threads: int = ...,
         allow_unmatched: bool = ..., allow_nonfinite: bool = ..., alpha_from: Optional[str] = ...,
         arch: Optional[str] = ..., maps: Sequence[PathLike] = ...,
         convention: Optional[str] = ..., tied: Optional[Mapping[str, str]] = ...) -> Dict[str, Any]: ...
def fuse_(tensors: Tensors, loras: Sequence[LoraEntry], *, threads: int = ..., allow_unmatched: bool = ...,
          allow_nonfinite: bool = ..., alpha_from: Optional[str] = ..., arch: Optional[str] = ...,
          maps: Sequence[PathLike] = ..., convention: Optional[str] = ...,
          tied: Optional[Mapping[str, str]] = ...) -> Dict[str, Any]: ...

class TrackerPhases(TypedDict):
    agree: float
    load: float
    fuse: float
    broadcast: float

class TrackerReport(TypedDict):
    """What Tracker.apply / reset return (the same on every rank); see
    Tracker.apply's docstring for each key."""
    status: str  # "ok"
    keys_fused: int  # summed over the ranks
    keys_restored: int  # summed over the ranks
    bytes_broadcast: int
    seconds: float  # the slowest rank's whole call
    digest: Optional[str]  # with digest=True only
    digests_agree: Optional[bool]  # with digest=True only
    skipped: bool  # the request equalled the fused set, no file of it changed
    adapters_changed: int  # files of the set changed since read: fused again
    backup_bytes_max: int  # the most base bytes one rank holds
    phases: TrackerPhases  # the slowest rank's seconds per phase

class Tracker:
    def __init__(self, tensors: Tensors, *, comm: Comm = ..., bucket_mb: int = ..., no_lora_swap: bool = ...,
                 threads: int = ..., allow_nonfinite: bool = ..., timeout: float = ...,
                 alpha_from: Optional[str] = ..., arch: Optional[str] = ...,
                 maps: Sequence[PathLike] = ..., convention: Optional[str] = ...,
                 tied: Optional[Mapping[str, str]] = ...) -> None: ...
    def apply(self, loras: Sequence[LoraEntry], *, digest: bool = ...) -> TrackerReport: ...
    def reset(self, *, digest: bool = ...) -> TrackerReport: ...
    @property
    def loras(self) -> List[Tuple[LoraSource, float]]: ...
    @property
    def convention(self) -> str: ...
    @property
    def busy(self) -> bool: ...
    @property
    def staging_bytes(self) -> int: ...
    def close(self) -> None: ...
    def __enter__(self) -> "Tracker": ...
    def __exit__(self, *exc: Any) -> None: ...

def sync_grads(grads: Sequence[Optional[Tensor]], comm: Comm = ..., *, like: Optional[Sequence[Tensor]] = ...,
               bucket_mb: float = ..., names: Optional[Sequence[str]] = ...) -> List[Tensor]: ...
def sync_param_grads(params: Union[Iterable[Any], Iterable[Tuple[str, Any]], Any], comm: Comm = ..., *,
                     bucket_mb: float = ...) -> List[Any]: ...
def check_replicas(tensors: Union[Tensors, Iterable[Tensor]], comm: Comm = ...) -> bool: ...

def merge(loras: Sequence[Union[str, os.PathLike, Tuple[Union[str, os.PathLike], float]]], out: Union[str, os.PathLike], *,
          rank: Optional[int] = ..., err: Optional[float] = ..., fro: Optional[float] = ..., ratio: Optional[float] = ...,
          max_rank: Optional[int] = ..., conv_rank: Optional[int] = ..., format: Optional[str] = ...,
          dtype: Optional[str] = ..., threads: int = ...) -> Dict[str, Any]: ...
def resize(path: Union[str, os.PathLike], out: Union[str, os.PathLike], *, rank: Optional[int] = ...,
           err: Optional[float] = ..., fro: Optional[float] = ..., ratio: Optional[float] = ...,
           max_rank: Optional[int] = ..., conv_rank: Optional[int] = ..., format: Optional[str] = ...,
           dtype: Optional[str] = ..., threads: int = ...) -> Dict[str, Any]: ...
def convert(path: Union[str, os.PathLike], out: Union[str, os.PathLike], *, format: Optional[str] = ...,
            base: Optional[Union[str, os.PathLike]] = ...) -> Dict[str, Any]: ...
def extract(base: Union[str, os.PathLike], tuned: Union[str, os.PathLike], out: Union[str, os.PathLike], *,
            rank: Optional[int] = ..., err: Optional[float] = ..., max_rank: Optional[int] = ...,
            conv_rank: Optional[int] = ..., include: Union[str, Sequence[str]] = ...,
            exclude: Union[str, Sequence[str]] = ..., seed: int = ..., oversample: Optional[int] = ...,
            power: Optional[int] = ..., exact_svd: bool = ..., format: Optional[str] = ...,
            dtype: Optional[str] = ..., threads: int = ...) -> Dict[str, Any]: ...
