"""docs/tutorial.ipynb runs from top to bottom (nbclient, the test extra) and is kept without outputs in the repository.

It optimizes the tiny random-weight model on the real transformers runtime, so it is the one place
the Python API, the notebook view (``_repr_html_``) and ``Engine.from_recipe`` are exercised
together as a new user meets them (about 25 s on the project's 2-core CPU).
"""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the test extra: pip install -e '.[test]' (nbclient, nbformat, ipykernel)")
nbclient = pytest.importorskip("nbclient", reason="the test extra: pip install -e '.[test]' (nbclient, nbformat, ipykernel)")
pytest.importorskip("ipykernel", reason="the test extra: pip install -e '.[test]' (nbclient, nbformat, ipykernel)")

NOTEBOOK = Path(__file__).resolve().parents[1] / "docs" / "tutorial.ipynb"


def test_tutorial_is_stored_without_outputs():
    """The repository keeps the notebook stripped: no outputs, no execution counts (a clean diff)."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "the tutorial has no code"
    assert all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.integration  # runs the notebook in a kernel on the tiny model: ~21 s
def test_tutorial_runs(tmp_path):
    """Every cell runs without error; the report renders in the notebook and the tuned engine generates."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # kernel "python3" runs this interpreter (jupyter_client puts sys.executable for a kernel spec's "python")
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    html = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    assert '<div class="fo-report">' in html and "<h2>The tower</h2>" in html, "the result did not render as the report"
    text = "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in outputs)
    assert "report.html" in text and "max_new_tokens" in text
    assert not [o for o in outputs if o.get("output_type") == "error"]
