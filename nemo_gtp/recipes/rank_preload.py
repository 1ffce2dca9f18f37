"""What the CLI's fork server imports once before it forks the ranks of a CPU launch.

Imported (for its effect) by the fork server of :func:`nemo_gtp.recipes.launch.launch_fits`:
the known-harmless warnings are filtered first (most of them are raised at import), then NeMo,
megatron-core and the recipe loader are imported, so every forked rank starts with them in
memory instead of importing them itself (~25 s of CPU per rank on a 2-core machine).

Example::

    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["nemo_gtp.recipes.rank_preload"])
"""

from nemo_gtp.recipes.quiet import quiet_known_warnings

quiet_known_warnings()

import nemo.collections.llm  # noqa: E402, F401
import nemo.lightning  # noqa: E402, F401

import nemo_gtp.cpu.compat  # noqa: E402, F401
import nemo_gtp.recipes.loader  # noqa: E402, F401
