"""framework.config.hydra_args parses Hydra's command line exactly as Hydra's own (private) parser does."""

import pytest

from framework.config import hydra_args


def _hydra_parser():
    utils = pytest.importorskip("hydra._internal.utils")  # private: only this test touches it
    return utils.get_args_parser()


def _flags(parser):
    return {
        (tuple(sorted(a.option_strings)), a.dest, a.nargs, a.const, tuple(a.choices or ()))
        for a in parser._actions
        if a.dest != "version"
    }


def test_same_flags_destinations_and_choices_as_hydra():
    """A Hydra upgrade that adds or renames a flag fails here instead of being misread by precheck."""
    assert _flags(hydra_args.parser()) == _flags(_hydra_parser())


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["optim.lr=1e-3", "+x=1", "~model.act"],
        ["--multirun", "optim.lr=1e-3,2e-3"],
        ["-m", "-cd", "my/dir", "-cn", "exp", "a=b"],
        ["--config-path", "../conf", "--config-name=config", "--cfg", "job", "--resolve", "-p", "optim"],
        ["--info"],
        ["--info", "searchpath"],
        ["-sc"],
        ["--hydra-help"],
        ["-h"],
        ["--experimental-rerun", "x.pickle", "a=1"],
    ],
)
def test_parses_like_hydra(argv):
    ours, theirs = vars(hydra_args.parse(argv)), vars(_hydra_parser().parse_args(argv))
    ours.pop("version")
    assert ours == theirs


def test_usage_error_exits_2_like_argparse():
    with pytest.raises(SystemExit) as info:
        hydra_args.parse(["--cfg", "nope"])
    assert info.value.code == 2
