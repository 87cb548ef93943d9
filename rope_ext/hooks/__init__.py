"""Hook installers, one per hook kind, and the modules that stand in for a model's own position modules."""

from rope_ext.hooks.base import (
    HookInstaller,
    PlanBuilder,
    RopeExtModule,
    Site,
    Sites,
    get_hook,
    register_hook,
    unregister_hook,
)
from rope_ext.hooks.rotary import FrequencyInstaller, RopeExtRotaryEmbedding, RotarySite
from rope_ext.hooks.attention import (  # noqa: E402  (registers the attention function with transformers)
    ATTENTION_KEY,
    AttentionHook,
    AttentionInstaller,
    AttentionSite,
    QueryScaleInstaller,
)

__all__ = [
    "ATTENTION_KEY",
    "AttentionHook",
    "AttentionInstaller",
    "AttentionSite",
    "QueryScaleInstaller",
    "FrequencyInstaller",
    "HookInstaller",
    "PlanBuilder",
    "RopeExtModule",
    "RopeExtRotaryEmbedding",
    "RotarySite",
    "Site",
    "Sites",
    "get_hook",
    "register_hook",
    "unregister_hook",
]
