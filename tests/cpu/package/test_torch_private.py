"""Every private PyTorch name supermem uses is reached through supermem/torch_private.py, so that a
PyTorch release that moves one breaks there, once. (Private attributes of tensors, modules and autograd
nodes, such as t._version or m._forward_hooks, are read where they are used.)"""

import ast
from pathlib import Path

import supermem

ROOT = Path(supermem.__file__).parent


def _private(parts: list[str]) -> bool:
    return parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def _chain(node: ast.AST) -> list[str] | None:
    """a.b.c as ["a", "b", "c"]; None for anything but names and attributes."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(names)]


def private_uses(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if _private(parts) or (parts == ["torch"] and any(a.name.startswith("_") for a in node.names)):
                out.append(f"{path.name}:{node.lineno} from {node.module} import ...")
        elif isinstance(node, ast.Import):
            out += [
                f"{path.name}:{node.lineno} import {a.name}"
                for a in node.names
                if _private(a.name.split("."))
            ]
        elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "ctx", None), ast.Store):
            chain = _chain(node)
            if chain and _private(chain):
                out.append(f"{path.name}:{node.lineno} {'.'.join(chain)}")
    return sorted(set(out))


def test_private_torch_names_are_reached_only_through_the_shim():
    found = [u for p in sorted(ROOT.rglob("*.py")) if p.name != "torch_private.py" for u in private_uses(p)]
    assert found == [], found


def test_the_check_finds_what_it_looks_for(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        "import torch\nimport torch._dynamo\nfrom torch.utils._pytree import tree_map\n"
        "x = torch._C._set_grad_enabled\ny = torch.cuda._sleep\n"
        "z = torch.__version__\nw = torch.cuda.is_available\n"
    )
    assert [u.split(" ", 1)[1] for u in private_uses(f)] == [
        "import torch._dynamo",
        "from torch.utils._pytree import ...",
        "torch._C",
        "torch._C._set_grad_enabled",
        "torch.cuda._sleep",
    ]
