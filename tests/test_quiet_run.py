"""The test run stays quiet and honest: advice no test expects is an error, not a printed line.

pyproject.toml's ``filterwarnings`` turns every :class:`TreepackWarning` (the cost model's
:class:`CostWarning` included) into an error, so a test that expects one must assert it
with ``pytest.warns`` and a test that is not about the advice must pass ``advise=False``.
These tests fail if that entry is dropped.
"""

from __future__ import annotations

import warnings

import pytest

from treepack.proto.cost import CostWarning
from treepack.proto.errors import TreepackWarning


@pytest.mark.parametrize("category", [TreepackWarning, CostWarning])
def test_an_unexpected_treepack_warning_is_an_error(category):
    with pytest.raises(category, match="advice no test expects"):
        warnings.warn("advice no test expects", category)


def test_an_expected_one_is_asserted_with_pytest_warns():
    with pytest.warns(TreepackWarning, match="expected advice"):
        warnings.warn("expected advice", TreepackWarning)
