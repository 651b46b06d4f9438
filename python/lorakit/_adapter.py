"""lorakit.Adapter: an adapter held in memory.

An Adapter is the image of a safetensors file plus, for PEFT, the text of
its adapter_config.json, both as bytes in this process; the C library
parses it with the same reader, format detection and PEFT config rules as
a file (lk_adapter_open_mem), so an Adapter fuses to the same bytes as the
same adapter saved and read from disk. It is accepted wherever a path is
(fuse, fuse_, Tracker.apply, the compat tracker), with a strength, as
(adapter, strength) or alone (strength 1).

Its label (shown where a path would be, and part of the tracker's request
that every rank must agree on) carries a digest of the bytes and the
config, so two different adapters never compare equal, and ranks holding
different adapters under one name raise LK_ERR_MISMATCH together.
"""
import hashlib
import json
import os
import struct
import sys
import threading

from . import _lorakit as _c

# set on a thread while adapter_check opens an adapter only to validate it:
# its warnings (alpha defaults to r, ...) come once, at the fuse, not twice
_quiet = threading.local()

__all__ = ["Adapter", "CONVENTIONS"]

# whose rules apply where the tools disagree on what a file means
# (`--convention`, lorakit/adapter.h's lk_convention, README "Conventions")
CONVENTIONS = ("lorakit", "comfyui", "lycoris", "peft")


def _check_convention(v):
    """None, or one of CONVENTIONS; else ValueError naming the value."""
    if v is None or (isinstance(v, str) and v in CONVENTIONS):
        return v
    shown = f"'{v}'" if isinstance(v, str) else repr(v)
    raise ValueError(f"unknown convention {shown}: expected {'|'.join(CONVENTIONS)}")

_TORCH_DT = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
             "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
             "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
_NP_DT = {"float32": "F32", "float16": "F16", "float64": "F64", "int64": "I64", "int32": "I32", "int16": "I16",
          "int8": "I8", "uint8": "U8", "bool": "BOOL", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3",
          "float8_e5m2": "F8_E5M2"}


def _raw(name, v):
    """(dtype, shape, bytes) of a tensor or array; raises naming the key."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(v, torch.Tensor):
        if v.device.type != "cpu":
            v = v.detach().cpu()  # an adapter is copied anyway (its bytes are serialised)
        v = v.detach().contiguous()
        dt = _TORCH_DT.get(str(v.dtype).replace("torch.", ""))
        if dt is None:
            raise TypeError(f"{name}: dtype {v.dtype} cannot be stored in a safetensors adapter")
        return dt, list(v.shape), v.reshape(-1).view(torch.uint8).numpy().tobytes() if v.numel() else b""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(v, np.ndarray):
        dt = _NP_DT.get(v.dtype.name)
        if dt is None:
            raise TypeError(f"{name}: dtype {v.dtype} cannot be stored in a safetensors adapter")
        return dt, list(v.shape), np.ascontiguousarray(v).tobytes()
    raise TypeError(f"{name}: expected a tensor or array, got {type(v).__name__}")


def _safetensors_image(tensors, metadata=None):
    """The bytes of a safetensors file holding tensors (name -> tensor)."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r}")
        dt, shape, raw = _raw(name, tensors[name])
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def _config_json(config):
    """A PEFT config (dict, LoraConfig or None) as adapter_config.json text."""
    if config is None:
        return None
    if isinstance(config, (str, bytes)):
        text = config.decode() if isinstance(config, bytes) else config
        json.loads(text)  # must be JSON
        return text
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict, a PEFT LoraConfig or JSON text, got {type(config).__name__}")

    def plain(o):
        if isinstance(o, (set, frozenset, tuple)):
            return sorted(o) if isinstance(o, (set, frozenset)) else list(o)
        if hasattr(o, "value"):  # enums (task_type, peft_type)
            return o.value
        return str(o)

    return json.dumps(config, default=plain, sort_keys=True)


def _alpha(alpha):
    """The caller's alpha: None, or a finite number (a double, used exactly)."""
    if alpha is None:
        return None
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) and not hasattr(alpha, "__float__"):
        raise TypeError(f"alpha must be a number or None, got {alpha!r}")
    v = float(alpha)
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"alpha {alpha!r} is not finite")
    return v


class Adapter:
    """An adapter held in memory; use it where a path goes, e.g.
    fuse_(model, [(Adapter.from_peft(peft_model), 0.8)]).

    Adapter.load(path): a file or PEFT folder read into memory (its
    adapter_config.json too); Adapter.from_state_dict(tensors, config=None,
    format="auto"): tensors as PEFT saves them
    (get_peft_model_state_dict: "base_model.model.<m>.lora_A.weight") or
    in any format lorakit reads, with a PEFT config (a dict or a
    peft.LoraConfig); Adapter.from_peft(peft_model, adapter_name="default"):
    the LoRA weights and config of a PeftModel (just trained, say). The
    tensors are copied once into the image; the model is not referenced.
    alpha=A (load, from_state_dict): the alpha the adapter was trained
    with, for every module its file and config leave at the default alpha
    = r (a FastVideo-legacy file: "<m>.lora_A", "<m>.lora_B"); an alpha the
    file or config gives that differs is a LoraError naming both. A config
    is read for every format (its r, lora_alpha, rank/alpha_pattern,
    use_rslora), not only for PEFT's keys.
    convention=C (every constructor): the convention the adapter is meant
    under ("lorakit", "comfyui", "lycoris", "peft"; None: whatever the call
    uses). A fuse, fuse_ or Tracker given no convention follows its
    Adapters'; one given another raises ValueError naming both (a fuse
    follows one convention for all its adapters). It is part of the
    adapter's identity (label, ==).
    Tensors on the GPU (from_peft of a model on CUDA) are copied into the
    host image once, when the Adapter is made. Fused into CUDA weights
    (fuse_, Tracker.apply), each factor is prepared on the host and
    uploaded once per call that fuses its key, never kept on the device
    between calls (README "Device weights")."""

    __slots__ = ("data", "config_json", "format", "name", "digest", "alpha", "convention")

    def __init__(self, data, config_json=None, format="auto", name="adapter", alpha=None, convention=None):
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be the bytes of a safetensors file, got {type(data).__name__}")
        if not isinstance(format, str):
            raise TypeError(f"format must be a str, got {format!r}")
        self.data = bytes(data)
        self.config_json = _config_json(config_json)
        self.format = format
        self.name = str(name)
        self.alpha = _alpha(alpha)
        self.convention = _check_convention(convention)
        h = hashlib.sha256(self.data)
        h.update(b"\0config\0" + (self.config_json or "").encode())
        if self.alpha is not None:  # another alpha is another adapter (the tracker's request)
            h.update(b"\0alpha\0" + float(self.alpha).hex().encode())
        if self.convention is not None:  # so is another convention
            h.update(b"\0convention\0" + self.convention.encode())
        self.digest = h.hexdigest()[:32]

    @property
    def label(self):
        """What names the adapter in messages and summaries (and in the
        tracker's request): <name>@<digest of the bytes and config>."""
        return f"{self.name}@{self.digest}"

    def _source(self):
        return (self.data, self.config_json)

    def __repr__(self):
        cv = f", convention {self.convention!r}" if self.convention else ""
        return f"Adapter({self.label!r}, {len(self.data)} bytes{', with config' if self.config_json else ''}{cv})"

    def __eq__(self, other):
        return isinstance(other, Adapter) and (self.digest, self.format) == (other.digest, other.format)

    def __hash__(self):
        return hash((self.digest, self.format))

    @classmethod
    def load(cls, path, format="auto", alpha=None, convention=None):
        """A safetensors file (with an adapter_config.json beside it) or a
        PEFT folder, read into memory."""
        path = os.fspath(path)
        if os.path.isdir(path):
            cfg = os.path.join(path, "adapter_config.json")
            for f in ("adapter_model.safetensors", "pytorch_lora_weights.safetensors"):
                if os.path.exists(os.path.join(path, f)):
                    file = os.path.join(path, f)
                    break
            else:
                raise FileNotFoundError(f"{path}: folder has no adapter_model.safetensors")
        else:
            file, cfg = path, os.path.join(os.path.dirname(path) or ".", "adapter_config.json")
        with open(file, "rb") as fh:
            data = fh.read()
        text = None
        if os.path.exists(cfg):
            with open(cfg, encoding="utf-8") as fh:
                text = fh.read()
        return cls(data, text, format, os.path.basename(os.path.normpath(path)), alpha, convention)

    @classmethod
    def from_state_dict(cls, tensors, config=None, format="auto", name="state_dict", alpha=None, convention=None):
        """tensors: name -> tensor/array (PEFT's saved keys, or any format
        lorakit reads); config: a PEFT config dict or LoraConfig (alpha,
        rank_pattern, ... as PEFT reads them) or None; alpha: see the class."""
        if not hasattr(tensors, "items"):
            raise TypeError(f"tensors must be a mapping of name to tensor, got {type(tensors).__name__}")
        ad = cls(_safetensors_image(dict(tensors.items())), config, format, name, alpha, convention)
        ad.check()
        return ad

    def check(self):
        """Opens the adapter as a fuse would, without a model: every key
        paired into a module, factor shapes and ranks consistent, the
        config read. A bad key or shape raises LoraError here, naming it
        (.key; .path is the label). from_state_dict and from_peft call it;
        matching onto a model comes at the fuse."""
        _quiet.on = True
        try:
            _c.adapter_check(self.label, self.data, self.config_json, self.format, self.alpha,
                             self.convention or "lorakit")
        finally:
            _quiet.on = False

    @classmethod
    def from_peft(cls, peft_model, adapter_name="default", convention=None):
        """The LoRA weights and config of a peft.PeftModel, as PEFT's
        save_pretrained would write them."""
        from peft.utils import get_peft_model_state_dict
        if adapter_name not in getattr(peft_model, "peft_config", {}):
            raise KeyError(f"{adapter_name!r} is not an adapter of this model (it has "
                           f"{sorted(getattr(peft_model, 'peft_config', {}))})")
        sd = get_peft_model_state_dict(peft_model, adapter_name=adapter_name)
        return cls.from_state_dict(sd, peft_model.peft_config[adapter_name], "peft", adapter_name,
                                   convention=convention)
