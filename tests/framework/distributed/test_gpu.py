"""On GPUs (NCCL): the main job, and every layout against one process. Marked gpu."""

import pytest
import torch

from framework.logging.jsonl import read
from scripts.loss_compare import compare, run_layout
from tests.conftest import layout_reference, run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
EXTRA = ["device=cuda", "data.grid=[32,32]", "data.hours_per_year=64", "data.batch_size=8"]


def test_main_job_on_one_gpu(tmp_path):
    proc = run_cli(
        [
            "device=cuda",
            "trainer.max_steps=60",
            "trainer.val_every=60",
            f"hydra.run.dir={tmp_path / 'r'}",
            f"data.root={tmp_path / 'data'}",
            "precision=bf16",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read(tmp_path / "r" / "metrics.jsonl", "train")
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert rows[-1]["mem_gb"] > 0 and rows[-1]["tflops"] > 0 and "mfu" in rows[-1]
    assert rows[-1]["mem_reserved_gb"] >= rows[-1]["mem_gb"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return layout_reference(tmp_path_factory, "gpu_parity", EXTRA)


@pytest.mark.parametrize(
    "layout,nproc",
    [
        (["parallel=ddp"], 2),
        (["parallel=fsdp2"], 2),
        (["parallel=hsdp"], 4),
        (["parallel=fsdp2", "parallel.dp_replicate=2", "parallel.dp_shard=1"], 2),
        (["parallel=domain"], 2),
        (["parallel=fsdp2_domain"], 2),
    ],
)
def test_nccl_layout_matches_one_gpu(reference, layout, nproc):
    if GPUS < nproc:
        pytest.skip(f"needs {nproc} GPUs, {GPUS} here")
    tmp, extra, ref = reference
    losses = run_layout(layout, nproc, tmp / "_".join(layout).replace("=", "-"), 5, extra)
    assert compare(ref, losses) <= 1e-5, (ref, losses)


@pytest.fixture(scope="module")
def reference_20(tmp_path_factory):
    return layout_reference(tmp_path_factory, "gpu_compile_parity", EXTRA, steps=20)


@pytest.mark.parametrize(
    "layout,nproc",
    [
        (["parallel=none"], 1),
        (["parallel=fsdp2"], 2),
        (["parallel=fsdp2_domain"], 2),
        (["parallel=none", "trainer.compile_cudagraphs=true"], 1),
        (["parallel=ddp", "trainer.compile_cudagraphs=true", "trainer.grad_accum=2"], 2),
    ],
    ids=["none", "fsdp2-x2", "fsdp2_domain-x2", "none-cudagraphs", "ddp-cudagraphs-x2"],
)
def test_compiled_layout_trains_like_one_eager_gpu(reference_20, layout, nproc):
    """trainer.compile=true (inductor) against the eager one-GPU run: fp32, 20 steps, 1e-5. The
    domain layout's halo exchanges and GroupNorm sums are functional collectives in the graphs;
    with CUDA graphs the blocks replay from inductor's cudagraph trees (and their GroupNorm takes
    the Triton kernels), under DDP with its gradient hooks around the replayed backward graphs
    and two micro-batches (no_sync, the gradients moved out of the graphs' pool)."""
    if GPUS < nproc:
        pytest.skip(f"needs {nproc} GPUs, {GPUS} here")
    tmp, extra, ref = reference_20
    run_dir = tmp / ("compiled_" + "_".join(layout).replace("=", "-"))
    losses = run_layout([*layout, "trainer.compile=true"], nproc, run_dir, 20, extra)
    assert compare(ref, losses) <= 1e-5, (ref, losses)
    log = (run_dir / "framework.log").read_text()
    assert "compile: first compiled step" in log and " 0 graph breaks" in log, log[-3000:]
    if "trainer.compile_cudagraphs=true" in layout:
        assert "CUDA graphs on, 0 graphs not captured" in log, log[-3000:]
