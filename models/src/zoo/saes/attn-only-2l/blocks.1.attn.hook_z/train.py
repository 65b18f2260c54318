"""Made by the zoo's SAE trainer (SAELens's runner; see it and docs/saes.md), from the repository root in SAELens's venv:
    /work/saevenv/bin/python models/src/zoo/saes/train.py attn-only-2l blocks.1.attn.hook_z"""
import runpy, sys; from pathlib import Path  # noqa: E401,E702
sys.argv = ["train.py", "attn-only-2l", "blocks.1.attn.hook_z", "--out", str(Path(__file__).resolve().parent)]
runpy.run_path(str(Path(__file__).resolve().parents[2] / "train.py"), run_name="__main__")
