"""Compare the per-step training losses of two layouts of the same run.

    python scripts/loss_compare.py --a parallel=none --b parallel=fsdp2 --nproc-b 4 --steps 5
    python scripts/loss_compare.py --a parallel=ddp --nproc-a 2 --b parallel=hsdp --nproc-b 4 -- data.grid=[16,16]

Both runs use deterministic=true and log every step; extra overrides after ``--`` go to
both. Prints the losses side by side and the largest relative difference; exits 1 when it
exceeds --rtol (default 1e-5).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from framework.logging.jsonl import read  # noqa: E402


def run_layout(layout: list[str], nproc: int, run_dir: Path, steps: int, extra: list[str], run=None) -> list[float]:
    """Train ``steps`` steps under ``layout`` on ``nproc`` processes; the logged train losses.
    ``run(overrides, nproc)`` launches (default: python -m framework, under torchrun for nproc > 1)."""
    overrides = [
        *layout,
        "deterministic=true",
        f"trainer.max_steps={steps}",
        "trainer.log_every=1",
        "trainer.val_every=0",
        "trainer.val_batches=1",
        "trainer.progress=false",
        "trainer.figures=false",  # losses only (an override in extra wins)
        "checkpoint=none",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]
    proc = (run or _launch)(overrides, nproc)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise SystemExit(f"run {' '.join(layout)} on {nproc} process(es) failed:\n{tail}")
    return [r["loss"] for r in read(run_dir / "metrics.jsonl", "train")]


def _launch(overrides: list[str], nproc: int) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "framework"]
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        launcher += ["-m", "framework"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([*launcher, *overrides], capture_output=True, text=True, env=env)


def compare(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        raise SystemExit(f"different numbers of steps: {len(a)} vs {len(b)}")
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))


def main(argv=None, run=None) -> int:
    """The script; ``run`` launches each layout (as run_layout's, default: a new process)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", nargs="+", default=["parallel=none"], help="overrides of layout A")
    ap.add_argument("--b", nargs="+", required=True, help="overrides of layout B")
    ap.add_argument("--nproc-a", type=int, default=1)
    ap.add_argument("--nproc-b", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--out", type=Path, default=None, help="keep the run dirs here")
    ap.add_argument("extra", nargs="*", help="overrides for both runs (after --)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        la = run_layout(args.a, args.nproc_a, out / "a", args.steps, args.extra, run=run)
        lb = run_layout(args.b, args.nproc_b, out / "b", args.steps, args.extra, run=run)
    name_a = f"{' '.join(args.a)} x{args.nproc_a}"
    name_b = f"{' '.join(args.b)} x{args.nproc_b}"
    print(f"{'step':>4}  {name_a:>28}  {name_b:>28}  rel.diff")
    for i, (x, y) in enumerate(zip(la, lb), 1):
        print(f"{i:>4}  {x:>28.8f}  {y:>28.8f}  {abs(x - y) / max(abs(x), 1e-12):.2e}")
    worst = compare(la, lb)
    ok = worst <= args.rtol
    print(f"max relative difference {worst:.2e} ({'within' if ok else 'EXCEEDS'} rtol {args.rtol:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
