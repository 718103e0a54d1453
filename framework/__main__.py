"""``python -m framework``: Hydra entry point; everything else lives in framework.cli.

``cli.precheck`` checks what Hydra is about to run (the whole config, its ``hydra`` node
included) before ``@hydra.main`` configures logging or instantiates anything from it.
"""

import sys

import hydra

from framework import cli
from framework.distributed.launcher import die_with_launcher


@hydra.main(version_base="1.3", config_path=cli.CONF_DIR, config_name="config")
def _hydra_main(cfg):
    return cli.main(cfg)


def main():
    die_with_launcher()
    try:
        cli.precheck(sys.argv[1:])
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
    _hydra_main()


if __name__ == "__main__":
    main()
