import pytest

from framework.config.schema import ParallelConfig
from framework.distributed.mesh import Degrees, resolve
from framework.errors import ConfigError


@pytest.mark.parametrize(
    "cfg,world,expected",
    [
        (dict(), 4, (1, 4, 1)),
        (dict(dp_replicate=2), 4, (2, 2, 1)),
        (dict(domain=2), 8, (1, 4, 2)),
        (dict(dp_replicate=2, domain=2), 8, (2, 2, 2)),
        (dict(dp_shard=1, domain=-1), 4, (1, 1, 4)),
        (dict(), 1, (1, 1, 1)),
    ],
)
def test_resolve_fills_the_free_axis(cfg, world, expected):
    assert resolve(ParallelConfig(**cfg), world) == Degrees(*expected)


def test_degrees_that_do_not_fill_the_world_are_a_config_error():
    with pytest.raises(ConfigError, match=r"1 x -1 x 3 cannot fill 4 ranks \(4 is not divisible by 3\)"):
        resolve(ParallelConfig(domain=3), 4)
    with pytest.raises(ConfigError, match=r"2 x 2 x 2 = 8 does not match the world size 4"):
        resolve(ParallelConfig(dp_replicate=2, dp_shard=2, domain=2), 4)


def test_one_process_asking_for_several_ranks_is_told_how_to_start_them():
    with pytest.raises(ConfigError, match=r"cannot fill 1 ranks .*; start 2 processes: torchrun --nproc-per-node=2 -m"):
        resolve(ParallelConfig(domain=2), 1)
    with pytest.raises(ConfigError, match=r"= 4 does not match the world size 1; start 4 processes: torchrun"):
        resolve(ParallelConfig(dp_shard=2, domain=2), 1)
    with pytest.raises(ConfigError) as err:  # several ranks already: the degrees are wrong, not the launch
        resolve(ParallelConfig(domain=3), 4)
    assert "torchrun" not in str(err.value)
