"""A minimal safetensors reader/writer in NumPy for the tests: written from
the format's specification (8-byte little-endian header length, a JSON
header of {name: {dtype, shape, data_offsets}}, then the bytes), so the
tests compare lorakit against a second, independent implementation. BF16
and FP8 tensors are held as raw uint16 / uint8 arrays."""
import json
import struct

import numpy as np

NP = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16, "I64": np.int64,
      "I32": np.int32, "U8": np.uint8, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8}


def write(path, tensors, metadata=None):
    """tensors: {name: (dtype, array)}; arrays are written as they are."""
    header, blobs, off = {}, [], 0
    for name, (dt, a) in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def read(path):
    """{name: (dtype, array)} with fresh, writable arrays."""
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, e in header.items():
        a, b = e["data_offsets"]
        arr = np.frombuffer(data[8 + n + a:8 + n + b], dtype=NP[e["dtype"]]).reshape(e["shape"]).copy()
        out[name] = (e["dtype"], arr)
    return out


def bf16_to_f64(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def f32_to_bf16(x):
    """Round-to-nearest-even float32 -> bfloat16 bits (finite inputs)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
