"""treepack's client: :class:`Packer` (sync) and :class:`AsyncPacker` (async).

``Packer()`` plans in-process (no server); ``Packer(url="http://127.0.0.1:8000")`` talks
to a ``treepack serve`` sidecar. No torch here. The HTTP backend needs ``httpx``
(the ``client`` extra: ``pip install '.[client]'`` in the clone).
"""

from treepack.client.packer import AsyncPacker, Packer
from treepack.proto.strategy import Strategy
from treepack.proto.whatif import Composition, Distribution, WhatIfResult, as_composition

__all__ = ["Packer", "AsyncPacker", "Composition", "Distribution", "WhatIfResult", "Strategy", "as_composition"]
