"""Rooms import downward only (README, "Layout"): every `import` in every module of `hf_dlm`, the lazy ones
inside functions included, is read from the syntax tree and checked against the room order. `from hf_dlm import
X` counts as an import of the module that defines X (the package's lazy export table)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import hf_dlm

PACKAGE = Path(hf_dlm.__file__).parent
# lowest first; a room may import its own modules and rooms before it
ROOMS = ("utils", "generation", "modeling", "diffusion", "data", "parallel", "training", "hub", "conversion",
         "serving", "evaluation", "commands")
TOP_LEVEL = {"__init__", "__main__", "cli"}  # the package's front door and the CLI sit above every room


def _module_name(path: Path) -> str:
    parts = path.with_suffix("").parts
    parts = parts[len(parts) - 1 - parts[::-1].index("hf_dlm"):]  # from the last `hf_dlm` folder down
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _room(module: str) -> str | None:
    """The room of an `hf_dlm...` module (`cli` counts as `commands`); None for other packages."""
    parts = module.split(".")
    if parts[0] != "hf_dlm":
        return None
    if len(parts) == 1 or parts[1] in ("__init__", "__main__"):
        return "hf_dlm"
    return "commands" if parts[1] == "cli" else parts[1]


def _defining_module(name: str) -> str:
    """Where `from hf_dlm import name` really comes from."""
    if name in hf_dlm._LAZY:
        return "hf_dlm" + hf_dlm._LAZY[name]
    if name in hf_dlm._EAGER:
        return "hf_dlm.modeling"
    return "hf_dlm.utils"  # __version__ and the like: plain values


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in the file, at any depth of the syntax tree."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name != "hf_dlm"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            if target == "hf_dlm":
                found += [(node.lineno, _defining_module(alias.name)) for alias in node.names]
            elif node.module is None:  # `from . import x`: x is a module of that package
                found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, target))
    return sorted(found)


def upward_imports(paths) -> list[str]:
    problems = []
    for path in paths:
        room = _room(_module_name(path))
        if room == "hf_dlm" or path.stem in TOP_LEVEL and path.parent.name == "hf_dlm":
            continue
        assert room in ROOMS, f"{path}: room {room!r} is not in the layering order; add it to ROOMS and README"
        for line, target in imports_of(path):
            target_room = _room(target)
            if target_room is None:
                continue
            where = f"{_module_name(path)}:{line} imports {target}"
            if target_room == "hf_dlm":
                problems.append(f"{where} (the package front door; import from the room that defines it)")
            elif target_room not in ROOMS:
                problems.append(f"{where} (unknown room {target_room!r})")
            elif ROOMS.index(target_room) > ROOMS.index(room):
                problems.append(f"{where} ({room} sits below {target_room})")
    return problems


def _library_files():
    return sorted(PACKAGE.rglob("*.py"))


def test_every_room_imports_only_rooms_below_it():
    assert upward_imports(_library_files()) == []


def test_modeling_imports_only_utils_and_generation():
    modeling = [p for p in _library_files() if _room(_module_name(p)) == "modeling"]
    assert modeling
    rooms = {_room(target) for path in modeling for _, target in imports_of(path)} - {None}
    assert rooms <= {"utils", "generation", "modeling"}, rooms


def test_no_library_module_imports_the_cli():
    offenders = [f"{_module_name(path)}:{line} imports {target}"
                 for path in _library_files() if _room(_module_name(path)) not in ("commands", "hf_dlm")
                 for line, target in imports_of(path)
                 if target.startswith(("hf_dlm.commands", "hf_dlm.cli"))]
    assert offenders == []


def test_every_room_is_a_package_named_in_the_order():
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == set(ROOMS)


def test_readme_layout_lists_the_rooms_in_layering_order():
    text = (PACKAGE.parent / "README.md").read_text()
    layout = text[text.index("## Layout"):].split("```")[1]
    listed = [line.split("/")[0].strip() for line in layout.splitlines() if re.match(r"^  [a-z]+/ ", line)]
    assert listed == list(ROOMS)


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The checker itself: an import inside a function, a relative `from ..x import` and a `from hf_dlm import`
    of a lazily exported name are all found and resolved to their room."""
    fake = tmp_path / "hf_dlm" / "modeling" / "probe.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("def f():\n    from ..training.runner import build_data\n"
                    "    from hf_dlm import DLMTrainer\n    from . import masks\n    import hf_dlm.serving.app\n")
    assert imports_of(fake) == [(2, "hf_dlm.training.runner"), (3, "hf_dlm.training.trainer"),
                                (4, "hf_dlm.modeling.masks"), (5, "hf_dlm.serving.app")]
    problems = upward_imports([fake])
    assert len(problems) == 3 and all("modeling sits below" in p for p in problems), problems


def test_files_named_in_the_library_and_readme_exist():
    """Docstrings and README name real files (no `tests/test_serving_engine.py` after a rename), and no file
    outside the repository (the team's notes are not shipped)."""
    root = PACKAGE.parent
    pattern = re.compile(r"\b((?:tests|benchmarks|examples|hf_dlm)/[A-Za-z0-9_./-]+\.(?:py|yaml|md|json))\b")
    texts = {path: path.read_text() for path in [*_library_files(), root / "README.md"]}
    missing = sorted({f"{path.relative_to(root)} names {name}" for path, text in texts.items()
                      for name in pattern.findall(text) if not (root / name).exists()})
    assert missing == []
    assert [str(path.relative_to(root)) for path, text in texts.items() if "REFERENCE.md" in text] == []


def test_no_test_imports_another_test_file_or_conftest():
    """Shared helpers live in tests/utils.py; a test file imported as a module runs its fixtures' imports twice
    and couples two tests' internals."""
    tests = Path(__file__).parent
    offenders = []
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}:{node.lineno} imports {name}" for name in names
                          if name.rpartition(".")[2].startswith(("test_", "conftest"))]
    assert offenders == []
