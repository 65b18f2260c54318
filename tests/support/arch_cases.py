"""The causal LMs of the issue tracker's list and how the tests build each: a native case of
hf_cases.CASES, else a wrapped case of wrapped_cases.WRAPPED (shared by test_architectures.py and
test_family_folders.py)."""

from __future__ import annotations

from hf_cases import CASES, build_hf
from wrapped_cases import WRAPPED, build_wrapped_hf

# The list of 41 causal LMs (interp.models.wrapped.LISTED).
ARCHITECTURES = [
    "gpt2", "gpt_neox", "llama", "mistral", "qwen2", "gemma3_text", "gemma", "gemma2", "qwen3", "olmo", "olmo2",
    "phi", "phi3", "gptj", "gpt_neo", "opt", "bloom", "falcon", "mpt", "stablelm", "starcoder2", "cohere",
    "granite", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "codegen", "gpt_bigcode", "exaone", "glm",
    "glm4", "smollm3", "apertus", "arcee", "ministral", "seed_oss", "nemotron", "xglm", "openai-gpt",
]
N = 12


def _model_type_of(config_class: str) -> str:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return {v: k for k, v in CONFIG_MAPPING_NAMES.items()}[config_class]


def native_case(model_type: str) -> str | None:
    """The first case of hf_cases.CASES whose config class is `model_type`'s."""
    return next((name for name, (cfg_cls, _, _) in CASES.items() if _model_type_of(cfg_cls) == model_type), None)


def builder(model_type: str):
    """A function seed -> transformers model for `model_type`, or None when no case covers it."""
    case = native_case(model_type)
    if case is not None:
        return lambda seed=0: build_hf(case, seed)
    if model_type in WRAPPED:
        return lambda seed=0: build_wrapped_hf(model_type, seed)
    return None


COVERED = [t for t in ARCHITECTURES if builder(t) is not None]
