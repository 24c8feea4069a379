"""scatter_dataset / scatter_index split as ChainerMN splits, and bad
arguments fail on every rank.  Serially and under mpiexec -n 2 / -n 3."""

import numpy
import pytest

from conftest import naive_comm as comm  # NOQA: the comm fixture
from conftest import chainer, needs_chainer

# Also under mpiexec -n 3: a dataset scatters unevenly over 3 ranks.
pytestmark = [needs_chainer, pytest.mark.many_ranks]

import mnopt  # NOQA


def chainermn_shares(n, size, force_equal_length):
    """ChainerMN's split, written out: equal shares of ceil(n / size) from
    floor(n * r / size); otherwise disjoint, the first n % size ranks one
    example longer."""
    if force_equal_length:
        return [(n * r // size, n * r // size + -(-n // size))
                for r in range(size)]
    lengths = [n // size + (r < n % size) for r in range(size)]
    starts = numpy.cumsum([0] + lengths)
    return [(int(starts[r]), int(starts[r + 1])) for r in range(size)]


def test_the_split_of_ten_over_three_is_chainermns():
    assert chainermn_shares(10, 3, False) == [(0, 4), (4, 7), (7, 10)]
    assert chainermn_shares(10, 3, True) == [(0, 4), (3, 7), (6, 10)]


@pytest.mark.parametrize('force_equal_length', [True, False])
@pytest.mark.parametrize('n', [0, 1, 2, 7, 10, 97])
def test_scatter_index_is_chainermns_split(comm, n, force_equal_length):
    mine = mnopt.scatter_index(n, comm, force_equal_length=force_equal_length)
    assert mine == chainermn_shares(n, comm.size,
                                    force_equal_length)[comm.rank]


@pytest.mark.parametrize('force_equal_length', [True, False])
@pytest.mark.parametrize('n', [0, 1, 5, 11])
@pytest.mark.parametrize('shuffle', [False, True])
def test_scatter_dataset_covers_everything(comm, n, shuffle,
                                           force_equal_length):
    root = comm.size - 1
    data = list(range(100, 100 + n)) if comm.rank == root else None
    mine = mnopt.scatter_dataset(data, comm, root=root, shuffle=shuffle,
                                 seed=3,
                                 force_equal_length=force_equal_length)
    assert isinstance(mine, chainer.datasets.SubDataset)
    shares = comm.allgather_obj(list(mine))
    everything = [x for s in shares for x in s]
    assert set(everything) == set(range(100, 100 + n))
    if force_equal_length:
        assert len({len(s) for s in shares}) == 1
    else:
        assert sorted(everything) == list(range(100, 100 + n))
    if shuffle:   # the seed's permutation, in ChainerMN's order
        order = numpy.random.RandomState(3).permutation(n)
        b, e = chainermn_shares(n, comm.size, force_equal_length)[comm.rank]
        assert list(mine) == [100 + int(i) for i in order[b:e]]


def test_force_equal_length_is_keyword_only(comm):
    with pytest.raises(TypeError):
        mnopt.scatter_dataset([1, 2], comm, 0, False, None, 10, False)


def test_a_root_without_a_dataset_fails_on_every_rank(comm):
    with pytest.raises(TypeError, match='on the root rank 0'):
        mnopt.scatter_dataset(None, comm)


def test_roots_that_differ_fail_on_every_rank(comm):
    if comm.size == 1:
        with pytest.raises(ValueError, match='not a rank'):
            mnopt.scatter_dataset([1], comm, root=1)
        return
    with pytest.raises(ValueError, match='ranks disagree on root'):
        mnopt.scatter_dataset([1, 2, 3], comm, root=comm.rank % 2)


def test_create_empty_dataset():
    assert mnopt.datasets.create_empty_dataset(numpy.arange(4)) == [()] * 4
    assert mnopt.create_empty_dataset([]) == []


def test_chainermn_module_paths():
    from mnopt.datasets.empty_dataset import create_empty_dataset
    from mnopt.datasets.scatter import (DataSizeError, scatter_dataset,
                                        scatter_index)
    assert mnopt.datasets.scatter_dataset is scatter_dataset
    assert mnopt.scatter_index is scatter_index
    assert mnopt.DataSizeError is DataSizeError
    assert mnopt.create_empty_dataset is create_empty_dataset
