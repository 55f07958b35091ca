"""``python -m hetjax.bench``."""

import sys

from hetjax.bench import main

sys.exit(main())
