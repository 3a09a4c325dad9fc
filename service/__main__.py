"""``python -m treepack.service``: run the sidecar (same flags as ``treepack serve``)."""

import sys

from treepack.service.serve import main

sys.exit(main())
