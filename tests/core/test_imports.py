"""The import graph of ``kvcache`` points one way, tier by tier:

    apps     kvcache.apps.*, kvcache.__main__ (the CLI, demo, eval, benchmarks, tiny models)
      |
    api      kvcache (the package: the public names)
      |
    model    cache, build, cachefile, spec, hf, attention_kwargs, support, foreign, compiled, prefill, linears (the transformers-facing cache)
      |
    storage  formats.*, layers.*, attention.*, persist.*, quant, policies, options, registry, fingerprint, half_precision,
             models.* (real pretrained models: may import errors and transformers, nothing of the cache)
      |
    errors   errors

A module imports only from its own tier or one below; within the library (every tier but apps)
the graph has no cycle. Every import counts: at module level and inside functions, relative ones
resolved, since a lazy import that dodges a cycle at load time is still a cycle in the design.
Imports under ``if TYPE_CHECKING:`` are left out: they never run, so they order nothing.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvcache

PACKAGE = Path(kvcache.__file__).parent

TIERS = ["errors", "storage", "model", "api", "apps"]
STORAGE = ("formats", "layers", "attention", "persist", "quant", "quant_native", "policies", "options", "registry", "fingerprint", "half_precision", "models")
MODEL = ("cache", "build", "cachefile", "spec", "hf", "attention_kwargs", "cache_arg", "support", "foreign", "compiled", "scoring", "prefill", "prompts", "engine", "train", "linears")


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
    raise AssertionError(f"{module} has no tier: add it to STORAGE or MODEL in {Path(__file__).name}")


def is_type_checking_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_nodes(tree: ast.AST):
    """Every import statement that can run, wherever it sits (functions included)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif not is_type_checking_block(node):
            yield from import_nodes(node)


def imported_modules(module: str, is_package: bool, tree: ast.AST, known: set[str]) -> set[str]:
    """The kvcache modules ``module`` imports: ``from pkg import sub`` names the submodule."""

    def deepest_known(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    found = set()
    for node in import_nodes(tree):
        if isinstance(node, ast.Import):
            found |= {deepest_known(alias.name) for alias in node.names}
            continue
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            anchor = package[: len(package) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            found.add(submodule if submodule in known else deepest_known(base))
    return {name for name in found if name is not None and name != module}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    known = set(paths)
    return {
        name: imported_modules(name, path.name == "__init__.py", ast.parse(path.read_text(), str(path)), known)
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
    assert "kvcache.foreign" in graph["kvcache.build"]  # from . import foreign
    assert "kvcache.cachefile" in graph["kvcache.apps.cli"]  # inside a function: from ..cachefile import
    assert "kvcache.apps.cli" in graph["kvcache.__main__"]
    assert "kvcache.layers.store" not in graph["kvcache.layers.base"]  # only under TYPE_CHECKING


def test_find_cycle_names_the_modules_of_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]


# ---- the library's graph ------------------------------------------------------------------------


def test_the_library_has_no_import_cycle():
    cycle = find_cycle(library(import_graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


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


def test_importing_kvcache_loads_no_application_module():
    code = "import sys, kvcache; print(' '.join(sorted(m for m in sys.modules if m.startswith('kvcache.'))))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = done.stdout.split()
    assert "kvcache.cache" in loaded  # the probe saw the library load
    assert [m for m in loaded if tier_of(m) == "apps"] == []


def test_importing_kvcache_pulls_in_no_optional_dependency():
    # redis (prompt stores at redis:// locations), gguf and accelerate (converting real models) are
    # extras: importing the library loads none of them beyond what torch and transformers' model
    # classes load by themselves (transformers imports accelerate where it is installed).
    optional = ("redis", "gguf", "accelerate")
    code = (
        "import sys, torch, transformers\n"
        "from transformers import AutoModelForCausalLM, PreTrainedModel, DynamicCache\n"
        "before = set(sys.modules)\n"
        "import kvcache\n"
        f"print(' '.join(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in {optional!r})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == []


def test_a_redis_location_without_the_redis_package_says_what_to_install():
    code = (
        "import sys\n"
        "sys.modules['redis'] = None  # as if not installed\n"
        "from kvcache.prompts.backends import open_backend\n"
        "try:\n"
        "    open_backend('redis://127.0.0.1:1/0')\n"
        "except ModuleNotFoundError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "kvcache[redis]" in done.stdout
