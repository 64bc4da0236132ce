"""The house's layout holds: the packages import one way only (docs/design.md's module list,
bottom to top), the model knows nothing of how it is split, and a layout reaches the model
only through the Parts it is built with (minipar/model/contract.py)."""
import dataclasses
import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import house_metrics  # noqa: E402

from minipar.model.contract import Parts  # noqa: E402
from minipar.model.gpt import GPT, GPTConfig  # noqa: E402
from minipar.parallel.parallelize import parallelize, parts  # noqa: E402

# bottom to top, as docs/design.md lists them: a package imports only itself and those before it
LAYERS = ["trace", "autograd", "comm", "optim", "model", "parallel", "config", "plan", "show", "train",
          "convert", "explain", "plot"]


def upward_imports(root: str) -> list[tuple[str, str]]:
    """(importer, imported) package pairs that point up the layers (or to a package not in them)."""
    trees = {p: house_metrics.parse(p) for p in house_metrics.library_files(root)}
    edges = house_metrics.import_graph(root, trees)
    bad = []
    for u, targets in edges.items():
        if u in ("", "minipar"):                     # the root __init__: the kept import paths
            continue
        for v in targets:
            if u not in LAYERS or v not in LAYERS or LAYERS.index(v) > LAYERS.index(u):
                bad.append((u, v))
    return sorted(bad)


def test_the_packages_import_one_way():
    assert sorted(d for d in os.listdir(os.path.join(REPO, "minipar"))
                  if os.path.isdir(os.path.join(REPO, "minipar", d)) and d != "__pycache__") == sorted(LAYERS)
    assert upward_imports(REPO) == []


def test_an_upward_import_is_caught(tmp_path):
    """A planted mistake: the model importing the parallel package (a lazy import counts too)."""
    for pkg, body in (("model", "def f():\n    from minipar.parallel import grid\n"), ("parallel", "X = 1\n")):
        os.makedirs(tmp_path / "minipar" / pkg)
        (tmp_path / "minipar" / pkg / "__init__.py").write_text("")
        (tmp_path / "minipar" / pkg / "grid.py").write_text(body)
    (tmp_path / "minipar" / "__init__.py").write_text("")
    assert upward_imports(str(tmp_path)) == [("model", "parallel")]


def test_a_cycle_is_caught(tmp_path):
    for pkg, other in (("model", "parallel"), ("parallel", "model")):
        os.makedirs(tmp_path / "minipar" / pkg)
        (tmp_path / "minipar" / pkg / "__init__.py").write_text("")
        (tmp_path / "minipar" / pkg / "a.py").write_text(f"from minipar.{other} import a\n")
    trees = {p: house_metrics.parse(p) for p in house_metrics.library_files(str(tmp_path))}
    assert house_metrics.cycles(house_metrics.import_graph(str(tmp_path), trees)) == [["model", "parallel"]]


CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)


def test_parts_are_fixed_when_the_model_is_built():
    model = GPT(CFG, parts=parts("full"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.parts.attention = None
    assert GPT(CFG).parts == Parts()


def test_one_process_through_parallelize_is_the_plain_gpt():
    idx = np.random.default_rng(0).integers(0, 64, (2, 8))
    plain, built = GPT(CFG, seed=3), parallelize(CFG, None, 3, np.float64)
    assert type(built) is GPT
    assert plain(idx, idx).item() == built(idx, idx).item()


def test_a_model_holds_only_what_its_parts_say():
    held = GPT(CFG, parts=Parts(holds=lambda n: not n.startswith("h.1.")))
    assert not any(n.startswith("h.1.") for n in held.params)
    assert set(GPT(CFG).params) - set(held.params) == {n for n in GPT(CFG).params if n.startswith("h.1.")}
