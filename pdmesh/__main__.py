"""``python -m pdmesh``: the `pdmesh` command."""

import sys

from pdmesh.cli import main

sys.exit(main())
