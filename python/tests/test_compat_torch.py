"""lorakit.compat side by side with the seeds' own code, under torchrun
(gloo, CPU) at 2 and 4 ranks:
- ltx_compat_worker.py: LTX-2's tracker (ltx_seed.py on ltx-core from
  PyPI) and lorakit.compat.ltx's, the same call sequence, every tensor
  equal after every step;
- fastvideo_compat_worker.py: FastVideo's LoRA training (fastvideo 0.2.1
  from PyPI) and lorakit.compat.fastvideo's, the same loop, weights equal
  after every step.
Each skips, with the reason shown, where torch, gloo or the seed's package
is missing (CI has none of them; see python/README.md for the
PYTHONPATH these runs use)."""
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (CI has none); run with a Python that has it")
dist = pytest.importorskip("torch.distributed", reason="torch.distributed is not available in this PyTorch")

HERE = os.path.dirname(os.path.abspath(__file__))


def torchrun(worker, nproc, *args):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this PyTorch has no gloo backend")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS", "WORLD_SIZE", "RANK"):
        env.pop(v, None)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                        "--master_port", str(29700 + nproc + os.getpid() % 1000), os.path.join(HERE, worker), *args],
                       capture_output=True, text=True, timeout=600, env=env)
    ok = r.stdout.count("side by side passed")
    assert r.returncode == 0 and ok == nproc, f"exit {r.returncode}, {ok}/{nproc} ranks passed\n{r.stdout}\n{r.stderr[-6000:]}"
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    for x in lines:
        print(json.dumps(x))  # the timings, shown with pytest -s
    return lines


@pytest.mark.parametrize("nproc", [2, 4])
def test_ltx_side_by_side(tmp_path, nproc):
    pytest.importorskip("ltx_core", reason="ltx-core is not installed (pip install --no-deps ltx-core: the oracle)")
    pytest.importorskip("safetensors", reason="safetensors is not installed")
    (res,) = torchrun("ltx_compat_worker.py", nproc, str(tmp_path))
    assert res["ranks"] == nproc and "reset_loras" in res["steps"]


@pytest.mark.parametrize("nproc", [2, 4])
def test_fastvideo_side_by_side(tmp_path, monkeypatch, nproc):
    pytest.importorskip("fastvideo.train.utils.lora",
                        reason="fastvideo 0.2.1 is not importable (pip install --no-deps fastvideo==0.2.1 and its "
                               "light imports: the oracle)")
    pytest.importorskip("peft", reason="peft is not installed")
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")  # FastVideo's LoRA forward is torch.compile'd
    (res,) = torchrun("fastvideo_compat_worker.py", nproc, str(tmp_path))
    assert res["ranks"] == nproc and res["layers"] == 7


def test_fastvideo_api_on_plain_linears(tmp_path):
    """enable_lora_training on nn.Linear layers (FastVideo wraps only its
    own classes; lorakit wraps these too), one process."""
    import lorakit
    from lorakit.compat import fastvideo as fv

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.to_q, self.to_k, self.ff = torch.nn.Linear(8, 6), torch.nn.Linear(8, 6), torch.nn.Linear(6, 6)

        def forward(self, x):
            return self.ff(self.to_q(x) + self.to_k(x))

    net = Net()
    net.config = type("C", (), {"arch_config": type("A", (), {"exclude_lora_layers": ["to_k"]})()})()
    x = torch.randn(3, 8)
    before = net(x)
    assert fv.enable_lora_training(net, lora_rank=2, lora_alpha=6, initialization_seed=7) == 1
    assert isinstance(net.to_q, fv.BaseLayerWithLoRA) and isinstance(net.to_k, torch.nn.Linear)
    assert [n for n, p in net.named_parameters() if p.requires_grad] == ["to_q.lora_A", "to_q.lora_B"]
    # A: the C generator keyed by (seed 7, "to_q.lora_A"), bound 1/sqrt(8); B zero: the output is the base's
    bound = float(torch.tensor(1.0) / torch.tensor(8.0).sqrt())
    raw = lorakit._lorakit.rand_uniform(16, 7, "to_q.lora_A", bound)
    assert torch.equal(net.to_q.lora_A.detach(), torch.frombuffer(bytearray(raw), dtype=torch.float32).view(2, 8))
    assert torch.equal(net(x), before)
    with torch.no_grad():
        net.to_q.lora_B.fill_(0.5)
    with torch.no_grad():
        want = net.ff(torch.nn.functional.linear(x, net.to_q.weight + 3 * net.to_q.lora_B @ net.to_q.lora_A,
                                                 net.to_q.bias) + net.to_k(x))
    assert torch.allclose(net(x), want, atol=1e-5)  # c = alpha / r = 3
    out = fv.save_lora_peft(net, str(tmp_path / "peft"))
    info = lorakit.inspect(out)
    assert json.load(open(os.path.join(out, "adapter_config.json")))["lora_alpha"] == 6
    assert "to_q" in json.dumps(info)
    assert fv.finalize_lora_training(net) == 1
    with pytest.raises(RuntimeError, match="Training LoRA wrapper is missing adapter parameters"):
        net.to_q.lora_A = None
        fv.finalize_lora_training(net)
