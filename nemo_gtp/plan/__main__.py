"""``python -m nemo_gtp.plan``: :func:`nemo_gtp.plan.cli.main`."""

import sys

from nemo_gtp.plan.cli import main

sys.exit(main())
