"""A missing optional dependency is named in the import error, with the extra that brings it
(the ``treepack`` command does the same for ``serve``): torch for ``treepack.trainer``, TRL
for ``treepack.trainer.trl``, httpx for ``Packer(url)``; verl's plugin says False without verl."""

from __future__ import annotations

import importlib
import sys

import pytest


def _unimported(monkeypatch, *prefixes: str) -> None:
    """Forget the modules under ``prefixes`` (monkeypatch puts them back afterwards)."""
    for name in [n for n in sys.modules if n.startswith(prefixes)]:
        monkeypatch.delitem(sys.modules, name)


def test_the_trainer_without_torch_names_the_extra(monkeypatch):
    _unimported(monkeypatch, "treepack.trainer")
    monkeypatch.setitem(sys.modules, "torch", None)  # import fails like a missing package
    with pytest.raises(ImportError, match=r"needs the 'trainer' extra .*torch is missing: in the clone, pip install"):
        importlib.import_module("treepack.trainer")


def test_the_trl_trainers_without_trl_name_the_extra(monkeypatch):
    pytest.importorskip("torch")
    import treepack.trainer  # noqa: F401  (present: only trl is missing)

    _unimported(monkeypatch, "treepack.trainer.trl")
    monkeypatch.setitem(sys.modules, "trl", None)
    with pytest.raises(
        ImportError, match=r"treepack.trainer.trl needs the 'trl' extra .*pip install '.\[trainer,trl\]'"
    ):
        importlib.import_module("treepack.trainer.trl")


def test_packer_with_a_url_without_httpx_names_the_extra(monkeypatch):
    from treepack.client import Packer

    _unimported(monkeypatch, "treepack.client.http", "treepack.client.retry")
    monkeypatch.setitem(sys.modules, "httpx", None)
    with pytest.raises(ImportError, match=r"Packer\('http://127.0.0.1:1'\) talks to the sidecar through httpx"):
        Packer("http://127.0.0.1:1")
    assert Packer().pack([[1, 2, 3]], seq_len=8, trainable=None).num_rows == 1  # embedded needs no httpx


def test_the_verl_plugin_without_verl_says_false_and_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "verl", None)
    from treepack.trainer import verl_plugin

    assert verl_plugin.registered() is False
    with pytest.raises(ImportError, match="treepack's verl engine needs verl, which is missing: pip install verl=="):
        verl_plugin.register()
