import numpy as np
import pytest
from hypothesis import given, strategies as st

from helpers import nan_buffer, sizes, float_arrays
from llambda.runtime import buffers


@given(st.data(), sizes(8, 5000))
def test_add_matches_reference(native, ref, data, n):
    a = float_arrays(data.draw, (n,))
    b = float_arrays(data.draw, (n,))
    got, want = nan_buffer(n), nan_buffer(n)
    native.add(a, b, got)
    ref.add(a, b, want)
    np.testing.assert_array_equal(got, want)   # one IEEE add: exact


def test_add_rejects_bad_arguments(native):
    a = buffers.zeros(16)
    out = buffers.zeros(16)
    with pytest.raises(ValueError, match="b: expected dtype float32"):
        native.add(a, buffers.zeros(16, np.float64), out)
    with pytest.raises(ValueError, match="out: expected shape"):
        native.add(a, a, buffers.zeros(15))
    with pytest.raises(ValueError, match="a: data must be 32-byte aligned"):
        native.add(buffers.zeros(17)[1:], buffers.zeros(16), out)
    with pytest.raises(ValueError, match="b: array must be C-contiguous"):
        native.add(a, buffers.zeros(32)[::2], out)
