"""The package's layout rules, read from its source with `ast` (nothing is imported):

- no import cycle among its modules (imports inside functions count: a cycle that works
  only because one import is late is still a cycle);
- no private name (`_x`) imported from another subpackage, and no attribute `mod._x` read
  of a module imported from another subpackage;
- a family (`matmul`, `grouped`, `fp8`, `moe`) imports the shared layers (`core`, `mgpu`)
  and other families' public modules only; `core` imports nothing of the package and
  `mgpu` only `core`;
- no module over 700 lines;
- the dated results records (benchmarks/results) hold at most 2 MB: summaries, small JSON
  and plots travel with every clone; raw logs stay out (.gitignore).
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "pallas_gemm"
MAX_LINES = 700
SHARED = {"core": set(), "mgpu": {"core"}, "testing": {"core", "mgpu", "matmul", "grouped", "fp8"}}


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    out[name] = path
  return out


MODULES = _modules()


def _packages() -> set[str]:
  return {m for m, p in MODULES.items() if p.name == "__init__.py"}


def _imports(module: str, with_alias: bool = False):
  """(imported module, name imported from it or None, line[, local name]) per import."""
  tree = ast.parse(MODULES[module].read_text())
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.startswith("pallas_gemm"):
          entry = alias.name, None, node.lineno
          yield (*entry, alias.asname or alias.name) if with_alias else entry
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pallas_gemm"):
      for alias in node.names:
        full = f"{node.module}.{alias.name}"
        # `from pkg import module` imports a module; `from module import name` a name.
        entry = (full, None, node.lineno) if full in MODULES else (node.module, alias.name,
                                                                    node.lineno)
        yield (*entry, alias.asname or alias.name) if with_alias else entry


def _graph() -> dict[str, set[str]]:
  graph = {}
  for module in MODULES:
    deps = {target for target, _, _ in _imports(module) if target in MODULES}
    # Importing pkg.sub.mod runs pkg/__init__ and pkg/sub/__init__ first.
    for target in list(deps):
      parts = target.split(".")
      deps.update(".".join(parts[:i]) for i in range(2, len(parts)))
    deps.discard(module)
    # A package's own __init__ runs before its modules; an edge from a module to its
    # enclosing packages is not a cycle of the source.
    graph[module] = {d for d in deps if not module.startswith(d + ".")}
  return graph


def test_no_import_cycle():
  graph, state, stack, cycles = _graph(), {}, [], []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for dep in sorted(graph.get(node, ())):
      if state.get(dep) == "open":
        cycles.append(stack[stack.index(dep):] + [dep])
      elif dep not in state:
        visit(dep)
    stack.pop()
    state[node] = "done"

  for node in sorted(graph):
    if node not in state:
      visit(node)
  assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _family(module: str) -> str:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 and f"pallas_gemm.{parts[1]}" in _packages() else ""


def test_no_private_name_across_subpackages():
  bad = []
  for module, path in MODULES.items():
    own = _family(module)
    aliases = {}
    for target, name, line, local in _imports(module, with_alias=True):
      other = _family(target)
      if other and other != own:
        if name is not None and name.startswith("_"):
          bad.append(f"{path.relative_to(PACKAGE)}:{line} imports {target}.{name}")
        if name is None:
          aliases[local] = target
    # mod._private on a module of another subpackage
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
          and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
          and node.value.id in aliases):
        bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno} reads "
                   f"{aliases[node.value.id]}.{node.attr}")
  assert not bad, "private names across subpackages:\n" + "\n".join(bad)


def test_layers_import_downwards():
  bad = []
  for module, path in MODULES.items():
    own = _family(module)
    for target, name, line in _imports(module):
      other = _family(target)
      where = f"{path.relative_to(PACKAGE)}:{line}: {own or 'the root'} imports {target}"
      if own in SHARED:
        if (other and other != own and other not in SHARED[own]) or (
            not other and own in ("core", "mgpu")):
          bad.append(where)
      elif own and other and other != own and other not in SHARED:
        # another family: its package (the module itself, or a public name it exports),
        # never one of its modules
        if target != f"pallas_gemm.{other}" or (name is not None and name.startswith("_")):
          bad.append(where + (f".{name}" if name else "") + " (not its public API)")
  assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_size(module):
  lines = MODULES[module].read_text().count("\n")
  assert lines <= MAX_LINES, f"{MODULES[module]} has {lines} lines (at most {MAX_LINES})"


def test_rules_see_the_package():
  # The rules above are vacuous if the walk finds nothing: the families are all there.
  families = {_family(m) for m in MODULES}
  assert {"core", "mgpu", "matmul", "grouped", "fp8"} <= families, families
  assert any(name for m in MODULES for _, name, _ in _imports(m))


RESULTS = PACKAGE.parent / "benchmarks" / "results"
# A dated record is a README, small JSON, plots and the probes as run (under 150 KB for
# most; 574 KB for the one with a full sweep's JSON).
# The cap keeps raw device output and large artifacts out of the repository, which
# travels to the GPU machine whole.
RESULTS_MAX_BYTES = 2_250_000
# What .gitignore keeps out of the records (raw device output), left out of the count here too.
RAW = (".log", ".hlo.txt", ".tgz", ".ncu-rep", ".tmp")


def test_results_records_stay_small():
  files = [f for f in RESULTS.rglob("*") if f.is_file() and not f.name.endswith(RAW)]
  total = sum(f.stat().st_size for f in files)
  assert files and total <= RESULTS_MAX_BYTES, (
      f"benchmarks/results holds {total} bytes (at most {RESULTS_MAX_BYTES}); the largest:"
      f" {sorted(files, key=lambda f: -f.stat().st_size)[:5]}")
