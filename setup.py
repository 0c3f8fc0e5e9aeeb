"""Builds supermem._C with CMake. Build it where torch is installed:

    pip install --no-build-isolation -e .

(--no-build-isolation: the build reads torch's headers and must not pull a second torch.)
Set SUPERMEM_CUDA=0 to skip the CUDA parts, SUPERMEM_SANITIZE=address|undefined|thread for a
sanitizer build.
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def torch_config():
    try:
        import torch
    except ImportError:
        return []
    return [
        f"-DTORCH_DIR={Path(torch.__file__).parent}",
        f"-DTORCH_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
    ]


class CMakeBuild(build_ext):
    def build_extension(self, ext):
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
            *torch_config(),
        ]
        if subprocess.run(["ninja", "--version"], capture_output=True).returncode == 0:
            args.append("-GNinja")
        subprocess.run(["cmake", str(Path(__file__).parent.resolve()), *args], cwd=build_dir, check=True)
        jobs = str(os.cpu_count() or 2)
        subprocess.run(["cmake", "--build", ".", "-j", jobs], cwd=build_dir, check=True)


setup(ext_modules=[Extension("supermem._C", sources=[])], cmdclass={"build_ext": CMakeBuild})
