"""The notebooks run top to bottom without errors, and are committed without outputs."""

import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
# Smaller than the defaults, so the three run in well under a minute on two cores.
# WSI_NB_WIDGETS is left unset: a headless run must leave the widgets out by itself (they are
# tested by calling their redraw functions in test_review.py), as nbconvert --execute would run it.
SMALL = {
    "WSI_NB_SLIDE_SIZE": "1536",
    "WSI_NB_N_IMAGES": "4",
    "WSI_NB_IMAGE_SIZE": "768",
    "MPLBACKEND": "",
    "WSI_NB_WIDGETS": "",
    "JPY_SESSION_NAME": "",
    "VSCODE_PID": "",
}


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_review_results.ipynb", "03_qc_station.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_is_clean(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has outputs"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"
        assert "attachments" not in cell or not cell.attachments, f"{path.name} cell {i} has attachments"


def images_shown(nb) -> int:
    return sum("image/png" in out.get("data", {}) for c in nb.cells if c.cell_type == "code" for out in c.outputs)


def text_of(nb) -> str:
    parts = []
    for c in nb.cells:
        for out in c.get("outputs", []):
            parts.append(out.get("text", ""))
            parts.append(out.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, monkeypatch):
    work = tmp_path / "work"
    for k, v in SMALL.items():
        if v:
            monkeypatch.setenv(k, v)
        else:
            monkeypatch.delenv(k, raising=False)  # the kernel picks its inline backend
    monkeypatch.setenv("WSI_NB_WORKDIR", str(work))
    monkeypatch.delenv("WSI_NB_RUN_DIR", raising=False)  # notebook 02 makes its own run in WORK
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError on the first failing cell
    print(f"{path.name}: {time.perf_counter() - t0:.1f} s")
    for i, c in enumerate(nb.cells):
        ex = c.metadata.get("execution", {})
        if ex:
            print(i, ex.get("iopub.execute_input"), ex.get("shell.execute_reply"))
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    text = text_of(nb)
    assert "Traceback" not in text
    if path.stem.startswith("01"):
        assert (work / "quickstart_run" / "summary.json").is_file()
        assert images_shown(nb) >= 2  # the overlay and the region
        assert "of nuclei found" in text
    elif path.stem.startswith("02"):
        assert (work / "review_run" / "summary.json").is_file()
        assert (work / "detections_filtered.geojson").is_file()
        assert images_shown(nb) >= 4  # overview, region, gallery, counts
        widget_views = [
            o
            for c in nb.cells
            for o in c.get("outputs", [])
            if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
        ]
        assert widget_views == []  # headless: no widgets
    else:
        assert len(list((work / "qc_images").glob("*.png"))) == int(SMALL["WSI_NB_N_IMAGES"])
        assert "PASS" in text or "FAIL" in text
        assert images_shown(nb) >= 1  # the latency plot
