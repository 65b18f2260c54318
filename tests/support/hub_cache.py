"""A Hugging Face cache built by hand, in huggingface_hub's layout, and code run against it offline.

    cache/models--owner--name/refs/<revision>          the commit a branch or tag names
    cache/models--owner--name/snapshots/<commit>/...   the files (huggingface_hub links them to blobs/; plain files
                                                       read the same)

`run_offline` runs a script in a child Python with HF_HUB_CACHE pointing there and HF_HUB_OFFLINE=1, so that
huggingface_hub and transformers read that environment as they start and no test ever reaches a network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path


def hub_repo(cache: Path, repo_id: str, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """The snapshot folder of `repo_id` at `commit` (made, empty), with each of `refs` naming that commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def run_offline(cache: Path, script: str) -> dict:
    """Run `script` offline against `cache`; it prints one JSON value as its last line, returned here."""
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(cache.parent / "hf_home")}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=tempfile.gettempdir())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
