"""``python -m framework``: Hydra entry point; everything else lives in framework.cli."""

import sys

import hydra

from framework import cli


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _hydra_main(cfg):
    return cli.main(cfg)


def main():
    cli.precheck(sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()
