"""Package structure: no file of this repo imports a private name from another file.

A leading-underscore name is private to the file that defines it. Importing one from another file
(`from infer.eagle import _check_format`, `from .model import _param`) couples the two files
through an internal detail that neither advertises: the owner can rename or change it at any time.
What two files share must be public. The check is static (AST), over every .py file under
`kernels_pallas/`, `kernels_cpu/` and `infer/`, for `from <module> import <name>` in absolute
and relative form, where <module> is another file of this repo (infer.*, kernels_pallas.* or
kernels_cpu.*) and <name> starts with an underscore (dunders such as __version__ excepted).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
REPO_PACKAGES = ("infer", "kernels_pallas", "kernels_cpu")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    """Dotted module name of a file under root: a/b/c.py -> a.b.c, a/b/__init__.py -> a.b."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(root: pathlib.Path, node: ast.ImportFrom, path: pathlib.Path) -> str | None:
    """The absolute module an ImportFrom reads from; None if a relative import climbs out of root."""
    if node.level == 0:
        return node.module
    package = _module_name(root, path).split(".")
    if path.name != "__init__.py":
        package.pop()  # a module's package is its parent
    if node.level - 1 > len(package) - 1:
        return None
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _module_file(root: pathlib.Path, module: str) -> pathlib.Path | None:
    """The file of a repo module (module.py or module/__init__.py), None if it is not (yet) there."""
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def private_imports(tree: str, root: pathlib.Path = ROOT) -> list[str]:
    """'file:line: from module import name (resolved module)' for every cross-file private import
    under root/tree."""
    found = []
    for path in sorted((root / tree).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            module = _resolve(root, node, path)
            if module is None or module.split(".")[0] not in REPO_PACKAGES:
                continue
            if _module_file(root, module) == path:
                continue  # the file itself: not another file
            for alias in node.names:
                if _is_private(alias.name):
                    dots = "." * node.level + (node.module or "")
                    found.append(f"{path.relative_to(root)}:{node.lineno}: "
                                 f"from {dots} import {alias.name} ({module})")
    return found


@pytest.mark.parametrize("tree", REPO_PACKAGES)
def test_no_private_imports_across_files(tree):
    found = private_imports(tree)
    assert not found, "private names imported from another file:\n" + "\n".join(found)


def test_checker_sees_absolute_and_relative_forms(tmp_path):
    """The checker itself: absolute and relative private imports are caught, public ones and
    dunders are not, and a relative import resolves against the importing file's package."""
    pkg = tmp_path / "kernels_pallas" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "kernels_pallas" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .a import __all__, public\n")
    (pkg / "a.py").write_text("_x = 1\npublic = 2\n__all__ = ['public']\n")
    (pkg / "b.py").write_text("from kernels_pallas.sub.a import _x\nfrom . import a\n"
                              "from .a import public, _x as y\nfrom ..sub.a import _x\n"
                              "from numpy import _globals\n")
    found = private_imports("kernels_pallas", tmp_path)
    assert [f.split(": ")[0] for f in found] == [
        "kernels_pallas/sub/b.py:1", "kernels_pallas/sub/b.py:3", "kernels_pallas/sub/b.py:4"], found


def test_paged_attention_package_exports_only_entry_points():
    import kernels_pallas.paged_attention as pa

    assert sorted(pa.__all__) == ["paged_attention", "paged_attention_reference",
                                  "paged_prefill_attention", "paged_prefill_attention_reference",
                                  "ragged_paged_attention", "ragged_paged_attention_reference"]
    for name in pa.__all__:
        assert callable(getattr(pa, name))
