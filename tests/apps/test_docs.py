"""The documentation site builds (``mkdocs build --strict``: broken links, missing pages or API
references fail it) and the getting-started page's code runs as written, in a fresh process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GETTING_STARTED = ROOT / "docs" / "getting-started.md"


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", page.read_text(encoding="utf-8"), flags=re.MULTILINE | re.DOTALL)


def test_getting_started_code_runs_in_order(tmp_path):
    blocks = python_blocks(GETTING_STARTED)
    assert len(blocks) >= 5, "the getting-started page lost its examples"
    script = tmp_path / "getting_started.py"
    script.write_text("\n\n".join(blocks), encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "tokens reused:" in done.stdout


def test_site_builds_strict(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert (tmp_path / "site" / "reference" / "api" / "index.html").is_file()
