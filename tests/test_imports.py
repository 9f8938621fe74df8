"""The package's import graph: no cycles among spec_jax modules, and a library core that never
imports the benchmark or evaluation packages.

The graph comes from the source (ast), every import statement counted, those inside functions
too (a lazy import that closes a circle is still a knot a reader must untangle). An import of
spec_jax.a.b.c also depends on the packages spec_jax.a and spec_jax.a.b (Python runs their
__init__ first) unless the importing module lies inside them; the root package spec_jax, which
imports the public API, is the one node left out (every module depends on it, and it on them).
"""

import ast
import pathlib

import pytest

from tests.conftest import ROOT

PACKAGE = ROOT / "spec_jax"
# Tools above the library: they may import anything, nothing in the core may import them.
UPPER = ("spec_jax.bench", "spec_jax.eval", "spec_jax.tools", "spec_jax.launch",
         "spec_jax.__main__", "spec_jax.aot")


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict:
  """{module name: path} for every .py file of the package."""
  return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str, path: pathlib.Path, modules) -> set:
  """The spec_jax modules `name` imports (statements anywhere in the file), with the packages
  they run first."""
  is_package = path.name == "__init__.py"
  base = name if is_package else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    targets = []
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        anchor = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
        source = f"{anchor}.{node.module}" if node.module else anchor
      else:
        source = node.module or ""
      for a in node.names:
        sub = f"{source}.{a.name}"
        targets.append(sub if sub in modules else source)
    for t in targets:
      if not (t == "spec_jax" or t.startswith("spec_jax.")):
        continue
      while t not in modules and "." in t:      # an attribute path: its module
        t = t.rpartition(".")[0]
      parts = t.split(".")
      for i in range(2, len(parts) + 1):        # the module and the packages above it
        dep = ".".join(parts[:i])
        inside = name == dep or name.startswith(dep + ".")
        if dep in modules and not (inside and dep != t):
          found.add(dep)
  found.discard(name)
  found.discard("spec_jax")
  return found


@pytest.fixture(scope="module")
def graph() -> dict:
  modules = all_modules()
  return {name: imported_modules(name, path, modules) for name, path in modules.items()
          if name != "spec_jax"}


def cycles(graph: dict) -> list:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_the_graph_sees_the_imports_it_should(graph):
  """The walk finds lazy imports and package dependencies (so a clean result means something)."""
  assert "spec_jax.decoding.rounds" in graph["spec_jax.decoding.loop"]
  assert "spec_jax.governor" in graph["spec_jax.decoding.plan"]       # the package runs first
  assert "spec_jax.tree.round" in graph["spec_jax.decoding.plan"]
  assert "spec_jax.tree" in graph["spec_jax.drafters.draft_model"]
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_among_spec_jax_modules(graph):
  assert cycles(graph) == []


def test_the_library_core_never_imports_the_bench_or_eval(graph):
  core = {m for m in graph if not any(m == u or m.startswith(u + ".") for u in UPPER)}
  bad = {m: sorted(d for d in graph[m] if any(d == u or d.startswith(u + ".") for u in UPPER))
         for m in core}
  assert {m: d for m, d in bad.items() if d} == {}
  assert "spec_jax.calibration" in core and "spec_jax.timing" in core
