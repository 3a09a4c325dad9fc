"""helpers.extras.require: a missing optional dependency skips outside CI and fails under CI."""

from __future__ import annotations

import pytest

from helpers.extras import in_ci, require


def test_a_missing_extra_skips_outside_ci_and_fails_under_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    assert not in_ci()
    with pytest.raises(pytest.skip.Exception):
        require("treepack_no_such_extra")
    for value in ("1", "true"):
        monkeypatch.setenv("CI", value)
        assert in_ci()
        with pytest.raises(
            ImportError, match="CI is set and the test dependency 'treepack_no_such_extra' does not import"
        ):
            require("treepack_no_such_extra")
    assert require("numpy").__name__ == "numpy"  # a present one imports either way
