"""How the house is laid out, measured from the code: the figures the redesign of the package
layout is judged by (one mechanism, one place; a model that knows nothing of how it is split).

    python scripts/house_metrics.py                 # this checkout
    python scripts/house_metrics.py --root DIR      # another checkout (e.g. a git worktree of
                                                    # an older commit: the "before" column)
    python scripts/house_metrics.py --run-log runs/X/log.jsonl   # also what `make run` did: the
                                                    # replicas' sha256 and a digest of every
                                                    # row's loss, grad norm and bytes

Measured before the redesign (the tree #30 left): 58 library files, 16,629 lines; 31 top-level
modules; pipeline 7 files in 2 folders, named by 13; MoE 2 in 2, named by 16; train_step 77
lines; 34 getattr/hasattr; 141 attributes set on another object, 5 of them methods; 2 import
cycles (comm-ops-tensor-trace, train-verify); the largest file plan.py, 1111 lines. `make
run`: loss 5.560 -> 0.782, replicas sha256 229c7e3a8aa32c54, rows digest a3360074a390be63
(the same in three runs).

After it: 105 files, 17,738 lines in 12 packages; 0 top-level modules; train_step 41 lines; 26
getattr/hasattr (loops over flag names); 117 attributes set on another object, 1 of them a
method (the abort hook, sys.excepthook), 4 fields no class declares; 0 import cycles; the largest
file autograd/ops.py, 640 lines. `make run`: the same loss, sha256 and rows digest.

Prints one table:
  - top-level modules: .py files directly in minipar/ (not __init__.py);
  - files per mechanism: the library files whose path names the mechanism (MECHANISMS below:
    patterns written for the old layout and the new), the folders they sit in, and how many
    files use one of the mechanism's names (how far it has spread);
  - lines of train_step;
  - getattr/hasattr calls in the library (probing objects instead of knowing them);
  - attributes set on another object (`x.attr = ...` with x not `self`, outside a class's own
    methods: wiring after construction), and of those, methods replaced on a live object (the
    value a lambda, a def of the same module, a bound method of self, or functools.partial),
    and those whose name no class declares (in an __init__ as self.X, or as a class-level
    field): the wiring that no constructor shows;
  - import cycles between subpackages (each top-level module counts as its own unit);
  - the largest file.
The figures are counted from the syntax tree (ast), so comments and strings never count.
"""
import argparse
import ast
import os
import re
import sys
from collections import defaultdict

MECHANISMS = {  # mechanism -> (a regex over the path below minipar/, one over the identifiers a file uses)
    "pipeline": (r"(instructions|schedules?|interleaved|zero_bubble|schedule_check|pipeline|backward_split)",
                 r"^(pipeline|PipelineStage|schedules|backward_split|zero_bubble|interleaved)$"),
    "mixture of experts": (r"(moe|expert)", r"^(moe|expert_parallel|MoE\w*|moe_\w+)$"),
    "ZeRO": (r"zero(?!_bubble)", r"^(zero|Zero\w*)$"),
    "tensor/sequence parallel": (r"(tensor_parallel|sequence_parallel|parallel/tensor/)",
                                 r"^(tensor_parallel|sequence_parallel|tp_group|sp)$"),
    "context parallel": (r"(ring_attention|context)", r"^(ring_attention|context_parallel|cp_group)$"),
    "recomputation": (r"recompute", r"^(recompute|Recompute\w*)$"),
    "explain pictures": (r"explain", r"^explain\w*$"),
    "reporting and pictures": (r"(report|trace|traceview|draw|plot|explain|show/)", None),
}


def library_files(root):
    base = os.path.join(root, "minipar")
    out = []
    for folder, dirs, files in os.walk(base):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    return sorted(out)


def rel(root, path):
    return os.path.relpath(path, os.path.join(root, "minipar"))


def parse(path):
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def function_lines(trees, name):
    """The lines of the trainer's module-level function `name` (in a module of the train
    package, or minipar/train.py)."""
    for path, tree in trees.items():
        if "train" not in os.path.basename(path) and f"{os.sep}train{os.sep}" not in path:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return node.end_lineno - node.lineno + 1
    return None


def identifiers(tree) -> set:
    """Every name, attribute and imported module the code uses."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update(a.name.split(".")[-1] for a in node.names)
            if isinstance(node, ast.ImportFrom) and node.module:
                out.update(node.module.split("."))
    return out


def probes(trees):
    return sum(1 for tree in trees.values() for node in ast.walk(tree)
               if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
               and node.func.id in ("getattr", "hasattr"))


def declared_fields(trees) -> set:
    """Attribute names a class declares: set as self.X in an __init__, or a class-level field
    (a dataclass's, an annotation)."""
    out = set()
    for tree in trees.values():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for item in cls.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    out.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    out |= {t.id for t in item.targets if isinstance(t, ast.Name)}
                elif isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    for n in ast.walk(item):
                        if (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                                and isinstance(n.value, ast.Name) and n.value.id == "self"):
                            out.add(n.attr)
    return out


def set_from_outside(tree, declared=frozenset()):
    """(attributes set on an object other than self, of those methods replaced, of those
    fields its class never declares: wiring from outside)."""
    local_defs = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def is_method(v):          # a lambda, a def of this module, a bound method of self, a partial
        return (isinstance(v, ast.Lambda) or (isinstance(v, ast.Name) and v.id in local_defs)
                or (isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.value.id == "self"
                    and v.attr in local_defs)
                or (isinstance(v, ast.Call) and getattr(v.func, "attr", getattr(v.func, "id", "")) == "partial"))

    wired = replaced = undeclared = 0
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            continue
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
            both = isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple)
            pairs = (list(zip(t.elts, node.value.elts)) if both
                     else [(a, node.value) for a in (t.elts if isinstance(t, ast.Tuple) else [t])])
            for a, v in pairs:
                if not isinstance(a, ast.Attribute) or (
                        isinstance(a.value, ast.Name) and a.value.id in ("self", "cls")):
                    continue
                wired += 1
                replaced += bool(v is not None and is_method(v))
                undeclared += a.attr not in declared
    return wired, replaced, undeclared


def unit_of(module):
    """minipar.parallel.zero -> 'parallel'; minipar.train -> 'train' (a top-level module)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def import_graph(root, trees):
    mods = {}
    for path in trees:
        r = rel(root, path)[:-3].replace(os.sep, ".")
        mods[path] = "minipar." + (r[:-len(".__init__")] if r.endswith("__init__") else r)
    known = set(mods.values())
    edges = defaultdict(set)
    for path, tree in trees.items():
        me = mods[path]
        package = me if path.endswith("__init__.py") else me.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                names = [mod] + [f"{mod}.{a.name}" for a in node.names]
            for n in names:
                if n in known and unit_of(n) != unit_of(me):
                    edges[unit_of(me)].add(unit_of(n))
    return edges


def cycles(edges):
    """Strongly connected components with more than one unit (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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

    sys.setrecursionlimit(10000)
    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def measure(root):
    files = library_files(root)
    trees = {p: parse(p) for p in files}
    lines = {p: sum(1 for _ in open(p, encoding="utf-8")) for p in files}
    top = [p for p in files if os.path.dirname(p) == os.path.join(root, "minipar")
           and not p.endswith("__init__.py")]
    rows = [("library files / lines", f"{len(files)} / {sum(lines.values()):,}"),
            ("top-level modules", str(len(top)))]
    names = {p: identifiers(t) for p, t in trees.items()}
    for name, (pattern, ident) in MECHANISMS.items():
        hits = [rel(root, p) for p in files if re.search(pattern, rel(root, p))]
        folders = sorted({os.path.dirname(h) or "." for h in hits})
        using = ("" if ident is None else
                 f"; {sum(1 for p in files if any(re.match(ident, n) for n in names[p]))} files name it")
        rows.append((f"files: {name}", f"{len(hits)} in {len(folders)} folder(s){using}"))
    rows.append(("lines of train_step", str(function_lines(trees, "train_step"))))
    rows.append(("getattr/hasattr calls", str(probes(trees))))
    declared = declared_fields(trees)
    wired = [set_from_outside(t, declared) for t in trees.values()]
    rows.append(("attributes set on another object", str(sum(w[0] for w in wired))))
    rows.append(("  of which methods replaced", str(sum(w[1] for w in wired))))
    rows.append(("  of which fields no class declares", str(sum(w[2] for w in wired))))
    found = cycles(import_graph(root, trees))
    rows.append(("import cycles between units", f"{len(found)}" + (f": {found}" if found else "")))
    big = max(files, key=lambda p: lines[p])
    rows.append(("largest file", f"{rel(root, big)} ({lines[big]} lines)"))
    return rows


def run_digest(path) -> list:
    """`make run`'s figures that must not change: the replicas' sha256 and a digest of every
    step's loss, grad norm and bytes (the exact floats, as logged)."""
    import hashlib  # noqa: PLC0415
    import json  # noqa: PLC0415
    with open(path) as f:
        objs = [json.loads(line) for line in f if line.strip()]
    rows = [o for o in objs if "loss" in o and "step" in o]
    summary = next((o for o in objs if o.get("summary") is True), {})
    keep = [[r["step"], r["loss"], r["grad_norm"], r["comm_bytes"], r.get("bytes_by_axis")] for r in rows]
    digest = hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]
    replicas = (summary.get("data_parallel") or {}).get("replicas_sha256_16")
    return [("make run: steps, loss first -> last", f"{len(rows)}, {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}"),
            ("make run: replicas sha256", str(replicas)), ("make run: rows digest", digest)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    help="the checkout to measure [this one]")
    ap.add_argument("--run-log", metavar="LOG.jsonl", help="a `make run` log: its sha256 and rows digest too")
    a = ap.parse_args()
    if not os.path.isdir(os.path.join(a.root, "minipar")):
        ap.error(f"--root {a.root}: no minipar/ folder in it")
    rows = measure(a.root) + (run_digest(a.run_log) if a.run_log else [])
    width = max(len(k) for k, _ in rows)
    print(f"{'figure':<{width}}  value")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
