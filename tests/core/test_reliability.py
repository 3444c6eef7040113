"""Reliability: cache files attacked as an adversary would (issue 10, section 5).

Every damaged, forged or hostile file must end in one of two ways: a ``CacheFileError`` (a
``ValueError``) whose message names the file, or a load whose greedy continuation is token for
token the continuation of the undamaged file. Anything else fails: another exception type, a
hang, a wrong continuation. Saving must be atomic against SIGKILL, a full disk and concurrent
writers. The CLI must turn every such file into one line on stderr and exit 2.

Quick by default (a sample of every mutation kind, a few kill trials); ``KVCACHE_RELIABILITY=full``
runs all of it (several thousand mutations, 20 kill trials). ``KVCACHE_RELIABILITY_SEED`` picks
the seed (default 0); ``KVCACHE_RELIABILITY_REPORT=FILE`` writes the counts as JSON.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch

import kvcache
from kvcache import cache_kwargs
from kvcache.apps.tiny import tiny_model
from forked import Forked
from mutations import SPECS, Mutation, crafted_forgeries, mutations

FULL = os.environ.get("KVCACHE_RELIABILITY", "quick") == "full"
SEED = int(os.environ.get("KVCACHE_RELIABILITY_SEED", "0"))
TESTS = Path(__file__).resolve().parents[1]  # the shared helpers and the worker live there
WORKER = TESTS / "reliability_worker.py"
PROMPT, GENERATED, CONTINUE = 30, 6, 4
HANG_GUARD_S = 30.0  # one load; generous: only a hang or a runaway allocation takes this long

#: (category, outcome) -> count, for the report; outcome is an error class name or "continued".
COUNTS: collections.Counter = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if not COUNTS:
        return
    table: dict[str, dict[str, int]] = {}
    for (category, outcome), n in sorted(COUNTS.items()):
        table.setdefault(category, {})[outcome] = n
    print(f"\nreliability ({'full' if FULL else 'quick'}, seed {SEED}): {json.dumps(table, indent=1)}")
    if os.environ.get("KVCACHE_RELIABILITY_REPORT"):
        Path(os.environ["KVCACHE_RELIABILITY_REPORT"]).write_text(json.dumps(table, indent=1) + "\n")


# ---- the model, the saved files and their continuations -----------------------------------------


@functools.lru_cache(maxsize=None)
def model():
    """Our own tiny gemma2 (hybrid sliding/full): nobody else's model has its attention switched."""
    return tiny_model("gemma2", seed=11)


def greedy(m, cache, first: torch.Tensor, n: int) -> list[int]:
    """Feed ``first`` ``[1, S]``, then ``n - 1`` greedy tokens; the ``n`` tokens chosen."""
    out, ids = [], first
    with kvcache.use_kvcache_attention(m), torch.no_grad():
        for _ in range(n):
            ids = m(ids, **cache_kwargs(m, cache), use_cache=True).logits[:, -1:].argmax(-1)
            out.append(int(ids))
    return out


@functools.lru_cache(maxsize=None)
def saved(spec: str) -> tuple[bytes, int, tuple[int, ...]]:
    """(file bytes, the last generated token (not yet cached), the continuation of the loaded file)."""
    m = model()
    cache = kvcache.make_cache(m, spec)
    ids = torch.randint(3, 256, (1, PROMPT), generator=torch.Generator().manual_seed(7))
    generated = greedy(m, cache, ids, GENERATED)
    last = generated[-1]
    conversation = ids[0].tolist() + generated  # the cached tokens and the last one, not yet fed
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.kv"
        cache.save(path, token_ids=conversation)
        raw = path.read_bytes()
        loaded = kvcache.load_cache(path, m)
    assert loaded.seen == PROMPT + GENERATED - 1
    assert loaded.token_ids == conversation
    return raw, last, tuple(greedy(m, loaded, torch.tensor([[last]]), CONTINUE))


def outcome(spec: str, mutation: Mutation, path: Path) -> str:
    """Load the mutated file: the error class name, or "continued" (identical tokens); else raise."""
    _, last, ref = saved(spec)
    path.write_bytes(mutation.data)
    where = f"[seed {SEED}] {spec}: {mutation.category} '{mutation.name}'"
    start = time.perf_counter()
    attention = model().config._attn_implementation
    try:
        cache = kvcache.load_cache(path, model())
    except kvcache.CacheFileError as e:
        message = str(e)
        assert model().config._attn_implementation == attention, f"{where}: a refused load switched the model's attention"
        assert str(path) in message, f"{where}: the message does not name the file: {message}"
        assert "\n" not in message, f"{where}: a message of several lines: {message!r}"
        return type(e).__name__
    except Exception as e:  # noqa: BLE001 - every other escape is the failure being looked for
        raise AssertionError(f"{where}: escaped as {type(e).__name__}: {str(e)[:300]}") from e
    finally:
        took = time.perf_counter() - start
        assert took < HANG_GUARD_S, f"{where}: load took {took:.1f} s"
    try:
        tokens = tuple(greedy(model(), cache, torch.tensor([[last]]), CONTINUE))
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{where}: loaded, then continuing raised {type(e).__name__}: {e}") from e
    assert tokens == ref, f"{where}: loaded and continued with {tokens}, the saved cache with {ref}"
    return "continued"


def _sample(items: list, key: str, keep: int, total: int) -> list:
    """Deterministic share ``keep/total`` of ``items`` (by name), rotated by ``key``: quick mode
    still runs every forgery on some kinds."""
    return [it for it in items if (zlib.crc32((key + it[0]).encode()) + SEED) % total < keep]


@pytest.mark.parametrize("spec", SPECS)
def test_mutated_files_are_refused_or_continue_identically(spec, tmp_path):
    raw, _, _ = saved(spec)
    rng = random.Random(f"{SEED}:{spec}")
    forgeries = crafted_forgeries()
    if not FULL:
        forgeries = _sample(forgeries, spec, 1, 12)
    muts = mutations(
        raw, rng,
        flips_n=40 if FULL else 4,
        cuts_n=12 if FULL else 3,
        appends_n=6 if FULL else 1,
        forgeries=forgeries,
        raw_too=FULL or spec == SPECS[(SEED % len(SPECS))],
    )
    failures = []
    for mutation in muts:
        try:
            COUNTS[mutation.category, outcome(spec, mutation, tmp_path / "m.kv")] += 1
        except AssertionError as e:
            COUNTS[mutation.category, "FAILED"] += 1
            failures.append(str(e).splitlines()[0])
    assert not failures, f"{len(failures)} mutations escaped:\n" + "\n".join(failures[:60 if not FULL else None])


# ---- a 2**40-element claim: refused fast, without allocating ------------------------------------


def _worker(*args, timeout: float = 120) -> str:
    """Run ``reliability_worker.py`` to completion (hang guard: ``timeout``); its stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)])}
    done = subprocess.run([sys.executable, str(WORKER), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, f"worker {args[0]} failed ({done.returncode}):\n{done.stderr[-3000:]}"
    return done.stdout


def _forked_worker(*args, timeout: float = 120) -> str:
    """``reliability_worker.main(args)`` in a forked child (``forked.py``), to completion; its stdout."""
    import reliability_worker as w

    child = Forked(w.main, [str(a) for a in args])
    out, err = child.communicate(timeout=timeout)
    assert child.returncode == 0, f"worker {args[0]} failed ({child.returncode}):\n{err[-3000:]}"
    return out


def test_huge_claims_are_refused_quickly_and_allocate_nothing(tmp_path):
    """Claims of 2**40 slots (a 4 TiB tensor) in the spec and options, a tensor's shape or the
    tokens seen: a separate process loads each and reports how much its peak memory grew."""
    from mutations import HUGE, crafted, raw_headers
    import reliability_worker as w

    raw_path = tmp_path / "base.kv"
    w.make(1, 50).save(raw_path)
    raw = raw_path.read_bytes()
    wanted = {
        "spec and every layer: first option = 1099511627776",
        "spec and every layer: first option = 4611686018427387904",
        "full layer seen = 4611686018427387904",
        "full layer + a format-1 length = 1099511627776",
    }
    cases = [m for m in crafted(raw) if m.name in wanted]
    cases += [m for m in raw_headers(raw) if "2**40" in m.name or "2**64" in m.name or "huge" in m.name]
    assert len(cases) >= 7, [m.name for m in cases]
    paths = []
    for k, m in enumerate(cases):
        paths.append(tmp_path / f"huge{k}.kv")
        paths[-1].write_bytes(m.data)
    report = json.loads(_worker("load", *paths).splitlines()[-1])
    for m, r in zip(cases, report):
        COUNTS["huge", "clean" if r["clean"] else "FAILED"] += 1
        assert r["clean"], f"{m.name}: {r['error']}"
        assert str(r["path"]) in r["error"], f"{m.name}: the message does not name the file: {r['error']}"
        assert r["seconds"] < HANG_GUARD_S, f"{m.name}: took {r['seconds']:.1f} s"
        assert r["rss_grew_kib"] < 256 * 1024, f"{m.name}: peak memory grew by {r['rss_grew_kib']} KiB"
    assert HUGE == 2**40


# ---- SIGKILL while saving over an existing file ---------------------------------------------------


def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_sigkill_during_save_leaves_old_or_new_file_and_sweepable_temps(tmp_path):
    import reliability_worker as w
    from kvcache.persist.atomic import _temp_pattern

    trials = 20 if FULL else 8
    rng = random.Random(f"{SEED}:kill")
    path = tmp_path / "chat.kv"
    old, new = w.make(100, 3000), w.make(200, 3000)
    versions = {"old": w.content(old), "new": w.content(new)}
    seen = collections.Counter()
    for trial in range(trials):
        old.save(path)
        assert _temps(tmp_path) == [], f"trial {trial}: the save before it left {_temps(tmp_path)}"
        delay = rng.uniform(0.0, 0.6)
        proc = Forked(w.main, ["save-loop", str(path), "200", "30"])
        try:
            assert proc.stdout.readline().strip() == "ready", f"trial {trial}: the worker did not start"
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.communicate(timeout=60)
        loaded = w.content(kvcache.load_cache(path, w.CONFIG))
        which = [name for name, want in versions.items() if all(torch.equal(a, b) for a, b in zip(loaded, want))]
        assert len(which) == 1, f"[seed {SEED}] trial {trial} (kill after {delay:.3f} s): the file is neither version"
        left = _temps(tmp_path)
        assert all(_temp_pattern(path).fullmatch(name) for name in left), f"trial {trial}: unexpected files {left}"
        seen[which[0]] += 1
        seen["temps left by the kill"] += len(left)
    # The next save sweeps what killed saves left (their process is gone), and nothing else is there.
    old.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.kv"]
    for what, n in seen.items():
        COUNTS["sigkill", what] += n
    assert seen["old"] + seen["new"] == trials


def test_temps_of_live_processes_are_not_swept(tmp_path):
    """A temp file of a live save (this process) stays; one of a dead process is swept."""
    import reliability_worker as w
    from kvcache.persist.atomic import _HOST

    path = tmp_path / "c.kv"
    mine = tmp_path / f".c.kv.{_HOST}~{os.getpid()}~abc123.tmp"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f".c.kv.{_HOST}~{dead.pid}~xyz789.tmp"
    other = tmp_path / ".other.kv.x~1~a.tmp"
    for p in (mine, gone, other):
        p.write_bytes(b"partial")
    w.make(3, 5).save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["c.kv", mine.name, other.name])


# ---- a full disk ----------------------------------------------------------------------------------


@contextlib.contextmanager
def small_tmpfs(folder: Path, options: str = "size=64k"):
    """Mount a tmpfs at ``folder``; yields False (and mounts nothing) where mounting is not allowed."""
    folder.mkdir(exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def _assert_clean_save_error(error: dict, path: Path, what: str) -> None:
    assert error["error"] is not None, f"{what}: the save succeeded"
    assert "CacheSaveError" in error["mro"] and "OSError" in error["mro"], f"{what}: {error}"
    assert str(path) in error["message"] and "\n" not in error["message"], f"{what}: {error['message']!r}"


def _save_over_full_disk(folder: Path, how: str) -> None:
    import reliability_worker as w

    path = folder / "chat.kv"
    old = w.make(5, 20)  # ~20 KiB: fits in 64 KiB
    old.save(path)
    before = path.read_bytes()
    if how == "tmpfs":
        new = w.make(6, 200)  # ~200 KiB: does not fit
        try:
            new.save(path)
        except Exception as e:  # noqa: BLE001
            error = {"error": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "message": str(e)}
        else:
            error = {"error": None}
    else:
        error = json.loads(_forked_worker("save-limited", path, 6, 64 * 1024).splitlines()[-1])
    _assert_clean_save_error(error, path, how)
    assert path.read_bytes() == before, f"{how}: the old file changed"
    assert all(torch.equal(a, b) for a, b in zip(w.content(kvcache.load_cache(path, w.CONFIG)), w.content(old)))
    assert sorted(p.name for p in folder.iterdir()) == ["chat.kv"], f"{how}: temporary files left"
    COUNTS["full disk", f"{how}: {error['error']}"] += 1


def test_save_onto_a_full_disk_raises_cleanly_and_keeps_the_old_file(tmp_path):
    """A 64 KiB tmpfs where we may mount one, else a file-size limit (EFBIG) in a subprocess."""
    with small_tmpfs(tmp_path / "disk") as mounted:
        _save_over_full_disk(tmp_path / "disk", "tmpfs" if mounted else "rlimit")


def test_save_past_a_file_size_limit_raises_cleanly_and_keeps_the_old_file(tmp_path):
    """The OS-level limit alone (RLIMIT_FSIZE), which works unprivileged too."""
    (tmp_path / "d").mkdir()
    _save_over_full_disk(tmp_path / "d", "rlimit")


# ---- concurrent saves to one path -----------------------------------------------------------------


def test_two_threads_saving_to_one_path(tmp_path):
    import reliability_worker as w

    path = tmp_path / "chat.kv"
    caches = [w.make(10, 1000), w.make(11, 1000)]
    errors: list[BaseException] = []

    def save_many(cache):
        try:
            for _ in range(10 if FULL else 4):
                cache.save(path)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=save_many, args=(c,)) for c in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, f"saving raised {errors!r}"
    loaded = w.content(kvcache.load_cache(path, w.CONFIG))
    assert any(all(torch.equal(a, b) for a, b in zip(loaded, w.content(c))) for c in caches)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.kv"]
    COUNTS["concurrent", "threads: one complete version"] += 1


def test_two_processes_saving_to_one_path(tmp_path):
    import reliability_worker as w

    path = tmp_path / "chat.kv"
    count = 10 if FULL else 4
    procs = [Forked(w.main, ["save-loop", str(path), str(seed), str(count)]) for seed in (20, 21)]
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, f"a saving process failed:\n{err[-3000:]}"
        assert json.loads(out.splitlines()[-1]) == {"saved": count}
    loaded = w.content(kvcache.load_cache(path, w.CONFIG))
    assert any(all(torch.equal(a, b) for a, b in zip(loaded, w.content(w.make(s, 3000)))) for s in (20, 21))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.kv"]
    COUNTS["concurrent", "processes: one complete version"] += 1


# ---- the CLI: --load-cache / --save-cache ---------------------------------------------------------


def _cli(capsys, *argv) -> tuple[int, str, str]:
    from kvcache.apps.cli import main

    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _forge(edit):
    """Rewrite the file's metadata with ``edit(meta)``, every checksum recomputed (a tamperer who
    knows the format)."""
    from mutations import Parts

    def damage(path: Path) -> None:
        parts = Parts(path.read_bytes())
        edit(parts.meta)
        path.write_bytes(parts.build())

    return damage


def _edit_ids(fn):
    """Forge the token ids: ``fn`` gets the list and returns the field's new text, or a value for JSON."""

    def edit(meta: dict) -> None:
        value = fn(json.loads(meta["token_ids"]))
        meta["token_ids"] = value if isinstance(value, str) else json.dumps(value)

    return _forge(edit)


def _flip_data_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x40
    path.write_bytes(bytes(raw))


def _flip_an_id_digit(path: Path) -> None:
    """A digit of the token ids changed, checksums not recomputed."""
    import re

    raw = bytearray(path.read_bytes())
    at = re.search(rb'"token_ids"\s*:\s*"\[', bytes(raw)).end()
    raw[at] = ord("1") if raw[at] != ord("1") else ord("2")
    path.write_bytes(bytes(raw))


def _other_model_file(path: Path) -> None:
    other = tiny_model("llama", seed=5)
    cache = kvcache.make_cache(other)
    with torch.no_grad():
        other(torch.tensor([[5, 6, 7, 8]]), **cache_kwargs(other, cache), use_cache=True)
    cache.save(path, token_ids=[5, 6, 7, 8, 9])


def _without_ids(path: Path) -> None:
    from kvcache.apps.trained import load_trained

    kvcache.load_cache(path, load_trained()[0]).save(path)


def _as_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


# The side file FILE.ids.json of format 1 is gone: its damages are the same lies told by the
# token_ids field (forged with every checksum recomputed), and a file without ids is a missing one.
CLI_DAMAGE = {
    "ids missing (saved without them)": _without_ids,
    "ids field removed": _forge(lambda meta: meta.pop("token_ids")),
    "ids field not JSON": _edit_ids(lambda ids: "{not json"),
    "ids field empty": _edit_ids(lambda ids: ""),
    "ids field null": _edit_ids(lambda ids: None),
    "ids field a JSON object": _edit_ids(lambda ids: {"ids": ids}),
    "ids field a JSON string": _edit_ids(lambda ids: "\"ids\""),
    "ids field nested 100000 deep": _edit_ids(lambda ids: "[" * 100_000 + "]" * 100_000),
    "ids field with NaN": _edit_ids(lambda ids: "[NaN]"),
    "ids: a digit changed (checksums kept)": _flip_an_id_digit,
    "ids: a string id": _edit_ids(lambda ids: ["a"] + ids[1:]),
    "ids: a negative id": _edit_ids(lambda ids: [-1] + ids[1:]),
    "ids: a boolean id": _edit_ids(lambda ids: [True] + ids[1:]),
    "ids: a float id": _edit_ids(lambda ids: [float(ids[0])] + ids[1:]),
    "ids: an id past the vocabulary": _edit_ids(lambda ids: [10**9] + ids[1:]),
    "ids: not a list": _edit_ids(lambda ids: {"0": 1}),
    "ids: one more than seen + 1": _edit_ids(lambda ids: ids + [ids[-1]]),
    "ids: one fewer than seen": _edit_ids(lambda ids: ids[:-2]),
    "ids: empty": _edit_ids(lambda ids: []),
    "ids: another conversation's (twice as long)": _edit_ids(lambda ids: ids + ids),
    "file: other format": _forge(lambda meta: meta.update(format="other")),
    "file: format version 1": _forge(lambda meta: meta.update(format_version="1")),
    "file: format version 3": _forge(lambda meta: meta.update(format_version="3")),
    "cache file missing": lambda p: p.unlink(),
    "cache path is a directory": _as_directory,
    "cache file truncated": lambda p: p.write_bytes(p.read_bytes()[:-100]),
    "cache file byte flipped": _flip_data_byte,
    "cache file empty": lambda p: p.write_bytes(b""),
    "cache file of another model": _other_model_file,
}


@pytest.fixture(scope="module")
def conversation(tmp_path_factory):
    """A conversation saved by the CLI: (folder, the cache path), files to be copied, never changed."""
    folder = tmp_path_factory.mktemp("conversation")
    path = folder / "chat.kv"
    from kvcache.apps.cli import main

    assert main(["generate", "--prompt", "The cache", "--max-new-tokens", "3", "--save-cache", str(path)]) == 0
    return folder, path


def _one_error_line(err: str, what: str, *names: str) -> None:
    assert "Traceback" not in err, f"{what}: a traceback:\n{err}"
    lines = err.strip().splitlines()
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and errors[0] == lines[-1], f"{what}: expected one error line, got:\n{err}"
    for name in names:
        assert name in errors[0], f"{what}: the error does not name {name}: {errors[0]}"


@pytest.mark.parametrize("damage", sorted(CLI_DAMAGE))
def test_cli_load_cache_refuses_damaged_conversations_in_one_line(damage, conversation, tmp_path, capsys):
    import shutil

    folder, original = conversation
    for p in folder.iterdir():
        shutil.copy(p, tmp_path / p.name)
    path = tmp_path / original.name
    CLI_DAMAGE[damage](path)
    rc, out, err = _cli(capsys, "generate", "--load-cache", path, "--prompt", " and", "--max-new-tokens", 2)
    COUNTS["cli", "exit 2" if rc == 2 else f"exit {rc}"] += 1
    assert rc == 2 and out == "", f"{damage}: exit {rc}, stdout {out!r}, stderr {err!r}"
    assert err.startswith("kvcache: error: ") and err.count("\n") == 1, f"{damage}: {err!r}"
    _one_error_line(err, damage, "chat.kv")


def test_cli_save_cache_to_unwritable_places_exits_2_in_one_line(tmp_path, capsys):
    regular = tmp_path / "file"
    regular.write_text("x")
    folder = tmp_path / "folder"
    folder.mkdir()
    places = {
        "under a regular file": regular / "c.kv",
        "a directory": folder,
        "in /proc": Path("/proc/kvcache-reliability.kv"),
        "in a missing folder": tmp_path / "missing" / "c.kv",
    }
    for what, place in places.items():
        rc, _, err = _cli(capsys, "generate", "--prompt", "hi", "--max-new-tokens", 2, "--save-cache", place)
        COUNTS["cli", "exit 2" if rc == 2 else f"exit {rc}"] += 1
        assert rc == 2, f"{what}: exit {rc}: {err}"
        _one_error_line(err, what)
        assert not place.exists() or place.is_dir()
    with small_tmpfs(tmp_path / "ro", "ro,size=64k") as mounted:
        if mounted:  # where mounting is allowed: a read-only file system
            place = tmp_path / "ro" / "c.kv"
            rc, _, err = _cli(capsys, "generate", "--prompt", "hi", "--max-new-tokens", 2, "--save-cache", place)
            COUNTS["cli", "exit 2" if rc == 2 else f"exit {rc}"] += 1
            assert rc == 2, f"read-only: exit {rc}: {err}"
            _one_error_line(err, "read-only", str(place))


@contextlib.contextmanager
def file_size_limit(limit: int):
    """Writes past ``limit`` bytes fail with EFBIG in this process while inside (soft limit only)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_cli_save_onto_a_full_disk_keeps_the_old_conversation(conversation, tmp_path, capsys):
    """Saving a longer conversation over the saved one does not fit (a 96 KiB tmpfs, or a file size
    limit where mounting is not allowed): exit 2 in one line, and the old pair still loads."""
    import shutil

    folder, original = conversation
    disk = tmp_path / "disk"
    with small_tmpfs(disk, "size=96k") as mounted:
        for p in folder.iterdir():
            shutil.copy(p, disk / p.name)
        path = disk / original.name
        before = {p.name: p.read_bytes() for p in disk.iterdir()}
        argv = ["generate", "--load-cache", path, "--prompt", " x" * 60, "--max-new-tokens", 30, "--save-cache", path]
        with contextlib.nullcontext() if mounted else file_size_limit(path.stat().st_size + 1024):
            rc, _, err = _cli(capsys, *argv)
        COUNTS["cli", "exit 2" if rc == 2 else f"exit {rc}"] += 1
        assert rc == 2, f"exit {rc}: {err}"
        _one_error_line(err, "full disk", str(path))
        assert {p.name: p.read_bytes() for p in disk.iterdir()} == before, "the old conversation changed"
        rc, _, err = _cli(capsys, "generate", "--load-cache", path, "--prompt", " and", "--max-new-tokens", 2)
        assert rc == 0, err
