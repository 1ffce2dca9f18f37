"""Recipe YAML loading with OmegaConf overrides; imports nothing heavy (no torch, no NeMo).

Example::

    cfg = load_recipe("configs/tiny_cpu.yaml", ["trainer.max_steps=50", "+trainer.seed=1"])
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf


def load_recipe(path: str, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The recipe at ``path`` with ``key=value`` overrides applied (``+key=value`` adds a key).

    Unknown keys without ``+`` are an error, so a typo does not silently do nothing.
    """
    cfg = OmegaConf.load(path)
    OmegaConf.set_struct(cfg, True)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not key=value")
        key, value = item.split("=", 1)
        add = key.startswith("+")
        key = key.lstrip("+")
        if not add and OmegaConf.select(cfg, key, default="__missing__") == "__missing__":
            raise ValueError(f"override {key!r}: no such key in {path} (use +{key}=... to add)")
        with _open_dict(cfg):
            OmegaConf.update(cfg, key, OmegaConf.from_dotlist([f"x={value}"]).x, merge=True)
    return cfg


class _open_dict:
    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg

    def __enter__(self) -> None:
        OmegaConf.set_struct(self.cfg, False)

    def __exit__(self, *exc: object) -> None:
        OmegaConf.set_struct(self.cfg, True)
