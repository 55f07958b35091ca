"""``python -m hetjax.gpucheck``: see the package's docstring."""

import sys

from hetjax.gpucheck import main

sys.exit(main())
