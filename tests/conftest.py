import os

# Triton (the `triton` extra) reads this when it is first imported: its kernels then run in its
# interpreter on CPU tensors, how the Triton decode kernels are tested without a GPU. Nothing routes
# CPU tensors to Triton by itself (attention/backends.py), so no other test changes path.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Every process a test starts (servers, CLI runs, workers) runs one OpenMP thread, as the tests in
# the worker do (``_one_thread``): beside the other xdist worker on two cores, a second thread a
# process only spins. Set before torch is imported, so children inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Inductor checks each vector ISA the CPU reports by building and loading a probe library: about
# 17 s in a fresh cache, then 4 s in every process that compiles. The suite trusts the CPU's flags
# instead (the compiler on these machines builds for all of them); a compiled test still builds
# its kernels for the widest ISA, as a user's process would.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

import pytest  # noqa: E402
from slowest import slowest_files  # noqa: E402

from kvcache.attention.half_precision import HalfPrecision, use_safe_isa

# Before any test runs a kernel: on CPUs whose oneDNN AMX kernels crash half-precision matmul, the
# cap below AMX must be in place before oneDNN first dispatches (it reads it once). Children of
# tests inherit it. Where even the cap does not help, half-precision tests are skipped, saying why.
HALF_PRECISION = use_safe_isa()

import torch  # noqa: E402  (after the cap)

HALF_DTYPES = (torch.bfloat16, torch.float16)


def pytest_report_header(config):
    found = HALF_PRECISION
    if found.status is HalfPrecision.NEEDS_ISA_CAP:
        return f"half precision: {found.describe()}; set for this run"
    if found.status is HalfPrecision.BROKEN:
        return f"half precision: {found.describe()}; tests marked half_precision or run in half dtypes are skipped"
    return f"half precision: {found.describe()}"


def runs_half_precision(item: pytest.Item) -> bool:
    if item.get_closest_marker("half_precision") is not None:
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(value in HALF_DTYPES for value in params.values() if isinstance(value, torch.dtype))


#: The files that take longest (worker-seconds on 2 cores, most first), run first. The README's
#: test command hands out whole files (``--dist loadfile``) in collection order, so these start at
#: once and the many short files fill in around them (longest first): two workers finish close
#: together, where a long file drawn last would leave one idle for minutes.
LONGEST_FIRST = (
    "hf/test_families.py",
    "apps/test_readme_commands.py",
    "apps/test_serve.py",
    "hf/test_compile.py",
    "core/test_isa_cap.py",
    "engine/test_engine_compiled.py",
    "apps/test_bench.py",
    "engine/test_engine_state.py",
    "hf/test_generate.py",
    "apps/test_kinds_answer.py",
    "hf/test_bounded.py",
    "core/test_triton_decode.py",
)


def _longest_first(items: list[pytest.Item]) -> None:
    """Move the tests of ``LONGEST_FIRST``'s files to the front, in its order; every other order
    (pytest-randomly's shuffle included) is kept."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable


def pytest_collection_modifyitems(config, items):
    _longest_first(items)
    if HALF_PRECISION.status is not HalfPrecision.BROKEN:
        return
    skip = pytest.mark.skip(reason=f"half precision: {HALF_PRECISION.describe()}")
    for item in items:
        if runs_half_precision(item):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _shared_models_left_as_found(request):
    """A test that switches a shared model's attention (helpers.model_for) must switch it back."""
    from helpers import SHARED_MODELS

    before = {key: model.config._attn_implementation for key, model in SHARED_MODELS.items()}
    yield
    changed = [
        f"{key[0]}: {before[key]} -> {model.config._attn_implementation}"
        for key, model in SHARED_MODELS.items()
        if key in before and model.config._attn_implementation != before[key]
    ]
    assert not changed, f"{request.node.nodeid} left shared models switched: {changed}"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models are overhead-bound: one intra-op thread is much faster on a busy 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_terminal_summary(terminalreporter):
    """The ten slowest files, so that drift shows in every run (``LONGEST_FIRST`` orders by them)."""
    reports = [r for group in terminalreporter.stats.values() for r in group if getattr(r, "nodeid", "") and hasattr(r, "when")]
    if not reports:
        return
    terminalreporter.section("slowest files (seconds, set-up + call + tear-down, summed over their tests)")
    for path, seconds in slowest_files(reports):
        terminalreporter.write_line(f"{seconds:7.1f}  {path}")
