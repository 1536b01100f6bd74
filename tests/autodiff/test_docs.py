"""The quick start in docs/autodiff.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "autodiff.md"


def test_quick_start_runs():
    block = re.search(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    assert block is not None, "docs/autodiff.md has no python quick start"
    namespace: dict = {}
    exec(compile(block.group(1), str(DOC), "exec"), namespace)  # noqa: S102 (our own documentation)
    assert namespace["gw"].shape == (3, 4) and namespace["h"].shape == (3, 4)
