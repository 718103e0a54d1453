"""PhysicsNeMo ``.mdlus`` checkpoints in and out: StormCast's SongUNets and StormScope's DiT.

A ``.mdlus`` file (PhysicsNeMo's ``Module.save``) is a zip archive (older files: a plain tar)
of exactly three members:

* ``model.pt``: the module's state dict (``torch.save``),
* ``args.json``: ``{"__name__", "__module__", "__args__"}`` of the constructor call; a nested
  module argument is the string ``"__physicsnemo.Module__.<arg>"`` and its own entry sits at
  the top level under that key,
* ``metadata.json``: ``mdlus_file_version`` (and ``<prefix>.mdlus_file_version`` per nested
  module), ``physicsnemo_version``.

Reading (``describe_mdlus``, ``read_mdlus``) checks the archive (members, sizes, names, no
links), reads ``args.json`` as data only (the class must be a known StormCast / StormScope
class; nothing named in it is ever imported; the arguments read are type-checked), loads ``model.pt``
with ``torch.load(weights_only=True)`` only (a crafted pickle is refused before it can run;
floating-point tensors only), refuses a model larger than those tensors could fill before building
it, maps the reference's state-dict names onto ours and checks every name and shape against the
model the derived config builds. It returns what ``python -m framework.export`` writes: the model config
(the JSON beside an exported ``.pt``: ``name``, ``model``, ``in_channels``, ``out_channels``,
``img_resolution``, ``kwargs``, ``task``, ``channels``) and the state dict.

Writing (``write_mdlus``, ``export_mdlus``) goes the other way, from our exported weights and
config to a zip ``.mdlus`` with the reference's names, ``args.json`` and ``metadata.json``.

The layouts (``REFERENCE_CLASSES``): a regression SongUNet is ``StormCastUNet`` (weights under
``model.``); a diffusion SongUNet or a StormScope DiT is ``EDMPreconditioner`` ->
``ConcatConditionWrapper`` -> the net (weights under ``model.model.``, ``sigma_data`` at the
top). Everything that fails is a ``DataError``: one line naming the file and what differs.

Numerics: the reference's GroupNorm uses the *unbiased* variance in eval mode (its train mode
and ours use the biased one), so eval outputs differ by about 1/(group size) relative;
``use_reference_groupnorm(model)`` makes ours do the same.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import io
import json
import os
import re
import tarfile
import zipfile
from pathlib import Path

import torch

from framework.checkpoint.backend import first_non_finite
from framework.errors import DataError
from framework.untrusted import is_int, is_number, shown

MEMBERS = ("model.pt", "args.json", "metadata.json")
MAX_JSON_BYTES = 1 << 20  # args.json, metadata.json
MAX_MODEL_BYTES = 16 << 30  # model.pt (the paper's diffusion SongUNet is 0.5 GB)
NESTED = "__physicsnemo.Module__"  # PhysicsNeMo's prefix of nested-module entries
FILE_VERSIONS = ("0.1.0", "0.2.0")  # mdlus_file_version values this reader knows

# Reference classes: the packages a class may come from (read) and the module written for it.
# Only __name__ resolves through PhysicsNeMo's model registry; __module__ is its import fallback.
REFERENCE_CLASSES = {
    "SongUNet": (
        ("physicsnemo.models.diffusion_unets", "physicsnemo.models.diffusion", "modulus.models.diffusion"),
        "physicsnemo.models.diffusion_unets.song_unet",
    ),
    "StormCastUNet": (
        ("physicsnemo.models.diffusion_unets", "physicsnemo.models.diffusion", "modulus.models.diffusion"),
        "physicsnemo.models.diffusion_unets.unet",
    ),
    "DiT": (("physicsnemo.models.dit", "physicsnemo.experimental.models.dit"), "physicsnemo.models.dit.dit"),
    "EDMPreconditioner": (("physicsnemo.diffusion",), "physicsnemo.diffusion.preconditioners"),
    "ConcatConditionWrapper": (("physicsnemo.diffusion",), "physicsnemo.diffusion.utils.model_wrappers"),
}
FILE_VERSION_WRITTEN = {"DiT": "0.2.0"}  # else 0.1.0

# Reference constructor defaults (used when args.json omits an argument) and the arguments that
# do not change the weights or the eval-mode function (read and ignored).
_SONGUNET_DEFAULTS = dict(
    model_channels=128,
    channel_mult=[1, 2, 2, 2],
    channel_mult_emb=4,
    num_blocks=4,
    attn_resolutions=[16],
    dropout=0.10,
    embedding_type="positional",
    additive_pos_embed=False,
    checkpoint_level=0,
)
_SONGUNET_FIXED = dict(
    label_dim=0,
    augment_dim=0,
    channel_mult_noise=1,
    encoder_type="standard",
    decoder_type="standard",
    resample_filter=[1, 1],
    bottleneck_attention=True,
)
_SONGUNET_KINDS = dict(
    model_channels="an int",
    channel_mult="a list of ints",
    channel_mult_emb="an int",
    num_blocks="an int",
    attn_resolutions="a list of ints",
    dropout="a finite number",
    embedding_type="a string",
    additive_pos_embed="a boolean",
)
_SONGUNET_IGNORED = ("label_dropout", "use_apex_gn", "act", "profile_mode", "amp_mode")
_STORMCAST_WRAPPER = (
    "img_resolution",
    "img_in_channels",
    "img_out_channels",
    "use_fp16",
    "sigma_min",
    "sigma_max",
    "sigma_data",
    "model_type",
)
_DIT_KINDS = dict(
    patch_size="an int or a list of ints",
    hidden_size="an int",
    depth="an int",
    num_heads="an int",
    mlp_ratio="a finite number",
    condition_dim="an int or null",
    use_nan_mask_tokens="a boolean",
    conditioning_embedder_kwargs="an object or null",
    timestep_embed_kwargs="an object or null",
    tokenizer_kwargs="an object or null",
    detokenizer_kwargs="an object or null",
    block_kwargs="an object or null",
    attn_kwargs="an object or null",
)
_DIT_KNOWN = (
    "input_size",
    "in_channels",
    "patch_size",
    "tokenizer",
    "detokenizer",
    "out_channels",
    "hidden_size",
    "depth",
    "num_heads",
    "mlp_ratio",
    "attention_backend",
    "layernorm_backend",
    "condition_dim",
    "conditioning_embedder",
    "dit_initialization",
    "conditioning_embedder_kwargs",
    "timestep_embed_kwargs",
    "tokenizer_kwargs",
    "detokenizer_kwargs",
    "block_kwargs",
    "attn_kwargs",
    "drop_path_rates",
    "force_tokenization_fp32",
    "use_nan_mask_tokens",
)


def _fail(path, msg: str):
    raise DataError(f"{path}: {msg}")


def _unpickler_reason(e: BaseException) -> str:
    """The one informative sentence of torch's weights-only refusal (it spans many lines)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    m = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\.\s|\n\n|$)", text, re.S)
    reason = " ".join(m.group(1).split()) if m else _first_line(e)
    return reason[:300]


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines() or [type(e).__name__])[0][:300]


# What an args.json argument must be, checked before any use (JSON hands over any type).
_KINDS = {
    "an int": is_int,
    "an int or null": lambda v: v is None or is_int(v),
    "an int or a list of ints": lambda v: is_int(v) or (isinstance(v, list) and all(map(is_int, v))),
    "a list of ints": lambda v: isinstance(v, list) and all(map(is_int, v)),
    "a finite number": is_number,
    "a boolean": lambda v: isinstance(v, bool),
    "a string": lambda v: isinstance(v, str),
    "an object or null": lambda v: v is None or isinstance(v, dict),
}


def _check_kinds(path, where: str, values: dict, kinds: dict[str, str]) -> None:
    """One DataError line naming the first argument of ``values`` that is not of its kind."""
    for arg, kind in kinds.items():
        if arg in values and not _KINDS[kind](values[arg]):
            _fail(path, f"args.json {where}: {arg}={shown(values[arg])} must be {kind}")


# -- the archive ---------------------------------------------------------------------------------


def _archive_kind(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(512)
    if len(head) >= 262 and head[257:262] == b"ustar":  # a tar header (PhysicsNeMo's legacy format)
        return "tar"
    if head[:4] == b"PK\x03\x04" and zipfile.is_zipfile(path):
        return "zip"
    _fail(path, "neither a zip nor a tar archive (a PhysicsNeMo .mdlus holds model.pt, args.json, metadata.json)")


def _check_members(path, names: list[str]) -> None:
    # counted in one pass: a crafted archive lists any number of members (a count of each name
    # over the whole list took 50 s for 60000 empty ones, 5 MB)
    counts = collections.Counter(names)
    dup = sorted(n for n, c in counts.items() if c > 1)
    if dup:
        _fail(path, f"archive member {dup[0]!r} appears more than once")
    unexpected = sorted(set(counts) - set(MEMBERS))
    if unexpected:
        _fail(
            path,
            f"unexpected archive member {unexpected[0]!r} (one of {len(names)} members; a .mdlus holds exactly "
            f"{', '.join(MEMBERS)})",
        )
    missing = [m for m in MEMBERS if m not in names]
    if missing:
        _fail(path, f"archive member {missing[0]!r} is missing (a .mdlus holds {', '.join(MEMBERS)})")


def _limit(name: str) -> int:
    return MAX_MODEL_BYTES if name == "model.pt" else MAX_JSON_BYTES


def _read_members(path: Path, wanted: tuple[str, ...]) -> dict[str, bytes]:
    """The bytes of ``wanted`` members, after checking the whole archive's member list."""
    if not path.is_file():
        _fail(path, "no such file")
    kind, out = "archive", {}
    try:
        kind = _archive_kind(path)
        if kind == "zip":
            with zipfile.ZipFile(path) as zf:
                infos = zf.infolist()
                _check_members(path, [i.filename for i in infos])
                for info in infos:
                    if info.is_dir() or info.flag_bits & 0x1:
                        _fail(path, f"archive member {info.filename!r} is a directory or encrypted")
                    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                        _fail(
                            path,
                            f"archive member {info.filename!r} uses compression method "
                            f"{info.compress_type} (stored or deflated expected)",
                        )
                    if info.file_size > _limit(info.filename):
                        _fail(
                            path,
                            f"archive member {info.filename!r} is {info.file_size} bytes "
                            f"(limit {_limit(info.filename)})",
                        )
                for name in wanted:
                    out[name] = zf.read(name)  # reads exactly file_size bytes and checks the CRC
        else:
            with tarfile.open(path, "r:") as tf:
                members = tf.getmembers()
                _check_members(path, [m.name for m in members])
                for m in members:
                    if not m.isreg():
                        _fail(
                            path,
                            f"archive member {m.name!r} is not a regular file (links, devices and "
                            "directories are refused)",
                        )
                    if m.size > _limit(m.name):
                        _fail(path, f"archive member {m.name!r} is {m.size} bytes (limit {_limit(m.name)})")
                by_name = {m.name: m for m in members}
                for name in wanted:
                    f = tf.extractfile(by_name[name])
                    out[name] = f.read(by_name[name].size)
    except DataError:
        raise
    except (OSError, zipfile.BadZipFile, tarfile.TarError, EOFError, ValueError) as e:
        _fail(path, f"unreadable {kind} archive ({_first_line(e)})")
    return out


def _json(path, name: str, data: bytes) -> dict:
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        _fail(path, f"{name} is not valid JSON ({_first_line(e)})")
    if not isinstance(value, dict):
        _fail(path, f"{name} must hold a JSON object, not {type(value).__name__}")
    return value


def _state_dict(path, data: bytes) -> dict[str, torch.Tensor]:
    try:
        sd = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  (any refusal: one line, never a traceback)
        _fail(
            path,
            f"model.pt is not a plain state dict: torch.load(weights_only=True) refused it ({_unpickler_reason(e)})",
        )
    if not isinstance(sd, dict):
        _fail(path, f"model.pt holds a {type(sd).__name__}, not a state dict")
    for k, v in sd.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            _fail(path, f"model.pt entry {k!r} is a {type(v).__name__}, not a tensor")
    # a tensor's shape and strides are the pickle's to say: an expanded (stride-0) view, or many
    # views of one storage, can declare any size over a few bytes, and the model built for them
    # would be that size
    declared = sum(v.numel() * v.element_size() for v in sd.values())
    if declared > len(data):
        _fail(
            path,
            f"model.pt's tensors declare {declared} bytes but the file holds {len(data)} (expanded or "
            "shared-storage views are refused)",
        )
    return dict(sd)


# -- args.json: a tree of constructor calls, as data ---------------------------------------------


@dataclasses.dataclass
class _Node:
    name: str  # class name
    module: str
    args: dict  # constructor arguments, nested modules replaced by their _Node
    prefix: str  # the entry's key in args.json ("" for the root)


def _node(path, args: dict, key: str, seen: set) -> _Node:
    entry = args if key == "" else args.get(key)
    where = "args.json" + (f" entry {key!r}" if key else "")
    if (
        not isinstance(entry, dict)
        or not isinstance(entry.get("__name__"), str)
        or not isinstance(entry.get("__module__"), str)
        or not isinstance(entry.get("__args__"), dict)
    ):
        _fail(path, f"{where} must hold __name__, __module__ (strings) and __args__ (an object)")
    name, module = entry["__name__"], entry["__module__"]
    known = REFERENCE_CLASSES.get(name)
    if (
        known is None
        or not any(module == p or module.startswith(p + ".") for p in known[0])
        or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", module)
    ):
        _fail(
            path,
            f"{where} names class {module}.{name}, not a known PhysicsNeMo StormCast/StormScope class "
            f"({', '.join(sorted(REFERENCE_CLASSES))}); it is never imported",
        )
    kwargs = {}
    for arg, value in entry["__args__"].items():
        if isinstance(value, str) and value.startswith(NESTED):
            if value != f"{key or NESTED}.{arg}" or value in seen:
                _fail(path, f"{where} argument {arg!r} refers to nested module {value!r} in the wrong place")
            seen.add(value)
            value = _node(path, args, value, seen)
        kwargs[arg] = value
    return _Node(name, module, kwargs, key)


def _tree(path, args: dict) -> _Node:
    for k in args:
        if k not in ("__name__", "__module__", "__args__") and not k.startswith(NESTED + "."):
            _fail(path, f"args.json has an unexpected top-level key {k!r}")
    seen: set = set()
    root = _node(path, args, "", seen)
    stray = sorted(k for k in args if k.startswith(NESTED + ".") and k not in seen)
    if stray:
        _fail(path, f"args.json entry {stray[0]!r} is not an argument of any module")
    return root


def _check_versions(path, metadata: dict, root: _Node) -> dict:
    """The mdlus_file_version of every module of the tree, each one this reader knows."""
    versions = {}
    stack = [root]
    while stack:
        node = stack.pop()
        key = f"{node.prefix}.mdlus_file_version" if node.prefix else "mdlus_file_version"
        v = metadata.get(key)
        if v is None and node.prefix == "":
            _fail(path, "metadata.json has no mdlus_file_version")
        v = v if v is not None else metadata.get("mdlus_file_version")
        if v not in FILE_VERSIONS:
            _fail(path, f"metadata.json {key} is {v!r}, not one this reader knows ({', '.join(FILE_VERSIONS)})")
        versions[node.prefix] = v
        stack += [a for a in node.args.values() if isinstance(a, _Node)]
    return versions


# -- args.json -> our model config ---------------------------------------------------------------


def _grid(path, value, what: str) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value, value]
    if not isinstance(value, list) or len(value) != 2 or not all(isinstance(v, int) and v > 0 for v in value):
        _fail(path, f"args.json {what} must be an int or [rows, cols] (got {value!r})")
    return [int(v) for v in value]


def _songunet_model(path, kw: dict, where: str) -> dict:
    """Our songunet model node from the reference SongUNet's arguments (checked)."""
    from framework.config.schema import Invalid
    from recipes.stormcast.config import SongUNetConfig

    for arg, want in _SONGUNET_FIXED.items():
        if arg in kw and kw[arg] != want and not (arg == "act" and kw[arg] is None):
            _fail(path, f"args.json {where}: {arg}={kw[arg]!r} is not supported (ours: {want!r})")
    if kw.get("act", "silu") not in ("silu", None):
        _fail(path, f"args.json {where}: act={kw['act']!r} is not supported (ours: 'silu')")
    if kw.get("use_apex_gn"):
        _fail(
            path,
            f"args.json {where}: use_apex_gn=true checkpoints keep their GroupNorms elsewhere; save "
            "the model with use_apex_gn=false",
        )
    unknown = sorted(set(kw) - set(_SONGUNET_DEFAULTS) - set(_SONGUNET_FIXED) - set(_SONGUNET_IGNORED))
    if unknown:
        _fail(path, f"args.json {where}: argument {unknown[0]!r} is not one this reader knows")
    _check_kinds(path, where, kw, _SONGUNET_KINDS)
    node = {"name": "songunet"} | {k: copy.deepcopy(kw.get(k, d)) for k, d in _SONGUNET_DEFAULTS.items()}
    node["checkpoint_level"] = 0  # a training-time memory option, not part of the model
    try:
        SongUNetConfig(**node)
    except (Invalid, TypeError, ValueError) as e:
        _fail(path, f"args.json {where}: {e}")
    return node


def _dit_model(path, kw: dict, where: str) -> tuple[dict, list[int], int, int]:
    """(our dit model node, grid, in, out) from the reference DiT's arguments (checked)."""
    from framework.config.schema import Invalid
    from recipes.stormscope.config import DiTConfig

    unknown = sorted(set(kw) - set(_DIT_KNOWN))
    if unknown:
        _fail(path, f"args.json {where}: argument {unknown[0]!r} is not one this reader knows")
    _check_kinds(path, where, kw, _DIT_KINDS)
    _check_kinds(path, f"{where} tokenizer_kwargs", kw.get("tokenizer_kwargs") or {}, {"pos_embed": "a string"})
    _check_kinds(path, f"{where} attn_kwargs", kw.get("attn_kwargs") or {}, {"attn_kernel": "an int"})

    def need(arg, ok, want):
        value = kw.get(arg, want)
        if not ok(value):
            _fail(path, f"args.json {where}: {arg}={value!r} is not supported (ours: {want!r})")
        return value

    need("tokenizer", lambda v: v == "patch_embed_2d", "patch_embed_2d")
    need("detokenizer", lambda v: v == "proj_reshape_2d", "proj_reshape_2d")
    backend = need("attention_backend", lambda v: v in ("natten2d", "natten2d_rope"), "natten2d")
    need("layernorm_backend", lambda v: v in ("torch", "apex"), "torch")  # no affine: the same function
    need("conditioning_embedder", lambda v: v == "dit", "dit")
    for arg in ("conditioning_embedder_kwargs", "timestep_embed_kwargs"):
        emb = kw.get(arg) or {}
        hidden = kw.get("hidden_size", 384)
        defaults = dict(
            max_positions=10000,
            endpoint=False,
            embed_fn="cos_sin",
            freq_embed_dim=None,
            mlp_hidden_dim=None,
            learnable=True,
        )
        for k, v in emb.items():
            same = {"freq_embed_dim": (None, hidden), "mlp_hidden_dim": (None, 2 * hidden)}.get(k, (defaults.get(k),))
            if k not in defaults or v not in same:
                _fail(path, f"args.json {where}: {arg} {k}={v!r} is not supported (ours: {same[-1]!r})")
    tok = kw.get("tokenizer_kwargs") or {}
    if set(tok) - {"pos_embed"} or kw.get("detokenizer_kwargs"):
        _fail(
            path,
            f"args.json {where}: tokenizer/detokenizer kwargs {tok or kw.get('detokenizer_kwargs')!r} "
            "are not supported",
        )
    attn = dict(kw.get("attn_kwargs") or {})
    blk = dict(kw.get("block_kwargs") or {})
    for k, want in (("qkv_bias", True), ("qk_norm", False), ("norm_eps", 1e-6)):
        for d in (attn, blk):
            if k in d and d.pop(k) != want:
                _fail(path, f"args.json {where}: {k} other than {want!r} is not supported")
    na2d = attn.pop("na2d_kwargs", None) or {}
    if na2d:
        _fail(path, f"args.json {where}: na2d_kwargs {na2d!r} are not supported (plain windows only)")
    kernel = attn.pop("attn_kernel", 3)
    for d in (attn, blk):  # dropout / drop-path rates: training only
        for k in list(d):
            if k in (
                "attn_drop_rate",
                "proj_drop_rate",
                "mlp_drop_rate",
                "final_mlp_dropout",
                "intermediate_dropout",
                "drop_path",
                "norm_layer",
            ):
                d.pop(k)
    if attn or blk:
        _fail(path, f"args.json {where}: attention/block kwargs {sorted(attn | blk)} are not supported")
    patch = kw.get("patch_size", [8, 8])
    if isinstance(patch, list):
        if len(patch) != 2 or patch[0] != patch[1]:
            _fail(path, f"args.json {where}: patch_size={patch!r} (ours: square patches)")
        patch = patch[0]
    tok_pos = tok.get("pos_embed", "learnable")
    if tok_pos not in ("learnable", "none"):  # no other value means anything we could build
        _fail(
            path, f"args.json {where}: tokenizer pos_embed={tok_pos!r} is not supported (ours: 'learnable' or 'none')"
        )
    if backend == "natten2d_rope":
        pos = "rope"
    else:
        pos = "learned" if tok_pos == "learnable" else "none"
    grid = _grid(path, kw.get("input_size"), f"{where} input_size")
    in_ch = kw.get("in_channels")
    out_ch = kw.get("out_channels") or in_ch
    node = {
        "name": "dit",
        "patch_size": patch,
        "hidden_size": kw.get("hidden_size", 384),
        "depth": kw.get("depth", 12),
        "num_heads": kw.get("num_heads", 8),
        "mlp_ratio": float(kw.get("mlp_ratio", 4.0)),
        "attn_kernel": kernel,
        "pos_embed": pos,
        "num_scalar_conditions": int(kw.get("condition_dim") or 0),
        "mask_token": bool(kw.get("use_nan_mask_tokens", False)),
        "checkpoint_blocks": False,
        "attn_impl": "auto",
    }
    try:
        DiTConfig(**node)
    except (Invalid, TypeError, ValueError) as e:
        _fail(path, f"args.json {where}: {e}")
    return node, grid, in_ch, out_ch


def _sigma_data(path, value) -> list[float]:
    values = value if isinstance(value, list) else [value]
    if not values or not all(is_number(v) and v > 0 for v in values):
        _fail(path, f"args.json sigma_data={value!r} must be positive numbers")
    return [float(v) for v in values]


def _task_node(kind: str, sigma_data: list[float] | None) -> dict:
    from recipes.stormscope.config import StormScopeTaskConfig
    from recipes.weather.config import DiffusionTaskConfig, RegressionTaskConfig

    if kind == "regression":
        return dataclasses.asdict(RegressionTaskConfig())
    if kind == "stormscope":
        node = dataclasses.asdict(StormScopeTaskConfig())
    else:  # StormCast's diffusion stage: its regression stage is a separate file
        node = dataclasses.asdict(DiffusionTaskConfig(regression="<the regression stage>"))
        node["regression"] = None
    node["edm"]["sigma_data"] = list(sigma_data)
    return node


def _config(path, root: _Node) -> tuple[dict, str]:
    """(our model config, the state-dict prefix of the net) from the args.json tree."""
    a = root.args
    if root.name == "StormCastUNet":
        if a.get("model_type", "SongUNet") != "SongUNet":
            _fail(path, f"args.json: StormCastUNet model_type={a.get('model_type')!r} is not supported (SongUNet)")
        inner = {k: v for k, v in a.items() if k not in _STORMCAST_WRAPPER}
        model = _songunet_model(path, inner, "StormCastUNet")
        grid, in_ch, out_ch = (
            _grid(path, a.get("img_resolution"), "img_resolution"),
            a.get("img_in_channels"),
            a.get("img_out_channels"),
        )
        kind, prefix, sigma = "regression", "model.", None
        if model["embedding_type"] != "zero":
            _fail(path, "args.json: StormCastUNet with a noise embedding is not a regression model")
    elif root.name == "EDMPreconditioner":
        wrapper = a.get("model")
        if (
            not isinstance(wrapper, _Node)
            or wrapper.name != "ConcatConditionWrapper"
            or not isinstance(wrapper.args.get("model"), _Node)
        ):
            _fail(path, "args.json: EDMPreconditioner must wrap a ConcatConditionWrapper around the net")
        extra = sorted(set(a) - {"model", "sigma_data"}) + sorted(
            k
            for k, v in wrapper.args.items()
            if k != "model" and v != {"image_cond_key": "cond_concat", "vector_cond_key": "cond_vec"}.get(k)
        )
        if extra:
            _fail(path, f"args.json: preconditioner/wrapper argument {extra[0]!r} is not supported")
        net = wrapper.args["model"]
        sigma, prefix = _sigma_data(path, a.get("sigma_data", 0.5)), "model.model."
        if net.name == "SongUNet":
            kw = {k: v for k, v in net.args.items() if k not in ("img_resolution", "in_channels", "out_channels")}
            model = _songunet_model(path, kw, "SongUNet")
            if model["embedding_type"] != "positional":
                _fail(path, "args.json: a diffusion SongUNet needs embedding_type='positional'")
            grid, in_ch, out_ch = (
                _grid(path, net.args.get("img_resolution"), "img_resolution"),
                net.args.get("in_channels"),
                net.args.get("out_channels"),
            )
            kind = "diffusion"
        elif net.name == "DiT":
            model, grid, in_ch, out_ch = _dit_model(path, net.args, "DiT")
            kind = "stormscope"
        else:
            _fail(path, f"args.json: the preconditioned net is a {net.name}, not a SongUNet or DiT")
    elif root.name == "SongUNet":
        _fail(
            path,
            "args.json: a bare SongUNet (no StormCastUNet or EDMPreconditioner around it) is not a "
            "StormCast checkpoint: regression or diffusion cannot be told",
        )
    else:
        _fail(path, f"args.json: a {root.name} at the top is not a StormCast/StormScope model")
    for what, v in (("in_channels", in_ch), ("out_channels", out_ch)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            _fail(path, f"args.json: {what} must be a positive int (got {v!r})")
    kwargs = {k: v for k, v in model.items() if k != "name"}
    kwargs.update(img_resolution=grid, in_channels=in_ch, out_channels=out_ch)
    config = {
        "name": model["name"],
        "model": model,
        "in_channels": in_ch,
        "out_channels": out_ch,
        "img_resolution": grid,
        "kwargs": kwargs,
        "task": _task_node(kind, sigma),
        "channels": {"hrrr_channels": None, "era5_channels": None, "invariants": None},
        "seed": None,
    }
    return config, prefix


def _with_channels(path, config: dict, channels: dict | None) -> dict:
    """Channel names recorded in the config, when the caller knows them (a .mdlus has none)."""
    if channels is None:
        return config
    from recipes.weather.diffusion import DiffusionTask
    from recipes.weather.layout import naming_of
    from recipes.weather.task import RegressionTask

    names = {k: list(channels.get(k) or []) for k in naming_of(channels).channel_keys}  # either recipe's keys
    io_of = RegressionTask.model_io if config["task"]["name"] == "stormcast_regression" else DiffusionTask.model_io
    want = io_of(names, config["task"])
    have = (config["in_channels"], config["out_channels"])
    if want != have:
        _fail(
            path,
            f"the model maps {have[0]} -> {have[1]} channels but the given channels make "
            f"{want[0]} -> {want[1]} (task {config['task']['name']}, conditions "
            f"{config['task'].get('conditions', ['state', 'background', 'invariants'])})",
        )
    return config | {"channels": names}


# -- names: ours <-> the reference's -------------------------------------------------------------

_SONG_LEVEL = re.compile(r"^(enc|dec)\.(\d+)_(.+)$")
_REF_LEVEL = re.compile(r"^(enc|dec)\.(\d+)x(\d+)_(.+)$")
_EDM_ATTN = re.compile(r"^([^.]+)\.(norm2|qkv|proj)\.(weight|bias)$")  # EDM's block-level attention names


def _song_to_ref(key: str, rows: int) -> str:
    if key == "pos_embed.weight":
        return "spatial_emb"
    if key.startswith("out_norm.") or key.startswith("out_conv."):
        head, rest = key.split(".", 1)
        return f"dec.{rows}x{rows}_aux_{head[4:]}.{rest}"
    m = _SONG_LEVEL.match(key)
    if m:
        part, res, rest = m.groups()
        return f"{part}.{res}x{res}_{rest}"  # attention under attn.{norm,qkv,proj}, as PhysicsNeMo 2.x has it
    return key


def _song_from_ref(key: str, rows: int) -> str:
    if key == "spatial_emb":
        return "pos_embed.weight"
    for head in ("norm", "conv"):
        if key.startswith(f"dec.{rows}x{rows}_aux_{head}."):
            return f"out_{head}." + key.split(".", 2)[2]
    m = _REF_LEVEL.match(key)
    if m and m.group(2) == m.group(3):
        part, res, _, rest = m.groups()
        legacy = _EDM_ATTN.match(rest)
        if legacy:  # EDM / older PhysicsNeMo: norm2, qkv, proj directly on the block
            name = "norm" if legacy.group(2) == "norm2" else legacy.group(2)
            rest = f"{legacy.group(1)}.attn.{name}.{legacy.group(3)}"
        return f"{part}.{res}_{rest}"
    return key


_DIT_RULES = [  # (ours, the reference's) name prefixes; the first reference form is the one written
    ("patch_embed.proj.", ("tokenizer.x_embedder.proj.",)),
    ("t_embed.mlp.", ("conditioning_embedder.t_embedder.mlp.", "t_embedder.mlp.")),
    ("t_embed.scalars.", ("conditioning_embedder.cond_embedder.",)),
    ("final.adaLN_modulation.", ("detokenizer.proj_layer.adaptive_modulation.",)),
    ("final.linear.", ("detokenizer.proj_layer.output_projection.",)),
]
_DIT_BLOCK_RULES = [  # within blocks.<i>.
    ("attn.", ("attention.",)),
    ("mlp.fc1.", ("linear.layers.0.", "linear.fc1.")),
    ("mlp.fc2.", ("linear.layers.2.", "linear.fc2.")),
    ("adaLN_modulation.", ("adaptive_modulation.",)),
]


def _dit_to_ref(key: str) -> str:
    if key == "pos_embed.weight":
        return "tokenizer.pos_embed"
    for ours, refs in _DIT_RULES:
        if key.startswith(ours):
            return refs[0] + key[len(ours) :]
    m = re.match(r"^(blocks\.\d+\.)(.+)$", key)
    if m:
        for ours, refs in _DIT_BLOCK_RULES:
            if m.group(2).startswith(ours):
                return m.group(1) + refs[0] + m.group(2)[len(ours) :]
    return key


def _dit_from_ref(key: str) -> str:
    if key == "tokenizer.pos_embed":
        return "pos_embed.weight"
    for ours, refs in _DIT_RULES:
        for ref in refs:
            if key.startswith(ref):
                return ours + key[len(ref) :]
    m = re.match(r"^(blocks\.\d+\.)(.+)$", key)
    if m:
        for ours, refs in _DIT_BLOCK_RULES:
            for ref in refs:
                if m.group(2).startswith(ref):
                    return m.group(1) + ours + m.group(2)[len(ref) :]
    return key


def _net_prefixes(config: dict) -> tuple[str, str]:
    """(our prefix, the reference's prefix) of the net's weights."""
    if config["task"]["name"] == "stormcast_regression":
        return "", "model."
    return "net.", "model.model."


def reference_names(config: dict, keys) -> dict[str, str]:
    """Our state-dict name -> the reference's, for the model of ``config`` (bijective on ``keys``)."""
    ours_p, ref_p = _net_prefixes(config)
    rows = int(config["img_resolution"][0])
    out = {}
    for k in keys:
        if k == "sigma_data":
            out[k] = k
            continue
        if not k.startswith(ours_p):
            raise DataError(f"weight {k!r} is not under the net's prefix {ours_p!r}")
        inner = k[len(ours_p) :]
        out[k] = ref_p + (_song_to_ref(inner, rows) if config["name"] == "songunet" else _dit_to_ref(inner))
    if len(set(out.values())) != len(out):
        raise DataError("the reference names of the weights are not one to one")
    return out


def _from_reference_name(config: dict, key: str) -> str | None:
    ours_p, ref_p = _net_prefixes(config)
    if key == "sigma_data":
        return key
    if not key.startswith(ref_p):
        return None
    inner = key[len(ref_p) :]
    if config["name"] == "songunet":
        return ours_p + _song_from_ref(inner, int(config["img_resolution"][0]))
    return ours_p + _dit_from_ref(inner)


def _positional_freqs(num_channels: int, endpoint: bool) -> torch.Tensor:
    """PhysicsNeMo PositionalEmbedding's ``freqs`` buffer (float32)."""
    half = num_channels // 2
    freqs = torch.arange(half, dtype=torch.float32) / (half - (1 if endpoint else 0))
    return (1 / 10000) ** freqs


def _constants(config: dict) -> dict[str, torch.Tensor]:
    """The reference's constant buffers (full names) that our model computes instead of storing."""
    m, (_, ref_p) = config["model"], _net_prefixes(config)
    if config["name"] == "songunet":
        if m["embedding_type"] != "positional":
            return {}
        return {ref_p + "map_noise.freqs": _positional_freqs(m["model_channels"], endpoint=True)}
    return {ref_p + "conditioning_embedder.t_embedder.freqs": _positional_freqs(m["hidden_size"], endpoint=False)}


def _is_constant(config: dict, key: str) -> torch.Tensor | None:
    """Expected value of a reference-only constant buffer ``key`` (None: not one)."""
    consts = _constants(config)
    _, ref_p = _net_prefixes(config)
    if config["name"] == "dit" and key == ref_p + "t_embedder.freqs":  # its legacy place
        key = ref_p + "conditioning_embedder.t_embedder.freqs"
    return consts.get(key)


# -- building our model (names and shapes only, on the meta device) ------------------------------


def build_model(config: dict, device=None) -> torch.nn.Module:
    """Our model of ``config``: the net (``kwargs``), wrapped in the EDM preconditioner for diffusion."""
    from recipes.weather.edm import EDMPrecond

    if config["name"] == "songunet":
        from recipes.stormcast.songunet import SongUNet as cls
    elif config["name"] == "dit":
        from recipes.stormscope.dit import DiT as cls
    else:
        raise DataError(f"model {config['name']!r} has no PhysicsNeMo counterpart (songunet, dit)")
    with torch.device(device or "cpu"):
        net = cls(**config["kwargs"])
        if config["task"]["name"] == "stormcast_regression":
            return net
        return EDMPrecond(net, sigma_data=list(config["task"]["edm"]["sigma_data"]))


def _expected(config: dict) -> dict[str, torch.Size]:
    model = build_model(config, device="meta")
    return {k: v.shape for k, v in model.state_dict().items()}


def _least_weights(config: dict, cap: int) -> int:
    """A lower bound on the number of weights of the model of ``config`` (a .mdlus's, its arguments
    checked), from its arguments alone, with every factor capped at ``cap`` (a bound above ``cap``
    stays above it, and the arithmetic small). Counted: the convolutions and linears every block
    has, the first and last layers, the learned position tables."""
    m = config["model"]
    rows, cols = (min(v, cap) for v in config["img_resolution"])
    in_ch, out_ch = min(config["in_channels"], cap), min(config["out_channels"], cap)
    if config["name"] == "songunet":
        mc = min(m["model_channels"], cap)
        emb = min(mc * m["channel_mult_emb"], cap)
        widths = [min(mc * k, cap) for k in m["channel_mult"][:cap]]
        blocks = min(m["num_blocks"], cap)
        n = 9 * mc * in_ch + 9 * widths[0] * out_ch  # the first and the output convolutions
        n += blocks * sum(9 * w * w + emb * w for w in widths)  # each encoder block's conv1 and affine
        n += emb * emb if m["embedding_type"] == "positional" else 0  # map_layer1
        return n + (mc * rows * cols if m["additive_pos_embed"] else 0)
    h, p, depth = min(m["hidden_size"], cap), min(m["patch_size"], cap), min(m["depth"], cap)
    mlp = int(h * min(m["mlp_ratio"], cap))
    n = h * p * p * (in_ch + out_ch)  # the patch embedding and the final projection
    n += depth * (10 * h * h + 2 * h * mlp)  # each block's qkv, proj, modulation and MLP
    return n + ((rows // p) * (cols // p) * h if m["pos_embed"] == "learned" else 0)


# -- public API ----------------------------------------------------------------------------------


def is_mdlus(path) -> bool:
    """Whether ``path`` is a .mdlus file (by suffix, or a zip/tar archive holding model.pt)."""
    path = Path(path)
    if path.suffix == ".mdlus":
        return True
    if not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return False
    if head[:4] == b"PK\x03\x04":
        return any(m.encode() in head[:64] for m in MEMBERS)  # the first member's local header
    return head[257:262] == b"ustar" and head[:100].rstrip(b"\0").decode("latin-1") in MEMBERS


def describe_mdlus(path, *, channels: dict | None = None) -> dict:
    """The model config of the .mdlus at ``path`` from its args.json and metadata.json (model.pt is
    not read). ``channels`` ({hrrr_channels, era5_channels, invariants}, or StormScope's
    {state_channels, background_channels, invariants}), when given, are checked against the model's
    channel counts and recorded under their keys; else they are None (a .mdlus has no names)."""
    path = Path(path)
    raw = _read_members(path, ("args.json", "metadata.json"))
    args, metadata = _json(path, "args.json", raw["args.json"]), _json(path, "metadata.json", raw["metadata.json"])
    root = _tree(path, args)
    versions = _check_versions(path, metadata, root)
    config, _ = _config(path, root)
    config = _with_channels(path, config, channels)
    config["source"] = {
        "mdlus": str(path.resolve()),
        "class": f"{root.module}.{root.name}",
        "mdlus_file_version": versions[""],
        "physicsnemo_version": metadata.get("physicsnemo_version"),
    }
    config["weights"] = path.name
    config["format"] = "physicsnemo"
    return config


def read_mdlus(path, *, channels: dict | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(model config, state dict in our names) of the .mdlus at ``path``; see ``describe_mdlus``.

    Every tensor of model.pt must map onto a weight of the model the config builds, with its
    shape; every weight must be there. The reference's constant buffers (``map_noise.freqs``,
    the DiT's timestep ``freqs``) must equal the values ours computes and are dropped.
    """
    path = Path(path)
    config = describe_mdlus(path, channels=channels)
    raw = _read_members(path, ("model.pt",))["model.pt"]
    ref = _state_dict(path, raw)
    # the file's tensors bound the model its args.json may describe: a crafted args.json (widths,
    # depths of 2**36) is refused here, before the build (even on the meta device: its modules are
    # Python objects, and its sizes may overflow)
    have = sum(v.numel() for v in ref.values())
    least = _least_weights(config, have + 1)
    if least > have:
        _fail(
            path,
            f"args.json describes a {config['name']} model of at least {least} weights, but model.pt holds {have}",
        )
    try:
        expected = _expected(config)
    except (ValueError, TypeError, RuntimeError, OverflowError) as e:  # arguments the constructor refuses
        _fail(path, f"args.json describes no {config['name']} model we can build ({_first_line(e)})")
    out = {}
    for key, value in ref.items():
        if key.endswith("device_buffer") and value.numel() == 0:  # PhysicsNeMo's old device marker
            continue
        if not value.is_floating_point():  # a complex or integer tensor would be cast to real floats, silently
            _fail(path, f"model.pt tensor {key!r} is {str(value.dtype).removeprefix('torch.')}, not floating point")
        if first_non_finite({key: value}):  # would only show as a non-finite loss (exit 4) later
            _fail(path, f"model.pt tensor {key!r} holds non-finite values (NaN or Inf)")
        const = _is_constant(config, key)
        if const is not None:
            if value.shape != const.shape or not torch.allclose(value.float(), const, rtol=1e-6, atol=0):
                _fail(
                    path, f"constant buffer {key!r} differs from the one our model computes (other embedding settings?)"
                )
            continue
        ours = _from_reference_name(config, key)
        if ours == "sigma_data" and ours not in expected and value.numel() <= 1:
            continue  # a wrapper's constant without meaning for a regression model
        if ours is None or ours not in expected:
            _fail(path, f"model.pt tensor {key!r} has no counterpart in our {config['name']} model")
        if ours in out:
            _fail(path, f"model.pt tensors map twice onto our {ours!r} (e.g. {key!r})")
        if ours == "sigma_data":
            want = config["task"]["edm"]["sigma_data"]
            if value.numel() != len(want) or not torch.allclose(value.double().flatten(), torch.tensor(want).double()):
                _fail(path, f"model.pt sigma_data {value.flatten().tolist()} differs from args.json's {want}")
            value = value.reshape(expected[ours])
        elif value.shape != expected[ours]:
            _fail(
                path, f"model.pt tensor {key!r} has shape {tuple(value.shape)}; our {ours!r} is {tuple(expected[ours])}"
            )
        out[ours] = value
    missing = [k for k in expected if k not in out]
    if missing == ["sigma_data"]:  # a preconditioner that keeps sigma_data as a plain number
        out["sigma_data"] = torch.tensor(config["task"]["edm"]["sigma_data"], dtype=torch.float32).reshape(
            expected["sigma_data"]
        )
        missing = []
    if missing:
        names = reference_names(config, missing)
        _fail(
            path,
            f"model.pt lacks {len(missing)} weights of our {config['name']} model, e.g. "
            f"{names[missing[0]]!r} (ours: {missing[0]!r})",
        )
    return config, {k: out[k] for k in expected}


def _reference_args(config: dict) -> dict:
    m, task = config["model"], config["task"]
    grid, in_ch, out_ch = list(config["img_resolution"]), config["in_channels"], config["out_channels"]
    if config["name"] == "songunet":
        song = {
            k: copy.deepcopy(m[k])
            for k in (
                "model_channels",
                "channel_mult",
                "channel_mult_emb",
                "num_blocks",
                "attn_resolutions",
                "dropout",
                "embedding_type",
                "additive_pos_embed",
            )
        }
        song |= {"checkpoint_level": 0, **copy.deepcopy(_SONGUNET_FIXED)}
        del song["bottleneck_attention"]  # newer versions only (default true): left to the default
        if task["name"] == "stormcast_regression":
            return {
                "__name__": "StormCastUNet",
                "__module__": REFERENCE_CLASSES["StormCastUNet"][1],
                "__args__": {
                    "img_resolution": grid,
                    "img_in_channels": in_ch,
                    "img_out_channels": out_ch,
                    "use_fp16": False,
                    "sigma_min": 0,
                    "sigma_max": float("inf"),
                    "sigma_data": 0.5,
                    "model_type": "SongUNet",
                    **song,
                },
            }
        net = {
            "__name__": "SongUNet",
            "__module__": REFERENCE_CLASSES["SongUNet"][1],
            "__args__": {"img_resolution": grid, "in_channels": in_ch, "out_channels": out_ch, **song},
        }
    else:
        if m["patch_size"] <= 0:
            raise DataError("dit patch_size must be positive")
        net = {
            "__name__": "DiT",
            "__module__": REFERENCE_CLASSES["DiT"][1],
            "__args__": {
                "input_size": grid,
                "in_channels": in_ch,
                "patch_size": m["patch_size"],
                "tokenizer": "patch_embed_2d",
                "detokenizer": "proj_reshape_2d",
                "out_channels": out_ch,
                "hidden_size": m["hidden_size"],
                "depth": m["depth"],
                "num_heads": m["num_heads"],
                "mlp_ratio": m["mlp_ratio"],
                "attention_backend": "natten2d_rope" if m["pos_embed"] == "rope" else "natten2d",
                "layernorm_backend": "torch",
                "condition_dim": m["num_scalar_conditions"] or None,
                "conditioning_embedder": "dit",
                "dit_initialization": True,
                "conditioning_embedder_kwargs": {},
                "tokenizer_kwargs": {"pos_embed": "none"} if m["pos_embed"] == "none" else {},
                "detokenizer_kwargs": {},
                "block_kwargs": {},
                "attn_kwargs": {"attn_kernel": m["attn_kernel"]},
                "drop_path_rates": None,
                "force_tokenization_fp32": False,
                "use_nan_mask_tokens": bool(m["mask_token"]),
            },
        }
    sd = [float(v) for v in task["edm"]["sigma_data"]]
    return {
        "__name__": "EDMPreconditioner",
        "__module__": REFERENCE_CLASSES["EDMPreconditioner"][1],
        "__args__": {"model": f"{NESTED}.model", "sigma_data": sd[0] if len(sd) == 1 else sd},
        f"{NESTED}.model": {
            "__name__": "ConcatConditionWrapper",
            "__module__": REFERENCE_CLASSES["ConcatConditionWrapper"][1],
            "__args__": {
                "model": f"{NESTED}.model.model",
                "image_cond_key": "cond_concat",
                "vector_cond_key": "cond_vec",
            },
        },
        f"{NESTED}.model.model": net,
    }


def to_reference(weights: dict[str, torch.Tensor], config: dict) -> tuple[dict, dict, dict]:
    """(state dict, args.json, metadata.json) of the reference for our ``weights`` of ``config``."""
    if config.get("name") not in ("songunet", "dit") or not isinstance(config.get("task"), dict):
        raise DataError(
            f"model {config.get('name')!r} of task {(config.get('task') or {}).get('name')!r} has no "
            "PhysicsNeMo counterpart (StormCast songunet regression/diffusion, StormScope dit)"
        )
    if config["name"] == "dit" and config["task"]["name"] == "stormcast_regression":
        raise DataError("a dit regression model has no PhysicsNeMo counterpart")
    if config["task"]["name"] == "stormcast_regression" and config["task"].get("residual"):
        raise DataError(
            "a regression model trained with task.residual=true predicts state(t+dt) - state(t); "
            "PhysicsNeMo's StormCastUNet predicts the state itself, so it has no counterpart"
        )
    expected = _expected(config)
    missing = [k for k in expected if k not in weights]
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise DataError(
            f"the weights do not fit the {config['name']} model of their config: missing "
            f"{missing[:3]}, unexpected {unexpected[:3]}"
        )
    for k, shape in expected.items():
        if weights[k].shape != shape:
            raise DataError(f"weight {k!r} has shape {tuple(weights[k].shape)}, the model's is {tuple(shape)}")
    names = reference_names(config, expected)
    ref = collections.OrderedDict()
    for k in expected:
        v = weights[k].detach().to("cpu").contiguous()
        if k == "sigma_data":
            v = v.flatten()
            v = v[0].clone() if v.numel() == 1 else v
        ref[names[k]] = v
    ref.update(_constants(config))
    args = _reference_args(config)
    metadata = {
        "physicsnemo_version": "unknown",
        "written_by": "framework (recipes.weather.mdlus)",
        "mdlus_file_version": FILE_VERSION_WRITTEN.get(args["__name__"], "0.1.0"),
    }
    for key, entry in args.items():
        if key.startswith(NESTED + "."):
            metadata[f"{key}.mdlus_file_version"] = FILE_VERSION_WRITTEN.get(entry["__name__"], "0.1.0")
    return ref, args, metadata


def write_mdlus(weights: dict[str, torch.Tensor], config: dict, out) -> Path:
    """Write our ``weights`` (state dict) of ``config`` (the export's model config) as a zip .mdlus."""
    out = Path(out)
    ref, args, metadata = to_reference(weights, config)
    buf = io.BytesIO()
    torch.save(ref, buf)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zf:  # as Module.save writes it
            zf.writestr("model.pt", buf.getvalue())
            zf.writestr("args.json", json.dumps(args))
            zf.writestr("metadata.json", json.dumps(metadata))
        os.replace(tmp, out)  # never a half-written file under the final name
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DataError(f"cannot write {out}: {e.strerror or e}") from None
    return out


def export_mdlus(weights_path, out) -> Path:
    """Our exported ``.pt`` (its ``.json`` beside it) as a .mdlus at ``out``."""
    weights_path = Path(weights_path)
    side = weights_path.with_suffix(".json")
    try:
        config = json.loads(side.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{side}: unreadable model config ({_first_line(e)})") from None
    try:
        weights = torch.load(weights_path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{weights_path}: cannot read weights ({_first_line(e)})") from None
    return write_mdlus(weights, config, out)


# -- the reference's eval-mode GroupNorm ---------------------------------------------------------


@functools.cache
def _reference_group_norm_class():
    from recipes.stormcast.layers import GroupNorm

    class ReferenceEvalGroupNorm(GroupNorm):
        """GroupNorm as PhysicsNeMo's in eval mode: the *unbiased* variance per group (train: biased)."""

        def normalise(self, x):
            if self.training:
                return super().normalise(x)
            b, c = x.shape[:2]
            xf = x.float().reshape(b, self.num_groups, -1)
            mean = xf.mean(-1, keepdim=True)
            var = xf.var(-1, keepdim=True)  # unbiased, as the reference's eval path
            y = ((xf - mean) * (var + self.eps).rsqrt()).reshape(x.shape)
            shape = (1, c) + (1,) * (x.ndim - 2)
            return (y * self.weight.float().reshape(shape) + self.bias.float().reshape(shape)).to(x.dtype)

    return GroupNorm, ReferenceEvalGroupNorm


def use_reference_groupnorm(model: torch.nn.Module, enable: bool = True) -> torch.nn.Module:
    """Make the SongUNet's GroupNorms compute as the reference's in eval mode (unbiased variance),
    or back (``enable=False``). Names and weights are unchanged; returns ``model``."""
    plain, ref = _reference_group_norm_class()
    for m in model.modules():
        if enable and type(m) is plain:
            m.__class__ = ref
        elif not enable and type(m) is ref:
            m.__class__ = plain
    return model
