"""The import graph of ``kvcache`` points one way, tier by tier:

    apps     kvcache.apps.*, kvcache.__main__ (the CLI, demo, eval, benchmarks, tiny models)
      |
    api      kvcache (the package: the public names)
      |
    model    kvcache.hf.* (the transformers-facing cache: bridge, cache, build, cachefile, spec, ...),
      |      kvcache.prompts.*, kvcache.engine.*, kvcache.train.*
    storage  kvcache.formats.*, kvcache.layers.*, kvcache.attention.*, kvcache.persist.*,
      |      kvcache.models.* (real pretrained models: may import errors and transformers, nothing of the cache)
    errors   kvcache.errors

A tier is a set of packages: the top level holds no loose modules (only ``__init__``, ``__main__``,
``errors``, ``csrc/`` and the packages), so a module placed there has no tier and fails here.

A module imports only from its own tier or one below; within the library (every tier but apps)
the graph has no cycle. Every import counts: at module level and inside functions, relative ones
resolved, since a lazy import that dodges a cycle at load time is still a cycle in the design.
Imports under ``if TYPE_CHECKING:`` are left out: they never run, so they order nothing.

The applications use the public API only: what they import of the library is ``kvcache`` or one of
its public packages (``PUBLIC``), and only names in that package's ``__all__``.
"""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvcache

PACKAGE = Path(kvcache.__file__).parent

TIERS = ["errors", "storage", "model", "api", "apps"]
STORAGE = ("formats", "layers", "attention", "persist", "models")
MODEL = ("hf", "prompts", "engine", "train")
#: What the applications may import of the library: these packages, and of each the names in its ``__all__``.
PUBLIC = ("kvcache", "kvcache.errors") + tuple(f"kvcache.{name}" for name in STORAGE + MODEL)
#: Public though in no ``__all__`` (``from kvcache import __version__``).
DUNDER = ("__version__",)


def module_name(path: Path) -> str:
    parts = ("kvcache",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def tier_of(module: str) -> str:
    top = module.split(".")[1] if "." in module else ""
    if module == "kvcache":
        return "api"
    if top in ("apps", "__main__"):
        return "apps"
    if top == "errors":
        return "errors"
    if top in STORAGE:
        return "storage"
    if top in MODEL:
        return "model"
    raise AssertionError(
        f"{module} has no tier: the top level holds no loose modules; put it in a package of its tier "
        f"(or add a new package to STORAGE or MODEL in {Path(__file__).name})"
    )


def is_type_checking_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_nodes(tree: ast.AST, typing: bool = False):
    """Every import statement that can run, wherever it sits (functions included); ``typing``:
    those under ``if TYPE_CHECKING:`` too."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif typing or not is_type_checking_block(node):
            yield from import_nodes(node, typing)


def absolute_base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` statement of ``module`` imports from, relative ones resolved."""
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        anchor = package[: len(package) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    return base


def imported_modules(module: str, is_package: bool, tree: ast.AST, known: set[str], typing: bool = False) -> set[str]:
    """The kvcache modules ``module`` imports: ``from pkg import sub`` names the submodule."""

    def deepest_known(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    found = set()
    for node in import_nodes(tree, typing):
        if isinstance(node, ast.Import):
            found |= {deepest_known(alias.name) for alias in node.names}
            continue
        base = absolute_base(module, is_package, node)
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            found.add(submodule if submodule in known else deepest_known(base))
    return {name for name in found if name is not None and name != module}


def import_graph(typing: bool = False) -> dict[str, set[str]]:
    """Each module's imports of kvcache; ``typing``: those under ``if TYPE_CHECKING:`` too."""
    paths = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    known = set(paths)
    return {
        name: imported_modules(name, path.name == "__init__.py", ast.parse(path.read_text(), str(path)), known, typing)
        for name, path in paths.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as ``[a, b, ..., a]``, or None when the graph has none."""
    done, on_path, path = set(), set(), []

    def visit(node: str) -> list[str] | None:
        on_path.add(node)
        path.append(node)
        for target in sorted(graph[node]):
            if target in on_path:
                return path[path.index(target) :] + [target]
            if target not in done and (cycle := visit(target)):
                return cycle
        on_path.discard(path.pop())
        done.add(node)
        return None

    for node in sorted(graph):
        if node not in done and (cycle := visit(node)):
            return cycle
    return None


def library(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph without the applications' modules (and the edges into them)."""
    core = {name for name in graph if tier_of(name) != "apps"}
    return {name: graph[name] & core for name in core}


# ---- the graph reader itself -------------------------------------------------------------------


def test_the_graph_reads_relative_lazy_and_submodule_imports():
    graph = import_graph()
    assert "kvcache.attention.kernel" in graph["kvcache.attention.choice"]  # from .kernel import ...
    assert "kvcache.hf.foreign" in graph["kvcache.hf.build"]  # from . import foreign
    assert "kvcache.formats.quant_native" in graph["kvcache.formats.quant"]  # inside a function: from . import quant_native
    assert "kvcache.attention" in graph["kvcache.apps.cli_options"]  # inside a function: from ..attention import
    assert "kvcache.apps.cli" in graph["kvcache.__main__"]
    assert "kvcache.layers.store" not in graph["kvcache.layers.base"]  # only under TYPE_CHECKING
    assert "kvcache.layers.store" in import_graph(typing=True)["kvcache.layers.base"]


def test_find_cycle_names_the_modules_of_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]


# ---- the library's graph ------------------------------------------------------------------------


def test_the_library_has_no_import_cycle():
    cycle = find_cycle(library(import_graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_anywhere_is_in_an_import_cycle():
    """Applications included, and imports made only for type checking: two modules that name each
    other are one idea in two files, or a third module is missing."""
    cycle = find_cycle(import_graph(typing=True))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_top_level_holds_no_loose_modules():
    """Every module sits in a package of its tier; at the top only ``__init__``, ``__main__`` and ``errors``."""
    loose = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "errors.py"], f"loose modules at the top level: {loose}"
    for name in import_graph():
        tier_of(name)  # raises, naming the module, for one without a tier


def test_every_import_goes_to_the_same_tier_or_below():
    """Generalises what persist kept alone: the storage never imports the cache, builder or loader."""
    upward = [
        f"{name} ({tier_of(name)}) imports {target} ({tier_of(target)})"
        for name, targets in sorted(import_graph().items())
        for target in sorted(targets)
        if TIERS.index(tier_of(target)) > TIERS.index(tier_of(name))
    ]
    assert not upward, "\n".join(upward)


def test_no_library_module_imports_the_applications():
    graph = import_graph()
    into_apps = sorted(
        f"{name} imports {target}"
        for name in library(graph)
        for target in graph[name]
        if tier_of(target) == "apps"
    )
    assert not into_apps, "\n".join(into_apps)


def test_the_model_registry_imports_nothing_of_the_cache():
    graph = import_graph()
    package = [name for name in graph if name == "kvcache.models" or name.startswith("kvcache.models.")]
    assert "kvcache.models.install" in package
    outside = sorted(
        f"{name} imports {target}"
        for name in package
        for target in graph[name]
        if target != "kvcache.errors" and not target.startswith("kvcache.models")
    )
    assert not outside, "\n".join(outside)


# ---- the applications on the public API -----------------------------------------------------------


def public_names(package: str) -> set[str]:
    names = set(importlib.import_module(package).__all__) | set(DUNDER)
    if package == "kvcache":
        names |= {name.removeprefix("kvcache.") for name in PUBLIC if name != "kvcache"}  # from kvcache import engine
    return names


def private_imports(module: str, is_package: bool, tree: ast.AST, path: str) -> list[str]:
    """Each import of ``module`` that reaches the library other than by a public name, as
    ``file:line: the import``: a module that is not ``kvcache`` or a ``PUBLIC`` package, or a name
    not in that package's ``__all__``. The applications' own modules are theirs to import."""

    def own(name: str) -> bool:
        return name == "kvcache.apps" or name.startswith("kvcache.apps.")

    found = []
    for node in import_nodes(tree):
        if isinstance(node, ast.Import):
            wrong = [
                alias.name for alias in node.names
                if alias.name.split(".")[0] == "kvcache" and alias.name not in PUBLIC and not own(alias.name)
            ]  # fmt: skip
        else:
            base = absolute_base(module, is_package, node)
            if base.split(".")[0] != "kvcache" or own(base):
                continue
            if base not in PUBLIC:
                wrong = [f"{base} (not a public package)"]
            else:
                public = public_names(base)
                wrong = [f"{base}.{alias.name}" for alias in node.names if alias.name not in public and not own(f"{base}.{alias.name}")]
        if wrong:
            found.append(f"{path}:{node.lineno}: {ast.unparse(node)}  <- {', '.join(wrong)}")
    return found


def applications() -> list[tuple[str, Path]]:
    paths = sorted((PACKAGE / "apps").rglob("*.py")) + [PACKAGE / "__main__.py"]
    return [(module_name(path), path) for path in paths]


def test_the_public_api_check_names_private_imports():
    code = (
        "from .. import make_cache, models, __version__\n"
        "from ..engine import BlockPool\n"
        "from .common import x\n"
        "import kvcache.train\n"
        "def f():\n"
        "    from ..engine.pool import BlockPool\n"
        "    from ..hf import hand_out\n"
        "    import kvcache.hf.cache\n"
        "    from kvcache.layers.auto import mix_of\n"
        "if TYPE_CHECKING:\n"
        "    from ..hf.cache import KVCache\n"
    )
    found = private_imports("kvcache.apps.probe", False, ast.parse(code), "probe.py")
    assert [line.split(":")[1] for line in found] == ["6", "7", "8", "9"], "\n".join(found)
    assert "kvcache.hf.hand_out" in found[1]


def test_the_applications_use_the_public_api_only():
    """Apps (and ``python -m kvcache``) import of the library only names that ``kvcache`` or a public
    package (``PUBLIC``) lists in its ``__all__``: what a user of the library can import too."""
    found = [
        line
        for name, path in applications()
        for line in private_imports(
            name, path.name == "__init__.py", ast.parse(path.read_text(), str(path)), str(path.relative_to(PACKAGE.parent))
        )
    ]
    assert not found, "imports of library internals in the applications:\n" + "\n".join(found)


#: Imports ``kvcache`` in a fresh interpreter after torch and transformers' model classes and prints
#: one JSON line: the ``kvcache.*`` modules loaded, the optional dependencies importing kvcache added,
#: and what opening a Redis location says once the ``redis`` package is made unimportable.
FRESH_IMPORT = """
import json, sys, torch, transformers
from transformers import AutoModelForCausalLM, PreTrainedModel, DynamicCache
before = set(sys.modules)
import pytest

import kvcache
added = sorted(m for m in set(sys.modules) - before if m.split('.')[0] in ('redis', 'gguf', 'accelerate'))
loaded = sorted(m for m in sys.modules if m.startswith('kvcache.'))
sys.modules['redis'] = None  # as if not installed
from kvcache.prompts.backends import open_backend
try:
    open_backend('redis://127.0.0.1:1/0')
    redis = 'opened'
except ModuleNotFoundError as e:
    redis = str(e)
print(json.dumps({'loaded': loaded, 'optional': added, 'redis': redis}))
"""


@pytest.fixture(scope="module")
def fresh_import() -> dict:
    """``FRESH_IMPORT``'s report (one interpreter start for the three tests that read it)."""
    done = subprocess.run([sys.executable, "-c", FRESH_IMPORT], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_importing_kvcache_loads_no_application_module(fresh_import):
    loaded = fresh_import["loaded"]
    assert "kvcache.hf.cache" in loaded  # the probe saw the library load
    assert [m for m in loaded if tier_of(m) == "apps"] == []


def test_importing_kvcache_pulls_in_no_optional_dependency(fresh_import):
    # redis (prompt stores at redis:// locations), gguf and accelerate (converting real models) are
    # extras: importing the library loads none of them beyond what torch and transformers' model
    # classes load by themselves (transformers imports accelerate where it is installed).
    assert fresh_import["optional"] == []


def test_a_redis_location_without_the_redis_package_says_what_to_install(fresh_import):
    assert "kvcache[redis]" in fresh_import["redis"]
