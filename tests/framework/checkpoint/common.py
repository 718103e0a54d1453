"""Small trainer-like objects for checkpoint tests: a sharded SongUNet, Adam, a schedule."""

from __future__ import annotations

from types import SimpleNamespace

import torch

BATCH = 4
SHAPE = (5, 3, 16, 16)  # in channels, out channels, rows, cols


def songunet(seed: int, channels_last: bool = False):
    from recipes.stormcast.songunet import SongUNet

    torch.manual_seed(seed)
    m = SongUNet(
        (16, 16),
        5,
        3,
        model_channels=8,
        channel_mult=[1, 2],
        num_blocks=1,
        attn_resolutions=[8],
        dropout=0.0,
        embedding_type="zero",
    )
    for p in m.parameters():  # the zero-initialised output conv would hide mistakes
        torch.nn.init.normal_(p, std=0.05)
    if channels_last:
        m = m.to(memory_format=torch.channels_last)
    return m


def trainer(topology, sharding: str, *, seed=0, channels_last=False, precision="fp32", init_scale=1024.0, lr=1e-2):
    """What CheckpointManager.save/load read: model, optimizer, scheduler, precision, step, run_id."""
    from framework.config.schema import PrecisionConfig, ShardingConfig
    from framework.distributed import precision as precision_mod
    from framework.distributed import sharding as policies

    torch.set_num_threads(1)  # ranks share 2 cores: no oversubscription
    device = torch.device("cpu")
    prec = precision_mod.build(PrecisionConfig(name=precision, init_scale=init_scale), device)
    model = songunet(seed, channels_last)
    if topology is not None and topology.mesh is not None:
        model = getattr(policies, sharding)(
            model, ShardingConfig(name=sharding), topology=topology, precision=prec, device=device
        ).model
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return SimpleNamespace(
        model=model,
        optimizer=opt,
        scheduler=sched,
        precision=prec,
        step=0,
        run_id=f"run{seed}",
        dp_rank=0 if topology is None else topology.dp_rank,
        dp_size=1 if topology is None else topology.dp_size,
    )


def batch(step: int, dp_rank: int = 0, dp_size: int = 1, channels_last: bool = False):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, SHAPE[0], *SHAPE[2:], generator=g)
    y = torch.randn(BATCH, SHAPE[1], *SHAPE[2:], generator=g)
    per = BATCH // dp_size
    sl = slice(dp_rank * per, (dp_rank + 1) * per)
    x, y = x[sl], y[sl]
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, y


def train(t, steps: int, manager=None, *, channels_last=False, poison_step=None):
    """Optimizer steps as the Trainer takes them (autocast, GradScaler, clip, checkpoint hook)."""
    scaler = t.precision.scaler
    for _ in range(steps):
        x, y = batch(t.step, t.dp_rank, t.dp_size, channels_last)
        with t.precision.autocast(torch.device("cpu")):
            loss = torch.nn.functional.mse_loss(t.model(x).float(), y)
        if poison_step is not None and t.step == poison_step:
            loss = loss * float("inf")  # an overflow: the scaler skips the step and backs off
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(t.optimizer)
        torch.nn.utils.clip_grad_norm_(t.model.parameters(), 1e9)
        if manager is not None:
            manager.before_optimizer_step()
        if scaler:
            scaler.step(t.optimizer)
            scaler.update()
        else:
            t.optimizer.step()
        t.optimizer.zero_grad(set_to_none=True)
        t.scheduler.step()
        t.step += 1


def full(tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def full_params(t) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {k: full(v).detach().clone() for k, v in get_model_state_dict(t.model).items()}


def full_optimizer(t) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(t.model, t.optimizer)
    return {fqn: {k: full(v).detach().clone() for k, v in s.items()} for fqn, s in osd["state"].items()}
