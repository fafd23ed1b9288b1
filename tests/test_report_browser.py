"""The HTML report in a real browser (headless Chromium): the page renders, every picture loads,
and the verdict is the first thing on the page.

Needs Debian's ``chromium`` (``apt-get install chromium``). CI installs it and sets
``FL_ATTACK_REQUIRE_BROWSER=1``, under which a missing browser fails instead of skipping.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from fl_attack.testbed.data import load_images
from fl_attack_flwr.output.store import AuditStore
from fl_attack_flwr.results.records import ClientAudit

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
if BROWSER is None:
    if os.environ.get("FL_ATTACK_REQUIRE_BROWSER") == "1":
        raise RuntimeError("FL_ATTACK_REQUIRE_BROWSER=1 but no chromium on PATH")
    pytest.skip("headless Chromium is not installed (apt-get install chromium)",
                allow_module_level=True)

_PROBE = """<script>
window.addEventListener('load', () => {
  const imgs = Array.from(document.images);
  document.body.setAttribute('data-images',
    imgs.map(i => (i.complete && i.naturalWidth > 0) ? '1' : '0').join(''));
  document.body.setAttribute('data-first', document.querySelector('h1 ~ div').id);
});
</script>"""


def _chromium(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu",
                           "--virtual-time-budget=5000", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    photos, _ = load_images("photos32", 8, seed=1)
    store = AuditStore(tmp_path_factory.mktemp("runs"), "browser",
                       config={"protocol": "dpsgd", "dataset": "photos32", "delta": 1e-5})
    for pid in range(2):
        x = photos[4 * pid: 4 * pid + 4].double().numpy()
        store.add(ClientAudit(1, 10 + pid, partition_id=pid, status="not-certified",
                              reason="noise detected on the update", batch_size=4,
                              sparsity_match=0.99, n_directions=4, attack_seconds=1.0,
                              inputs=x.reshape(4, -1), recon_images=x, original_images=x,
                              psnr=[40.0] * 4, psnr_mean=40.0, epsilon=3.0,
                              epsilon_cumulative=3.0, delta=1e-5))
    store.add(ClientAudit(1, 12, partition_id=2, status="protected",
                          reason="noise hides the batch: the update has numerical rank 0"))
    store.add_round(1, {"audit-replies": 3, "audit-reconstructions": 2})
    store.finalize({"status": "completed"})
    return store.run_dir / "report.html"


def test_the_report_renders_and_every_picture_loads(report: Path, tmp_path: Path) -> None:
    page = report.read_text()
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", _PROBE + "</body>"))
    dom = _chromium("--dump-dom", probe.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    loaded = re.search(r'data-images="([01]*)"', dom.stdout)
    assert loaded is not None, dom.stdout[:2000]
    n_img = page.count("<img ")
    assert n_img == 5  # plot + 2 x (reconstruction, original)
    assert loaded.group(1) == "1" * n_img  # every inline picture decodes
    assert 'data-first="verdict"' in dom.stdout  # the verdict comes right after the title
    assert "1.0e-05" in dom.stdout  # δ in scientific notation


def test_the_report_screenshot_shows_pictures(report: Path, tmp_path: Path) -> None:
    from matplotlib import image as mpimg

    shot = tmp_path / "report.png"
    out = _chromium(f"--screenshot={shot}", "--window-size=1200,2400", report.as_uri())
    assert out.returncode == 0 and shot.is_file(), out.stderr[-2000:]
    pixels = mpimg.imread(shot)
    assert pixels.shape[:2] == (2400, 1200)
    colours = np.unique((pixels[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 500  # photos and the plot, not a blank or error page
