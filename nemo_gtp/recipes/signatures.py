"""The keywords the classes a recipe's sections feed accept, read from the installed packages'
source without importing them (the CLI's checks import no torch, so a typo'd ``+key`` is refused
in a fraction of a second instead of by a traceback after NeMo's import).

A class's keywords are its ``__init__``'s parameters, or for a dataclass without one its
annotated fields; a base class's count too when the class has no ``__init__`` or passes
``**kwargs`` on. Bases are followed through the defining module's ``from X import Name`` lines.
``tests/test_bad_inputs.py`` checks every section's set against the imported classes.

Example::

    "max_steps" in section_keywords("trainer")   # True: Lightning's Trainer takes it
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

# section -> (module, class) it is passed to, and the name errors give that class.
SECTION_CLASSES: dict[str, tuple[str, str, str]] = {
    "trainer": ("lightning.pytorch.trainer.trainer", "Trainer", "nl.Trainer"),
    "strategy": (
        "nemo.lightning.pytorch.strategies.megatron_strategy",
        "MegatronStrategy",
        "GTPMegatronStrategy",
    ),
    "ddp": (
        "megatron.core.distributed.distributed_data_parallel_config",
        "DistributedDataParallelConfig",
        "megatron's DistributedDataParallelConfig",
    ),
    "optim": (
        "megatron.core.optimizer.optimizer_config",
        "OptimizerConfig",
        "megatron's OptimizerConfig",
    ),
    "model": ("nemo.collections.llm.gpt.model.base", "GPTConfig", "llm.GPTConfig"),
    "data": (
        "nemo_gtp.data.synthetic",
        "ArithmeticGPTDataModule",
        "the recipes' data module (NeMo's MockDataModule)",
    ),
}
# Keys the loader takes itself (added), and keys it fills from elsewhere (removed: a recipe
# key for them would collide with the loader's own argument), with where they come from.
LOADER_ADDS: dict[str, set[str]] = {
    "strategy": {"num_weight_shards", "expert_num_weight_shards"},
    "model": {"layer_spec"},
    "data": {"dataset", "vocab_size"},
}
LOADER_PASSES: dict[str, dict[str, str]] = {
    "trainer": {
        "strategy": "the strategy, ddp and gtp sections",
        "plugins": "precision and the fp8 section",
        "callbacks": "the checkpoint and peft sections",
    },
    "strategy": {"ddp": "the ddp section", "gtp_config": "the gtp section"},
    "model": {"vocab_size": "data.vocab_size", "seq_length": "data.seq_length"},
    "data": {
        "tokenizer": "data.vocab_size (a null tokenizer)",
        "num_workers": "the loader (0)",
        "pin_memory": "the loader (false)",
        "create_attention_mask": "the loader (true)",
    },
}


def section_keywords(section: str) -> frozenset[str] | None:
    """The keys a recipe's ``section`` may hold; None when its class's source is not found."""
    module, name, _ = SECTION_CLASSES[section]
    keys = _class_keywords(module, name)
    if keys is None:
        return None
    return frozenset((keys | LOADER_ADDS.get(section, set())) - set(LOADER_PASSES.get(section, {})))


def _module_path(module: str) -> Path | None:
    top, _, rest = module.partition(".")
    spec = importlib.util.find_spec(top)  # a top-level name: found, not imported
    if spec is None or not spec.submodule_search_locations or not rest:
        return None
    for root in spec.submodule_search_locations:  # several for a namespace package
        base = Path(root, *rest.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
    return None


@functools.cache
def _parsed(module: str) -> ast.Module | None:
    path = _module_path(module)
    return ast.parse(path.read_text()) if path is not None else None


@functools.cache
def _class_keywords(module: str, name: str) -> frozenset[str] | None:
    tree = _parsed(module)
    if tree is None:
        return None
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if cls is None:
        return None
    init = next(
        (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None
    )
    if init is not None:
        args = init.args
        keys = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)} - {"self"}
        if args.kwarg is None:
            return frozenset(keys)
    else:  # a dataclass: its annotated fields
        keys = {
            n.target.id
            for n in cls.body
            if isinstance(n, ast.AnnAssign)
            and isinstance(n.target, ast.Name)
            and "ClassVar" not in ast.unparse(n.annotation)
        }
    for base in cls.bases:
        found = _base_keywords(tree, module, base)
        keys |= found or set()
    return frozenset(keys)


def _base_keywords(tree: ast.Module, module: str, base: ast.expr) -> frozenset[str] | None:
    if not isinstance(base, ast.Name):
        return None  # e.g. io.IOMixin: a mixin without keywords of its own
    if any(isinstance(n, ast.ClassDef) and n.name == base.id for n in tree.body):
        return _class_keywords(module, base.id)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(a.name == base.id for a in node.names):
            source = node.module or ""
            if node.level:  # relative to this module's package
                package = module.split(".")[: -node.level]
                source = ".".join([*package, *([source] if source else [])])
            return _class_keywords(source, base.id)
    return None
