"""The one gate (framework.config.security, framework.cli.precheck / job_gate): nothing a config, an
override or a sweep names may run code; what the framework ships and what the primary config trusts still runs.

In-process and fast: precheck is called as __main__ calls it (a refusal is SystemExit(2) and one line);
the real CLI runs with marker-file payloads are in tests/framework/test_cli_security.py.
"""

import re
import sys
import textwrap

import pytest
from omegaconf import OmegaConf

from framework import cli
from framework.config import resolvers, security
from framework.config.compose import Source, compose
from framework.config.validate import validate
from framework.errors import ConfigError


@pytest.fixture(autouse=True)
def _no_hydra_config():
    yield
    cli._clear_hydra_config()


def gate(overrides, source=None, multirun=False):
    """Compose with the hydra node and run the checks precheck runs on it; returns (trust, job config)."""
    source = source or Source()
    cfg = compose(overrides, source, with_hydra=True)
    return cli.check_composed(cfg, source, overrides, multirun=multirun)


def refused(overrides, pattern, source=None):
    with pytest.raises(ConfigError, match=pattern) as info:
        gate(overrides, source)
    assert "\n" not in str(info.value) and info.value.exit_code == 2


def group_file(root, group: str, name: str, text: str) -> Source:
    """A config file ``root/group/name.yaml`` (a --config-dir of someone else's files)."""
    (root / group).mkdir(exist_ok=True)
    (root / group / f"{name}.yaml").write_text(textwrap.dedent(text))
    return Source(extra_dir=str(root))


def precheck_exit(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.precheck(argv)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    return info.value.code, err


# -- _target_ ----------------------------------------------------------------------------------------
def test_allowed_prefixes_come_from_the_installed_plugins(monkeypatch):
    from framework import registry

    assert security.target_prefixes() == ("framework.", "recipes.", "torch.optim.")
    monkeypatch.setattr(registry, "plugin_modules", lambda: ["acme_weather.plugin", "torch.contrib_x.reg", "os.x"])
    assert security.target_prefixes() == ("framework.", "acme_weather.", "torch.contrib_x.", "os.", "torch.optim.")


@pytest.mark.parametrize(
    "target",
    [
        "framework.cli.os.system",  # os imported by framework.cli
        "framework.train.preemption.subprocess.run",  # subprocess imported by framework.train.preemption
        "torch.optim.adam.torch.load",  # torch reached through torch.optim
        "torch.optim.optimizer.torch.hub.load",
        "framework.cli.sys.modules",
        "framework.cli.fail.__globals__",
        "framework.registry.models.build",  # a method of an instance
    ],
)
def test_a_target_must_be_defined_under_an_allowed_prefix(target):
    with pytest.raises(ConfigError, match=r"^t: target .* (is not allowed|is not a dotted name)"):
        security.check_target("t", target, security.target_prefixes())


@pytest.mark.parametrize("target", ["torch.optim.Adam", "torch.optim.adamw.AdamW", "framework.cli.main"])
def test_allowed_targets_resolve(target):
    security.check_target("t", target, security.target_prefixes())


def test_a_target_inside_an_interpolation_is_checked_after_resolution():
    cfg = compose([])
    cfg.optim = '${oc.decode:"{_target_: evilmod_never_imported.x, lr: 0.001}"}'
    with pytest.raises(ConfigError, match=r"^optim\._target_: target 'evilmod_never_imported\.x' is not allowed"):
        validate(cfg)
    assert "evilmod_never_imported" not in sys.modules


def test_an_interpolated_target_is_refused_unresolved():
    with pytest.raises(ConfigError, match=r"^optim\._target_: .*must be a plain string"):
        validate(compose(["optim._target_=${oc.env:EVIL_TARGET,torch.optim.Adam}"]))


def test_only_safe_resolvers_stay_registered():
    OmegaConf.register_new_resolver("test_evil_eval", lambda x: eval(x))  # noqa: S307 (what a package might do)
    assert resolvers.restrict() == ["test_evil_eval"]
    assert set(resolvers.registered()) <= resolvers.SAFE
    cfg = OmegaConf.create({"x": "${test_evil_eval:1+1}"})
    with pytest.raises(Exception, match="test_evil_eval"):
        OmegaConf.to_container(cfg, resolve=True)


# -- the hydra node --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["cluster=slurm_local"],
        [
            "cluster=slurm_gpu_example",
            "hydra.launcher.nodes=2",
            "hydra.launcher.partition=gpu",
            "hydra.launcher.account=my_project",
        ],
        ["cluster=slurm_local", '+hydra.launcher.srun_args=["--cpu-bind=none"]'],  # docs/slurm.md
        [
            "cluster=slurm_local",
            "+hydra.launcher.additional_parameters.exclusive=true",
            "+hydra.launcher.additional_parameters.hint=nomultithread",
        ],
        ["hydra/launcher=submitit_local"],
        ["hydra/launcher=basic"],
        ["hydra/job_logging=disabled"],
        ["hydra.job_logging.root.level=DEBUG", "hydra.job.chdir=true", "hydra.job.name=x"],
        ["+hydra.job.env_copy=[HOME]"],
    ],
)
def test_what_the_framework_ships_passes(overrides):
    gate(overrides)


@pytest.mark.parametrize(
    "overrides,pattern",
    [
        (
            ["+hydra.callbacks.x._target_=pathlib.Path.write_text", "+hydra.callbacks.x.data=pwned"],
            r"^hydra\.callbacks\.x: Hydra callbacks run code and are not allowed",
        ),
        (["+hydra.callbacks.x._target_=framework.cli.main"], r"^hydra\.callbacks\.x: Hydra callbacks run code"),
        (["+hydra.launcher.x._target_=pathlib.Path.write_text"], r"^hydra\.launcher\.x: may only take the value"),
        (
            ["hydra.launcher._target_=hydra_plugins.evil.Launcher"],
            r"^hydra\.launcher\._target_: launcher .* not allowed",
        ),
        (
            [
                "cluster=slurm_local",
                "hydra.launcher._target_=hydra_plugins.hydra_submitit_launcher.submitit_launcher.os.system",
            ],
            r"^hydra\.launcher\._target_: target .* not allowed",
        ),
        (["cluster=slurm_local", "hydra.launcher.setup=[touch /tmp/x]"], r"^hydra\.launcher\.setup: may only take"),
        (
            ["cluster=slurm_local", '+hydra.launcher.srun_args=["--task-prolog=/tmp/x.sh"]'],
            r"^hydra\.launcher\.srun_args\[0\]: srun option '--task-prolog=/tmp/x\.sh' is not allowed",
        ),
        (
            ["cluster=slurm_local", "+hydra.launcher.additional_parameters.export='ALL,LD_PRELOAD=/tmp/x.so'"],
            r"^hydra\.launcher\.additional_parameters\.export: sbatch option --export is not allowed",
        ),
        (["cluster=slurm_local", "+hydra.launcher.python=/tmp/python"], r"^hydra\.launcher\.python: may only take"),
        (
            ["cluster=slurm_local", "hydra.launcher.partition='gpu\ntouch /tmp/x #'"],
            r"^hydra\.launcher\.partition: control characters",
        ),
        (["hydra.sweeper._target_=hydra_plugins.evil.Sweeper"], r"^hydra\.sweeper\._target_: sweeper .* not allowed"),
        (["+hydra.job.env_set.PATH=/tmp/evil:/usr/bin"], r"^hydra\.job\.env_set\.PATH: setting environment variables"),
        (["+hydra.job.env_set.LD_PRELOAD=/tmp/x.so"], r"^hydra\.job\.env_set\.LD_PRELOAD:"),
        (
            ["+hydra.job_logging.handlers.x.class=zipfile.ZipFile", "+hydra.job_logging.handlers.x.file=/tmp/m"],
            r"^hydra\.job_logging\.handlers\.x\.class: logging class 'zipfile\.ZipFile' is not allowed",
        ),
        (["+hydra.hydra_logging.handlers.x.class=subprocess.Popen"], r"^hydra\.hydra_logging\.handlers\.x\.class:"),
        (
            ["hydra.job_logging.handlers.console.stream=ext://evilmod.stream"],
            r"^hydra\.job_logging\.handlers\.console\.stream: 'ext://evilmod\.stream' is not allowed",
        ),
        (
            ["hydra.job_logging.handlers.console.stream=${logger.project}"],
            r"^hydra\.job_logging\.handlers\.console\.stream: interpolation '\$\{logger\.project\}' is not allowed",
        ),
        (
            ["hydra.job_logging.handlers.console.class=${oc.decode:zipfile.ZipFile}"],
            r"^hydra\.job_logging\.handlers\.console\.class: .* must be a plain string",
        ),
    ],
)
def test_hydra_nodes_that_run_code_are_refused(overrides, pattern):
    refused(overrides, pattern)


def test_values_equal_to_a_framework_preset_pass(tmp_path):
    """A site preset in conf/cluster may set env_set and setup lines: the same values pass, others do not."""
    from omegaconf import open_dict, read_write

    group_file(
        tmp_path,
        "cluster",
        "site",
        """\
        # @package _global_
        hydra:
          job:
            env_set: {NCCL_DEBUG: INFO}
          launcher:
            setup: [module load cuda]
        """,
    )
    presets = security.Presets.load(tmp_path)

    def check(overrides):
        cfg = compose(["hydra/launcher=submitit_slurm", *overrides], with_hydra=True)
        with read_write(cfg.hydra), open_dict(cfg.hydra):
            cfg.hydra.runtime.output_dir = str(tmp_path / "out")
        security.check_hydra(cfg.hydra, security.Trust(), presets=presets, job_targets=security.target_prefixes())

    check(["+hydra.job.env_set.NCCL_DEBUG=INFO", "hydra.launcher.setup=[module load cuda]"])
    with pytest.raises(ConfigError, match=r"^hydra\.job\.env_set\.NCCL_DEBUG:"):
        check(["+hydra.job.env_set.NCCL_DEBUG=WARN"])
    with pytest.raises(ConfigError, match=r"^hydra\.launcher\.setup:"):
        check(["hydra.launcher.setup=[module load cuda, touch /tmp/x]"])


@pytest.mark.parametrize(
    "overrides,pattern",
    [
        (
            ["hydra.searchpath=[pkg://evilmod_never_imported]"],
            r"^hydra\.searchpath: 'pkg://evilmod_never_imported' is not allowed",
        ),
        (
            ["+trust.env_set=[PATH]"],
            r"^\+trust\.env_set=\[PATH\]: trust can only be granted in the primary config file",
        ),
        (["hydra.overrides.hydra=[x]"], r"hydra\.overrides\.hydra is Hydra's own bookkeeping"),
        (["+hydra.runtime.x=1"], r"hydra\.runtime\.x is Hydra's own bookkeeping"),
        (["hydra.job_logging.root.level=DEBUG,INFO"], r"sweeping over Hydra's configuration is not supported"),
    ],
)
def test_overrides_acting_during_composition_are_refused_before_it(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        security.check_overrides(overrides)
    assert "evilmod_never_imported" not in sys.modules


def test_a_logging_node_built_by_an_interpolation_is_refused(tmp_path):
    group_file(
        tmp_path,
        "experiment",
        "log",
        """\
        # @package _global_
        hydra:
          job_logging:
            handlers: '${oc.create:"{x: {class: zipfile.ZipFile, file: /tmp/m, mode: w}}"}'
        """,
    )
    refused(
        ["experiment=log"],
        r"^hydra\.job_logging\.handlers: .*oc\.create.* not an interpolation allowed here",
        Source(extra_dir=str(tmp_path)),
    )


@pytest.mark.parametrize(
    "overrides,pattern",
    [
        (  # the formatter's text would be a line of Python in every later interpreter's start
            [
                "+hydra.job_logging.handlers.x.class=logging.FileHandler",
                "+hydra.job_logging.handlers.x.filename=/tmp/site-packages/zz.pth",
            ],
            r"^hydra\.job_logging\.handlers\.x\.filename: '/tmp/site-packages/zz\.pth' is not allowed: "
            r".* ending in \.log",
        ),
        (  # the class from one file, the name from another: the name is checked wherever it is
            ["+hydra.job_logging.handlers.x.filename=/root/.bashrc"],
            r"^hydra\.job_logging\.handlers\.x\.filename: '/root/\.bashrc' is not allowed",
        ),
        (
            ["hydra.job_logging.handlers.file.filename='/tmp/a.log\nimport os'"],
            r"^hydra\.job_logging\.handlers\.file\.filename: .* is not allowed",
        ),
        (
            ["+hydra.job_logging.handlers.file.mode=w"],
            r"^hydra\.job_logging\.handlers\.file\.mode: 'w' is not allowed: a log file is only appended to",
        ),
        (
            [
                "+hydra.hydra_logging.handlers.r.class=logging.handlers.RotatingFileHandler",
                "+hydra.hydra_logging.handlers.r.filename=${hydra.runtime.cwd}/evil.pth",
            ],
            r"^hydra\.hydra_logging\.handlers\.r\.filename: '.*/evil\.pth' is not allowed",
        ),
    ],
)
def test_a_logging_handler_from_a_config_writes_only_log_files(overrides, pattern):
    refused(overrides, pattern)


def test_a_log_file_in_another_directory_passes_and_a_trusted_class_writes_any_file(tmp_path):
    gate(
        [
            "+hydra.job_logging.handlers.x.class=logging.handlers.WatchedFileHandler",
            f"+hydra.job_logging.handlers.x.filename={tmp_path}/team/run.log",
            "+hydra.job_logging.handlers.x.mode=a",
        ]
    )
    source = _primary(tmp_path, "trust:\n  logging: [logging.FileHandler]\n")
    gate(
        [
            "+hydra.job_logging.handlers.x.class=logging.FileHandler",
            f"+hydra.job_logging.handlers.x.filename={tmp_path}/x.txt",
        ],
        source,
    )


def test_a_logging_handlers_attributes_cannot_be_set(tmp_path):
    """dictConfig's '.' key sets attributes after the handler is built: its file among them."""
    group_file(
        tmp_path,
        "experiment",
        "attr",
        """\
        # @package _global_
        hydra:
          job_logging:
            handlers:
              file:
                delay: true
                .: {baseFilename: /tmp/site-packages/zz.pth}
        """,
    )
    refused(
        ["experiment=attr"],
        r"^hydra\.job_logging\.handlers\.file\.'\.': setting a logging object's attributes is not allowed",
        Source(extra_dir=str(tmp_path)),
    )


@pytest.mark.parametrize("value", ["/tmp/conf", "../../conf", "meta/../../x", "${hydra.runtime.cwd}/conf"])
def test_hydras_own_files_stay_in_the_run_dir(value):
    """Hydra writes config.yaml, hydra.yaml and overrides.yaml into run dir / hydra.output_subdir."""
    refused([f"hydra.output_subdir={value}"], r"^hydra\.output_subdir: '.*' is not allowed: Hydra writes config\.yaml")


@pytest.mark.parametrize("value", ["null", "meta", "meta/hydra", "''"])
def test_an_output_subdir_inside_the_run_dir_passes(value):
    gate([f"hydra.output_subdir={value}"])


def test_a_hidden_override_list_from_a_config_file_is_refused(tmp_path):
    group_file(
        tmp_path,
        "experiment",
        "hide",
        """\
        # @package _global_
        hydra:
          overrides:
            hydra: ['+hydra.job.env_set.PATH=/tmp/evil']
        """,
    )
    refused(["experiment=hide"], r"^hydra\.overrides: set by a config file", Source(extra_dir=str(tmp_path)))


# -- trust ---------------------------------------------------------------------------------------
def _primary(tmp_path, trust: str, name="mine"):
    (tmp_path / f"{name}.yaml").write_text("defaults:\n  - config\n  - _self_\n" + trust)
    return Source(extra_dir=str(tmp_path), config_name=name)


def test_the_primary_config_grants_trust(tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    (tmp_path / "mycb.py").write_text("class Cb:\n    def __init__(self, path):\n        self.path = path\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    source = _primary(
        tmp_path,
        textwrap.dedent("""\
        trust:
          env_set: [WANDB_DIR]
          hydra_targets: [mycb.Cb]
          launcher_fields: [setup]
          logging: [logging.handlers.SysLogHandler]
        """),
    )
    trust, job = gate(
        [
            "+hydra.job.env_set.WANDB_DIR=/tmp/w",
            "+hydra.callbacks.c._target_=mycb.Cb",
            f"+hydra.callbacks.c.path={marker}",
            "cluster=slurm_local",
            "hydra.launcher.setup=[module load x]",
            "+hydra.job_logging.handlers.s.class=logging.handlers.SysLogHandler",
        ],
        source,
    )
    assert trust.env_set == ("WANDB_DIR",) and trust.source.endswith("mine.yaml")
    validate(job, trust)  # the trust node is dropped, not an unknown key
    refused(["+hydra.job.env_set.PATH=/x"], r"^hydra\.job\.env_set\.PATH:", source)
    refused(["+hydra.callbacks.c._target_=mycb.Other"], r"^hydra\.callbacks\.c:", source)


def test_trust_from_another_config_file_is_refused(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "grant.yaml").write_text("# @package _global_\ntrust:\n  env_set: [PATH]\n")
    refused(
        ["experiment=grant", "+hydra.job.env_set.PATH=/x"],
        r"^trust: may only be set in the primary config file",
        Source(extra_dir=str(tmp_path)),
    )
    # A primary config whose own values come first: the experiment, composed after them, would
    # replace its trust node (with `_self_` last, the primary's node wins and nothing changes).
    (tmp_path / "mine.yaml").write_text("defaults:\n  - _self_\n  - config\ntrust:\n  env_set: [FOO]\n")
    source = Source(extra_dir=str(tmp_path), config_name="mine")
    refused(["experiment=grant"], r"^trust: may only be set in the primary config file", source)


def test_trust_cannot_be_an_interpolation(tmp_path):
    source = _primary(tmp_path, "trust:\n  env_set: ['${oc.env:X}']\n")
    refused([], r"^trust\.env_set: interpolations are not allowed", source)


def test_trust_in_conf_dir_of_another_name_is_not_the_primary(tmp_path):
    """A config.yaml in --config-dir is shadowed by conf/config.yaml: it is not the primary config."""
    (tmp_path / "config.yaml").write_text("trust:\n  env_set: [PATH]\n")
    refused(["+hydra.job.env_set.PATH=/x"], r"^hydra\.job\.env_set\.PATH:", Source(extra_dir=str(tmp_path)))


# -- a sweep ----------------------------------------------------------------------------------------
def test_every_option_of_a_swept_group_is_checked(tmp_path, capsys):
    group_file(
        tmp_path,
        "cluster",
        "evil",
        """\
        # @package _global_
        cluster: {name: local}
        hydra:
          job:
            env_set: {PATH: /tmp/evil}
        """,
    )
    code, err = precheck_exit(
        ["--multirun", "--config-dir", str(tmp_path), "cluster=local,evil", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        capsys,
    )
    assert code == 2 and len(err) == 1 and err[0].startswith("error: hydra.job.env_set.PATH:"), err
    code, err = precheck_exit(
        ["--multirun", "--config-dir", str(tmp_path), "cluster=glob(*)", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        capsys,
    )
    assert code == 2 and err[0].startswith("error: hydra.job.env_set.PATH:"), err
    assert not (tmp_path / "sweep").exists()


def test_a_sweep_with_more_options_than_the_check_makes_is_refused(tmp_path, capsys, monkeypatch):
    """Options past the cap would configure their jobs' logging unchecked: the sweep is refused,
    while repeats of one option count once."""
    monkeypatch.setattr(cli, "MAX_SWEEP_VARIANTS", 4)
    (tmp_path / "cluster").mkdir()
    for i in range(4):
        (tmp_path / "cluster" / f"c{i}.yaml").write_text("# @package _global_\ncluster: {name: local}\n")
    sweep = ["--multirun", "--config-dir", str(tmp_path), f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    cli.precheck([*sweep, "cluster=local" + ",c0" * 20 + ",c1,c2"])
    code, err = precheck_exit([*sweep, "cluster=glob(*)"], capsys)  # local, c0-c3 and the shipped ones
    assert code == 2 and len(err) == 1, err
    pattern = r"^error: --multirun: checking this sweep's config group options takes \d+ compositions, more than 4;"
    assert re.match(pattern, err[0]), err
    assert not (tmp_path / "sweep").exists()


def test_a_clean_sweep_passes_precheck(tmp_path):
    cli.precheck(["--multirun", "optim=adam,adamw", "optim.lr=1e-3,2e-3", f"hydra.sweep.dir={tmp_path / 's'}"])
    assert not (tmp_path / "s").exists()  # precheck writes nothing


@pytest.mark.parametrize(
    "argv,pattern",
    [
        (
            ["--help", "+hydra.hydra_logging.handlers.x.class=zipfile.ZipFile"],
            r"hydra\.hydra_logging\.handlers\.x\.class",
        ),
        (["--experimental-rerun", "x.pickle"], r"--experimental-rerun loads a pickle"),
        (
            ["--config-path", "pkg://evilmod_never_imported"],
            r"--config-path: 'pkg://evilmod_never_imported' is not allowed",
        ),
        (["--cfg", "job", "+hydra.callbacks.x._target_=os.system"], r"hydra\.callbacks\.x"),
    ],
)
def test_precheck_covers_every_command_that_composes(argv, pattern, capsys):
    code, err = precheck_exit(argv, capsys)
    assert code == 2 and len(err) == 1 and __import__("re").search(pattern, err[0]), err


# -- the job's own check -------------------------------------------------------------------------------
def test_the_job_checks_its_hydra_node_again():
    """A job whose config came from a file (a submitit pickle, a sweep) never passed precheck."""
    from hydra.core.hydra_config import HydraConfig

    cfg = compose(["+hydra.job.env_set.PATH=/tmp/evil"], with_hydra=True)
    cfg.hydra.runtime.output_dir = "/tmp/out"
    HydraConfig.instance().set_config(cfg)
    job = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    with pytest.raises(ConfigError, match=r"^hydra\.job\.env_set\.PATH:"):
        cli.job_gate(job)
