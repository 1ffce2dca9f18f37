"""Write a cProfile of some training steps as text (where a host-bound step's time goes).

prof = cProfile.Profile(); prof.enable(); ...steps...; prof.disable()
write_host_profile("out/host_profile_gtp.txt", "mode=gtp: 5 steps", prof,
                   (("tottime", 30), ("cumulative", 40)))
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats


def write_host_profile(
    path: str,
    header: str,
    prof: cProfile.Profile,
    tables: tuple[tuple[str, int], ...] = (("tottime", 35),),
) -> None:
    """``header`` then one pstats table per ``(sort key, rows)`` in ``tables``, into ``path``."""
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    for key, rows in tables:
        stats.sort_stats(key).print_stats(rows)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(f"{header}\n{text.getvalue()}")
