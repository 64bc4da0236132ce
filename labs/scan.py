"""The student's file read before it runs: a walk of its syntax tree against the lab's list
of what a solution may use. Nothing of the file is executed.

Allowed: the imports the lab names (NumPy, math and a few plain standard modules for every
lab; from minipar exactly the names the handout gives). Refused, each with its line and a
one-line reason:
  - any other import (os, sys, subprocess, ctypes, importlib, builtins, inspect, pkgutil,
    gc, signal, threading, socket, labs.*, mpi4py, ...), relative and star imports;
  - a minipar name the handout does not give: above all the seam's own implementation
    (labs 02's ring, 07's schedules), which would grade minipar instead of the student;
  - __import__, exec, eval, compile, open, input, breakpoint, globals, locals, vars,
    setattr, delattr, exit, quit; getattr/hasattr with a name that is not a plain literal;
  - every attribute or name that starts with an underscore (__class__, __globals__,
    __subclasses__, __builtins__, a module's _private), frame and code attributes, NumPy's
    file and pointer doors (load, save, fromfile, tofile, memmap, ctypes, lib, testing ...),
    MPI's own collectives, and `str.format` fields that reach into attributes;
  - assigning to, or deleting, an attribute of an imported module (np.isclose = ...).

This is a first line of defence, not the verdict: the verdict is reached outside the
student's process whatever the file does (labs/README.md, "What the grader guarantees").
"""
from __future__ import annotations

import ast
import string
from dataclasses import dataclass, field

from minipar.comm.static_check import FORBIDDEN as MPI_COLLECTIVES

ANY = None                               # a module whose every (not refused) name may be used

# Every lab may import these; a lab adds its own minipar names (Allowed.modules).
BASE_MODULES: dict[str, set | None] = {
    "numpy": ANY, "numpy.linalg": ANY, "numpy.random": ANY, "math": ANY, "cmath": ANY,
    "__future__": ANY, "typing": ANY, "dataclasses": ANY, "functools": ANY, "itertools": ANY,
    "collections": ANY, "numbers": ANY, "time": ANY, "enum": ANY, "abc": ANY, "copy": ANY,
    "heapq": ANY, "bisect": ANY, "fractions": ANY, "json": {"dumps", "loads"},
}

REFUSED_CALLS = {
    "__import__": "imports a module by name, past the scan",
    "exec": "runs code the scan cannot see", "eval": "runs code the scan cannot see",
    "compile": "makes code the scan cannot see", "open": "opens files: a solution computes, it reads nothing",
    "input": "reads the terminal", "breakpoint": "starts a debugger",
    "globals": "reaches the module's namespace", "locals": "reaches a frame's namespace",
    "vars": "reaches an object's namespace", "setattr": "changes attributes by name",
    "delattr": "deletes attributes by name", "exit": "ends the process", "quit": "ends the process",
    "help": "starts the interactive help", "memoryview": "reaches raw memory",
}
# The underscore names a plain solution writes (super().__init__(...), fn.__name__): none
# of them reaches the interpreter's insides by itself (__globals__, __subclasses__ ... stay refused).
PLAIN_DUNDERS = {"__init__", "__name__", "__call__", "__doc__"}
# Attribute names refused on any object: files, pointers, frames, the interpreter's insides.
REFUSED_ATTRIBUTES = {
    **{n: "reads or writes files" for n in ("load", "loads", "save", "savez", "savez_compressed", "savetxt",
                                            "loadtxt", "genfromtxt", "fromfile", "tofile", "memmap", "open_memmap",
                                            "dump", "dumps", "fromregex", "DataSource", "mmap")},
    **{n: "reaches raw memory or C" for n in ("ctypes", "ctypeslib", "f2py", "distutils", "lib", "core")},
    **{n: "reaches the interpreter's insides" for n in (
        "f_globals", "f_locals", "f_back", "f_builtins", "f_code", "gi_frame", "gi_code", "cr_frame",
        "ag_frame", "tb_frame", "tb_next", "co_code", "co_consts", "mro", "modules", "attrgetter",
        "methodcaller", "environ", "system", "popen", "kill", "testing")},
    **{n: "ends or reshapes the MPI job" for n in ("Abort", "Spawn", "Spawn_multiple", "Disconnect", "Finalize")},
}


@dataclass
class Allowed:
    """What a lab's student file may import: module -> the names it may use from it (ANY: all
    but the refused ones). `refused` names are refused with the lab's own reason."""
    modules: dict = field(default_factory=dict)
    refused: dict = field(default_factory=dict)          # name -> reason (e.g. the seam's own)

    def all_modules(self) -> dict:
        return {**BASE_MODULES, **self.modules}


@dataclass
class Finding:
    line: int
    code: str
    reason: str

    def __str__(self):
        return f"line {self.line}: {self.code}: {self.reason}"


class Scanner(ast.NodeVisitor):
    def __init__(self, allowed: Allowed, lines: list[str]):
        self.modules = allowed.all_modules()
        self.refused = allowed.refused
        self.lines = lines
        self.aliases: dict[str, str] = {}                 # local name -> module it is bound to
        self.found: list[Finding] = []

    def refuse(self, node, reason: str):
        line = getattr(node, "lineno", 0)
        code = self.lines[line - 1].strip() if 0 < line <= len(self.lines) else ast.unparse(node)
        self.found.append(Finding(line, code[:120], reason))

    # --- imports -------------------------------------------------------------------------
    def module_ok(self, name: str) -> bool:
        if name in self.modules:
            return True
        parent, _, child = name.rpartition(".")           # numpy.fft: numpy allows any name
        return bool(parent) and parent in self.modules and self.modules[parent] is ANY \
            and self.name_ok(parent, child) is None

    def name_ok(self, module: str, name: str) -> str | None:
        """None when `module`.`name` may be used, else the reason."""
        dotted = f"{module}.{name}"
        if dotted in self.refused or name in self.refused:
            return self.refused.get(dotted) or self.refused[name]
        if name.startswith("_"):
            return "a private name (it starts with an underscore)"
        if name in REFUSED_ATTRIBUTES:
            return REFUSED_ATTRIBUTES[name]
        if name in MPI_COLLECTIVES:
            return "an MPI collective: communicate only as the handout says"
        if dotted in self.modules:                            # a listed submodule
            return None
        if module not in self.modules:                        # a package named only for its submodules
            subs = sorted(m for m in self.modules if m.startswith(module + "."))
            return f"{dotted} is not part of this lab's API (of {module} it gives {', '.join(subs) or 'nothing'})"
        names = self.modules[module]
        if names is ANY or name in names:
            return None
        given = ", ".join(sorted(names)) or "none of its names"
        return f"{dotted} is not part of this lab's API ({module} offers it: {given})"

    def visit_Import(self, node):
        for a in node.names:
            if not self.module_ok(a.name):
                self.refuse(node, f"import of {a.name}: {self.why_module(a.name)}")
                continue
            if a.asname:
                self.aliases[a.asname] = a.name
            else:
                self.aliases[a.name.split(".")[0]] = a.name.split(".")[0]

    def why_module(self, name: str) -> str:
        top = name.split(".")[0]
        if top == "labs":
            return "the labs' own code (the answers and the grader) is not for a solution"
        if top == "minipar":
            return "not a module this lab's handout gives"
        allowed = sorted(m for m in self.modules if "." not in m and m != "__future__")
        return f"not among the modules a solution may use ({', '.join(allowed)} and the lab's minipar API)"

    def visit_ImportFrom(self, node):
        if node.level:
            self.refuse(node, "a relative import: name the module in full")
            return
        mod = node.module or ""
        for a in node.names:
            if a.name == "*":
                self.refuse(node, "a star import: name what you import")
                continue
            sub = f"{mod}.{a.name}"
            if sub in self.modules:                         # from minipar import comm
                self.aliases[a.asname or a.name] = sub
            elif not self.module_ok(mod):
                self.refuse(node, f"import from {mod}: {self.why_module(mod)}")
                break
            else:
                why = self.name_ok(mod, a.name)
                if why:
                    self.refuse(node, f"from {mod} import {a.name}: {why}")

    # --- names and attributes --------------------------------------------------------------
    def visit_Name(self, node):
        if node.id in REFUSED_CALLS and node.id not in self.aliases:
            self.refuse(node, f"{node.id}: {REFUSED_CALLS[node.id]}")
        elif node.id.startswith("__") and node.id != "__name__":
            self.refuse(node, f"{node.id}: a name of the interpreter's insides")

    def module_of(self, node) -> str | None:
        """The module an expression names (np -> numpy, np.linalg -> numpy.linalg), or None."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.module_of(node.value)
            if base is not None and f"{base}.{node.attr}" in self.modules:
                return f"{base}.{node.attr}"
            if base is not None and self.modules.get(base, ()) is ANY and self.name_ok(base, node.attr) is None \
                    and node.attr in {"linalg", "random", "fft"}:
                return f"{base}.{node.attr}"
        return None

    def visit_Attribute(self, node):
        module = self.module_of(node.value)
        attr = node.attr
        if module is not None:
            why = self.name_ok(module, attr)
            if why:
                self.refuse(node, f"{module}.{attr}: {why}")
        elif attr.startswith("_") and attr not in PLAIN_DUNDERS:
            self.refuse(node, f".{attr}: a private or interpreter attribute (it starts with an underscore)")
        elif attr in REFUSED_ATTRIBUTES:
            self.refuse(node, f".{attr}: {REFUSED_ATTRIBUTES[attr]}")
        elif attr in MPI_COLLECTIVES:
            self.refuse(node, f".{attr}: an MPI collective: communicate only as the handout says")
        if isinstance(node.ctx, (ast.Store, ast.Del)) and module is not None:
            self.refuse(node, f"changes {module}.{attr}: a solution does not patch the modules it uses")
        self.generic_visit(node)

    def visit_Call(self, node):
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("getattr", "hasattr") and f.id not in self.aliases:
            name = node.args[1] if len(node.args) > 1 else None
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                self.refuse(node, f"{f.id} with a name that is not a plain string literal")
            elif name.value.startswith("_") or name.value in REFUSED_ATTRIBUTES:
                self.refuse(node, f"{f.id}(..., {name.value!r}): a refused attribute")
            else:
                module = self.module_of(node.args[0]) if node.args else None
                why = self.name_ok(module, name.value) if module else None
                if why:
                    self.refuse(node, f"{f.id}({ast.unparse(node.args[0])}, {name.value!r}): {why}")
        if isinstance(f, ast.Attribute) and f.attr in ("format", "format_map"):
            receiver = f.value
            if not (isinstance(receiver, ast.Constant) and isinstance(receiver.value, str)):
                self.refuse(node, f".{f.attr} on a string that is not a literal: use an f-string")
            elif any(n and ("." in n or "[" in n) for _, n, _, _ in _fields(receiver.value)):
                self.refuse(node, f".{f.attr} with a field that reaches into attributes")
        self.generic_visit(node)

    def visit_Assign(self, node):
        self.generic_visit(node)


def _fields(text: str):
    try:
        return list(string.Formatter().parse(text))
    except ValueError:
        return [(None, "[", None, None)]                # malformed: refuse


def scan(source: str, filename: str, allowed: Allowed) -> list[Finding]:
    """Every finding in `source`, in line order; SyntaxError as Python raises it (the caller
    reports its line)."""
    tree = ast.parse(source, filename)
    s = Scanner(allowed, source.splitlines())
    s.visit(tree)
    seen, out = set(), []
    for f in sorted(s.found, key=lambda f: f.line):
        if (f.line, f.reason) not in seen:
            seen.add((f.line, f.reason))
            out.append(f)
    return out
