"""Finding and loading the package's optional CUDA shared libraries.

CMake builds each one at install time when nvcc is present (CMakeLists.txt) and installs it
beside the Python module that calls it; without nvcc the package installs as pure Python and
the caller reports itself unavailable with the reason returned here.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import sys
import sysconfig


def candidate_paths(folder: pathlib.Path, package_dir: str, names) -> list[pathlib.Path]:
  """Where a library may be: in `folder` (regular install, in-tree build), then in every
  `package_dir` (e.g. "pallas_gemm/matmul") on the import path: scikit-build-core's editable
  install puts compiled files in site-packages, not in the source tree."""
  dirs = [folder.resolve()]
  for root in (sysconfig.get_path("platlib"), sysconfig.get_path("purelib"), *sys.path):
    if root:
      dirs.append(pathlib.Path(root).resolve() / package_dir)
  seen, paths = set(), []
  for d in dirs:
    for name in names:
      path = d / name
      if path not in seen:
        seen.add(path)
        paths.append(path)
  return paths


def load(folder: pathlib.Path, package_dir: str, names, env: str,
         declare=None) -> tuple[ctypes.CDLL | None, str | None]:
  """(library, None), or (None, why not). The environment variable `env` names the
  library explicitly; `declare(lib)` sets the C signatures of its host entry points (an
  AttributeError there means a build from older sources)."""
  explicit = os.environ.get(env)
  paths = ([pathlib.Path(explicit)] if explicit
           else candidate_paths(folder, package_dir, names))
  found = [p for p in paths if p.is_file()]
  if not found:
    where = f"{env}={explicit}" if explicit else ", ".join(
        str(p.parent) for p in paths[::len(names)])
    return None, (f"the CUDA library {names[0]} was not built (no CUDA compiler when "
                  f"pallas_gemm was installed?); looked in: {where}")
  try:
    lib = ctypes.CDLL(str(found[0]))
  except OSError as e:
    return None, f"could not load {found[0]}: {e}"
  try:
    if declare is not None:
      declare(lib)
  except AttributeError as e:  # a build from before an entry point was added
    return None, (f"{found[0]} lacks an entry point this pallas_gemm needs ({e}): a stale"
                  " build; reinstall pallas_gemm (see BUILD.md)")
  return lib, None
