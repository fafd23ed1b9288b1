"""Let a second virtualenv use this one's PyTorch instead of installing its own copy.

    python scripts/share_torch.py OTHER_VENV      (run with this venv's interpreter)

PyTorch's Linux wheels with their CUDA libraries take about 5.5 GB in a venv. The newest-Flower
check (``make test-flower-next``) builds a second venv, and two copies of that stack have run
CI's disk out. This links the heavy distributions of the running interpreter's environment
(torch, torchvision, triton and the ``nvidia-*`` / ``cuda-*`` packages torch requires), files
and ``.dist-info`` metadata alike, into ``OTHER_VENV/shared-torch`` and puts that folder on the
other venv's path with a ``.pth`` file. pip there then finds ``torch==…`` already installed and
installs only the light dependencies (numpy, sympy, …) itself; everything else in the other venv
(Flower, the plugin's wheel) is installed there as usual. The links are read-only use: nothing
is written into this venv.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import sys
import sysconfig
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HEAVY = re.compile(r"^(torch|torchvision|triton|nvidia-.*|cuda-.*)$")


def heavy_closure(roots: tuple[str, ...] = ("torch", "torchvision")) -> list[metadata.Distribution]:
    """The installed distributions among ``roots`` and their requirements that match HEAVY."""
    seen: dict[str, metadata.Distribution] = {}
    done: set[tuple[str, str]] = set()
    todo = [(canonicalize_name(r), "") for r in roots]
    while todo:
        name, extra = todo.pop()
        if (name, extra) in done or not HEAVY.match(name):
            continue
        done.add((name, extra))
        seen.setdefault(name, metadata.distribution(name))
        for line in seen[name].requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                dep = canonicalize_name(req.name)
                todo += [(dep, "")] + [(dep, e) for e in req.extras]
    return list(seen.values())


def top_level_entries(dist: metadata.Distribution) -> set[str]:
    """First path components of the distribution's files inside site-packages."""
    return {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}


def main(other_venv: str) -> None:
    """Link the heavy stack into ``other_venv`` and register it there with a .pth file."""
    site = Path(sysconfig.get_paths()["purelib"])
    other = Path(other_venv).resolve()
    other_sites = sorted(other.glob("lib/python*/site-packages"))
    if len(other_sites) != 1:
        raise SystemExit(f"share_torch: {other} is not a virtualenv (no single site-packages)")
    shared = other / "shared-torch"
    shared.mkdir(exist_ok=True)
    entries = set().union(*(top_level_entries(d) for d in heavy_closure()))
    for entry in sorted(entries):
        source = site / entry
        if not source.exists():
            raise SystemExit(f"share_torch: {source} is listed but missing")
        link = shared / entry
        if not link.is_symlink():
            link.symlink_to(source)
    (other_sites[0] / "zz_shared_torch.pth").write_text(f"{shared}\n")
    print(f"share_torch: {len(entries)} entries of {site} linked into {shared}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
