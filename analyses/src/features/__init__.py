"""What a head moves (`interp features`): an attention-output SAE's features split by head, after Kissane et al.
2024 ("Interpreting Attention Layer Outputs with Sparse Autoencoders", arXiv 2406.17759). Each analyzer returns a
tidy DataFrame:

- `decoder_norms(sae, cfg)`: each feature's decoder norm on each head's d_head slice, its share, the top head;
- `direct_feature_attribution(model, sae, tokens)`: each head's exact term of each feature's pre-activation,
  summed over the positions where the feature is active, with the constant they add up to it with;
- `head_top_features(frame, by=...)`: each head's top features, by attribution or by decoder-norm share;
- `max_activating(model, sae, token_batches, k=...)`: each feature's k max-activating contexts, streamed;
- `logit_effect(model, sae, top=...)`: each feature's most raised and lowered tokens through W_O and W_U.

The rooms: `site` (the SAE's hook and the model's activations there), `encoder` (the linear part of the encoder),
`passes` (one streamed pass for every measure), `heads`, `contexts`, `logits`, and the study (`study`, `report`,
`view`). Names are imported on first use.
"""

from __future__ import annotations

from .._faces import lazy_face

_LAZY = {
    "decoder_norms": ".heads",
    "direct_feature_attribution": ".heads",
    "feature_head_terms": ".heads",
    "head_top_features": ".heads",
    "max_activating": ".contexts",
    "logit_effect": ".logits",
    "feature_directions": ".logits",
    "FeaturesSettings": ".study",
    "FeaturesStudy": ".study",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_face(__name__, _LAZY)
