"""Fuse a PEFT LoRA adapter into a state_dict loaded with safetensors.torch,
in place, with lorakit.fuse_, and compare with PEFT's own merge
(merge_and_unload) when peft is installed.

    python examples/python/fuse_peft.py                       # a small demo model
    python examples/python/fuse_peft.py BASE.safetensors ADAPTER_DIR [STRENGTH]

With no arguments it builds a small model with q_proj/v_proj/o_proj linear
layers, saves it with safetensors, trains nothing but gives a PEFT LoRA
random B factors (PEFT initialises B to zero, which would make the merge a
no-op), saves the adapter with PEFT, then fuses it both ways. Prints one
JSON object; exits 1 if lorakit and PEFT disagree by more than the
rounding of the weight dtype. Needs torch and safetensors; peft for the
demo and the comparison.
"""
import json
import os
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

import lorakit


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q_proj = torch.nn.Linear(d, d)
        self.v_proj = torch.nn.Linear(d, d)
        self.o_proj = torch.nn.Linear(d, d, bias=False)

    def forward(self, x):
        return self.o_proj(torch.tanh(self.q_proj(x)) * self.v_proj(x))


class Tiny(torch.nn.Module):
    def __init__(self, d=64, n=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        for b in self.layers:
            x = x + b(x)
        return x


def demo_files(d):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = Tiny()
    base = os.path.join(d, "base.safetensors")
    save_file(model.state_dict(), base)
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    pm = get_peft_model(Tiny(), cfg)
    pm.base_model.model.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    adapter = os.path.join(d, "adapter")
    pm.save_pretrained(adapter)
    return base, adapter, Tiny


def peft_merge(model_cls, base, adapter):
    from peft import PeftModel

    model = model_cls()
    model.load_state_dict(load_file(base))
    return PeftModel.from_pretrained(model, adapter).merge_and_unload().state_dict()


def main():
    tmp = tempfile.mkdtemp(prefix="lk-fuse-peft-")
    if len(sys.argv) >= 3:
        base, adapter, model_cls = sys.argv[1], sys.argv[2], None
    else:
        base, adapter, model_cls = demo_files(tmp)
    strength = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0

    sd = load_file(base)  # the state_dict a process holds
    summary = lorakit.fuse_(sd, [(adapter, strength)])
    report = {"base": base, "adapter": adapter, "strength": strength, "lorakit": summary,
              "digest": lorakit.digest_tensors(sd)}
    # the same fuse through the CLI path (file to file) gives the same bytes
    out = os.path.join(tmp, "fused.safetensors")
    lorakit.fuse(base, [(adapter, strength)], out)
    report["digest_equals_file_fuse"] = lorakit.digest(out) == report["digest"]
    ok = report["digest_equals_file_fuse"]

    try:
        import peft  # noqa: F401
    except ImportError:
        report["peft"] = "not installed: comparison skipped"
    else:
        if model_cls is None or strength != 1.0:
            report["peft"] = "comparison needs the demo's model class and strength 1 (PEFT merges at full weight)"
        else:
            ref = peft_merge(model_cls, base, adapter)
            worst = 0.0
            for k, v in sd.items():
                r = ref[k]
                diff = (v.double() - r.double()).abs().max().item() if v.numel() else 0.0
                worst = max(worst, diff)
                eps = torch.finfo(v.dtype).eps if v.is_floating_point() else 0
                if diff > 4 * eps * max(1.0, r.double().abs().max().item()):
                    ok = False
                    report.setdefault("disagree", []).append(k)
            report["peft"] = {"version": peft.__version__, "tensors": len(ref), "max_abs_diff": worst}
    report["ok"] = ok
    print(json.dumps(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
