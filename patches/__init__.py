"""Family adapters, one module per Hugging Face architecture family (installed as ``rope_ext.patches``).

Adding a family is one module that calls ``register_family`` plus one import line below.
"""

from rope_ext.patches.base import (
    CONFIG_KEY,
    FamilyAdapter,
    PatchPlan,
    find_family,
    get_family,
    list_families,
    register_family,
)
from rope_ext.patches import (  # noqa: F401  (each import registers a family)
    apertus,
    arcee,
    bitnet,
    ernie4_5,
    exaone4,
    falcon,
    gemma,
    gemma2,
    gemma3,
    glm4,
    gpt_neox,
    granite,
    granitemoe,
    llama,
    mistral,
    mixtral,
    nemotron,
    olmo,
    olmo2,
    olmoe,
    persimmon,
    phi,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
    seed_oss,
    smollm3,
    stablelm,
    starcoder2,
)

__all__ = ["CONFIG_KEY", "FamilyAdapter", "PatchPlan", "find_family", "get_family", "list_families", "register_family"]
