"""``python -m treepack.service.cli``: the ``treepack`` command."""

import sys

from treepack.service.cli.command import main

sys.exit(main())
