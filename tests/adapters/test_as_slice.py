from lightning_cg.adapters import as_slice


def test_consecutive_ascending_indices_become_a_slice():
    assert as_slice([3, 4, 5]) == slice(3, 6)
    assert as_slice((0,)) == slice(0, 1)


def test_other_indices_stay_indices():
    assert as_slice([]) is None
    assert as_slice([0, 2]) is None
    assert as_slice([2, 1]) is None
    assert as_slice([1, 1]) is None
