"""The notebooks in notebooks/ run, and are committed without outputs.

Each notebook is executed top to bottom with nbclient in a fresh kernel running this interpreter
(`sys.executable`, through a kernel spec written to a temporary folder, so a `python3` kernel
registered elsewhere can never be picked up), in an empty working folder. A notebook passes when no
cell raises and at least one cell shows a figure (an image/png output: the figure its title
promises). Executing them takes about a minute each on 2 CPU cores, hence `slow` (CI runs them).

Set INTERP_NOTEBOOK_OUTPUTS=DIR to keep the executed copies (with their figures) in DIR.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300
# Under `pytest -n 2` two notebooks may run at once on 2 cores: one torch thread each, as conftest.py
# gives the test workers; alone, two.
THREADS = "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2"
KERNEL_ENV = {
    # CI exports MPLBACKEND=Agg, under which pyplot figures never reach the notebook: use the inline backend.
    "MPLBACKEND": "module://matplotlib_inline.backend_inline",
    "OMP_WAIT_POLICY": "PASSIVE",  # idle OpenMP threads sleep instead of spinning on a shared machine
    "OMP_NUM_THREADS": THREADS,  # torch's intra-op threads
    "MKL_NUM_THREADS": THREADS,
    "TQDM_DISABLE": "1",
    "PYDEVD_DISABLE_FILE_VALIDATION": "1",  # silence the debugger's frozen-modules warning on stderr
}


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS][:5] == [
        "01_quickstart.ipynb", "02_induction_heads.ipynb", "03_attention_sinks.ipynb",
        "04_head_ablation.ipynb", "05_long_context.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_is_stripped(path: Path):
    """No outputs, no execution counts, no widget state: the diff of a notebook is its source."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3", "the notebooks run on the python3 kernel"
    assert "widgets" not in nb.metadata
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{path.name} has no code"
    for i, cell in enumerate(nb.cells):
        where = f"{path.name} cell {i}"
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{where} has outputs: strip them (jupyter nbconvert --clear-output)"
            assert cell.execution_count is None, f"{where} has an execution count: strip it"
        assert not cell.get("attachments"), f"{where} has attachments"
        assert set(cell.metadata) <= {"tags", "jupyter", "collapsed"}, f"{where} carries metadata {dict(cell.metadata)}"
    assert len(path.read_bytes()) < 100_000, f"{path.name} is large for a stripped notebook"


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory) -> Path:
    """A kernel spec named python3 that starts this interpreter, with the environment above."""
    root = tmp_path_factory.mktemp("kernels")
    spec = root / "python3"
    spec.mkdir()
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python 3 ({sys.executable})",
        "language": "python",
        "env": KERNEL_ENV,
    }))
    return root


def execute(path: Path, kernel_dir: Path, workdir: Path):
    """Run the notebook in a fresh kernel; return the executed notebook and the kernel's sys.executable."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    nb = nbformat.read(path, as_version=4)
    probe = nbformat.v4.new_code_cell("import sys; print(sys.executable, end='')")
    nb.cells.append(probe)
    km = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_dir)]))
    client = nbclient.NotebookClient(nb, km=km, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                                     resources={"metadata": {"path": str(workdir)}})
    try:
        client.execute()
    finally:  # nbclient shuts down only a kernel manager it made itself: this one's kernel (GBs) would outlive the test
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    assert not km.is_alive(), "the notebook's kernel outlived its test"
    nb.cells.pop()
    executable = "".join(o.get("text", "") for o in probe.outputs if o.output_type == "stream")
    return nb, executable


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path: Path, kernel_dir: Path, tmp_path: Path):
    start = time.perf_counter()
    nb, executable = execute(path, kernel_dir, tmp_path)  # a cell that raises fails here (CellExecutionError)
    seconds = time.perf_counter() - start
    keep = os.environ.get("INTERP_NOTEBOOK_OUTPUTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, Path(keep) / path.name)
    print(f"{path.name}: executed in {seconds:.1f} s")
    assert executable == sys.executable, f"the kernel ran {executable!r}, not this interpreter {sys.executable!r}"
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: {errors[0].get('ename')}: {errors[0].get('evalue')}"
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, f"{path.name} showed no figure"


def strip(path: Path) -> bool:
    """Remove outputs, execution counts and editor metadata in place; True if the file changed."""
    nb = nbformat.read(path, as_version=4)
    before = nbformat.writes(nb)
    nb.metadata.pop("widgets", None)
    nb.metadata["language_info"] = {"name": "python"}  # execution fills in the local Python's version
    for cell in nb.cells:
        cell.metadata = {k: v for k, v in cell.metadata.items() if k in ("tags", "jupyter", "collapsed")}
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    after = nbformat.writes(nb)
    if after != before:
        nbformat.write(nb, path)
    return after != before


if __name__ == "__main__":  # python tests/contract/test_notebooks.py [NOTEBOOK ...]: strip before committing
    for p in [Path(a) for a in sys.argv[1:]] or NOTEBOOKS:
        print(f"{'stripped' if strip(p) else 'clean   '} {p}")
