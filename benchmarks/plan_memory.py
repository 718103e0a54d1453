"""``mode=plan``'s memory estimate against the peak a real run measures, preset by preset.

For each case: ``python -m framework mode=plan <overrides>`` (traced on fake CPU tensors, with the
GPU's autocast rules) and the same overrides trained for a few steps, whose ``metrics.jsonl``
``mem_gb`` is ``torch.cuda.max_memory_allocated``. Runs eager (``trainer.compile=false``), or
compiled with ``--compiled`` (``trainer.compile=true``, without CUDA graphs, whose private pools
the plan does not model): the plan then traces the compiled step (docs/plan.md). Synthetic data
at the preset's grid:

    python benchmarks/plan_memory.py                        # on a GPU machine: the default cases
    python benchmarks/plan_memory.py --cases stormcast_b4   # one of them
    python benchmarks/plan_memory.py --compiled             # the compiled steps
    python benchmarks/plan_memory.py --grid 64 64 --steps 2 # a quick check (any device)

Prints plan / measured per case (the target is within 15%) and writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

STORMSCOPE_DATA = [
    "data=stormscope_synthetic",
    "data.state_channels=[abi07,abi08,abi09,abi10,abi11,abi13,abi14,abi15,refc]",  # the preset's (data=stormscope)
    "data.background_channels=[u850,v850,t850,z500,tcwv,u10m,v10m,t2m]",
]
CASES = {  # name: overrides (the grid, data root and run settings are added)
    "stormcast_b4": ["recipe=stormcast_fast", "data=synthetic", "data.batch_size=4"],
    "stormcast_b4_nodropout": ["recipe=stormcast_fast", "data=synthetic", "data.batch_size=4", "model.dropout=0"],
    "stormcast_fp32_b2": ["recipe=stormcast", "data=synthetic", "data.batch_size=2"],
    "stormcast_diffusion_b2": [
        "recipe=stormcast_diffusion_fast",
        "data=synthetic",
        "data.batch_size=2",
        "task.regression=null",  # the network and step of the diffusion stage, without a first stage
        "task.residual=false",
        "task.conditions=[state,background,invariants]",
        "task.plot_channels=[t2m]",  # the synthetic stores' channels
    ],
    "stormscope_b1": ["recipe=stormscope", *STORMSCOPE_DATA, "data.batch_size=1"],
    "stormscope_b4": ["recipe=stormscope", *STORMSCOPE_DATA, "data.batch_size=4"],
}


def _gib(text: str, pattern: str) -> float | None:
    m = re.search(pattern + r" ([\d.]+) (GiB|MiB|KiB|B)\b", text)
    if not m:
        return None
    return float(m.group(1)) / {"GiB": 1, "MiB": 1024, "KiB": 1024**2, "B": 1024**3}[m.group(2)]


def run_case(name: str, args, work: Path) -> dict:
    grid = f"data.grid=[{args.grid[0]},{args.grid[1]}]"
    common = [
        *CASES[name],
        grid,
        f"data.root={work / 'data' / name.split('_')[0]}",
        "data.hours_per_year=8",
        "data.num_workers=2",
        *(["trainer.compile=true", "trainer.compile_cudagraphs=false"] if args.compiled else ["trainer.compile=false"]),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    run_dir = work / "runs" / name
    train = [
        *common,
        f"trainer.max_steps={args.steps}",
        "trainer.log_every=1",
        "trainer.val_every=0",
        "trainer.figures=false",
        "trainer.progress=false",
        "checkpoint=none",
        f"hydra.run.dir={run_dir}",
    ]
    done = subprocess.run([sys.executable, "-m", "framework", *train], env=env, capture_output=True, text=True)
    if done.returncode:
        return {"case": name, "error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    measured = max(r["mem_gb"] for r in rows if r.get("split") == "train")
    # the plan after the run: the data store exists then (the plan reads none, but validates the root)
    plan = subprocess.run(
        [sys.executable, "-m", "framework", "mode=plan", *common], env=env, capture_output=True, text=True
    )
    text = plan.stdout + plan.stderr
    planned = _gib(text, "the fullest rank needs")
    acts = re.search(r"^rank 0 .*$", text, re.M)
    return {
        "case": name,
        "overrides": CASES[name],
        "planned_gib": planned,
        "measured_gib": measured,
        "ratio": planned / measured if planned and measured else None,
        "plan_row": acts.group(0) if acts else None,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    p.add_argument("--grid", nargs=2, type=int, default=[512, 640])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--work", help="data and run dirs (default: a temporary directory)")
    p.add_argument("--compiled", action="store_true", help="trainer.compile=true (no CUDA graphs)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="plan_memory_"))
    results = []
    how = "compiled" if args.compiled else "eager"
    print(f"mode=plan against measured peak memory ({how}, {args.grid[0]}x{args.grid[1]}, {args.steps} steps)")
    print(f"{'case':<24} {'plan GiB':>9} {'measured':>9} {'plan/meas':>9}")
    for name in args.cases:
        r = run_case(name, args, work)
        results.append(r)
        if "error" in r:
            print(f"{name:<24} failed: {r['error']}", flush=True)
            continue
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        print(f"{name:<24} {r['planned_gib'] or 0:>9.2f} {r['measured_gib']:>9.2f} {ratio:>9}", flush=True)
        print(f"  plan: {r['plan_row']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
