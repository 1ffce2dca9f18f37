"""Recipe YAML loading with OmegaConf overrides; imports nothing heavy (no torch, no NeMo).

Example::

    cfg = load_recipe("configs/tiny_cpu.yaml", ["trainer.max_steps=50", "+data.seed=1"])
"""

from __future__ import annotations

import difflib
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


class RecipeError(ValueError):
    """A recipe or override the CLI rejects before launching; the message names the key."""


def load_recipe(path: str, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The recipe at ``path`` with ``key=value`` overrides applied (``+key=value`` adds a key).

    Unknown keys without ``+`` are an error, so a typo does not silently do nothing. Raises
    :class:`RecipeError` (one line naming the file or key) for a missing or unparsable recipe
    and for a malformed override.
    """
    if not Path(path).is_file():
        hint = ""
        configs = Path(__file__).resolve().parents[2] / "configs"
        if configs.is_dir():
            hint = f" (recipes: {', '.join(sorted(p.name for p in configs.glob('*.yaml')))})"
        raise RecipeError(f"recipe file {path!r} not found: give a recipe YAML path{hint}")
    try:
        cfg = OmegaConf.load(path)
    except Exception as err:  # YAML syntax: the parser's first line names line and column
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise RecipeError(f"recipe file {path!r} is not valid YAML: {first}") from None
    if not isinstance(cfg, DictConfig):
        raise RecipeError(f"recipe file {path!r} must be a mapping of sections (trainer:, ...)")
    OmegaConf.set_struct(cfg, True)
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r} is not key=value (e.g. trainer.max_steps=10)")
        key, value = item.split("=", 1)
        add = key.startswith("+")
        key = key.lstrip("+")
        if not key:
            raise RecipeError(f"override {item!r} has no key (e.g. trainer.max_steps=10)")
        if not add and OmegaConf.select(cfg, key, default="__missing__") == "__missing__":
            raise RecipeError(
                f"override {key!r}: no such key in {path}{_close_key(cfg, key)} "
                f"(use +{key}=... to add it)"
            )
        try:
            parsed = OmegaConf.from_dotlist([f"x={value}"]).x
            with _open_dict(cfg):
                OmegaConf.update(cfg, key, parsed, merge=True)
        except RecipeError:
            raise
        except Exception as err:
            raise RecipeError(f"override {item!r}: {err}".splitlines()[0]) from None
    return cfg


def _close_key(cfg: DictConfig, key: str) -> str:
    """``" (did you mean 'trainer.max_steps'?)"`` when close names make ``key`` one that exists."""
    guess, node = [], cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig):
            return ""
        if part not in node:
            close = difflib.get_close_matches(part, [str(k) for k in node.keys()], n=1)
            if not close:
                return ""
            part = close[0]
        guess.append(part)
        node = node[part]
    return f" (did you mean {'.'.join(guess)!r}?)"


class _open_dict:
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg

    def __enter__(self) -> None:
        OmegaConf.set_struct(self.cfg, False)

    def __exit__(self, *exc: object) -> None:
        OmegaConf.set_struct(self.cfg, True)
