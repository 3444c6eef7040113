"""Every command the README shows works after the README's own set-up, which installs the package
with the extras its first command names (``pip install -e ".[models]"``) and no others.

The commands of the README's "Command line" block run in README order, one after the other, in
one subprocess in a fresh folder (torch and transformers imported once, not once a command), with
the modules that only the other extras bring (matplotlib, pytest, hypothesis, ...) made
unimportable, so the environment is the README's install; each command's exit code, output and
any traceback are its own, and each is a test of its own. Long runs take their quick, seconds-long
modes: ``bench`` and ``eval`` add ``--tiny`` (same code paths, smaller sizes), the demo one repeat
and fewer tokens. The README's first Python example runs too, on a tiny model.
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
from test_bench import RUN_ELSEWHERE, assert_well_formed
from kvcache import cache_kwargs

README = (ROOT / "README.md").read_text()

#: Appended to a documented command so that it runs in seconds; what it prints and writes is checked.
#: ``eval`` runs one budget: each budget runs the same code again.
QUICK = {"demo": ["--repeats", "1", "--new-tokens", "8", "--prompt-tokens", "256", "--sessions", "4"], "bench": ["--tiny"],
         "eval": ["--tiny", "--budgets", "0.125"]}
#: Further, for one ``bench`` suite: ``real`` traces each compiled contender once a batch size, and
#: ``test_bench_real.py`` runs its batch sizes already; ``engine`` compiles its engines by default
#: (minutes), which ``test_bench_engine.py`` checks the suite asks for.
QUICK_SUITE = {"real": ["--batches", "1"], "engine": ["--eager"]}


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


#: Runs CLI commands one after the other with the extras' modules unimportable: ``sys.argv[1]`` a
#: JSON list of names, ``sys.argv[2]`` a JSON list of argument lists, ``sys.argv[3]`` where to
#: write each command's ``{"code", "stdout", "stderr"}`` (a traceback in its stderr).
BLOCKED_RUNNER = """
import contextlib, io, json, sys, traceback
from importlib.machinery import PathFinder
blocked = set(json.loads(sys.argv[1]))
class NotInstalled(PathFinder):  # the path finder, blind to the extras: as if they were not installed
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.split(".")[0] in blocked else super().find_spec(name, path, target)
sys.meta_path[:] = [NotInstalled if f is PathFinder else f for f in sys.meta_path]
from kvcache.apps.cli import main
results = []
for argv in json.loads(sys.argv[2]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
    with open(sys.argv[3], "w") as f:
        json.dump(results, f)
"""


def run_blocked(commands: list[list[str]], cwd: Path, timeout: float = 900) -> list[dict]:
    """Each command's ``{"code", "stdout", "stderr"}``, run in order in one subprocess in ``cwd``
    (a command the run did not reach: code None and the subprocess's own output)."""
    blocked = json.dumps(sorted(extras_only_modules()))
    written = cwd / "results.json"
    run = subprocess.run(
        [sys.executable, "-c", BLOCKED_RUNNER, blocked, json.dumps(commands), str(written)],
        cwd=cwd, capture_output=True, text=True, timeout=timeout,
    )
    results = json.loads(written.read_text()) if written.exists() else []
    missing = {"code": None, "stdout": run.stdout[-2000:], "stderr": f"not reached (exit {run.returncode}):\n{run.stderr[-3000:]}"}
    return results + [missing] * (len(commands) - len(results))


def quick(command: str) -> list[str]:
    """A documented command's arguments in its quick mode."""
    argv = shlex.split(command)[1:]
    argv += QUICK.get(argv[0], [])
    if argv[0] == "bench":
        argv += QUICK_SUITE.get(argv[1], [])
    if argv[0] == "demo" and "--model" in argv:  # a real model's prompt is text (--prompt), not a token count
        argv = [a for a, b in zip(argv, ["", *argv]) if a != "--prompt-tokens" and b != "--prompt-tokens"]
    return argv


#: Run after the README's commands in the same subprocess, to check the runner itself: a command
#: that fails, then one that must still run.
PROBES = [["generate", "--cache", "nonsense"], ["models", "list"]]


@pytest.fixture(scope="module")
def readme_runs(tmp_path_factory) -> dict[str, tuple[list[str], dict, Path]]:
    """Every documented command run once, in README order (so ``--load-cache`` continues what the
    ``--save-cache`` line wrote), then ``PROBES``: command -> (its arguments, its result, the
    folder it ran in); each probe under its arguments joined by spaces."""
    folder = tmp_path_factory.mktemp("readme")
    commands = documented_commands()
    argvs = [quick(c) for c in commands] + PROBES
    results = run_blocked(argvs, folder)
    names = commands + [" ".join(p) for p in PROBES]
    return {c: (argv, result, folder) for c, argv, result in zip(names, argvs, results)}


def test_the_readme_documents_commands_for_every_subcommand():
    commands = documented_commands()
    assert {shlex.split(c)[1] for c in commands} >= {"demo", "generate", "bench", "eval"}


def test_the_suites_test_bench_leaves_to_this_file_are_documented_here():
    """``test_bench.py`` checks these suites' results only through this file's runs."""
    ran = {shlex.split(c)[2] for c in documented_commands() if shlex.split(c)[1] == "bench"}
    left_here = {name for name, where in RUN_ELSEWHERE.items() if where == Path(__file__).name}
    assert left_here <= ran, f"the README no longer runs {sorted(left_here - ran)}: check them in test_bench.py again"


def test_extras_only_modules_are_found():
    """The blocked set is real: matplotlib (bench extra) and pytest (test extra) are in it, and
    what the set-up's ``models`` extra installs (gguf, accelerate) is not."""
    assert setup_extras() == {"models"}
    blocked = extras_only_modules()
    assert {"matplotlib", "pytest"} <= blocked
    assert not {"gguf", "accelerate"} & blocked


@pytest.mark.parametrize("command", documented_commands())
def test_documented_command_works_after_the_readme_install(command, readme_runs):
    argv, result, folder = readme_runs[command]
    assert result["code"] == 0, f"{command}\nstdout:\n{result['stdout'][-2000:]}\nstderr:\n{result['stderr'][-3000:]}"
    assert "Traceback" not in result["stderr"]
    if argv[0] in ("bench", "eval"):
        name = argv[1] if argv[0] == "bench" else "eval"
        written = folder / "benchmarks" / "results"
        assert (written / f"{name}.json").is_file() and (written / f"{name}.md").is_file()
        assert not (written / f"{name}.png").exists()  # no matplotlib here ...
        assert "pip install 'kvcache[bench]'" in result["stderr"]  # ... and one line says how to get it
        report = json.loads((written / f"{name}.json").read_text())
        assert report
        if argv[0] == "bench" and RUN_ELSEWHERE.get(name) == Path(__file__).name:  # test_bench.py does not run it again
            assert_well_formed(name, written, report, png=False)


def test_the_runner_reports_each_command_apart(readme_runs):
    """A command that fails or raises is its own result; the next ones still run."""
    failed, after = (readme_runs[" ".join(p)][1] for p in PROBES)
    assert failed["code"] == 2 and "nonsense" in failed["stderr"]
    assert after["code"] == 0 and "smollm2" in after["stdout"]


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
