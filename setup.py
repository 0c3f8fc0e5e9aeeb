"""Builds supermem._C with CMake, against the torch installed where supermem is being installed:

    pip install .                            (or, for development: pip install --no-build-isolation -e .)

torch is not a build requirement: an isolated build would pull a second torch (another version, another
C++ standard in its headers) and build against it. Under pip's build isolation the installed torch is
found by asking the same interpreter, isolated (`python -I`), where it is; a build that finds none stops
with one line saying what to run. Set SUPERMEM_CUDA=0 to skip the CUDA parts,
SUPERMEM_SANITIZE=address|undefined|thread for a sanitizer build.
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NO_TORCH = (
    "supermem: no installed PyTorch to build against; install torch first (pip install torch), then "
    "pip install --no-build-isolation ."
)
# Prints the installed torch's directory and C++ ABI flag; run by this interpreter, then by it isolated.
_TORCH_PROBE = (
    "import torch, os; print(os.path.dirname(torch.__file__), int(torch._C._GLIBCXX_USE_CXX11_ABI))"
)


def installed_torch() -> tuple[str, int] | None:
    """(torch's directory, its _GLIBCXX_USE_CXX11_ABI) for the torch installed beside this interpreter.
    Under pip's build isolation this process sees only the build environment, whose path set-up comes
    from PYTHONPATH; `python -I` ignores it and sees the environment supermem is installed into."""
    for argv in ([sys.executable, "-c", _TORCH_PROBE], [sys.executable, "-I", "-c", _TORCH_PROBE]):
        probe = subprocess.run(argv, capture_output=True, text=True, cwd="/")
        if probe.returncode == 0:
            torch_dir, abi = probe.stdout.split()
            return torch_dir, int(abi)
    return None


def torch_config() -> list[str]:
    found = installed_torch()
    if found is None:
        raise SystemExit(NO_TORCH)
    torch_dir, abi = found
    return [f"-DTORCH_DIR={torch_dir}", f"-DTORCH_CXX11_ABI={abi}"]


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        torch_args = torch_config()  # first: a build without torch stops before CMake runs
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_dir = Path(self.build_temp).resolve()
        build_dir.mkdir(parents=True, exist_ok=True)
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DSUPERMEM_CUDA={'OFF' if os.environ.get('SUPERMEM_CUDA') == '0' else 'ON'}",
            f"-DSUPERMEM_SANITIZE={os.environ.get('SUPERMEM_SANITIZE', '')}",
            *torch_args,
        ]
        if subprocess.run(["ninja", "--version"], capture_output=True).returncode == 0:
            args.append("-GNinja")
        subprocess.run(["cmake", str(Path(__file__).parent.resolve()), *args], cwd=build_dir, check=True)
        jobs = str(os.cpu_count() or 2)
        subprocess.run(["cmake", "--build", ".", "-j", jobs], cwd=build_dir, check=True)


setup(ext_modules=[Extension("supermem._C", sources=[])], cmdclass={"build_ext": CMakeBuild})
