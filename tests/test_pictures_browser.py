"""The SVGs as a browser sees them: headless Chromium parses each (no XML error page, the
labels present in its DOM) and renders it to a PNG that is not blank. The pictures are
docs/img/*.svg (scripts/make_pictures.py made them from real runs) and a pipeline timeline
drawn now. Chromium is not part of `make install`; without /usr/bin/chromium (or chromium on
PATH) these tests skip, saying so.

Every SVG is parsed as XML here (Python's parser: well-formed, an <svg> root in the SVG
namespace); Chromium renders one of each kind of drawing (SAMPLE: plots, timelines, the
schedules, the explain drawings), two seconds apiece. MINIPAR_ALL_PICTURES=1 renders every
one (before changing minipar/show/draw.py or the pictures).
"""
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from minipar.show import draw

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMG = os.path.join(REPO, "docs", "img")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# headless, and nothing that reaches for the network (this machine has none to reach)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed "
                                    "(apt install chromium): the SVGs are not checked in a browser")


def chromium(tmp_path, *args):
    p = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def ink(path):
    """(height, width) of a PNG and the fraction of its pixels that are not the background."""
    image = pytest.importorskip("matplotlib.image").imread(str(path))[..., :3]
    background = image[0, 0]
    return image.shape[:2], float(np.mean(np.any(np.abs(image - background) > 0.05, axis=-1)))


def svgs():
    fresh = draw.timeline_svg([(0, "F", 0, 0.0, 1.0), (1, "F", 0, 1.0, 2.0), (1, "B", 0, 2.0, 4.0),
                               (0, "B", 0, 4.0, 6.0)], 2, "planted title: bubble 0.333")
    found = sorted(f for f in os.listdir(IMG) if f.endswith(".svg")) if os.path.isdir(IMG) else []
    return [("timeline_svg", fresh)] + [(f, open(os.path.join(IMG, f)).read()) for f in found]


SAMPLE = {"timeline_svg", "loss.svg", "timeline.svg", "schedule-interleaved.svg", "sequence-parallel.svg",
          "explain-ring-all-reduce-p4.svg", "explain-moe-dispatch-p4.svg"}
ALL = os.environ.get("MINIPAR_ALL_PICTURES", "") not in ("", "0")


@pytest.mark.parametrize("name,svg", svgs(), ids=lambda v: v if len(v) < 60 else "")
def test_every_svg_is_well_formed(name, svg):
    import xml.etree.ElementTree as ET                              # noqa: PLC0415
    root = ET.fromstring(svg)
    assert root.tag == "{http://www.w3.org/2000/svg}svg", f"{name}: root {root.tag}"


def test_docs_img_has_the_pictures():
    """Every picture docs/pictures.md shows is in docs/img (scripts/make_pictures.py makes them)."""
    names = {name for name, _ in svgs()}
    with open(os.path.join(REPO, "docs", "pictures.md")) as f:
        shown = set(re.findall(r"\]\(img/([\w.-]+\.svg)\)", f.read()))
    assert len(shown) >= 10 and not shown - names, f"missing from docs/img: {sorted(shown - names)}"
    assert SAMPLE <= names, f"the rendered sample names pictures that are gone: {sorted(SAMPLE - names)}"


@needs_chromium
@pytest.mark.parametrize("name,svg", [(n, s) for n, s in svgs() if ALL or n in SAMPLE],
                         ids=lambda v: v if len(v) < 60 else "")
def test_chromium_parses_and_renders(name, svg, tmp_path):
    path = tmp_path / "picture.svg"
    path.write_text(svg)
    dom = chromium(tmp_path, "--dump-dom", path.as_uri())
    assert "<parsererror" not in dom and re.match(r"(<!DOCTYPE[^>]*>\s*)?<svg", dom.lstrip()), \
        f"{name}: {dom[:500]}"
    if name == "timeline_svg":
        assert "planted title: bubble 0.333" in dom and "stage 1" in dom
    png = tmp_path / "picture.png"
    chromium(tmp_path, f"--screenshot={png}", "--window-size=800,400", path.as_uri())
    shape, drawn = ink(png)
    assert shape == (400, 800)
    assert drawn > 0.002, f"{name}: the rendering is blank ({drawn:.2%} of the pixels drawn)"
