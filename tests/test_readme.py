"""The README's Python examples run as written (each block in a fresh interpreter)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_python_examples():
    assert BLOCKS, "README.md has no ```python block; this test would check nothing"


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code, tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    # Each example states what it prints in "# ..." comments ending its print lines.
    expected = [
        line.split("#", 1)[1].split(":")[-1].strip()
        for line in code.splitlines()
        if line.lstrip().startswith("print(") and "#" in line
    ]
    printed = result.stdout.splitlines()[-len(expected) :] if expected else []
    assert printed == expected, result.stdout
