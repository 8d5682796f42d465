"""Execute a notebook as Jupyter does (nbclient, a real ipykernel kernel), and read what its cells printed."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "recipes" / "notebooks"


def execute(name: str, cwd: Path, env: dict[str, str]) -> list[str]:
    """Runs recipes/notebooks/<name> top to bottom in a fresh kernel (with env added to its
    environment, in cwd); returns each code cell's printed text. A failing cell raises
    nbclient's CellExecutionError, with the cell's output."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}})
    saved = dict(os.environ)
    os.environ.update(env)  # the kernel starts with this process's environment ...
    # ... minus pytest's marker, under which ipykernel does not pass output written to the process's
    # file descriptors (the local ranks') into the cell, as it does for a user
    os.environ.pop("PYTEST_CURRENT_TEST", None)
    try:
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return [
        "".join(out.get("text", "") for out in cell.get("outputs", []) if out.get("output_type") == "stream")
        for cell in nb.cells
        if cell.cell_type == "code"
    ]
