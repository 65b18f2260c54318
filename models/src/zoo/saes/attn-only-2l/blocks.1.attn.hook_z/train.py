"""Trains the zoo's SAE on attn-only-2l's layer-1 attention output (blocks.1.attn.hook_z, the 4 heads of
d_head 32 flattened, d_in 128) with SAELens's own runner, and evaluates it with SAELens's own evaluator.

SAELens is the trainer; interp writes none. Run it in a side environment (sae-lens pins transformer-lens<4):

    python3.11 -m venv /work/saevenv
    /work/saevenv/bin/pip install -c constraints.txt torch==2.13.0     # the CPU wheel first
    /work/saevenv/bin/pip install sae-lens==6.54.12
    /work/saevenv/bin/pip install --no-deps -e .                       # interp, for the model and the text
    /work/saevenv/bin/python models/src/zoo/saes/attn-only-2l/blocks.1.attn.hook_z/train.py

The model is interp's own (`override_model=interp.load("attn-only-2l")`); the text is the one interp ships,
the Python Language Reference (`interp.analyses.evaldata`, pinned by sha256), as bytes: rows of <bos> + 127
bytes, the zoo model's context. The first 90% of the rows train it (~420K tokens, one pass), the last 10% are
held out for the evaluation. Writes cfg.json + sae_weights.safetensors (SAELens's inference files) and
eval.json (SAELens's metrics on the held-out rows) beside this file. Deterministic on a CPU (seed 42).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from sae_lens import LanguageModelSAERunnerConfig, LanguageModelSAETrainingRunner, SAE
from sae_lens.config import LoggingConfig
from sae_lens.evals import EvalConfig, run_evals
from sae_lens.saes.topk_sae import TopKTrainingSAEConfig
from sae_lens.training.activation_scaler import ActivationScaler
from sae_lens.training.activations_store import ActivationsStore

import interp
from interp.analyses import evaldata

HERE = Path(__file__).resolve().parent
HOOK, CONTEXT, D_SAE, K = "blocks.1.attn.hook_z", 128, 512, 16


def rows(model) -> torch.Tensor:
    """The language reference as [n, CONTEXT] byte tokens, each row <bos> + CONTEXT - 1 bytes."""
    data = torch.tensor(list(evaldata.language_reference().encode("utf-8")), dtype=torch.long)
    n = len(data) // (CONTEXT - 1)
    body = data[: n * (CONTEXT - 1)].reshape(n, CONTEXT - 1)
    bos = torch.full((n, 1), model.tokenizer.bos_token_id, dtype=torch.long)
    return torch.cat([bos, body], dim=1)


def main() -> dict:
    torch.manual_seed(42)
    model = interp.load("attn-only-2l")
    tokens = rows(model)
    n_train = int(len(tokens) * 0.9)
    train = Dataset.from_dict({"tokens": tokens[:n_train].tolist()})
    heldout = Dataset.from_dict({"tokens": tokens[n_train:].tolist()})
    cfg = LanguageModelSAERunnerConfig(
        sae=TopKTrainingSAEConfig(d_in=model.cfg.n_heads * model.cfg.d_head, d_sae=D_SAE, k=K,
                                  reshape_activations="hook_z", dtype="float32", device="cpu"),
        model_name="attn-only-2l", hook_name=HOOK, dataset_path="interp evaldata python-language-reference",
        is_dataset_tokenized=True, streaming=False, context_size=CONTEXT, prepend_bos=True,
        training_tokens=n_train * CONTEXT, train_batch_size_tokens=1024, store_batch_size_prompts=16,
        n_batches_in_buffer=8, lr=1e-3, lr_warm_up_steps=20, device="cpu", seed=42, n_eval_batches=0,
        logger=LoggingConfig(log_to_wandb=False), checkpoint_path=None, output_path=None, verbose=False,
    )
    sae = LanguageModelSAETrainingRunner(cfg, override_dataset=train, override_model=model).run()

    with tempfile.TemporaryDirectory() as tmp:  # SAELens's inference files (and nothing of its training state)
        sae.save_inference_model(tmp)
        for name in ("cfg.json", "sae_weights.safetensors"):
            shutil.copyfile(Path(tmp) / name, HERE / name)
    inference = SAE.load_from_disk(HERE)

    store = ActivationsStore.from_sae(model, inference, dataset=heldout, context_size=CONTEXT, streaming=False,
                                      store_batch_size_prompts=16, n_batches_in_buffer=4, train_batch_size_tokens=1024,
                                      total_tokens=len(heldout) * CONTEXT)
    n_batches = len(heldout) // 16
    metrics, _ = run_evals(inference, store, model, ActivationScaler(),
                           EvalConfig(batch_size_prompts=16, n_eval_reconstruction_batches=n_batches, compute_ce_loss=True,
                                      n_eval_sparsity_variance_batches=n_batches, compute_variance_metrics=True,
                                      compute_sparsity_metrics=True),
                           exclude_special_tokens=[model.tokenizer.bos_token_id])
    result = {"heldout_tokens": len(heldout) * CONTEXT, "train_tokens": n_train * CONTEXT, "d_sae": D_SAE, "k": K,
              "sae_lens": __import__("sae_lens").__version__, "metrics": metrics}
    (HERE / "eval.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return result


if __name__ == "__main__":
    out = main()
    print(json.dumps(out["metrics"], indent=1))
