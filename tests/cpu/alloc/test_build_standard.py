"""CMakeLists.txt builds with the C++ standard the installed torch's headers need: the one its
TorchConfig.cmake declares on the torch target, C++17 at least (torch 2.14's c10 headers do not compile
as C++17; issue 43). Only CMake's configure step runs, on a stand-in torch directory."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
pybind11 = pytest.importorskip("pybind11")
pytestmark = pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")


def configured_standard(tmp_path: Path, declared: int | None) -> int:
    torch_dir = tmp_path / "torch"
    if declared is not None:  # the lines of TorchConfig.cmake that matter here
        config = torch_dir / "share" / "cmake" / "Torch" / "TorchConfig.cmake"
        config.parent.mkdir(parents=True)
        config.write_text(
            "set_target_properties(torch PROPERTIES\n"
            '    INTERFACE_INCLUDE_DIRECTORIES "${TORCH_INCLUDE_DIRS}"\n'
            f"    CXX_STANDARD {declared}\n)\n"
        )
    build = tmp_path / "build"
    args = [
        "cmake",
        "-S",
        str(ROOT),
        "-B",
        str(build),
        f"-DPython_EXECUTABLE={sys.executable}",
        f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
        "-DSUPERMEM_CUDA=OFF",
        f"-DTORCH_DIR={torch_dir}",
        "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
    ]
    if shutil.which("ninja"):
        args.append("-GNinja")
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    commands = json.loads((build / "compile_commands.json").read_text())
    standards = {int(m) for c in commands for m in re.findall(r"-std=(?:gnu|c)\+\+(\d+)", c["command"])}
    assert len(standards) == 1, standards
    return standards.pop()


@pytest.mark.parametrize(("declared", "expected"), [(20, 20), (23, 23), (14, 17), (None, 17)])
def test_the_build_takes_the_standard_torch_declares_and_17_at_least(tmp_path, declared, expected):
    assert configured_standard(tmp_path, declared) == expected
