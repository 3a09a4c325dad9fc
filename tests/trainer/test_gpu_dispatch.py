"""treepack.trainer.kernels.gpu without GPU packages: the probe, the import errors, the buckets.

The wrappers themselves run in tests/triton_interp (Triton interpreter) and gpu_check (GPU).
"""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import given
from hypothesis import strategies as st

from treepack.trainer.kernels import gpu


def test_available_names_every_kernel_with_a_reason():
    avail = gpu.available()
    assert set(avail) == set(gpu.KERNELS)
    for name, (module, _) in gpu.KERNELS.items():
        top = module.split(".")[0]
        if importlib.util.find_spec(top) is None:
            assert avail[name] and top in avail[name], (name, avail[name])


def test_load_kernel_error_names_the_kernel():
    name = next((n for n, (m, _) in gpu.KERNELS.items() if importlib.util.find_spec(m.split(".")[0]) is None), None)
    if name is None:
        pytest.skip("every kernel package imports here")
    with pytest.raises(ImportError, match=name.replace(".", r"\.")):
        gpu.load_kernel(name)


@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.sampled_from([0.0, 0.5, 1.0, 3.0]))
def test_length_buckets_cover_once_and_bound_padding(lens, ratio):
    groups = gpu.length_buckets(lens, ratio)
    flat = sorted(i for g in groups for i in g)
    assert flat == list(range(len(lens)))
    for g in groups:
        longest, real = lens[g[0]], sum(lens[i] for i in g)
        assert longest == max(lens[i] for i in g)
        assert len(g) * longest - real <= ratio * real or len(g) == 1
