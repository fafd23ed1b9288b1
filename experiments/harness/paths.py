"""Where the repository and its results files are."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository root (the parent of ``experiments/``)."""
RESULTS_DIR = ROOT / "experiments" / "results"
"""Where the results files live."""
