"""The worked examples under examples/, imported from their files as the docs show them (not installed), and the
text docs/plugins.md shows for each."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_from_file(path: Path, name: str):
    """The module at ``path`` imported as ``name``, registered in sys.modules: the isolated workers rebuild a backend
    from its module by name."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def shown_in_plugins_docs(marker: str) -> str | None:
    """The code docs/plugins.md shows between ``<!-- {marker}:start -->`` and ``<!-- {marker}:end -->``."""
    docs = (ROOT / "docs" / "plugins.md").read_text()
    shown = re.search(rf"<!-- {marker}:start -->\n```python\n(.*?)```\n<!-- {marker}:end -->", docs, re.S)
    return shown.group(1) if shown else None
