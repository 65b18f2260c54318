"""The circuit study's choices, in a module that imports nothing (not torch): what `interp circuit --help` and its
argument parser show (`interp.commands.circuit`), and what the study's modules check settings against."""

METHODS = ("patching", "eap", "eap-ig")
IG_ON = ("inputs", "activations")  # EAP-IG interpolates the embeddings, or every receiver's input
IG_POINTS = ("midpoint", "left")  # where EAP-IG takes its gradients between the corrupted (0) and clean (1) run
SELECTIONS = ("top", "greedy")
