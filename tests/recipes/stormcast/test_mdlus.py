"""PhysicsNeMo .mdlus in and out (recipes/weather/mdlus.py), without PhysicsNeMo.

The archives here are built the way PhysicsNeMo's ``Module.save`` writes them (a stored zip, or
the legacy tar, of model.pt / args.json / metadata.json), with the reference's state-dict names
produced by this file's own renaming rules (written from the reference's module layout, not
taken from the reader), so the reader is checked against an independent statement of the names.
"""

from __future__ import annotations

import copy
import io
import json
import pickle
import re
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
import torch

from framework.errors import DataError
from recipes.stormcast.layers import GroupNorm
from recipes.stormcast.songunet import SongUNet
from recipes.stormscope.dit import DiT
from recipes.weather import mdlus
from recipes.weather.edm import EDMPrecond
from tests.conftest import MarkerPayload

GRID = (32, 48)
CHANNELS = {"hrrr_channels": ["u10m", "v10m", "t2m"], "era5_channels": ["u850"], "invariants": ["lsm"]}
SONG = dict(
    model_channels=16,
    channel_mult=[1, 2, 2],
    channel_mult_emb=4,
    num_blocks=1,
    attn_resolutions=[16],
    dropout=0.0,
    additive_pos_embed=True,
)


# -- the reference's names and archives, as this test states them ------------------------------------


def ref_song_name(key: str, rows: int) -> str:
    """Our SongUNet name -> PhysicsNeMo's: spatial_emb, {R}x{R} levels, dec.{H}x{H}_aux_norm/_aux_conv
    for the output head; the attention keeps its ``attn.{norm,qkv,proj}`` names (PhysicsNeMo 2.x)."""
    if key == "pos_embed.weight":
        return "spatial_emb"
    if key.startswith("out_norm."):
        return f"dec.{rows}x{rows}_aux_norm." + key[len("out_norm.") :]
    if key.startswith("out_conv."):
        return f"dec.{rows}x{rows}_aux_conv." + key[len("out_conv.") :]
    m = re.match(r"^(enc|dec)\.(\d+)_(.*)$", key)
    if m:
        return f"{m[1]}.{m[2]}x{m[2]}_" + m[3]
    return key


DIT_NAMES = [  # ours -> PhysicsNeMo DiT (tokenizer / conditioning_embedder / blocks / detokenizer)
    (r"^patch_embed\.proj\.", "tokenizer.x_embedder.proj."),
    (r"^pos_embed\.weight$", "tokenizer.pos_embed"),
    (r"^t_embed\.mlp\.", "conditioning_embedder.t_embedder.mlp."),
    (r"^t_embed\.scalars\.", "conditioning_embedder.cond_embedder."),
    (r"^(blocks\.\d+\.)attn\.", r"\1attention."),
    (r"^(blocks\.\d+\.)mlp\.fc1\.", r"\1linear.layers.0."),
    (r"^(blocks\.\d+\.)mlp\.fc2\.", r"\1linear.layers.2."),
    (r"^(blocks\.\d+\.)adaLN_modulation\.", r"\1adaptive_modulation."),
    (r"^final\.adaLN_modulation\.", "detokenizer.proj_layer.adaptive_modulation."),
    (r"^final\.linear\.", "detokenizer.proj_layer.output_projection."),
]


def ref_dit_name(key: str) -> str:
    for pat, rep in DIT_NAMES:
        new = re.sub(pat, rep, key)
        if new != key:
            return new
    raise AssertionError(f"no reference name for {key}")


def positional_freqs(channels: int, endpoint: bool) -> torch.Tensor:
    half = channels // 2
    return (1 / 10000) ** (torch.arange(half, dtype=torch.float32) / (half - (1 if endpoint else 0)))


def song_args(in_ch, out_ch, embedding_type, **over):
    """SongUNet's arguments as Module.__new__ records them (every one, defaults applied)."""
    return (
        dict(
            img_resolution=list(GRID),
            in_channels=in_ch,
            out_channels=out_ch,
            label_dim=0,
            augment_dim=0,
            model_channels=16,
            channel_mult=[1, 2, 2],
            channel_mult_emb=4,
            num_blocks=1,
            attn_resolutions=[16],
            dropout=0.0,
            label_dropout=0.0,
            embedding_type=embedding_type,
            channel_mult_noise=1,
            encoder_type="standard",
            decoder_type="standard",
            resample_filter=[1, 1],
            checkpoint_level=0,
            additive_pos_embed=True,
            bottleneck_attention=True,
            use_apex_gn=False,
            act="silu",
            profile_mode=False,
            amp_mode=False,
        )
        | over
    )


def regression_archive(model: SongUNet, **over):
    sd = {"model." + ref_song_name(k, GRID[0]): v for k, v in model.state_dict().items()}
    inner = song_args(model.in_channels, model.out_channels, "zero", **over)
    for k in ("img_resolution", "in_channels", "out_channels"):
        del inner[k]
    args = {
        "__name__": "StormCastUNet",
        "__module__": "physicsnemo.models.diffusion_unets.unet",
        "__args__": dict(
            img_resolution=list(GRID),
            img_in_channels=model.in_channels,
            img_out_channels=model.out_channels,
            use_fp16=False,
            sigma_min=0,
            sigma_max=float("inf"),
            sigma_data=0.5,
            model_type="SongUNet",
            **inner,
        ),
    }
    return sd, args, {"mdlus_file_version": "0.1.0", "physicsnemo_version": "1.2.0"}


def preconditioned_archive(precond: EDMPrecond, net_entry: dict, names, constants: dict, sigma_data=0.5):
    sd = {"model.model." + names(k[len("net.") :]): v for k, v in precond.state_dict().items() if k != "sigma_data"}
    sd.update({"model.model." + k: v for k, v in constants.items()})
    sd["sigma_data"] = torch.tensor(sigma_data)
    args = {
        "__name__": "EDMPreconditioner",
        "__module__": "physicsnemo.diffusion.preconditioners",
        "__args__": {"model": "__physicsnemo.Module__.model", "sigma_data": sigma_data},
        "__physicsnemo.Module__.model": {
            "__name__": "ConcatConditionWrapper",
            "__module__": "physicsnemo.diffusion.utils.model_wrappers",
            "__args__": {
                "model": "__physicsnemo.Module__.model.model",
                "image_cond_key": "cond_concat",
                "vector_cond_key": "cond_vec",
            },
        },
        "__physicsnemo.Module__.model.model": net_entry,
    }
    meta = {
        "mdlus_file_version": "0.1.0",
        "physicsnemo_version": "1.2.0",
        "__physicsnemo.Module__.model.mdlus_file_version": "0.1.0",
        "__physicsnemo.Module__.model.model.mdlus_file_version": "0.2.0" if net_entry["__name__"] == "DiT" else "0.1.0",
    }
    return sd, args, meta


def save_like_physicsnemo(path: Path, sd, args, meta, fmt="zip", members=None):
    """What Module.save writes: a stored zip (default) or a plain tar of the three members."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    files = {
        "model.pt": buf.getvalue(),
        "args.json": json.dumps(args).encode(),
        "metadata.json": json.dumps(meta).encode(),
    }
    files = members(files) if members else files
    if fmt == "zip":
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
            for name, data in files.items():
                zf.writestr(name, data)
    else:
        with tarfile.open(path, "w") as tf:
            for name, data in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path


def perturb_(model, seed=0, std=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)
    return model


def regression_model(seed=0):
    torch.manual_seed(seed)
    return perturb_(SongUNet(GRID, 5, 3, embedding_type="zero", **SONG), seed).eval()


def diffusion_model(seed=0):
    torch.manual_seed(seed)
    return perturb_(EDMPrecond(SongUNet(GRID, 10, 3, embedding_type="positional", **SONG), 0.5), seed).eval()


def dit_model(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = (
        dict(
            patch_size=4, hidden_size=32, depth=2, num_heads=4, attn_kernel=3, num_scalar_conditions=2, mask_token=True
        )
        | kw
    )
    return perturb_(EDMPrecond(DiT(GRID, 10, 3, **cfg), 0.5), seed).eval()


def dit_entry(net: DiT, **over):
    return {
        "__name__": "DiT",
        "__module__": "physicsnemo.models.dit.dit",
        "__args__": dict(
            input_size=list(GRID),
            in_channels=net.in_channels,
            patch_size=net.patch_size,
            tokenizer="patch_embed_2d",
            detokenizer="proj_reshape_2d",
            out_channels=net.out_channels,
            hidden_size=32,
            depth=2,
            num_heads=4,
            mlp_ratio=4.0,
            attention_backend="natten2d",
            layernorm_backend="apex",
            condition_dim=2,
            conditioning_embedder="dit",
            dit_initialization=True,
            conditioning_embedder_kwargs={},
            tokenizer_kwargs={},
            detokenizer_kwargs={},
            block_kwargs={},
            attn_kwargs={"attn_kernel": 3},
            drop_path_rates=None,
            force_tokenization_fp32=False,
            use_nan_mask_tokens=True,
        )
        | over,
    }


def song_entry(in_ch, out_ch):
    return {
        "__name__": "SongUNet",
        "__module__": "physicsnemo.models.diffusion_unets.song_unet",
        "__args__": song_args(in_ch, out_ch, "positional"),
    }


def diffusion_archive(model):
    return preconditioned_archive(
        model,
        song_entry(10, 3),
        lambda k: ref_song_name(k, GRID[0]),
        {"map_noise.freqs": positional_freqs(16, endpoint=True)},
    )


def dit_archive(model, **over):
    return preconditioned_archive(
        model,
        dit_entry(model.net, **over),
        ref_dit_name,
        {"conditioning_embedder.t_embedder.freqs": positional_freqs(32, endpoint=False)},
    )


def loaded(path, **kw):
    config, weights = mdlus.read_mdlus(path, **kw)
    model = mdlus.build_model(config)
    model.load_state_dict(weights)
    return config, weights, model.eval()


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(2, 3, *GRID, generator=g),
        torch.rand(2, generator=g) * 5 + 0.1,
        torch.randn(2, 7, *GRID, generator=g),
        torch.randn(2, 2, generator=g),
    )


# -- reading ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["zip", "tar"])
def test_regression_archive_loads_into_our_songunet_with_equal_outputs(tmp_path, fmt):
    model = regression_model()
    path = save_like_physicsnemo(tmp_path / "regression.mdlus", *regression_archive(model), fmt=fmt)
    config, weights, ours = loaded(path, channels=CHANNELS)
    assert config["name"] == "songunet" and config["task"] == {"name": "stormcast_regression", "residual": False}
    assert (config["in_channels"], config["out_channels"], config["img_resolution"]) == (5, 3, list(GRID))
    assert config["model"] == {"name": "songunet", **SONG, "embedding_type": "zero", "checkpoint_level": 0}
    assert config["channels"] == CHANNELS and config["format"] == "physicsnemo"
    assert config["source"]["class"] == "physicsnemo.models.diffusion_unets.unet.StormCastUNet"
    for k, v in model.state_dict().items():  # the weights renamed back, bit for bit
        assert torch.equal(weights[k], v), k
    x = torch.randn(2, 5, *GRID)
    with torch.no_grad():
        assert torch.equal(ours(x), model(x))


@pytest.mark.parametrize("fmt", ["zip", "tar"])
def test_diffusion_archive_loads_into_our_preconditioned_songunet(tmp_path, fmt):
    model = diffusion_model()
    path = save_like_physicsnemo(tmp_path / "diffusion.mdlus", *diffusion_archive(model), fmt=fmt)
    config, weights, ours = loaded(path, channels=CHANNELS)
    assert config["task"]["name"] == "stormcast_diffusion" and config["task"]["residual"]
    assert config["task"]["conditions"] == ["state", "regression", "invariants"]
    assert config["task"]["edm"]["sigma_data"] == [0.5] and config["task"]["regression"] is None
    assert config["model"]["embedding_type"] == "positional" and config["in_channels"] == 10
    y, sigma, cond, _ = inputs()
    with torch.no_grad():
        assert torch.equal(ours(y, sigma, cond), model(y, sigma, cond))


def test_stormscope_dit_archive_loads_into_our_dit(tmp_path):
    model = dit_model()
    path = save_like_physicsnemo(tmp_path / "stormscope.mdlus", *dit_archive(model))
    config, _, ours = loaded(path)
    assert config["name"] == "dit" and config["task"]["name"] == "stormscope"
    assert config["model"] == {
        "name": "dit",
        "patch_size": 4,
        "hidden_size": 32,
        "depth": 2,
        "num_heads": 4,
        "mlp_ratio": 4.0,
        "attn_kernel": 3,
        "pos_embed": "learned",
        "num_scalar_conditions": 2,
        "mask_token": True,
        "checkpoint_blocks": False,
        "attn_impl": "auto",
    }
    assert config["channels"] == {"hrrr_channels": None, "era5_channels": None, "invariants": None}
    y, sigma, cond, scalars = inputs()
    mask = torch.zeros(2, 1, *GRID, dtype=torch.bool)
    mask[0, :, 3:9, 10:13] = True
    with torch.no_grad():  # the DiT itself: noise labels, scalar conditions and an invalid-pixel mask
        x = torch.cat([y, cond], 1)
        assert torch.equal(
            ours.net(x, sigma.log() / 4, scalars, mask=mask), model.net(x, sigma.log() / 4, scalars, mask=mask)
        )
    assert torch.equal(ours.sigma_data, model.sigma_data)


@pytest.mark.parametrize("variant", ["rope", "no positions", "legacy names"])
def test_dit_variants(tmp_path, variant):
    if variant == "rope":
        model, over = dit_model(pos_embed="rope"), dict(attention_backend="natten2d_rope")
    elif variant == "no positions":
        model, over = dit_model(pos_embed="none"), dict(tokenizer_kwargs={"pos_embed": "none"})
    else:
        model, over = dit_model(), {}
    sd, args, meta = dit_archive(model, **over)
    if variant == "legacy names":  # older PhysicsNeMo: timestep embedder at the root, timm-style MLP names
        sd = {
            k.replace("conditioning_embedder.t_embedder.", "t_embedder.")
            .replace("linear.layers.0.", "linear.fc1.")
            .replace("linear.layers.2.", "linear.fc2."): v
            for k, v in sd.items()
        }
    path = save_like_physicsnemo(tmp_path / "v.mdlus", sd, args, meta)
    config, weights, _ = loaded(path)
    assert config["model"]["pos_embed"] == {"rope": "rope", "no positions": "none"}.get(variant, "learned")
    for k, v in model.state_dict().items():
        assert torch.equal(weights[k], v), k


def test_legacy_edm_attention_names_are_read(tmp_path):
    """EDM's own layout keeps a block's attention GroupNorm/qkv/proj on the block (norm2, qkv, proj)."""
    model = regression_model()
    sd, args, meta = regression_archive(model)
    sd = {re.sub(r"\.attn\.(qkv|proj)\.", r".\1.", k.replace(".attn.norm.", ".norm2.")): v for k, v in sd.items()}
    assert any(".norm2." in k and ".attn." not in k for k in sd)
    _, weights, _ = loaded(save_like_physicsnemo(tmp_path / "edm.mdlus", sd, args, meta))
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


# -- writing ------------------------------------------------------------------------------------


def export_config(kind: str) -> dict:
    from recipes.weather.diffusion import DiffusionTask
    from recipes.weather.task import RegressionTask

    data = {**CHANNELS, "grid": list(GRID)}
    if kind == "regression":
        model = {"name": "songunet", **SONG, "embedding_type": "zero", "checkpoint_level": 0}
        return RegressionTask.export_spec(
            {"model": model, "data": data, "task": {"name": "stormcast_regression", "residual": False}}
        )
    if kind == "diffusion":
        model = {"name": "songunet", **SONG, "embedding_type": "positional", "checkpoint_level": 0}
        task = {
            "name": "stormcast_diffusion",
            "conditions": ["state", "regression", "invariants"],
            "residual": True,
            "regression": "reg.pt",
            "edm": {"sigma_data": [0.5]},
        }
    else:
        model = {
            "name": "dit",
            "patch_size": 4,
            "hidden_size": 32,
            "depth": 2,
            "num_heads": 4,
            "mlp_ratio": 4.0,
            "attn_kernel": 3,
            "pos_embed": "learned",
            "num_scalar_conditions": 2,
            "mask_token": True,
            "checkpoint_blocks": False,
            "attn_impl": "auto",
        }
        task = {
            "name": "stormscope",
            "conditions": ["state", "background", "invariants"],
            "residual": False,
            "edm": {"sigma_data": [0.5, 0.4, 0.3]},
        }
    return DiffusionTask.export_spec({"model": model, "data": data, "task": task})


@pytest.mark.parametrize("kind", ["regression", "diffusion", "stormscope"])
def test_writer_output_has_the_reference_layout_and_reimports_bit_exactly(tmp_path, kind):
    config = export_config(kind)
    model = perturb_(mdlus.build_model(config), seed=3)
    weights = model.state_dict()
    # an exported .pt with its .json beside it, as python -m framework.export writes them
    torch.save(weights, tmp_path / "model.pt")
    (tmp_path / "model.json").write_text(json.dumps(config))
    out = mdlus.export_mdlus(tmp_path / "model.pt", tmp_path / "out.mdlus")

    with zipfile.ZipFile(out) as zf:
        assert zf.namelist() == ["model.pt", "args.json", "metadata.json"]
        assert all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())
        sd = torch.load(io.BytesIO(zf.read("model.pt")), weights_only=True)
        args, meta = json.loads(zf.read("args.json")), json.loads(zf.read("metadata.json"))
    rows = GRID[0]
    if kind == "regression":
        want = {"model." + ref_song_name(k, rows) for k in weights}
        assert args["__name__"] == "StormCastUNet" and args["__args__"]["model_type"] == "SongUNet"
        assert args["__args__"]["img_in_channels"] == 5 and args["__args__"]["embedding_type"] == "zero"
    else:
        names = (lambda k: ref_song_name(k, rows)) if kind == "diffusion" else ref_dit_name
        want = {"model.model." + names(k[4:]) for k in weights if k != "sigma_data"} | {"sigma_data"}
        want |= (
            {"model.model.map_noise.freqs"}
            if kind == "diffusion"
            else {"model.model.conditioning_embedder.t_embedder.freqs"}
        )
        net = args["__physicsnemo.Module__.model.model"]
        assert args["__name__"] == "EDMPreconditioner"
        assert args["__physicsnemo.Module__.model"]["__name__"] == "ConcatConditionWrapper"
        assert net["__name__"] == ("SongUNet" if kind == "diffusion" else "DiT")
        assert meta["__physicsnemo.Module__.model.model.mdlus_file_version"] in ("0.1.0", "0.2.0")
    assert set(sd) == want
    assert "mdlus_file_version" in meta and "physicsnemo_version" in meta

    config2, weights2 = mdlus.read_mdlus(out, channels=CHANNELS)
    assert list(weights2) == list(weights)
    for k, v in weights.items():
        assert v.dtype == weights2[k].dtype and torch.equal(v, weights2[k]), k
    assert config2["model"] == config["model"] and config2["kwargs"] == config["kwargs"]
    assert config2["task"]["name"] == config["task"]["name"]
    if kind != "regression":
        assert config2["task"]["edm"]["sigma_data"] == config["task"]["edm"]["sigma_data"]


def test_writer_refuses_weights_that_do_not_fit(tmp_path):
    config = export_config("regression")
    weights = mdlus.build_model(config).state_dict()
    weights["enc.32_conv.weight"] = torch.zeros(1)
    with pytest.raises(DataError, match="enc.32_conv.weight"):
        mdlus.write_mdlus(weights, config, tmp_path / "x.mdlus")
    del weights["enc.32_conv.weight"]
    with pytest.raises(DataError, match=r"missing \['enc.32_conv.weight'\]"):
        mdlus.write_mdlus(weights, config, tmp_path / "x.mdlus")
    residual = config | {"task": {"name": "stormcast_regression", "residual": True}}
    with pytest.raises(DataError, match="residual=true"):
        mdlus.write_mdlus(mdlus.build_model(config).state_dict(), residual, tmp_path / "x.mdlus")
    assert not list(tmp_path.iterdir())


# -- names for the paper-size models ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["regression", "diffusion", "stormscope"])
def test_name_mapping_is_one_to_one_for_the_paper_models(kind):
    config = export_config(kind)
    if kind == "stormscope":
        model = {
            "name": "dit",
            "patch_size": 4,
            "hidden_size": 768,
            "depth": 16,
            "num_heads": 16,
            "mlp_ratio": 4.0,
            "attn_kernel": 31,
            "pos_embed": "learned",
            "num_scalar_conditions": 3,
            "mask_token": True,
            "checkpoint_blocks": False,
            "attn_impl": "auto",
        }
        grid, io_ = [512, 640], (10, 5)
    else:
        model = {
            "name": "songunet",
            "model_channels": 128,
            "channel_mult": [1, 2, 2, 2, 2],
            "channel_mult_emb": 4,
            "num_blocks": 4,
            "attn_resolutions": [],
            "dropout": 0.0,
            "additive_pos_embed": True,
            "embedding_type": "zero" if kind == "regression" else "positional",
            "checkpoint_level": 0,
        }
        grid, io_ = [512, 640], ((127, 99) if kind == "regression" else (299, 99))
    config = config | {
        "model": model,
        "img_resolution": grid,
        "in_channels": io_[0],
        "out_channels": io_[1],
        "kwargs": {
            **{k: v for k, v in model.items() if k != "name"},
            "img_resolution": grid,
            "in_channels": io_[0],
            "out_channels": io_[1],
        },
    }
    keys = list(mdlus.build_model(config, device="meta").state_dict())
    names = mdlus.reference_names(config, keys)
    assert len(set(names.values())) == len(keys)
    assert all(mdlus._from_reference_name(config, r) == k for k, r in names.items())
    if kind != "stormscope":
        rows = grid[0]
        assert all(names[k].endswith(ref_song_name(k.removeprefix("net."), rows)) for k in keys if k != "sigma_data")
        assert f"{'model.' if kind == 'regression' else 'model.model.'}dec.512x512_aux_conv.weight" in names.values()
        assert any(".attn.norm." in n for n in names.values())  # the bottleneck's attention
    else:
        assert all(names[k] == "model.model." + ref_dit_name(k[4:]) for k in keys if k != "sigma_data")


# -- refusals -----------------------------------------------------------------------------------


def _crafted_torch(marker):
    buf = io.BytesIO()
    torch.save({"model.spatial_emb": MarkerPayload(marker)}, buf)
    return buf.getvalue()


def test_crafted_pickles_are_refused_in_one_line_and_never_run(tmp_path):
    marker = tmp_path / "marker"
    pickle.loads(pickle.dumps(MarkerPayload(tmp_path / "proof")))  # the payload works when unpickled...
    assert (tmp_path / "proof").exists()
    model = regression_model()
    sd, args, meta = regression_archive(model)
    for i, payload in enumerate((_crafted_torch(marker), pickle.dumps({"w": MarkerPayload(marker)}))):
        for fmt in ("zip", "tar"):
            path = save_like_physicsnemo(
                tmp_path / f"bomb{i}.{fmt}.mdlus", sd, args, meta, fmt=fmt, members=lambda f: f | {"model.pt": payload}
            )
            with pytest.raises(DataError) as e:
                mdlus.read_mdlus(path)
            msg = str(e.value)
            assert "\n" not in msg and path.name in msg and "weights_only" in msg, msg
            assert not marker.exists()  # ...but never here


def _bad(tmp_path, name, sd=None, args=None, meta=None, members=None, fmt="zip"):
    model = regression_model()
    sd0, args0, meta0 = regression_archive(model)
    return save_like_physicsnemo(
        tmp_path / f"{name}.mdlus",
        sd if sd is not None else sd0,
        args if args is not None else args0,
        meta if meta is not None else meta0,
        fmt=fmt,
        members=members,
    )


def _args(**over):
    _, args, _ = regression_archive(regression_model())
    args["__args__"].update(over)
    return args


def _sd(edit):
    sd, _, _ = regression_archive(regression_model())
    edit(sd)
    return sd


MALFORMED = [
    (
        "missing member",
        dict(members=lambda f: {k: v for k, v in f.items() if k != "metadata.json"}),
        "'metadata.json' is missing",
    ),
    ("extra member", dict(members=lambda f: f | {"evil.py": b"import os"}), "unexpected archive member 'evil.py'"),
    (
        "tar: extra member",
        dict(fmt="tar", members=lambda f: f | {"../model.pt": b"x"}),
        "unexpected archive member '../model.pt'",
    ),
    (
        "unknown class",
        dict(args={"__name__": "Popen", "__module__": "subprocess", "__args__": {"args": "ls"}}),
        "subprocess.Popen, not a known PhysicsNeMo",
    ),
    (
        "known name, foreign module",
        dict(args={"__name__": "SongUNet", "__module__": "os", "__args__": {}}),
        "os.SongUNet, not a known PhysicsNeMo",
    ),
    ("unknown argument", dict(args=_args(frobnicate=True)), "argument 'frobnicate'"),
    ("unsupported argument value", dict(args=_args(encoder_type="residual")), "encoder_type='residual'"),
    ("other model type", dict(args=_args(model_type="SongUNetPosEmbd")), "model_type='SongUNetPosEmbd'"),
    (
        "wrong shape",
        dict(sd=_sd(lambda sd: sd.update({"model.enc.32x32_conv.weight": torch.zeros(16, 4, 3, 3)}))),
        "'model.enc.32x32_conv.weight' has shape (16, 4, 3, 3)",
    ),
    (
        "missing tensor",
        dict(sd=_sd(lambda sd: sd.pop("model.dec.32x32_aux_conv.bias"))),
        "e.g. 'model.dec.32x32_aux_conv.bias'",
    ),
    (
        "extra tensor",
        dict(sd=_sd(lambda sd: sd.update({"model.enc.32x32_extra.weight": torch.zeros(1)}))),
        "'model.enc.32x32_extra.weight' has no counterpart",
    ),
    ("not a state dict", dict(sd=[torch.zeros(1)]), "holds a list"),
    ("bad json", dict(members=lambda f: f | {"args.json": b"{not json"}), "args.json is not valid JSON"),
    ("unknown file version", dict(meta={"mdlus_file_version": "9.0.0"}), "'9.0.0', not one this reader knows"),
]


@pytest.mark.parametrize("name,kw,expect", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_archives_are_refused_in_one_line(tmp_path, name, kw, expect):
    path = _bad(tmp_path, name.replace(" ", "_").replace(":", ""), **kw)
    with pytest.raises(DataError) as e:
        mdlus.read_mdlus(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(path)), msg
    assert expect in msg, msg


def test_more_refusals(tmp_path, monkeypatch):
    not_archive = tmp_path / "plain.mdlus"
    not_archive.write_bytes(b"hello")
    with pytest.raises(DataError, match="neither a zip nor a tar"):
        mdlus.read_mdlus(not_archive)
    with pytest.raises(DataError, match="no such file"):
        mdlus.read_mdlus(tmp_path / "absent.mdlus")
    # a tar member that is a link
    link = tmp_path / "link.mdlus"
    good = _bad(tmp_path, "good", fmt="tar")
    with tarfile.open(good) as src, tarfile.open(link, "w") as dst:
        for m in src.getmembers():
            if m.name == "args.json":
                info = tarfile.TarInfo("args.json")
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                dst.addfile(info)
            else:
                dst.addfile(m, src.extractfile(m))
    with pytest.raises(DataError, match="'args.json' is not a regular file"):
        mdlus.read_mdlus(link)
    # sizes are checked before anything is read
    monkeypatch.setattr(mdlus, "MAX_JSON_BYTES", 100)
    with pytest.raises(DataError, match=r"'args.json' is \d+ bytes \(limit 100\)"):
        mdlus.read_mdlus(good)
    monkeypatch.undo()
    # channel counts that do not fit the model
    with pytest.raises(DataError, match="maps 5 -> 3 channels"):
        mdlus.read_mdlus(good, channels=CHANNELS | {"invariants": []})
    # a constant buffer with other values than ours computes
    model = diffusion_model()
    sd, args, meta = diffusion_archive(model)
    sd["model.model.map_noise.freqs"] = sd["model.model.map_noise.freqs"] * 2
    with pytest.raises(DataError, match="constant buffer 'model.model.map_noise.freqs' differs"):
        mdlus.read_mdlus(save_like_physicsnemo(tmp_path / "freqs.mdlus", sd, args, meta))
    # a bare SongUNet cannot tell regression from diffusion; an EDM embedder DiT is another model
    with pytest.raises(DataError, match="bare SongUNet"):
        mdlus.read_mdlus(_bad(tmp_path, "bare", args=song_entry(5, 3)))
    dsd, dargs, dmeta = dit_archive(dit_model(), conditioning_embedder="edm")
    with pytest.raises(DataError, match="conditioning_embedder='edm'"):
        mdlus.read_mdlus(save_like_physicsnemo(tmp_path / "edm_dit.mdlus", dsd, dargs, dmeta))


def test_describe_reads_no_weights(tmp_path):
    path = _bad(tmp_path, "crafted", members=lambda f: f | {"model.pt": _crafted_torch(tmp_path / "m")})
    config = mdlus.describe_mdlus(path)  # model.pt is never opened
    assert config["name"] == "songunet" and config["weights"] == path.name
    assert mdlus.is_mdlus(path) and not mdlus.is_mdlus(tmp_path / "absent.pt")
    assert not (tmp_path / "m").exists()


HOSTILE_ARGS = [  # (net, argument overrides, what the one line says): each crashed, or was misread, before
    ("dit", dict(mlp_ratio="abc"), "DiT: mlp_ratio='abc' must be a finite number"),
    ("dit", dict(mlp_ratio=float("inf")), "DiT: mlp_ratio=inf must be a finite number"),  # JSON's Infinity
    ("dit", dict(condition_dim="x"), "DiT: condition_dim='x' must be an int or null"),
    ("dit", dict(conditioning_embedder_kwargs=[1]), "DiT: conditioning_embedder_kwargs=[1] must be an object"),
    ("dit", dict(tokenizer_kwargs=5), "DiT: tokenizer_kwargs=5 must be an object"),
    ("dit", dict(attn_kwargs="abc"), "DiT: attn_kwargs='abc' must be an object"),
    ("dit", dict(attn_kwargs={"attn_kernel": "3"}), "DiT attn_kwargs: attn_kernel='3' must be an int"),
    ("dit", dict(use_nan_mask_tokens="false"), "DiT: use_nan_mask_tokens='false' must be a boolean"),  # was True
    ("dit", dict(tokenizer_kwargs={"pos_embed": "sincos"}), "DiT: tokenizer pos_embed='sincos' is not supported"),
    ("songunet", dict(attn_resolutions="x"), "StormCastUNet: attn_resolutions='x' must be a list of ints"),
    ("songunet", dict(additive_pos_embed="no"), "StormCastUNet: additive_pos_embed='no' must be a boolean"),
]


@pytest.mark.parametrize("net,over,expect", HOSTILE_ARGS, ids=[f"{n}-{o}" for n, o, _ in HOSTILE_ARGS])
def test_args_json_values_of_another_type_are_refused_in_one_line_naming_the_argument(tmp_path, net, over, expect):
    archive = dit_archive(dit_model(), **over) if net == "dit" else regression_archive(regression_model(), **over)
    path = save_like_physicsnemo(tmp_path / "hostile.mdlus", *archive)
    with pytest.raises(DataError) as e:
        mdlus.read_mdlus(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(path)) and expect in msg, msg


def test_an_args_json_beyond_its_weights_or_unbuildable_is_refused_in_one_line(tmp_path, monkeypatch):
    """The file's tensors bound the model its args.json may describe: far wider or deeper ones are
    refused before any build (a meta-device build of 2**36 channels overflowed; one of millions of
    blocks is millions of Python modules); arguments our constructor refuses are one line too."""
    built, real = [], mdlus.build_model
    monkeypatch.setattr(mdlus, "build_model", lambda *a, **k: built.append(1) or real(*a, **k))
    cases = [
        ("song_wide", regression_archive(regression_model(), model_channels=2**36), "songunet model of at least"),
        ("dit_wide", dit_archive(dit_model(), hidden_size=2**36), "dit model of at least"),
        ("dit_deep", dit_archive(dit_model(), depth=2000), "dit model of at least"),
    ]
    for name, archive, expect in cases:
        path = save_like_physicsnemo(tmp_path / f"{name}.mdlus", *archive)
        with pytest.raises(DataError) as e:
            mdlus.read_mdlus(path)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(str(path)) and expect in msg and "model.pt holds" in msg, msg
    assert not built
    sd, args, meta = regression_archive(regression_model())
    args["__args__"]["img_resolution"] = [34, GRID[1]]  # rows not a multiple of the 4x down-sampling
    path = save_like_physicsnemo(tmp_path / "rows.mdlus", sd, args, meta)
    with pytest.raises(DataError, match=r"^\S+rows.mdlus: args.json describes no songunet model we can build \(.*34"):
        mdlus.read_mdlus(path)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int64])
def test_weights_that_are_not_floating_point_are_refused(tmp_path, dtype):
    """A complex weight would be cast to its real part (a warning at most), an integer one to
    float: either is another model than the file's; one line naming the tensor."""
    sd, args, meta = regression_archive(regression_model())
    key = f"model.enc.{GRID[0]}x{GRID[0]}_conv.weight"
    sd[key] = sd[key].to(dtype)
    path = save_like_physicsnemo(tmp_path / "dtype.mdlus", sd, args, meta)
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(DataError, match=rf"dtype.mdlus: model.pt tensor '{key}' is {name}, not floating point$"):
        mdlus.read_mdlus(path)


def test_non_finite_weights_are_refused(tmp_path, monkeypatch):
    """NaN or Inf in a weight only showed later, as a non-finite loss (exit 4): one line naming the
    tensor, from the reader, which weights.load then does not check a second time."""
    from recipes.weather import weights

    sd, args, meta = regression_archive(regression_model())
    key = f"model.enc.{GRID[0]}x{GRID[0]}_conv.weight"
    for bad in (float("nan"), float("inf")):
        sd[key] = sd[key].clone()
        sd[key].view(-1)[3] = bad
        path = save_like_physicsnemo(tmp_path / "nan.mdlus", sd, args, meta)
        with pytest.raises(
            DataError, match=rf"nan.mdlus: model.pt tensor '{key}' holds non-finite values \(NaN or Inf\)$"
        ):
            mdlus.read_mdlus(path)
        with pytest.raises(DataError, match=rf"nan.mdlus: model.pt tensor '{key}' holds non-finite values"):
            weights.load(path)
    checked = {"reader": [], "load": []}
    real = mdlus.first_non_finite
    monkeypatch.setattr(mdlus, "first_non_finite", lambda w: checked["reader"].extend(w) or real(w))
    monkeypatch.setattr(weights, "first_non_finite", lambda w: checked["load"].extend(w) or real(w))
    good = save_like_physicsnemo(tmp_path / "good.mdlus", *regression_archive(regression_model()))
    weights.load(good)
    assert checked["reader"] and not checked["load"], "the weights checked twice"


@pytest.mark.parametrize("sigma", [float("inf"), [0.5, float("nan")]])
def test_a_non_finite_sigma_data_is_refused(tmp_path, sigma):
    """JSON's Infinity and NaN passed as positive numbers before."""
    model = dit_model()
    sd, args, meta = dit_archive(model)
    args["__args__"]["sigma_data"] = sigma
    path = save_like_physicsnemo(tmp_path / "sigma.mdlus", sd, args, meta)
    with pytest.raises(DataError, match=r"sigma.mdlus: args.json sigma_data=.* must be positive numbers$"):
        mdlus.read_mdlus(path)


def test_an_archive_of_many_members_is_refused_at_once(tmp_path):
    """Members are counted in one pass: 20000 empty ones (1.7 MB) took 5 s when each name was
    counted across the whole list (60000: 50 s), and take 0.1 s."""
    path = tmp_path / "many.mdlus"
    with zipfile.ZipFile(path, "w") as zf:
        for i in range(20000):
            zf.writestr(str(i), b"")
    start = time.perf_counter()
    with pytest.raises(DataError, match=r"unexpected archive member '0' \(one of 20000 members; a .mdlus holds"):
        mdlus.read_mdlus(path)
    assert time.perf_counter() - start < 1.5


# -- the reference's eval-mode GroupNorm --------------------------------------------------------


def test_reference_groupnorm_uses_the_unbiased_variance_in_eval_only():
    model = regression_model()
    x = torch.randn(2, 5, *GRID)
    with torch.no_grad():
        plain = model(x)
        mdlus.use_reference_groupnorm(model)
        assert all(type(m) is not GroupNorm for m in model.modules() if isinstance(m, GroupNorm))
        ref = model(x)
        assert not torch.equal(ref, plain)
        gn = model.out_norm
        h = torch.randn(2, 16, 8, 8)
        g = h.reshape(2, gn.num_groups, -1)
        want = (g - g.mean(-1, keepdim=True)) / (g.var(-1, unbiased=True, keepdim=True) + gn.eps).sqrt()
        want = want.reshape(h.shape) * gn.weight[None, :, None, None] + gn.bias[None, :, None, None]
        torch.testing.assert_close(gn(h), want)
        model.train()
        torch.testing.assert_close(gn(h), torch.nn.functional.group_norm(h, gn.num_groups, gn.weight, gn.bias, gn.eps))
        model.eval()
        mdlus.use_reference_groupnorm(model, enable=False)
        assert torch.equal(model(x), plain)
        assert list(model.state_dict()) == list(regression_model().state_dict())


def test_an_args_json_larger_than_its_weights_is_refused_before_the_model_is_built(tmp_path, monkeypatch):
    """weights.load reads a .mdlus's model.pt before it builds the model of its args.json: a
    crafted args.json (a model 64 times wider than its weights) is refused by the bound the file's
    tensors set, before even a meta-device build; one twice as wide, by the shape check against
    that build; neither is ever allocated."""
    from recipes.weather import weights

    sd, args, meta = regression_archive(regression_model())
    wider = copy.deepcopy(args)
    wider["__args__"]["model_channels"] *= 2
    wider = save_like_physicsnemo(tmp_path / "wider.mdlus", sd, wider, meta)
    args["__args__"]["model_channels"] *= 64
    big = save_like_physicsnemo(tmp_path / "big.mdlus", sd, args, meta)
    built, real = [], weights.build
    monkeypatch.setattr(weights, "build", lambda info: built.append(info.path) or real(info))
    with pytest.raises(DataError, match=r"wider.mdlus: model.pt tensor .* has shape"):
        weights.load(wider)
    meta_built, real_meta = [], mdlus.build_model
    monkeypatch.setattr(mdlus, "build_model", lambda *a, **k: meta_built.append(1) or real_meta(*a, **k))
    with pytest.raises(DataError, match=r"big.mdlus: args.json describes a songunet model of at least \d+ weights"):
        weights.load(big)
    assert not meta_built
    # the same shapes as expanded views of one zero each: a small file that matches every shape
    with torch.device("meta"):  # the shapes only
        wide = SongUNet(GRID, 5, 3, embedding_type="zero", **(SONG | {"model_channels": 16 * 64}))
    wide = regression_archive(wide)[0]
    views = {k: torch.zeros((), dtype=v.dtype).expand(v.shape) for k, v in wide.items()}
    expanded = save_like_physicsnemo(tmp_path / "expanded.mdlus", views, args, meta)
    assert expanded.stat().st_size < 1 << 20
    with pytest.raises(DataError, match=r"expanded.mdlus: model.pt's tensors declare \d+ bytes but the file holds"):
        weights.load(expanded)
    assert not built
    good = save_like_physicsnemo(tmp_path / "good.mdlus", *regression_archive(regression_model()))
    model, _ = weights.load(good)  # the archive as written loads
    assert built == [good] and sum(p.numel() for p in model.parameters()) > 0
