#!/usr/bin/env python3
"""gen_many_tensors.py N OUT.safetensors [ADAPTER_DIR] — a checkpoint of N
small tensors (issue 20 item 15: a 1.3 M-tensor file has a 97 MB header),
standard library only, the header written as it goes (never held whole).

Tensor i is "<i>.weight", F32: the first three [2, 2], the last [64, 64]
(the largest, 16 KiB), the others scalars (a 1.3 M-tensor header is then
95 MB, under the format's 100 MB limit), values 0.5. With ADAPTER_DIR, a PEFT adapter (rank 1, 4 modules:
the first three tensors and the last) is written there for a fuse. Prints
the header length and the largest tensor's bytes.
"""
import json
import os
import struct
import sys


def name(i):
    return "%d.weight" % i


def main():
    n, out = int(sys.argv[1]), sys.argv[2]
    shapes = [[2, 2]] * 3 + [[]] * (n - 4) + [[64, 64]]
    parts, off = [], 0
    for i in range(n):
        nb = 4
        for d in shapes[i]:
            nb *= d
        parts.append('"%s":{"dtype":"F32","shape":%s,"data_offsets":[%d,%d]}'
                     % (name(i), json.dumps(shapes[i]).replace(" ", ""), off, off + nb))
        off += nb
    hdr = ("{" + ",".join(parts) + "}").encode()
    del parts
    hdr += b" " * (-len(hdr) % 8)
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(hdr)))
        f.write(hdr)
        f.write(struct.pack("<f", 0.5) * (off // 4))
    print("header %d bytes, largest tensor %d bytes, %d tensors" % (len(hdr), 4 * 64 * 64, n))
    if len(sys.argv) > 3:
        ad = sys.argv[3]
        os.makedirs(ad, exist_ok=True)
        mods = [name(i)[: -len(".weight")] for i in (0, 1, 2, n - 1)]
        ents, data, off = {}, b"", 0
        for m, i in zip(mods, (0, 1, 2, n - 1)):
            d = shapes[i][0]
            for k, shp in (("lora_A", [1, d]), ("lora_B", [d, 1])):
                nb = 4 * d
                ents["base_model.model.%s.%s.weight" % (m, k)] = {"dtype": "F32", "shape": shp,
                                                                  "data_offsets": [off, off + nb]}
                data += struct.pack("<f", 0.25) * d
                off += nb
        h = json.dumps(ents).encode()
        h += b" " * (-len(h) % 8)
        with open(os.path.join(ad, "adapter_model.safetensors"), "wb") as f:
            f.write(struct.pack("<Q", len(h)) + h + data)
        with open(os.path.join(ad, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": 1, "lora_alpha": 1}, f)


if __name__ == "__main__":
    main()
