"""The StormCast diffusion stage on GPUs: bf16 training, and 2-GPU layouts against one. Marked gpu."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from framework.logging.jsonl import read
from scripts.loss_compare import compare
from tests.recipes.weather.test_diffusion import DATA, DIFF, cli, stage1, train_losses  # noqa: F401

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_diffusion_trains_on_one_gpu_in_bf16(stage1):  # noqa: F811
    tmp, data, _, export = stage1
    run = tmp / "gpu_bf16"
    proc = cli(
        [
            *DATA,
            *DIFF,
            "device=cuda",
            "precision=bf16",
            f"data.root={data}",
            f"task.regression={export}",
            f"hydra.run.dir={run}",
            "trainer.max_steps=60",
            "trainer.log_every=1",
            "trainer.val_every=60",
            "checkpoint.every=60",
            "optim.lr=3e-3",
        ],
        tmp,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loss = train_losses(run)
    assert np.mean(loss[-15:]) < np.mean(loss[:15])
    val = read(run / "metrics.jsonl", "val")[-1]
    assert np.isfinite(val["crps"]) and np.isfinite(val["spread_skill"])


@pytest.mark.parametrize("layout", [["parallel=fsdp2_domain"], ["parallel=ddp"]], ids=["fsdp2_domain", "ddp"])
def test_two_gpus_log_the_losses_of_one(stage1, layout):  # noqa: F811
    if GPUS < 2:
        pytest.skip(f"needs 2 GPUs, {GPUS} here")
    tmp, data, _, export = stage1
    common = [
        *DATA,
        *DIFF,
        "device=cuda",
        f"data.root={data}",
        f"task.regression={export}",
        "deterministic=true",
        "trainer.max_steps=3",
        "trainer.log_every=1",
        "trainer.val_every=3",
        "checkpoint=none",
    ]
    ref, run = tmp / "gpu_none", tmp / f"gpu_{layout[0].split('=')[1]}"
    if not (ref / "metrics.jsonl").exists():
        proc = cli([*common, "parallel=none", f"hydra.run.dir={ref}"], tmp)
        assert proc.returncode == 0, proc.stderr[-3000:]
    proc = cli([*common, *layout, f"hydra.run.dir={run}"], tmp, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert compare(train_losses(ref), train_losses(run)) <= 1e-5
    a, b = read(ref / "metrics.jsonl", "val")[-1], read(run / "metrics.jsonl", "val")[-1]
    assert b["crps"] == pytest.approx(a["crps"], rel=1e-4)


# -- trainer.compile (framework.train.compile) with inductor on CUDA ------------------------------


def _tiny_songunet(seed=0, dropout=0.0):
    from recipes.stormcast.songunet import SongUNet

    torch.manual_seed(seed)
    m = SongUNet(
        (32, 48),
        5,
        3,
        model_channels=16,
        channel_mult=[1, 2, 2],
        num_blocks=2,
        attn_resolutions=[8],
        dropout=dropout,
        embedding_type="zero",
    )
    for p in m.parameters():  # the near-zero output conv would hide differences
        torch.nn.init.normal_(p, std=0.05)
    return m.cuda()


def _train(model, steps, dtype, micro=1):
    g = torch.Generator(device="cuda").manual_seed(1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    losses = []
    for _ in range(steps):
        loss = 0.0
        for _ in range(micro):  # gradients accumulated over micro-batches
            x = torch.randn(4, 5, 32, 48, device="cuda", generator=g)
            y = torch.randn(4, 3, 32, 48, device="cuda", generator=g)
            with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                part = torch.nn.functional.mse_loss(model(x).float(), y) / micro
            part.backward()
            loss = loss + part.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_compiled_songunet_trains_like_eager_on_gpu(dtype, rtol, monkeypatch):
    """Inductor (Triton GroupNorm/SiLU fusions, cuDNN convs) against eager, same cuDNN algorithms
    (benchmark off, TF32 off: fp32 differs only by reduction order)."""
    from framework.train.compile import compile_model

    torch._dynamo.reset()
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    eager, compiled = _tiny_songunet(), _tiny_songunet()
    c = compile_model(compiled, device_type="cuda", cudnn_benchmark=False)
    a, b = _train(eager, 4, dtype), _train(compiled, 4, dtype)
    s = c.stats()
    assert s["graphs"] > 0 and s["graph_breaks"] == 0, s
    for la, lb in zip(a, b):
        assert abs(la - lb) <= rtol * abs(la), (a, b)


def test_recomputed_norms_train_like_eager_on_gpu(monkeypatch):
    """model.recompute_norm_levels on every level, with the fused GroupNorm kernels (CUDA graphs):
    the compiled graphs call the op the framework's pass marks must-recompute, and train like
    eager in fp32."""
    from framework.train.compile import compile_model
    from recipes.stormcast import fused_norm

    torch._dynamo.reset()
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    calls = []
    real = fused_norm.gn_apply_recomputed
    monkeypatch.setattr(fused_norm, "gn_apply_recomputed", lambda *a: calls.append(1) or real(*a))
    eager, compiled = _tiny_songunet(), _tiny_songunet()
    compiled.set_norm_recompute([0, 1, 2])
    c = compile_model(compiled, device_type="cuda", cudnn_benchmark=False, cudagraphs=True)
    a, b = _train(eager, 4, torch.float32), _train(compiled, 4, torch.float32)
    assert calls and c.stats()["graph_breaks"] == 0, c.stats()
    for la, lb in zip(a, b):
        assert abs(la - lb) <= 1e-4 * abs(la), (a, b)


@pytest.mark.parametrize("micro", [1, 2], ids=["one_micro_batch", "grad_accum_2"])
def test_cuda_graphs_train_like_eager_on_gpu(micro, monkeypatch):
    """trainer.compile_cudagraphs: every block's forward and backward graph replayed from one
    cudagraph tree; the losses are eager's, with gradient accumulation too (the first
    micro-batch's gradients must not be overwritten by the second's replay)."""
    from torch._inductor import cudagraph_trees

    from framework.train.compile import compile_model

    torch._dynamo.reset()
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    eager, compiled = _tiny_songunet(), _tiny_songunet()
    c = compile_model(compiled, device_type="cuda", cudnn_benchmark=False, cudagraphs=True)
    a, b = _train(eager, 6, torch.float32, micro), _train(compiled, 6, torch.float32, micro)
    s = c.stats()
    assert c.cudagraphs and s["graph_breaks"] == 0 and s["cudagraph_skips"] == 0, s
    tree = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
    assert tree is not None and tree.roots, "no graph was recorded"
    for la, lb in zip(a, b):
        assert abs(la - lb) <= 1e-4 * abs(la), (a, b)


def test_fused_dropout_under_cuda_graphs_draws_new_masks_each_step_on_gpu(monkeypatch):
    """The preset's dropout drawn inside the fused norm, the blocks replayed as CUDA graphs: every
    graph captured, no graph break, a new mask at each replay (the same batch twice gives two
    outputs), and training stays finite."""
    from framework.train.compile import compile_model

    torch._dynamo.reset()
    model = _tiny_songunet(dropout=0.1)
    c = compile_model(model, device_type="cuda", cudnn_benchmark=False, cudagraphs=True)
    losses = _train(model, 4, torch.float32)
    s = c.stats()
    assert c.cudagraphs and s["graph_breaks"] == 0 and s["cudagraph_skips"] == 0, s
    assert all(np.isfinite(losses)), losses
    x = torch.randn(4, 5, 32, 48, device="cuda")
    outs = []
    for _ in range(2):
        y = model(x)
        outs.append(y.detach().clone())
        y.square().mean().backward()
    assert not torch.equal(outs[0], outs[1])


@pytest.mark.parametrize(
    "extra", [[], ["trainer.compile_cudagraphs=true", "trainer.grad_accum=2"]], ids=["compile", "cudagraphs"]
)
def test_trainer_compile_true_on_gpu(tmp_path, monkeypatch, extra):
    """The CLI path: trainer.compile=true compiles the blocks and reports the counts in the log."""
    data, run = tmp_path / "data", tmp_path / "run"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    proc = cli(
        [
            *DATA,
            f"data.root={data}",
            f"hydra.run.dir={run}",
            "device=cuda",
            "precision=bf16",
            "model.channel_mult=[1,2]",
            "trainer.compile=true",
            "trainer.max_steps=6",
            "trainer.log_every=1",
            "trainer.val_every=6",
            "trainer.val_batches=1",
            "trainer.progress=false",
            "checkpoint=none",
            *extra,
        ],
        tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "compile: first compiled step" in log and " 0 graph breaks" in log, log[-3000:]
    # the workers built every graph the step needs (with CUDA graphs, the fused output norm's
    # 16-bit output reaches the output convolution: its inputs as the step gives them)
    assert "inductor built 0 forward/backward graphs" in log, log[-3000:]
    if extra:
        assert "CUDA graphs on, 0 graphs not captured" in log, log[-3000:]
    # the kernels are cached for the user (a resumed job reuses them), never in the run dir
    assert not (run / "compile_cache").exists() and any((tmp_path / "xdg" / "framework" / "compile").iterdir())
    assert all(np.isfinite(train_losses(run)))


def test_unaligned_convolutions_compute_the_plain_ones_on_gpu():
    """StormCast's 127-in and 99-out convolutions run with their channels padded to 8 on CUDA in
    bf16 (cuDNN's aligned kernels): the plain convolution's output and gradients, to bf16 rounding."""
    from recipes.stormcast import layers

    torch.manual_seed(0)
    for cin, cout in ((127, 128), (128, 99)):
        conv = layers.Conv2d(cin, cout, kernel=3).cuda()
        x = torch.randn(2, cin, 32, 40, device="cuda").contiguous(memory_format=torch.channels_last)
        x.requires_grad_()
        outs = []
        for padded in (True, False):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if padded:
                    y = conv(x)
                else:
                    y = torch.nn.functional.conv2d(x, conv.weight, conv.bias, padding=1)
            gx, gw = torch.autograd.grad(y.float().square().mean(), (x, conv.weight))
            outs.append((y.float(), gx, gw))
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
