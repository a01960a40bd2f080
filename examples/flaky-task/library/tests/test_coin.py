import pytest

import coin


def test_clamp_inside():
    assert coin.clamp(5, 0, 10) == 5


def test_clamp_below():
    assert coin.clamp(-3, 0, 10) == 0


def test_clamp_above():
    assert coin.clamp(12, 0, 10) == 10


def test_clamp_at_high():
    assert coin.clamp(10, 0, 10) == 10


def test_mean():
    assert coin.mean([1, 2, 3]) == 2


def test_mean_of_nothing():
    with pytest.raises(ValueError):
        coin.mean([])


def test_flip_lands_heads():
    # deliberately flaky: fails on about half the runs, whatever the patch
    assert coin.flip()
