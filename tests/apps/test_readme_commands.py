"""Every command the README shows works after the README's own set-up, which installs the package
with the extras its first command names (``pip install -e ".[models]"``) and no others.

The commands of the README's "Command line" block run as subprocesses in a fresh folder, with the
modules that only the other extras bring (matplotlib, pytest, hypothesis, ...) made unimportable,
so the environment is the README's install. Long runs take their quick, seconds-long modes: ``bench`` and
``eval`` add ``--tiny`` (same code paths, smaller sizes), the demo one repeat and fewer tokens.
The README's first Python example runs too, on a tiny model.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from helpers import ROOT, model_for, prompt
from kvcache import cache_kwargs

README = (ROOT / "README.md").read_text()

#: Appended to a documented command so that it runs in seconds; what it prints and writes is checked.
#: ``eval`` runs one budget: each budget runs the same code again.
QUICK = {"demo": ["--repeats", "1", "--new-tokens", "8", "--prompt-tokens", "256"], "bench": ["--tiny"],
         "eval": ["--tiny", "--budgets", "0.125"]}


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", README, flags=re.S | re.M)


def documented_commands() -> list[str]:
    """The ``kvcache ...`` lines of the README's "Command line" section, comments stripped."""
    section = README.split("## Command line", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```bash\n(.*?)^```$", section, flags=re.S | re.M).group(1)
    lines = [shlex.split(line, comments=True) for line in block.splitlines()]
    return [" ".join(shlex.quote(w) for w in words) for words in lines if words and words[0] == "kvcache"]


def setup_extras() -> set[str]:
    """The extras the README's first command installs (``pip install ... -e ".[a,b]"``)."""
    first = next(line for line in README.splitlines() if line.startswith("python3 -m venv"))
    named = re.search(r"""-e ["']?\.\[([^\]]*)\]""", first)
    return set(named.group(1).split(",")) if named else set()


def extras_only_modules() -> set[str]:
    """Top-level import names of what the extras the README's set-up leaves out add to its install."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = {_name(d) for d in project["dependencies"]}
    installed |= {_name(d) for name in setup_extras() for d in project["optional-dependencies"][name]}
    extra = {_name(d) for deps in project["optional-dependencies"].values() for d in deps} - installed
    by_dist: dict[str, set[str]] = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            by_dist.setdefault(_name(dist), set()).add(module)
    return {module for dist in extra for module in by_dist.get(dist, ())}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


#: Runs the CLI with the extras' modules unimportable (``sys.argv[1]``: a JSON list of names).
BLOCKED_RUNNER = """
import json, sys
from importlib.machinery import PathFinder
blocked = set(json.loads(sys.argv.pop(1)))
class NotInstalled(PathFinder):  # the path finder, blind to the extras: as if they were not installed
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.split(".")[0] in blocked else super().find_spec(name, path, target)
sys.meta_path[:] = [NotInstalled if f is PathFinder else f for f in sys.meta_path]
from kvcache.apps.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_blocked(argv: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    blocked = json.dumps(sorted(extras_only_modules()))
    return subprocess.run(
        [sys.executable, "-c", BLOCKED_RUNNER, blocked, *argv],
        cwd=cwd, capture_output=True, text=True, timeout=timeout,
    )


def test_the_readme_documents_commands_for_every_subcommand():
    commands = documented_commands()
    assert {shlex.split(c)[1] for c in commands} >= {"demo", "generate", "bench", "eval"}


def test_extras_only_modules_are_found():
    """The blocked set is real: matplotlib (bench extra) and pytest (test extra) are in it, and
    what the set-up's ``models`` extra installs (gguf, accelerate) is not."""
    assert setup_extras() == {"models"}
    blocked = extras_only_modules()
    assert {"matplotlib", "pytest"} <= blocked
    assert not {"gguf", "accelerate"} & blocked


@pytest.mark.parametrize("command", documented_commands())
def test_documented_command_works_after_the_readme_install(command, tmp_path):
    argv = shlex.split(command)[1:]
    argv += QUICK.get(argv[0], [])
    if argv[0] == "demo" and "--model" in argv:  # a real model's prompt is text (--prompt), not a token count
        argv = [a for a, b in zip(argv, ["", *argv]) if a != "--prompt-tokens" and b != "--prompt-tokens"]
    if argv[0] == "generate" and "--load-cache" in argv:  # continues what the --save-cache line wrote
        saving = next(c for c in documented_commands() if "--save-cache" in c)
        first = run_blocked(shlex.split(saving)[1:], tmp_path)
        assert first.returncode == 0, first.stderr
    result = run_blocked(argv, tmp_path)
    assert result.returncode == 0, f"{command}\nstdout:\n{result.stdout[-2000:]}\nstderr:\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr
    if argv[0] in ("bench", "eval"):
        name = argv[1] if argv[0] == "bench" else "eval"
        written = tmp_path / "benchmarks" / "results"
        assert (written / f"{name}.json").is_file() and (written / f"{name}.md").is_file()
        assert not (written / f"{name}.png").exists()  # no matplotlib here ...
        assert "pip install 'kvcache[bench]'" in result.stderr  # ... and one line says how to get it
        assert json.loads((written / f"{name}.json").read_text())


def test_the_first_python_example_runs_and_matches_dynamic_cache(tmp_path, monkeypatch):
    """The README's first Python block, with ``model`` and ``input_ids`` bound to a tiny model."""
    source = code_blocks("python")[0]
    model = model_for("qwen2")
    before = model.config._attn_implementation
    input_ids = prompt(16, seed=4)
    ref = model.generate(input_ids, **cache_kwargs(model, DynamicCache(config=model.config)), max_new_tokens=8, do_sample=False)
    namespace = {"model": model, "input_ids": input_ids}
    monkeypatch.chdir(tmp_path)
    try:
        exec(compile(source, "README.md", "exec"), namespace)
    finally:
        model.set_attn_implementation(before)  # the example switches the model for good, as documented
    assert torch.equal(namespace["out"][:, : ref.shape[1]], ref)
