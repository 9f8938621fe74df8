"""The import graph of the repository's packages: layers that only import downwards, no cycles,
and a core that imports at its top only.

The graph comes from the source (ast), every import statement counted, those inside functions
too (a lazy import that closes a circle is still a knot a reader must untangle, and a lazy
import that reaches upwards is still an upward dependency). An import of spec_jax.a.b.c also
depends on the packages spec_jax.a and spec_jax.a.b (Python runs their __init__ first) unless
the importing module lies inside them; the root package spec_jax, which imports the public API,
is the one node left out (every module depends on it, and it on them).

Since lazy imports are in the graph, an acyclic graph means that no function-level import
dodges a cycle: every one of them could stand at its module's top.
"""

import ast
import pathlib

import pytest

from tests.conftest import ROOT

PACKAGES = ("spec_jax", "kernels_pallas", "train")

# The layers, lowest first. A module may import its own layer and those below it, never one
# above. A module belongs to the layer of the longest prefix that names it (a package or a
# module); every module of PACKAGES must have one.
LAYERS = (
    ("kernels", ("kernels_pallas",)),                 # verify attention: Pallas + reference
    ("infrastructure", ("spec_jax.files", "spec_jax.distributed", "spec_jax.sharding",
                        "spec_jax.compile_cache", "spec_jax.timing")),
    ("models", ("spec_jax.models",)),                 # transformers, caches, checkpoints
    ("round math", ("spec_jax.sampling", "spec_jax.sampling_options", "spec_jax.sampling_draw",
                    "spec_jax.sampling_history", "spec_jax.processors",
                    "spec_jax.constraints", "spec_jax.rejection",
                    "spec_jax.stats", "spec_jax.governor")),    # pure functions of arrays
    ("trees", ("spec_jax.tree",)),                    # TreeSpec, building, verification
    ("drafters", ("spec_jax.drafters",)),
    ("decode core", ("spec_jax.decoding", "spec_jax.decoding.target", "spec_jax.decoding.state",
                     "spec_jax.decoding.checks", "spec_jax.decoding.rounds")),
    ("strategies", ("spec_jax.decoding.strategies",)),   # plug into the loop, never import it
    ("decode", ("spec_jax.decoding.loop",)),          # sj.decode: prefill + a strategy's rounds
    ("host", ("spec_jax.decoding.compiled", "spec_jax.decoding.prompts",
              "spec_jax.decoding.calibration", "spec_jax.decoding.generate",
              "spec_jax.global_batch", "spec_jax.memory")),   # sj.generate, sj.calibrate
    ("tools", ("spec_jax.bench", "spec_jax.eval", "spec_jax.tools", "spec_jax.aot",
               "spec_jax.launch", "spec_jax.__main__")),     # command lines over the library
    ("training", ("train",)),
)

# Modules whose imports of PACKAGES all stand at the module's top (third-party imports may be
# lazy: optional dependencies).
EAGER = ("spec_jax.sampling", "spec_jax.sampling_options", "spec_jax.sampling_draw",
         "spec_jax.sampling_history",
         "spec_jax.processors",
         "spec_jax.rejection", "spec_jax.stats",
         "spec_jax.governor", "spec_jax.tree", "spec_jax.decoding", "spec_jax.global_batch", "spec_jax.memory")


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict:
  """{module name: path} for every .py file of the packages."""
  return {module_name(p): p for package in PACKAGES
          for p in sorted((ROOT / package).rglob("*.py"))}


def ours(name: str) -> bool:
  return any(name == p or name.startswith(p + ".") for p in PACKAGES)


def import_statements(path: pathlib.Path):
  """(node, inside a function) for every import statement of the file."""
  tree = ast.parse(path.read_text())
  lazy = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
          for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
  for node in ast.walk(tree):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      yield node, id(node) in lazy


def imported_modules(name: str, path: pathlib.Path, modules, lazy_only: bool = False) -> set:
  """Our modules `name` imports (statements anywhere in the file, or inside functions only),
  with the packages they run first."""
  is_package = path.name == "__init__.py"
  base = name if is_package else name.rpartition(".")[0]
  found = set()
  for node, lazy in import_statements(path):
    if lazy_only and not lazy:
      continue
    targets = []
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    else:
      if node.level:
        anchor = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
        source = f"{anchor}.{node.module}" if node.module else anchor
      else:
        source = node.module or ""
      for a in node.names:
        sub = f"{source}.{a.name}"
        targets.append(sub if sub in modules else source)
    for t in targets:
      if not ours(t) or t == "spec_jax":
        continue
      while t not in modules and "." in t:      # an attribute path: its module
        t = t.rpartition(".")[0]
      parts = t.split(".")
      for i in range(1, len(parts) + 1):        # the module and the packages above it
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


def layer_of(name: str):
  """(index, layer name) of the longest LAYERS prefix naming `name`, or None."""
  best = None
  for i, (layer, prefixes) in enumerate(LAYERS):
    for p in prefixes:
      if (name == p or name.startswith(p + ".")) and (best is None or len(p) > best[0]):
        best = (len(p), i, layer)
  return None if best is None else best[1:]


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
  assert "spec_jax.decoding.strategies" in graph["spec_jax.decoding.loop"]    # the package
  assert "spec_jax.decoding.strategies.tree" in graph["spec_jax.decoding.strategies"]
  assert "spec_jax.tree" in graph["spec_jax.drafters.draft_model"]
  assert "spec_jax.decoding.compiled" in graph["spec_jax.bench.suites.targets"]   # lazy
  assert "spec_jax.models" in graph["train.features"]
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert layer_of("spec_jax.decoding.strategies.chain")[1] == "strategies"
  assert layer_of("spec_jax.decoding.rounds")[1] == "decode core"
  assert layer_of("spec_jax.decodingx") is None


def test_every_module_has_a_layer(graph):
  assert [m for m in graph if layer_of(m) is None] == []


def test_imports_only_go_down_the_layers(graph):
  """No module imports one in a higher layer (the core never imports the strategies, the
  calibration, the tools or the trainer; strategies never import the loop)."""
  up = {}
  for m, deps in graph.items():
    lm = layer_of(m)
    bad = sorted(f"{d} ({layer_of(d)[1]})" for d in deps if layer_of(d)[0] > lm[0])
    if bad:
      up[f"{m} ({lm[1]})"] = bad
  assert up == {}


def test_no_import_cycles(graph):
  assert cycles(graph) == []


def test_the_core_imports_at_its_top():
  """In EAGER modules every import of our packages stands at the module's top (no lazy import
  that hides a dependency)."""
  modules = all_modules()
  lazy = {name: sorted(imported_modules(name, path, modules, lazy_only=True))
          for name, path in modules.items()
          if any(name == p or name.startswith(p + ".") for p in EAGER)}
  assert {m: d for m, d in lazy.items() if d} == {}
