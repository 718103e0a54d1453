"""CPU time per step: the framework's training loop against a hand-written PyTorch loop.

Same model (the tiny recipe's SongUNet), same data (the synthetic zarr stores read through
the same dataset class), same optimizer, batch and clipping; measured side by side in one
process, alternating rounds, after warm-up. Prints the ratio (target: <= 1.05).

    python benchmarks/loop_overhead.py [--steps 60] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from framework.cli import compose  # noqa: E402
from framework.config.validate import validate  # noqa: E402
from framework.logging.jsonl import read  # noqa: E402
from framework.runtime import run_job  # noqa: E402

WARMUP = 10  # steps excluded from timing (first-step FLOP count, allocator warm-up)


def framework_step_time(tmp: Path, data_root: Path, steps: int, round_: int) -> float:
    run_dir = tmp / f"fw{round_}"
    run = validate(
        compose(
            [
                f"data.root={data_root}",
                f"trainer.max_steps={steps + WARMUP}",
                f"trainer.log_every={WARMUP}",
                "trainer.val_every=0",
                "trainer.val_batches=1",
                "trainer.progress=false",
                "checkpoint=none",
            ]
        )
    )
    run_job(run, run_dir)
    rows = [r for r in read(run_dir / "metrics.jsonl", "train") if r["step"] > WARMUP]
    batch = run.data.batch_size
    return statistics.fmean(batch / r["samples_per_s"] for r in rows)


def plain_step_time(data_root: Path, steps: int) -> float:
    """What a user would write by hand: DataLoader, forward, MSE, backward, clip, step."""
    from recipes.stormcast.songunet import SongUNet
    from recipes.weather.dataset import HrrrEra5Dataset

    run = validate(compose([f"data.root={data_root}"]))
    d, m = run.data, run.model
    torch.manual_seed(0)
    ds = HrrrEra5Dataset(d.root, list(d.train_years), list(d.hrrr_channels), list(d.era5_channels), list(d.invariants))
    loader = torch.utils.data.DataLoader(ds, batch_size=d.batch_size, shuffle=True, drop_last=True)
    model = SongUNet(
        tuple(d.grid),
        len(d.hrrr_channels) + len(d.era5_channels) + len(d.invariants),
        len(d.hrrr_channels),
        model_channels=m.model_channels,
        channel_mult=list(m.channel_mult),
        num_blocks=m.num_blocks,
        attn_resolutions=[],
        dropout=0.0,
        embedding_type="zero",
    )
    opt = torch.optim.Adam(model.parameters(), lr=run.optim.lr)
    it = iter(loader)
    t0 = None
    for step in range(steps + WARMUP):
        if step == WARMUP:
            t0 = time.perf_counter()
        try:
            b = next(it)
        except StopIteration:
            it = iter(loader)
            b = next(it)
        x = torch.cat([b["state"], b["background"], b["invariants"]], dim=1)
        loss = torch.nn.functional.mse_loss(model(x), b["target"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % WARMUP == 0:
            loss.item()
    return (time.perf_counter() - t0) / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data_root = tmp / "data"
        framework_step_time(tmp, data_root, 1, -1)  # writes the synthetic stores once
        fw, plain = [], []
        for r in range(args.rounds):
            fw.append(framework_step_time(tmp, data_root, args.steps, r))
            plain.append(plain_step_time(data_root, args.steps))
            print(f"round {r}: framework {fw[-1] * 1e3:.1f} ms/step, plain {plain[-1] * 1e3:.1f} ms/step")
    f, p = statistics.median(fw), statistics.median(plain)
    print(f"framework {f * 1e3:.1f} ms/step  plain PyTorch {p * 1e3:.1f} ms/step  ratio {f / p:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
