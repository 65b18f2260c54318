"""Sparse autoencoders as objects of their own, with SAELens 6's meaning and names.

`SAE`, `SAEConfig` (sae.py): the parameters, hook points, encode / decode / forward and the error term;
`load_sae` (formats.py): a SAELens, Gemma Scope or EleutherAI sparsify folder, local, in the zoo or in the
Hugging Face cache; `as_sae`: a SAELens SAE object as ours. How each format's files are read: files.py.
Splicing into a model: splice.py."""

from .formats import as_sae, load_sae, zoo_saes
from .sae import SAE, SAEConfig

__all__ = ["SAE", "SAEConfig", "as_sae", "load_sae", "zoo_saes"]
