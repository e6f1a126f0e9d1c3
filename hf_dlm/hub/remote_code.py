"""Self-contained `trust_remote_code` files, generated from hf-dlm's own source at export time.

A saved hf-dlm model must load with `AutoModelForMaskedLM.from_pretrained(path, trust_remote_code=True)`
where hf-dlm is not installed. transformers' `custom_object_save` copies a class's file and its
same-folder relative imports verbatim; that breaks as soon as a modeling file imports from another
hf-dlm package (`..utils`, `..kernels`) and would ship the hf-dlm-only save hook. So this module walks
the real import graph of `hf_dlm.modeling.configuration_dlm` / `modeling_dlm`, and writes two flat files
(the Hub convention: `configuration_dlm.py`, `modeling_dlm.py`) by editing the original source lines:
in-package imports are removed (the names now live in the same file) or pointed at the sibling
configuration file, `__all__` lists and hf-dlm-only members are dropped, comments and docstrings stay.
Nothing is kept by hand: the files are regenerated from whatever hf-dlm's source is at export time.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_ROOT = "hf_dlm.modeling.configuration_dlm"
MODEL_ROOT = "hf_dlm.modeling.modeling_dlm"
CONFIG_FILE, MODEL_FILE = "configuration_dlm.py", "modeling_dlm.py"
AUTO_MAP = {
    "AutoConfig": "configuration_dlm.DLMConfig",
    "AutoModel": "modeling_dlm.DLMModel",
    "AutoModelForMaskedLM": "modeling_dlm.DLMForDiffusionLM",
}
# members that only make sense with hf-dlm installed (the save hook that calls this generator)
HF_DLM_ONLY = {MODEL_ROOT: {"DLMPreTrainedModel.save_pretrained", "DLMPreTrainedModel.push_to_hub"}}
# packages a machine that runs transformers models has anyway; anything else imported unguarded is an error
BASE_REQUIREMENTS = {"torch", "transformers", "huggingface_hub", "safetensors", "tokenizers", "numpy", "packaging"}


@dataclass
class _Module:
    name: str
    path: Path
    source: str
    tree: ast.Module
    deps: list[str] = field(default_factory=list)


def _resolve(module_name: str, node: ast.ImportFrom) -> str | None:
    """Absolute name of the hf-dlm module an ImportFrom reads, or None for an outside package."""
    if node.level == 0:
        package = module_name.split(".")[0]
        return node.module if node.module and node.module.split(".")[0] == package else None
    base = module_name.split(".")[: -node.level]
    return ".".join(base + ([node.module] if node.module else []))


def _hf_dlm_only_nodes(module_name: str, tree: ast.Module) -> list[ast.FunctionDef]:
    """The HF_DLM_ONLY methods of `module_name`, which the export leaves out."""
    found = []
    for member in HF_DLM_ONLY.get(module_name, ()):
        class_name, method = member.split(".")
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == class_name:
                found += [item for item in node.body if isinstance(item, ast.FunctionDef) and item.name == method]
    return found


def _load(module_name: str) -> _Module:
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        raise ImportError(f"remote-code export: cannot find the source of {module_name}")
    path = Path(spec.origin)
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, filename=str(path))
    module = _Module(module_name, path, source, tree)
    skipped = {id(n) for member in _hf_dlm_only_nodes(module_name, tree) for n in ast.walk(member)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        package = module_name.split(".")[0]
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == package for a in node.names):
            raise NotImplementedError(
                f"{path}:{node.lineno}: `import {package}...` cannot be flattened; use `from .x import name`"
            )
        if isinstance(node, ast.ImportFrom) and (target := _resolve(module_name, node)) is not None:
            spec = importlib.util.find_spec(target)
            if spec is None or spec.origin is None or spec.submodule_search_locations is not None:
                raise NotImplementedError(
                    f"{path}:{node.lineno}: `from {'.' * node.level}{node.module or ''} import ...` reads a package, "
                    "not a module file; import from the module itself so the remote code can be flattened"
                )
            if target not in module.deps:
                module.deps.append(target)
    return module


def _closure(root: str, loaded: dict[str, _Module]) -> list[str]:
    """Modules `root` needs, dependencies first."""
    order: list[str] = []

    def visit(name: str, stack: tuple[str, ...]):
        if name in order:
            return
        if name in stack:
            raise ImportError(f"remote-code export: import cycle {' -> '.join(stack + (name,))}")
        loaded.setdefault(name, _load(name))
        for dep in loaded[name].deps:
            visit(dep, stack + (name,))
        order.append(name)

    visit(root, ())
    return order


def _top_level_names(tree: ast.Module) -> dict[str, ast.AST]:
    names = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name) and target.id != "__all__":
                    names[target.id] = node
    return names


def _flatten(module: _Module, sibling: dict[str, str]) -> str:
    """Source of `module` with in-package imports rewritten for a flat file (modules pasted into the same
    file need no import: their names are plain globals there).

    sibling: module name -> flat file stem for modules that live in the other generated file.
    """
    lines = module.source.splitlines()
    edits: list[tuple[int, int, list[str]]] = []  # (first line, last line) 1-based inclusive -> replacement

    def replace(node: ast.AST, new: list[str]):
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        indent = " " * node.col_offset
        edits.append((first, node.end_lineno, [indent + text for text in new]))

    top_level = {id(node) for node in module.tree.body}
    skipped = {id(n) for member in _hf_dlm_only_nodes(module.name, module.tree) for n in ast.walk(member)}
    for node in ast.walk(module.tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            replace(node, [])
        elif isinstance(node, ast.ImportFrom) and (target := _resolve(module.name, node)) is not None:
            new = []
            if target in sibling:
                names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in node.names)
                new = [f"from .{sibling[target]} import {names}"]
            else:
                new = [f"{a.asname} = {a.name}" for a in node.names if a.asname and a.asname != a.name]
            if not new and id(node) not in top_level:
                new = ["pass"]
            replace(node, new)
        elif isinstance(node, ast.Assign) and id(node) in top_level and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            replace(node, [])
    for member in _hf_dlm_only_nodes(module.name, module.tree):
        replace(member, [])
    for first, last, new in sorted(edits, key=lambda e: e[0], reverse=True):
        lines[first - 1 : last] = new
    relative = module.path.relative_to(module.path.parents[len(module.name.split(".")) - 1])
    return f"# ---- from {relative.as_posix()} ----\n" + "\n".join(lines).strip("\n") + "\n"


def _check_collisions(modules: list[_Module]) -> None:
    seen: dict[str, tuple[str, str]] = {}
    for module in modules:
        for name, node in _top_level_names(module.tree).items():
            text = ast.get_source_segment(module.source, node)
            if name in seen and seen[name][1] != text:
                raise NameError(
                    f"remote-code export: `{name}` is defined differently in {seen[name][0]} and {module.name}; "
                    "the flat remote-code file needs one definition (rename one of them)"
                )
            seen[name] = (module.name, text)


def generate_remote_code(config_root: str = CONFIG_ROOT, model_root: str = MODEL_ROOT) -> dict[str, str]:
    """{file name: source} of the two self-contained remote-code files: `config_root` and what it imports
    from its package go to configuration_dlm.py, `model_root` and the rest of its imports to modeling_dlm.py."""
    from .. import __version__

    loaded: dict[str, _Module] = {}
    config_order = _closure(config_root, loaded)
    model_order = [m for m in _closure(model_root, loaded) if m not in config_order]
    sibling = {name: CONFIG_FILE[:-3] for name in config_order}
    header = (
        f'"""Generated by hf-dlm {__version__} from its own source at export time; do not edit by hand.\n'
        "Load with `AutoModelForMaskedLM.from_pretrained(path, trust_remote_code=True)`; hf-dlm need not be installed.\n"
        '"""\n\nfrom __future__ import annotations\n\n'
    )
    files = {}
    for file_name, order, other in ((CONFIG_FILE, config_order, {}), (MODEL_FILE, model_order, sibling)):
        modules = [loaded[name] for name in order]
        _check_collisions(modules)
        files[file_name] = header + "\n\n".join(_flatten(m, other) for m in modules)
        compile(files[file_name], file_name, "exec")  # a broken rewrite fails here, not on the user's machine
    return files


def check_requirements(folder: str | os.PathLike) -> None:
    """Fail if the generated files import, unguarded, a package outside BASE_REQUIREMENTS (transformers
    would refuse to load them on a machine without it)."""
    from transformers.dynamic_module_utils import get_imports

    for file_name in (CONFIG_FILE, MODEL_FILE):
        extra = sorted(set(get_imports(os.path.join(folder, file_name))) - BASE_REQUIREMENTS - set(sys.stdlib_module_names))
        if extra:
            raise ImportError(
                f"remote-code export: {file_name} imports {extra} outside a try block or an is_xxx_available() "
                "check; remote loading would demand them"
            )


def write_remote_code(save_directory: str | os.PathLike) -> list[str]:
    """Write the remote-code files into `save_directory` and add `auto_map` to its config.json."""
    save_directory = Path(save_directory)
    save_directory.mkdir(parents=True, exist_ok=True)
    written = []
    for file_name, source in generate_remote_code().items():
        (save_directory / file_name).write_text(source, encoding="utf-8")
        written.append(str(save_directory / file_name))
    check_requirements(save_directory)
    config_path = save_directory / "config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["auto_map"] = dict(AUTO_MAP)
        # write next to it first, then rename: a crash never leaves a half-written config.json
        with tempfile.NamedTemporaryFile("w", dir=save_directory, suffix=".json", delete=False, encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(f.name, 0o666 & ~umask)  # a temporary file is 0600: the published config.json is not
        os.replace(f.name, config_path)
    return written


def remove_remote_code(save_directory: str | os.PathLike) -> None:
    """Undo a failed export: the generated files go; config.json is only rewritten by a complete export."""
    for file_name in (CONFIG_FILE, MODEL_FILE):
        (Path(save_directory) / file_name).unlink(missing_ok=True)


__all__ = ["AUTO_MAP", "generate_remote_code", "write_remote_code", "remove_remote_code", "check_requirements"]
