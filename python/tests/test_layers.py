"""The package's import layers, as the C++ build enforces its own (Layers.* probes): every
module imports only modules before it in ORDER (the C++ folders: sharding, format and storage
below interop, the reader, offline and the package; the DCP backend above), so no two modules
import each other, whether at the top or inside a function; every module outside the DCP
backend imports alone in a fresh interpreter where torch cannot be imported."""
import ast
import os
import subprocess
import sys

PKG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tessera_ckpt")
ROOT = os.path.dirname(PKG)

ORDER = [
    "_error", "_crc32c",                                          # core/
    "_sharding_chunk", "_sharding_spec", "_sharding_layout",      # sharding/
    "_storage_file",                                              # checkpoint/storage/file
    "_format_json", "_format_checksum", "_format_safetensors", "_format_metadata",  # checkpoint/format/
    "_storage_commit",                                            # checkpoint/storage/commit
    "_interop_hf_dir",                                            # checkpoint/interop/
    "_reader", "_verify", "_offline",                             # checkpoint/reader, verify, offline/
    "__init__", "__main__",                                       # tessera_ckpt, python -m tessera_ckpt
    "_dcp_members", "_state_optimizer_state", "_dcp_reader", "_dcp_writer", "_trainer_checkpoint",
    "dcp",                                                        # tessera_ckpt.dcp (torch 2.x)
]
NEEDS_TORCH = {"_dcp_members", "_state_optimizer_state", "_dcp_reader", "_dcp_writer", "_trainer_checkpoint", "dcp"}


def modules():
    return sorted(n[:-3] for n in os.listdir(PKG) if n.endswith(".py"))


def imports_of(name):
    """The package's modules that ``name`` imports (``from . import X``, ``from .X import``),
    anywhere in it; ``from . import NAME`` of a name that is no module means the package."""
    tree = ast.parse(open(os.path.join(PKG, name + ".py")).read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(a.name if a.name in modules() else "__init__" for a in node.names)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            assert not any(n.split(".")[0] == "tessera_ckpt" for n in names), f"{name}: imports its package by name"
    return out


def test_every_module_has_its_place():
    assert sorted(ORDER) == modules(), "a module was added or removed: place it in ORDER"


def test_imports_flow_one_way():
    for name in ORDER:
        for dep in imports_of(name):
            assert ORDER.index(dep) < ORDER.index(name), f"{name} imports {dep}, which comes after it in ORDER"


def top_level_imports(name):
    tree = ast.parse(open(os.path.join(PKG, name + ".py")).read())
    out = set()
    for node in tree.body:
        for n in ([node] + list(ast.walk(node)) if isinstance(node, ast.Try) else [node]):
            if isinstance(n, ast.Import):
                out.update(a.name.split(".")[0] for a in n.names)
            elif isinstance(n, ast.ImportFrom) and n.level == 0:
                out.add(n.module.split(".")[0])
    return out


def test_only_the_dcp_backend_imports_torch_at_import():
    for name in ORDER:
        assert ("torch" in top_level_imports(name)) == (name in NEEDS_TORCH), name


def run(code, *args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", "import sys; sys.modules['torch'] = None\n" + code, *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_each_module_imports_alone_without_torch():
    for name in ORDER:
        if name in NEEDS_TORCH or name == "__main__":
            continue
        mod = "tessera_ckpt" if name == "__init__" else f"tessera_ckpt.{name}"
        r = run(f"import importlib; importlib.import_module({mod!r})")
        assert r.returncode == 0, f"{mod}:\n{r.stderr}"


def test_the_command_runs_without_torch(tmp_path):
    r = run("import runpy; runpy.run_module('tessera_ckpt', run_name='__main__')", "verify", str(tmp_path / "nowhere"))
    assert r.returncode == 1 and f"'{tmp_path / 'nowhere'}' does not exist" in r.stderr, r.stderr


def test_the_public_names():
    r = run("import tessera_ckpt as t; print(sorted(t.__all__)); "
            "print(all(hasattr(t, n) for n in t.__all__), issubclass(t.CheckpointNotFoundError, FileNotFoundError))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == [
        "['Checkpoint', 'CheckpointError', 'CheckpointNotFoundError', 'crc32c', 'inspect', 'load', 'verify']",
        "True True"]
