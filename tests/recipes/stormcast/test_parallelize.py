"""The SongUNet's domain-parallel rules (recipes/stormcast/parallelize.py) on real gloo ranks.

Every layer and the whole SongUNet (bare, and wrapped in the diffusion task's EDM
preconditioner), split over rows by ``framework.domain.splitter.split`` with the SongUNet's
plan (``recipes.stormcast.parallelize.PLAN``), reproduce the single-device forward output,
input gradient and parameter gradients (summed over the domain ranks) in float64, for even
and uneven row splits on 2 and 4 ranks; the splitter refuses what it cannot split; each
domain rank reads only its rows.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from framework.domain import splitter
from framework.domain.comm import DomainGroup, split_extents
from framework.errors import ConfigError
from recipes.stormcast import layers
from recipes.stormcast.parallelize import PLAN
from recipes.stormcast.songunet import SongUNet
from recipes.weather.edm import EDMPrecond
from tests.framework.domain.helpers import band, compare_split, for_each_group, randomize
from tests.multiproc import spawn

pytestmark = pytest.mark.timeout(300)


def split(model, dg):
    """Split by the SongUNet's plan."""
    return splitter.split(model, dg, PLAN)


H, W, B = 16, 6, 2
# Rows per rank at the layer's input resolution. EVEN/UNEVEN: even numbers (the
# down-sampling layers need them); ODD: anything, for layers that keep or raise resolution.
SPLITS = {
    2: {"even": [8, 8], "uneven": [10, 6]},
    4: {"even": [4, 4, 4, 4], "uneven": [6, 2, 4, 4], "odd": [7, 1, 5, 3]},  # odd: a band of 1 row
}


def _layer_cases():
    """(name, factory, input channels, output rows per input row, needs even rows, takes emb)."""
    L = layers
    return [
        ("Conv2d 3x3", lambda: L.Conv2d(4, 6, 3), 4, 1, False, False),
        ("Conv2d 1x1", lambda: L.Conv2d(4, 6, 1), 4, 1, False, False),
        ("Conv2d 3x3 down", lambda: L.Conv2d(4, 6, 3, down=True), 4, 0.5, True, False),
        ("Conv2d 3x3 up", lambda: L.Conv2d(4, 6, 3, up=True), 4, 2, False, False),
        ("Conv2d 1x1 down (skip)", lambda: L.Conv2d(4, 6, 1, down=True), 4, 0.5, True, False),
        ("Conv2d 1x1 up (skip)", lambda: L.Conv2d(4, 6, 1, up=True), 4, 2, False, False),
        ("Conv2d kernel 0 down (resample)", lambda: L.Conv2d(4, 4, 0, down=True), 4, 0.5, True, False),
        ("Conv2d kernel 0 up (resample)", lambda: L.Conv2d(4, 4, 0, up=True), 4, 2, False, False),
        ("Conv2d 3x3 no bias", lambda: L.Conv2d(4, 6, 3, bias=False), 4, 1, False, False),
        ("GroupNorm", lambda: L.GroupNorm(8, eps=1e-6), 8, 1, False, False),
        ("Attention 1 head", lambda: L.Attention(8, 1), 8, 1, False, False),
        ("Attention 2 heads", lambda: L.Attention(8, 2), 8, 1, False, False),
        ("AdditivePosEmbed", lambda: L.AdditivePosEmbed(4, (H, W)), 4, 1, False, False),
        (
            "UNetBlock down + attention",
            lambda: L.UNetBlock(8, 8, emb_channels=12, down=True, attention=True, num_heads=2, eps=1e-6),
            8,
            0.5,
            True,
            True,
        ),
        ("UNetBlock up", lambda: L.UNetBlock(8, 4, emb_channels=12, up=True, eps=1e-6), 8, 2, False, True),
        (
            "UNetBlock resample_proj=False",
            lambda: L.UNetBlock(8, 8, emb_channels=12, down=True, resample_proj=False),
            8,
            0.5,
            True,
            True,
        ),
    ]


def _check_layers(group, world, rank):
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(B, 12, generator=g)
    checked = 0
    for kind, extents in SPLITS[world].items():
        dg = DomainGroup(group, extents)
        for i, (name, make, cin, scale, needs_even, takes_emb) in enumerate(_layer_cases()):
            if needs_even and kind == "odd":
                continue
            torch.manual_seed(i)
            module = randomize(make(), seed=i)
            x = torch.randn(B, cin, H, W, generator=torch.Generator().manual_seed(100 + i))
            compare_split(name, module, dg, x, split_fn=split, scale=scale, args=(emb,) if takes_emb else (), seed=i)
            checked += 1
    cases = _layer_cases()
    assert checked == len(SPLITS[world]) * len(cases) - ("odd" in SPLITS[world]) * sum(c[4] for c in cases)


def _layers_on_ranks(rank, world):
    for_each_group(rank, _check_layers)


def test_every_layer_matches_its_single_device_twin_on_2_and_4_ranks():
    spawn(_layers_on_ranks, 4)


# ------------------------------------------------------------------ the whole SongUNet


def _unet(rows, in_channels=5, **kw):
    kw = dict(dict(model_channels=8, channel_mult=[1, 2, 2], num_blocks=1, dropout=0.0), **kw)
    return SongUNet((rows, 16), in_channels, 3, **kw)


# (name, rows per split kind, SongUNet options). channel_mult [1, 2, 2]: rows split in
# multiples of 4; 16 rows split evenly, 20 rows (5 units of 4) unevenly on 2 and 4 ranks.
UNET_CASES = [
    (
        "zero embedding, attention at 8 rows + bottleneck, additive_pos_embed",
        16,
        dict(embedding_type="zero", attn_resolutions=[8], additive_pos_embed=True),
    ),
    (
        "positional embedding, attention at 10 rows + bottleneck, additive_pos_embed",
        20,
        dict(embedding_type="positional", attn_resolutions=[10], additive_pos_embed=True),
    ),
    (
        "zero embedding, attention at full resolution + bottleneck, gradient checkpointing",
        20,
        dict(embedding_type="zero", attn_resolutions=[20], checkpoint_level=3),
    ),  # 2 ranks only (time)
]


# float64 throughout (GroupNormMixin keeps float64 statistics), so the split UNet matches
# the whole one far inside the 1e-6 bar.
UNET_TOL = dict(rtol=1e-6, atol=1e-8)


def _check_unet(group, world, rank, tol=UNET_TOL):
    for i, (name, rows, kw) in enumerate(UNET_CASES):
        if kw.get("checkpoint_level") and world != 2:
            continue
        torch.manual_seed(i)
        plain = randomize(_unet(rows, **kw), seed=i, std=0.2)
        extents = split_extents(rows, world, plain.downsample_factor)
        assert (len(set(extents)) == 1) == (rows == 16), extents  # 16 rows even, 20 rows uneven
        name = f"{name}, {world} ranks"
        dg = DomainGroup(group, extents)
        g = torch.Generator().manual_seed(50 + i)
        x = torch.randn(B, 5, rows, 16, generator=g)
        args = (torch.rand(B, generator=g) * 5 + 0.1,) if kw["embedding_type"] == "positional" else ()
        compare_split(f"SongUNet {name}", plain, dg, x, split_fn=split, args=args, seed=i, tol=tol)

        # names, classes and checkpoints across the split
        split_model = split(copy.deepcopy(plain), dg)
        assert [n for n, _ in split_model.named_parameters()] == [n for n, _ in plain.named_parameters()]
        assert list(split_model.state_dict()) == list(plain.state_dict())
        spatial = (layers.Conv2d, layers.GroupNorm, layers.Attention, layers.AdditivePosEmbed)
        for mname, m in split_model.named_modules():
            if isinstance(m, spatial):
                assert type(m).__name__.startswith("Domain") and m._domain is dg, mname
        other = randomize(_unet(rows, **kw), seed=100 + i, std=0.2)
        split_model.load_state_dict(other.state_dict())  # unsplit -> split (strict)
        plain.load_state_dict(split_model.state_dict())  # split -> unsplit (strict)
        for (n, a), (_, b) in zip(plain.state_dict().items(), other.state_dict().items()):
            assert torch.equal(a, b), n
        if i == 0:  # and the loaded split model computes the loaded model's output
            with torch.no_grad():
                torch.testing.assert_close(
                    split_model(band(x, extents, rank), *args), band(other(x, *args), extents, rank), **tol
                )

    # The diffusion task's model: the EDM preconditioner around the net. It holds no parameters
    # and is per pixel, so the net's plan covers it without a rule of its own. (It computes in
    # float32, as in training: float32 tolerances.)
    rows = 20
    plain = EDMPrecond(
        randomize(_unet(rows, in_channels=3, embedding_type="positional"), seed=7, std=0.2), sigma_data=[0.5, 1.0, 2.0]
    ).float()
    extents = split_extents(rows, world, plain.net.downsample_factor)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(B, 3, rows, 16, generator=g, dtype=torch.float32)
    sigma = torch.rand(B, generator=g, dtype=torch.float32) * 5 + 0.1
    compare_split(
        f"EDMPrecond(SongUNet), {world} ranks",
        plain,
        DomainGroup(group, extents),
        x,
        split_fn=split,
        args=(sigma,),
        seed=7,
        tol=dict(rtol=1e-4, atol=1e-4),
    )


def _unet_on_ranks(rank, world):
    for_each_group(rank, _check_unet)


def test_whole_songunet_matches_the_unsplit_one_on_2_and_4_ranks():
    spawn(_unet_on_ranks, 4)


# ------------------------------------------------------------------ what the rules refuse


def _fake_domain(rows=16):
    return DomainGroup(None, [rows // 2, rows // 2])  # converts, never communicates


def test_a_resample_filter_other_than_box_is_refused():
    with pytest.raises(
        ConfigError,
        match=r"splitter: module 'enc\.\d+_down\.conv0' \(Conv2d\): resample_filter of "
        r"size \(4, 4\) is not supported over the domain axis; use \[1, 1\]",
    ):
        split(_unet(16, resample_filter=[1, 3, 3, 1]), _fake_domain())
    split(_unet(16, resample_filter=[1, 1]), _fake_domain())  # the DDPM++ box filter splits


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def test_dropout_under_deterministic_algorithms_is_refused(deterministic):
    with pytest.raises(
        ConfigError,
        match=r"splitter: module .* \(UNetBlock\): dropout > 0 with deterministic=true is "
        r"not supported over the domain axis",
    ):
        split(layers.UNetBlock(8, 8, emb_channels=4, dropout=0.1), _fake_domain())
    with pytest.raises(ConfigError, match="dropout > 0 with deterministic=true"):
        split(_unet(16, dropout=0.1), _fake_domain())
    split(_unet(16, dropout=0.0), _fake_domain())  # no dropout: fine


def test_dropout_without_deterministic_algorithms_splits():
    assert not torch.are_deterministic_algorithms_enabled()
    model = split(_unet(16, dropout=0.1), _fake_domain())
    assert type(model.enc["16_block0"].conv0).__name__ == "DomainConv2d"


def test_the_songunet_splits_through_the_registry_entry():
    from framework import registry
    from framework.config.schema import SplitterConfig

    model = _unet(16, attn_resolutions=[8], additive_pos_embed=True, embedding_type="positional")
    plan = registry.models.entry("songunet").split_plan  # what the runtime passes
    assert plan is PLAN
    out = registry.splitters.build(
        "rows",
        model,
        SplitterConfig(name="rows"),
        topology=None,
        domain=_fake_domain(),
        plan=plan,
        model_name="songunet",
    )
    assert out is model
    converted = {n for n, m in model.named_modules() if type(m).__name__.startswith("Domain")}
    assert {
        "pos_embed",
        "enc.16_conv",
        "enc.8_down.conv0",
        "enc.8_down.skip",
        "enc.8_block0.attn",
        "enc.8_block0.attn.norm",
        "dec.16_up.conv0",
        "out_norm",
        "out_conv",
    } <= converted
    assert not any(n.startswith("map_") for n in converted)  # the noise embedding is per sample


# ------------------------------------------------------------------ data per shard

ROWS, COLS, ROW_CHUNK = 64, 16, 16


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from recipes.weather.synthetic import write_synthetic

    return write_synthetic(
        tmp_path_factory.mktemp("rowband") / "store",
        height=ROWS,
        width=COLS,
        hours_per_year=6,
        years=(2020,),
        row_chunk=ROW_CHUNK,
        channel_chunk=1,  # a chunk per channel and band of rows: each read below is one of them
    )


def _dataset(root):
    from recipes.weather.dataset import HrrrEra5Dataset
    from recipes.weather.synthetic import DEFAULT_ERA5_CHANNELS, DEFAULT_HRRR_CHANNELS, DEFAULT_INVARIANTS

    return HrrrEra5Dataset(
        root, [2020], list(DEFAULT_HRRR_CHANNELS), list(DEFAULT_ERA5_CHANNELS), list(DEFAULT_INVARIANTS)
    )


def test_row_band_reads_exactly_its_rows_and_only_their_chunks(store, zarr_reads):
    """Chunk reads of zarr's LocalStore, counted (the zarr_reads fixture)."""
    from recipes.weather.task import RowBand

    calls = zarr_reads

    chunk_bytes = ROW_CHUNK * COLS * 4  # one (1, 1, ROW_CHUNK, COLS) float32 chunk; the rest is shard indexes

    def chunk_reads():
        return [c for c in calls if c[0].startswith("data/c") and c[1] == chunk_bytes]

    full_ds = _dataset(store)
    full_ds.read(0)  # opens the stores, caches the invariants
    calls.clear()
    full = full_ds[1]
    full_chunks, full_bytes = len(chunk_reads()), sum(n for _, n in calls)
    n_fields = len(full["state"]) + len(full["target"]) + len(full["background"])
    assert full_chunks == n_fields * ROWS // ROW_CHUNK

    for parts in (2, 3, 4):
        extents = split_extents(ROWS, parts, ROW_CHUNK)
        band_chunks = 0
        for rank, e in enumerate(extents):
            start = sum(extents[:rank])
            ds = RowBand(_dataset(store), slice(start, start + e))
            ds[0]
            calls.clear()
            sample = ds[1]
            assert sample.keys() == full.keys() and sample["index"] == 1
            for key in ("state", "target", "background", "invariants"):
                torch.testing.assert_close(sample[key], full[key][:, start : start + e], rtol=0, atol=0)
            chunks, nbytes = len(chunk_reads()), sum(n for _, n in calls)
            assert chunks == n_fields * e // ROW_CHUNK, (extents, rank)  # only the chunks of its rows
            assert nbytes < full_bytes
            band_chunks += chunks
        assert band_chunks == full_chunks  # the bands read each chunk of the sample once between them


def test_row_band_is_the_dataset_for_everything_but_the_rows(store):
    from recipes.weather.task import RowBand

    ds = _dataset(store)
    band_ds = RowBand(ds, slice(16, 48))
    assert len(band_ds) == len(ds) and band_ds.grid == ds.grid
    assert list(band_ds.hrrr_stds) == list(ds.hrrr_stds)
    again = pickle.loads(pickle.dumps(band_ds))  # DataLoader workers get a pickled copy
    torch.testing.assert_close(again[2]["state"], ds[2]["state"][:, 16:48], rtol=0, atol=0)


def _task(tmp_path, domain, rows=48):
    from types import SimpleNamespace

    from recipes.stormcast.config import SongUNetConfig
    from recipes.weather.config import RegressionTaskConfig, SyntheticDataConfig
    from recipes.weather.task import RegressionTask

    data = SyntheticDataConfig(root=str(tmp_path / "data"), grid=[rows, 16], hours_per_year=4)
    run = SimpleNamespace(data=data, model=SongUNetConfig(channel_mult=[1, 2, 2, 2, 2]), task=RegressionTaskConfig())
    return RegressionTask(run, SimpleNamespace(is_main=True), torch.device("cpu"), domain=domain)


def test_task_reads_its_band_and_weights_its_loss_by_pixel_share(tmp_path):
    from recipes.weather.task import RowBand

    extents = split_extents(48, 2, 16)
    assert extents == [32, 16]
    tasks = []
    for rank in range(2):
        dg = DomainGroup(None, extents)
        dg.rank = rank
        tasks.append(_task(tmp_path, dg))
    assert [t.rows for t in tasks] == [slice(0, 32), slice(32, 48)]
    assert [t.loss_weight for t in tasks] == pytest.approx([2 * 32 / 48, 2 * 16 / 48])
    whole = _task(tmp_path, None)
    assert whole.loss_weight == 1.0 and whole.rows is None

    train = tasks[1].train_dataset()
    assert isinstance(train, RowBand) and train.rows == slice(32, 48)
    assert train[0]["state"].shape[1:] == (16, 16)
    assert not isinstance(whole.train_dataset(), RowBand)

    # the ranks' weighted losses, averaged over the domain ranks (as DDP/FSDP2 average), are the
    # loss of the whole sample
    g = torch.Generator().manual_seed(0)
    batch = {
        k: torch.randn(2, c, 48, 16, generator=g)
        for k, c in (("state", 4), ("background", 3), ("invariants", 2), ("target", 4))
    }
    model = lambda x: x[:, :4] * 0.5  # noqa: E731  (any per-pixel map)
    local = [t.loss(model, {k: v[:, :, t.rows] for k, v in batch.items()}) for t in tasks]
    torch.testing.assert_close(sum(local) / 2, whole.loss(model, batch), rtol=1e-6, atol=0)


def test_a_refused_resample_filter_names_the_module():
    with pytest.raises(ConfigError, match=r"'enc\.8_down\.conv0'"):
        split(_unet(16, resample_filter=[1, 3, 3, 1]), _fake_domain())
