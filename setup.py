"""Build of kvcached._C: plain pybind11, no torch and no CUDA toolkit needed.

The CUDA driver is dlopen'ed at run time; cuda.h provides its types and comes
from CUDA_HOME, /usr/local/cuda, or the nvidia-cuda-runtime build requirement.
HIP sources are compiled in only where ROCm headers exist.
"""

import glob
import os
import shutil
import subprocess

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _cuda_include_dir() -> str:
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "include"))
    candidates.append("/usr/local/cuda/include")
    try:  # the nvidia-cuda-runtime wheel (a build requirement)
        import nvidia

        for base in nvidia.__path__:
            candidates += sorted(glob.glob(os.path.join(base, "cu*", "include")), reverse=True)
            candidates.append(os.path.join(base, "cuda_runtime", "include"))
    except ImportError:
        pass
    for c in candidates:
        if os.path.isfile(os.path.join(c, "cuda.h")):
            return c
    raise RuntimeError(
        "cuda.h not found: install the build requirement 'nvidia-cuda-runtime' "
        "(pip does this with build isolation) or set CUDA_HOME"
    )


def _rocm_include_dir():
    root = os.environ.get("ROCM_PATH", "/opt/rocm")
    inc = os.path.join(root, "include")
    return inc if os.path.isfile(os.path.join(inc, "hip", "hip_runtime_api.h")) else None


include_dirs = [os.path.join("csrc", "include"), _cuda_include_dir()]
macros = []
rocm = _rocm_include_dir()
if rocm:
    include_dirs.append(rocm)
    macros += [("KVCACHED_WITH_HIP", "1"), ("__HIP_PLATFORM_AMD__", "1")]

ext = Pybind11Extension(
    "kvcached._C",
    sorted(glob.glob("csrc/src/*.cpp")) + ["csrc/bindings/module.cpp"],
    include_dirs=include_dirs,
    define_macros=macros,
    cxx_std=17,
    extra_compile_args=["-O2", "-fvisibility=hidden", "-Wall", "-Wno-unused-function"],
    extra_link_args=["-ldl", "-lrt", "-pthread"],
)


class BuildPyWithPth(build_py):
    """Puts kvcached_autopatch.pth at the site-packages root of the wheel."""

    def run(self):
        super().run()
        src = os.path.join(HERE, "kvcached_autopatch.pth")
        if os.path.exists(src):
            shutil.copyfile(src, os.path.join(self.build_lib, "kvcached_autopatch.pth"))
        # The commit this wheel was built from, for `kvctl version` (a source tree asks git).
        commit = ""
        try:
            out = subprocess.run(["git", "-C", HERE, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
            commit = out.stdout.strip() if out.returncode == 0 else ""
        except OSError:
            pass
        if commit:
            with open(os.path.join(self.build_lib, "kvcached", "_build_info.py"), "w") as f:
                f.write(f'COMMIT = "{commit}"\n')


setup(ext_modules=[ext], cmdclass={"build_py": BuildPyWithPth})
