"""Global batch k holds the same samples whatever the mesh; resuming continues the sequence."""

import itertools

import pytest

from framework.data.sampler import GlobalBatchSampler, shard_range
from framework.errors import ConfigError


def take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


@pytest.mark.parametrize("dp_size", [1, 2, 4, 8])
def test_global_batch_is_mesh_independent(dp_size):
    ref = take(GlobalBatchSampler(50, 8, seed=3), 15)  # crosses two epochs (6 steps each)
    shards = [take(GlobalBatchSampler(50, 8, dp_rank=r, dp_size=dp_size, seed=3), 15) for r in range(dp_size)]
    for k in range(15):
        assert [i for s in shards for i in s[k]] == ref[k]  # rank order = contiguous shares
        assert all(len(s[k]) == 8 // dp_size for s in shards)


def test_epochs_are_permutations_and_differ():
    s = GlobalBatchSampler(48, 8, seed=0)
    epoch0 = [i for b in take(s, 6) for i in b]
    epoch1 = [i for b in take(s, 6) for i in b]
    assert sorted(epoch0) == list(range(48)) == sorted(epoch1)
    assert epoch0 != epoch1


def test_seed_changes_order():
    assert take(GlobalBatchSampler(40, 4, seed=0), 3) != take(GlobalBatchSampler(40, 4, seed=1), 3)


def test_resume_at_step_continues_the_sequence():
    full = take(GlobalBatchSampler(30, 4, seed=7), 20)
    resumed = take(GlobalBatchSampler(30, 4, seed=7, start_step=13), 7)
    assert resumed == full[13:]


def test_bad_sizes_name_the_key():
    with pytest.raises(ConfigError, match="data.batch_size: 6 is not divisible by the 4 data-parallel ranks"):
        GlobalBatchSampler(100, 6, dp_size=4)
    with pytest.raises(ConfigError, match="data.batch_size: 16 exceeds the 10 training samples"):
        GlobalBatchSampler(10, 16)


def test_shard_range_covers_everything_once():
    for n in range(0, 12):
        for size in (1, 2, 3, 5):
            parts = [list(shard_range(n, r, size)) for r in range(size)]
            assert [i for p in parts for i in p] == list(range(n))


def test_micro_batches_split_each_ranks_samples_evenly():
    from framework.data.sampler import micro_batch

    assert micro_batch(8, 2, 2) == 2 and micro_batch(8, 1, 8) == 1
    with pytest.raises(ConfigError, match=r"^data\.batch_size: 6 is not divisible by the 4 data-parallel ranks"):
        micro_batch(6, 4, 1)
    with pytest.raises(
        ConfigError,
        match=r"^trainer\.grad_accum=3: the 4 samples per rank \(8 over 2 data-parallel ranks\) do not split into 3 "
        r"equal micro-batches; make data\.batch_size a multiple of 6$",
    ):
        micro_batch(8, 2, 3)
